package netpolicy

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/netip"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/miekg/dns"
)

// Resolver defaults, used for zero ResolverConfig fields.
const (
	DefaultMinTTL          = 5 * time.Second
	DefaultMaxTTL          = 10 * time.Minute
	DefaultMaxConcurrent   = 32
	DefaultUpstreamTimeout = 2 * time.Second
	hostsTTL               = 5 * time.Minute // TTL of answers from Policy.Hosts, before clamping
	maxCNAMEChain          = 8
	ednsSize               = 1232 // UDP payload size offered to sandboxes (the DNS flag day value)
)

// ResolverConfig configures a node's Resolver.
type ResolverConfig struct {
	// Upstreams are the DNS servers asked for allowed names, in order
	// ("host:port"). With none, every allowed name not in Policy.Hosts gets
	// SERVFAIL.
	Upstreams []string
	// Allow adds addr to sandbox id's allowed set for ttl, reachable on
	// ports (empty: every port); name is the name the sandbox asked. It is
	// called for every A answer before the reply leaves; an error turns the
	// reply into SERVFAIL so a sandbox never holds an address it cannot use.
	Allow func(id string, addr netip.Addr, ports []Port, ttl time.Duration, name string) error
	// Audit receives one Event per query. Nil: not recorded.
	Audit func(Event)
	// MinTTL and MaxTTL clamp the TTL of answers (both in the reply and in
	// Allow), so a learned address lives neither absurdly short nor long.
	MinTTL, MaxTTL time.Duration
	// MaxConcurrent caps a sandbox's queries in flight; more get SERVFAIL.
	MaxConcurrent int
	// UpstreamTimeout bounds one exchange with one upstream.
	UpstreamTimeout time.Duration
	// StrictCNAME requires every name of a CNAME chain to be allowed by the
	// policy. Off (default), only the asked name must be allowed and a name
	// in the chain must not be denied: CDNs alias allowed names to names an
	// operator cannot list, and the address returned is what gets allowed
	// either way.
	StrictCNAME bool
	Log         *slog.Logger
}

// Resolver is the node's DNS server for sandboxes. Each sandbox gets its own
// sockets (Serve), so the socket a query arrives on names the sandbox; the
// answer depends on that sandbox's Policy (SetPolicy). Behaviour per query:
//
//   - a name the policy denies (Policy.Name): REFUSED, audited as deny;
//   - an allowed name in Policy.Hosts: answered with those addresses;
//   - another allowed name: an A query goes to the upstreams; CNAME chains
//     are followed (see ResolverConfig.StrictCNAME), only A records of the
//     chain are kept, TTLs are clamped to [MinTTL, MaxTTL];
//   - AAAA and every other type of an allowed name: an empty NOERROR answer,
//     since the node enforces IPv4 only and other records (HTTPS hints, TXT)
//     could carry addresses past the policy;
//   - every A answer is passed to Allow before the reply is sent;
//   - upstream failure: SERVFAIL, audited as allow with Detail.
//
// Each query yields one audit Event: Kind "dns", Proto "udp" or "tcp", Port
// 53, Name and QType as asked, Rule the rules key(s) that decided, Answers
// the addresses returned (Dest the first), Detail why there was no answer.
type Resolver struct {
	cfg ResolverConfig
	log *slog.Logger

	mu       sync.Mutex
	policies map[string]*Policy
	inflight map[string]chan struct{}
}

// NewResolver returns a Resolver; it serves nothing until Serve.
func NewResolver(cfg ResolverConfig) *Resolver {
	if cfg.MinTTL <= 0 {
		cfg.MinTTL = DefaultMinTTL
	}
	if cfg.MaxTTL <= 0 {
		cfg.MaxTTL = DefaultMaxTTL
	}
	if cfg.MaxTTL < cfg.MinTTL {
		cfg.MaxTTL = cfg.MinTTL
	}
	if cfg.MaxConcurrent <= 0 {
		cfg.MaxConcurrent = DefaultMaxConcurrent
	}
	if cfg.UpstreamTimeout <= 0 {
		cfg.UpstreamTimeout = DefaultUpstreamTimeout
	}
	log := cfg.Log
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	return &Resolver{cfg: cfg, log: log, policies: map[string]*Policy{}, inflight: map[string]chan struct{}{}}
}

// SetPolicy sets (or replaces, while the sandbox runs) sandbox id's policy.
// p must not be modified afterwards. Addresses already passed to Allow stay
// until their TTL ends; removing them earlier is the caller's job.
func (r *Resolver) SetPolicy(id string, p *Policy) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.policies[id] = p
}

// Forget drops sandbox id's policy; its queries are refused from now on.
func (r *Resolver) Forget(id string) {
	r.mu.Lock()
	defer r.mu.Unlock()
	delete(r.policies, id)
	delete(r.inflight, id)
}

func (r *Resolver) policy(id string) *Policy {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.policies[id]
}

// acquire takes one of id's query slots without waiting.
func (r *Resolver) acquire(id string) (release func(), ok bool) {
	r.mu.Lock()
	sem, found := r.inflight[id]
	if !found {
		sem = make(chan struct{}, r.cfg.MaxConcurrent)
		r.inflight[id] = sem
	}
	r.mu.Unlock()
	select {
	case sem <- struct{}{}:
		return func() { <-sem }, true
	default:
		return nil, false
	}
}

// Serve answers sandbox id's queries on udp and tcp (either may be nil)
// until ctx ends or a socket fails, then closes both and returns. A ctx
// ending is not an error.
func (r *Resolver) Serve(ctx context.Context, id string, udp net.PacketConn, tcp net.Listener) error {
	if udp == nil && tcp == nil {
		return fmt.Errorf("serve dns for %s: no sockets", id)
	}
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	var servers []*dns.Server
	if udp != nil {
		servers = append(servers, &dns.Server{PacketConn: udp, Handler: r.handler(ctx, id, "udp")})
	}
	if tcp != nil {
		servers = append(servers, &dns.Server{Listener: tcp, Handler: r.handler(ctx, id, "tcp")})
	}
	errs := make(chan error, len(servers))
	started := make([]chan struct{}, len(servers))
	for i, s := range servers {
		started[i] = make(chan struct{})
		ch := started[i]
		var once sync.Once
		s.NotifyStartedFunc = func() { once.Do(func() { close(ch) }) }
		go func() {
			err := s.ActivateAndServe()
			once.Do(func() { close(ch) })
			errs <- err
		}()
	}
	var first error
	select {
	case <-ctx.Done():
	case first = <-errs:
		if first == nil {
			first = errors.New("socket closed")
		}
	}
	for i, s := range servers {
		<-started[i]
		sctx, scancel := context.WithTimeout(context.WithoutCancel(ctx), 5*time.Second)
		_ = s.ShutdownContext(sctx) // "server not started" when it already returned
		scancel()
	}
	if udp != nil {
		udp.Close()
	}
	if tcp != nil {
		tcp.Close()
	}
	remaining := len(servers)
	if first != nil {
		remaining--
	}
	for ; remaining > 0; remaining-- {
		<-errs
	}
	if ctx.Err() != nil && first == nil {
		return nil
	}
	if first != nil && ctx.Err() == nil {
		return fmt.Errorf("serve dns for %s: %w", id, first)
	}
	return nil
}

func (r *Resolver) handler(ctx context.Context, id, proto string) dns.HandlerFunc {
	return func(w dns.ResponseWriter, req *dns.Msg) {
		reply := r.answer(ctx, id, proto, req)
		size := dns.MinMsgSize
		if opt := req.IsEdns0(); opt != nil {
			size = min(max(int(opt.UDPSize()), dns.MinMsgSize), ednsSize)
			reply.SetEdns0(ednsSize, false)
		}
		if proto == "udp" {
			reply.Truncate(size)
		}
		if err := w.WriteMsg(reply); err != nil {
			r.log.Debug("write dns reply", "sandbox", id, "err", err)
		}
	}
}

func (r *Resolver) audit(e Event) {
	if r.cfg.Audit != nil {
		r.cfg.Audit(e)
	}
}

func (r *Resolver) clamp(ttl time.Duration) time.Duration {
	return min(max(ttl, r.cfg.MinTTL), r.cfg.MaxTTL)
}

// answer builds the reply to one query of sandbox id.
func (r *Resolver) answer(ctx context.Context, id, proto string, req *dns.Msg) *dns.Msg {
	reply := new(dns.Msg)
	reply.SetReply(req)
	reply.RecursionAvailable = true
	if req.Opcode != dns.OpcodeQuery {
		reply.Rcode = dns.RcodeNotImplemented
		return reply
	}
	if len(req.Question) != 1 {
		reply.Rcode = dns.RcodeFormatError
		return reply
	}
	q := req.Question[0]
	name := strings.TrimSuffix(strings.ToLower(q.Name), ".")
	ev := Event{Time: time.Now(), SandboxID: id, Kind: "dns", Proto: proto, Port: 53, Name: name, QType: dns.TypeToString[q.Qtype]}
	p := r.policy(id)
	allow, ports, rule := p.Name(name)
	ev.Rule = rule
	if !allow || q.Qclass != dns.ClassINET {
		ev.Verdict = "deny"
		reply.Rcode = dns.RcodeRefused
		r.audit(ev)
		return reply
	}
	ev.Verdict = "allow"
	release, ok := r.acquire(id)
	if !ok {
		ev.Verdict, ev.Detail = "deny", "too many queries in flight"
		reply.Rcode = dns.RcodeServerFailure
		r.audit(ev)
		return reply
	}
	defer release()

	if q.Qtype != dns.TypeA {
		ev.Detail = "no records: only A is answered"
		r.audit(ev)
		return reply
	}

	var records []dns.RR
	if addrs := p.Host(name); addrs != nil {
		ttl := r.clamp(hostsTTL)
		for _, a := range addrs {
			records = append(records, &dns.A{
				Hdr: dns.RR_Header{Name: q.Name, Rrtype: dns.TypeA, Class: dns.ClassINET, Ttl: uint32(ttl / time.Second)},
				A:   a.AsSlice(),
			})
		}
		ev.Detail = "hosts"
	} else {
		up, err := r.forward(ctx, q.Name)
		if err != nil {
			r.log.Debug("resolve upstream", "sandbox", id, "name", name, "err", err)
			ev.Detail = "upstream: " + err.Error()
			reply.Rcode = dns.RcodeServerFailure
			r.audit(ev)
			return reply
		}
		if up.Rcode != dns.RcodeSuccess {
			ev.Detail = "upstream: " + dns.RcodeToString[up.Rcode]
			reply.Rcode = up.Rcode
			if up.Rcode != dns.RcodeNameError {
				reply.Rcode = dns.RcodeServerFailure
			}
			r.audit(ev)
			return reply
		}
		var denied string
		records, denied = r.chain(p, q.Name, up.Answer)
		if denied != "" {
			ev.Verdict, ev.Detail = "deny", "CNAME to "+denied+" not allowed"
			reply.Rcode = dns.RcodeRefused
			r.audit(ev)
			return reply
		}
	}

	for _, rr := range records {
		a, ok := rr.(*dns.A)
		if !ok {
			continue
		}
		addr, ok := netip.AddrFromSlice(a.A)
		if !ok {
			continue
		}
		addr = addr.Unmap()
		ttl := time.Duration(a.Hdr.Ttl) * time.Second
		if r.cfg.Allow != nil {
			if err := r.cfg.Allow(id, addr, slices.Clone(ports), ttl, name); err != nil {
				r.log.Warn("allow learned address", "sandbox", id, "name", name, "addr", addr, "err", err)
				ev.Detail = "allow " + addr.String() + ": " + err.Error()
				ev.Answers = nil
				reply.Rcode = dns.RcodeServerFailure
				r.audit(ev)
				return reply
			}
		}
		ev.Answers = append(ev.Answers, addr)
	}
	if len(ev.Answers) > 0 {
		ev.Dest = ev.Answers[0]
	}
	reply.Answer = records
	r.audit(ev)
	return reply
}

// forward asks the upstreams, in order, for name's A records.
func (r *Resolver) forward(ctx context.Context, fqdn string) (*dns.Msg, error) {
	if len(r.cfg.Upstreams) == 0 {
		return nil, errors.New("no upstream servers")
	}
	m := new(dns.Msg)
	m.SetQuestion(fqdn, dns.TypeA)
	m.SetEdns0(4096, false)
	var errs []error
	for _, up := range r.cfg.Upstreams {
		c := &dns.Client{Net: "udp", Timeout: r.cfg.UpstreamTimeout}
		resp, _, err := c.ExchangeContext(ctx, m, up)
		if err == nil && resp.Truncated {
			c.Net = "tcp"
			resp, _, err = c.ExchangeContext(ctx, m, up)
		}
		if err != nil {
			errs = append(errs, fmt.Errorf("%s: %w", up, err))
			continue
		}
		if resp.Rcode == dns.RcodeServerFailure || resp.Rcode == dns.RcodeRefused {
			errs = append(errs, fmt.Errorf("%s: %s", up, dns.RcodeToString[resp.Rcode]))
			continue
		}
		return resp, nil
	}
	return nil, errors.Join(errs...)
}

// chain follows CNAMEs from fqdn through answer and returns the CNAME and A
// records of the chain with clamped TTLs, or the first name of the chain the
// policy does not accept.
func (r *Resolver) chain(p *Policy, fqdn string, answer []dns.RR) ([]dns.RR, string) {
	var out []dns.RR
	cur := strings.ToLower(fqdn)
	for hop := 0; ; hop++ {
		var next string
		for _, rr := range answer {
			h := rr.Header()
			if strings.ToLower(h.Name) != cur || h.Class != dns.ClassINET {
				continue
			}
			switch v := rr.(type) {
			case *dns.A:
				c := dns.Copy(v).(*dns.A)
				c.Hdr.Ttl = uint32(r.clamp(time.Duration(v.Hdr.Ttl)*time.Second) / time.Second)
				out = append(out, c)
			case *dns.CNAME:
				if next == "" {
					c := dns.Copy(v).(*dns.CNAME)
					c.Hdr.Ttl = uint32(r.clamp(time.Duration(v.Hdr.Ttl)*time.Second) / time.Second)
					out = append(out, c)
					next = strings.ToLower(v.Target)
				}
			}
		}
		if next == "" || hop >= maxCNAMEChain {
			return out, ""
		}
		target := strings.TrimSuffix(next, ".")
		allow, _, rule := p.Name(target)
		if !allow && (r.cfg.StrictCNAME || rule != "") {
			return nil, target
		}
		cur = next
	}
}

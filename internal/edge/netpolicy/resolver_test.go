package netpolicy

import (
	"context"
	"errors"
	"net"
	"net/netip"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/miekg/dns"
)

// upstream is a real DNS server on loopback holding test zones.
type upstream struct {
	addr string

	mu      sync.Mutex
	queries []string
	slow    chan struct{} // "slow.pypi.test." waits for it
	gotSlow chan struct{}
}

func (u *upstream) count(name string) int {
	u.mu.Lock()
	defer u.mu.Unlock()
	n := 0
	for _, q := range u.queries {
		if q == name {
			n++
		}
	}
	return n
}

func rr(t *testing.T, s string) dns.RR {
	t.Helper()
	r, err := dns.NewRR(s)
	if err != nil {
		t.Fatal(err)
	}
	return r
}

func startUpstream(t *testing.T) *upstream {
	t.Helper()
	zone := map[string][]dns.RR{
		"index.pypi.test.": {rr(t, "index.pypi.test. 300 IN A 192.0.2.10")},
		"multi.pypi.test.": {rr(t, "multi.pypi.test. 120 IN A 192.0.2.11"), rr(t, "multi.pypi.test. 120 IN A 192.0.2.12")},
		"cdn.pypi.test.": {
			rr(t, "cdn.pypi.test. 60 IN CNAME edge.cdn.test."),
			rr(t, "edge.cdn.test. 1 IN A 192.0.2.20"),
			rr(t, "unrelated.test. 60 IN A 203.0.113.1"),
		},
		"bad.pypi.test.":    {rr(t, "bad.pypi.test. 60 IN CNAME evil.test."), rr(t, "evil.test. 60 IN A 203.0.113.66")},
		"long.pypi.test.":   {rr(t, "long.pypi.test. 86400 IN A 192.0.2.30")},
		"short.pypi.test.":  {rr(t, "short.pypi.test. 0 IN A 192.0.2.31")},
		"evil.test.":        {rr(t, "evil.test. 60 IN A 203.0.113.66")},
		"refuse.pypi.test.": {rr(t, "refuse.pypi.test. 60 IN A 192.0.2.40")},
		"slow.pypi.test.":   {rr(t, "slow.pypi.test. 60 IN A 192.0.2.50")},
		"fast.pypi.test.":   {rr(t, "fast.pypi.test. 60 IN A 192.0.2.51")},
	}
	u := &upstream{slow: make(chan struct{}), gotSlow: make(chan struct{}, 1)}
	handler := dns.HandlerFunc(func(w dns.ResponseWriter, req *dns.Msg) {
		q := req.Question[0]
		u.mu.Lock()
		u.queries = append(u.queries, q.Name)
		u.mu.Unlock()
		if q.Name == "slow.pypi.test." {
			u.gotSlow <- struct{}{}
			<-u.slow
		}
		m := new(dns.Msg)
		m.SetReply(req)
		records, ok := zone[q.Name]
		if !ok {
			m.Rcode = dns.RcodeNameError
		}
		switch q.Qtype {
		case dns.TypeA:
			m.Answer = records
		case dns.TypeAAAA:
			m.Answer = []dns.RR{rr(t, q.Name+" 60 IN AAAA 2001:db8::1")}
		}
		w.WriteMsg(m)
	})
	pc, err := net.ListenPacket("udp4", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	srv := &dns.Server{PacketConn: pc, Handler: handler}
	started := make(chan struct{})
	srv.NotifyStartedFunc = func() { close(started) }
	go srv.ActivateAndServe()
	<-started
	t.Cleanup(func() {
		select {
		case <-u.slow:
		default:
			close(u.slow)
		}
		srv.Shutdown()
	})
	u.addr = pc.LocalAddr().String()
	return u
}

type allowCall struct {
	id    string
	addr  netip.Addr
	ports []Port
	ttl   time.Duration
	name  string
}

type recorder struct {
	mu      sync.Mutex
	allows  []allowCall
	events  []Event
	failFor netip.Addr
}

func (r *recorder) allow(id string, addr netip.Addr, ports []Port, ttl time.Duration, name string) error {
	r.mu.Lock()
	defer r.mu.Unlock()
	if addr == r.failFor {
		return errors.New("nftables set is full")
	}
	r.allows = append(r.allows, allowCall{id, addr, ports, ttl, name})
	return nil
}

func (r *recorder) audit(e Event) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.events = append(r.events, e)
}

func (r *recorder) lastEvent(t *testing.T, name string) Event {
	t.Helper()
	r.mu.Lock()
	defer r.mu.Unlock()
	for i := len(r.events) - 1; i >= 0; i-- {
		if r.events[i].Name == name {
			return r.events[i]
		}
	}
	t.Fatalf("no audit event for %s", name)
	return Event{}
}

func (r *recorder) allowsFor(name string) []allowCall {
	r.mu.Lock()
	defer r.mu.Unlock()
	var out []allowCall
	for _, c := range r.allows {
		if c.name == name {
			out = append(out, c)
		}
	}
	return out
}

type served struct {
	udp, tcp string
	done     chan error
	cancel   context.CancelFunc
}

// serve runs r.Serve for id on fresh loopback sockets until the test ends.
func serve(t *testing.T, r *Resolver, id string) *served {
	t.Helper()
	pc, err := net.ListenPacket("udp4", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	ln, err := net.Listen("tcp4", "127.0.0.1:0")
	if err != nil {
		pc.Close()
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	s := &served{udp: pc.LocalAddr().String(), tcp: ln.Addr().String(), done: make(chan error, 1), cancel: cancel}
	go func() { s.done <- r.Serve(ctx, id, pc, ln) }()
	t.Cleanup(func() {
		cancel()
		select {
		case <-s.done:
		case <-time.After(30 * time.Second):
			t.Error("Serve did not return after cancel")
		}
	})
	return s
}

func query(t *testing.T, server, netw, name string, qtype uint16) *dns.Msg {
	t.Helper()
	m := new(dns.Msg)
	m.SetQuestion(dns.Fqdn(name), qtype)
	c := &dns.Client{Net: netw, Timeout: 10 * time.Second}
	resp, _, err := c.Exchange(m, server)
	if err != nil {
		t.Fatalf("query %s %s: %v", name, dns.TypeToString[qtype], err)
	}
	return resp
}

func aRecords(m *dns.Msg) []string {
	var out []string
	for _, r := range m.Answer {
		if a, ok := r.(*dns.A); ok {
			out = append(out, a.A.String())
		}
	}
	return out
}

func testResolverPolicy(t *testing.T) *Policy {
	t.Helper()
	c := testCatalog()
	c.Services["mirrored"] = Service{
		Domains: []string{"mirrored.pkg.test"},
		Ports:   webPorts,
		Mirror:  &Mirror{URL: "http://mirror.internal.test:3141/", Addrs: []netip.Addr{netip.MustParseAddr("10.20.0.5")}},
	}
	p, _, err := Compile(map[string]bool{
		"pypi":                 true, // index.pypi.test and *.files.pypi.test on 443/tcp
		"*.pypi.test":          true,
		"evil.test":            false,
		"denied.pypi.test":     false,
		"mirrored":             true,
		"strict-only.cdn.test": false,
	}, c)
	if err != nil {
		t.Fatal(err)
	}
	return p
}

func TestResolver(t *testing.T) {
	up := startUpstream(t)
	rec := &recorder{failFor: netip.MustParseAddr("192.0.2.40")}
	r := NewResolver(ResolverConfig{
		Upstreams: []string{up.addr},
		Allow:     rec.allow,
		Audit:     rec.audit,
		MinTTL:    10 * time.Second,
		MaxTTL:    time.Hour,
	})
	r.SetPolicy("sb-1", testResolverPolicy(t))
	s := serve(t, r, "sb-1")

	t.Run("allowed", func(t *testing.T) {
		resp := query(t, s.udp, "udp", "index.pypi.test", dns.TypeA)
		if resp.Rcode != dns.RcodeSuccess || strings.Join(aRecords(resp), ",") != "192.0.2.10" {
			t.Fatalf("reply: %v", resp)
		}
		if resp.Answer[0].Header().Ttl != 300 {
			t.Errorf("TTL = %d, want 300", resp.Answer[0].Header().Ttl)
		}
		calls := rec.allowsFor("index.pypi.test")
		if len(calls) != 1 || calls[0].id != "sb-1" || calls[0].addr != netip.MustParseAddr("192.0.2.10") ||
			calls[0].ttl != 300*time.Second || len(calls[0].ports) != 1 || calls[0].ports[0] != (Port{Proto: "tcp", Port: 443}) {
			t.Errorf("Allow calls = %+v", calls)
		}
		e := rec.lastEvent(t, "index.pypi.test")
		if e.Kind != "dns" || e.Verdict != "allow" || e.SandboxID != "sb-1" || e.Rule != "pypi" || e.Proto != "udp" ||
			e.Dest != netip.MustParseAddr("192.0.2.10") || len(e.Answers) != 1 || e.QType != "A" || e.Time.IsZero() {
			t.Errorf("event = %+v", e)
		}
	})

	t.Run("multiple answers over tcp", func(t *testing.T) {
		resp := query(t, s.tcp, "tcp", "multi.pypi.test", dns.TypeA)
		if got := strings.Join(aRecords(resp), ","); got != "192.0.2.11,192.0.2.12" {
			t.Fatalf("answers = %s", got)
		}
		if n := len(rec.allowsFor("multi.pypi.test")); n != 2 {
			t.Errorf("%d Allow calls, want 2", n)
		}
		if e := rec.lastEvent(t, "multi.pypi.test"); e.Proto != "tcp" || len(e.Answers) != 2 {
			t.Errorf("event = %+v", e)
		}
	})

	t.Run("denied", func(t *testing.T) {
		for _, name := range []string{"denied.pypi.test", "other.test", "evil.test"} {
			resp := query(t, s.udp, "udp", name, dns.TypeA)
			if resp.Rcode != dns.RcodeRefused || len(resp.Answer) != 0 {
				t.Errorf("%s: reply %v", name, resp)
			}
			if e := rec.lastEvent(t, name); e.Verdict != "deny" || e.Kind != "dns" {
				t.Errorf("%s: event %+v", name, e)
			}
			if up.count(dns.Fqdn(name)) != 0 {
				t.Errorf("%s reached upstream", name)
			}
			if len(rec.allowsFor(name)) != 0 {
				t.Errorf("%s: Allow called", name)
			}
		}
	})

	t.Run("cname chain", func(t *testing.T) {
		resp := query(t, s.udp, "udp", "cdn.pypi.test", dns.TypeA)
		if resp.Rcode != dns.RcodeSuccess || strings.Join(aRecords(resp), ",") != "192.0.2.20" || len(resp.Answer) != 2 {
			t.Fatalf("reply: %v", resp)
		}
		calls := rec.allowsFor("cdn.pypi.test")
		if len(calls) != 1 || calls[0].addr != netip.MustParseAddr("192.0.2.20") || calls[0].ttl != 10*time.Second {
			t.Errorf("Allow calls = %+v (the unrelated record must be dropped, TTL clamped up)", calls)
		}
		// A chain through an explicitly denied name is refused.
		resp = query(t, s.udp, "udp", "bad.pypi.test", dns.TypeA)
		if resp.Rcode != dns.RcodeRefused || len(rec.allowsFor("bad.pypi.test")) != 0 {
			t.Errorf("bad chain: %v", resp)
		}
		if e := rec.lastEvent(t, "bad.pypi.test"); e.Verdict != "deny" || !strings.Contains(e.Detail, "evil.test") {
			t.Errorf("event = %+v", e)
		}
	})

	t.Run("ttl clamp", func(t *testing.T) {
		resp := query(t, s.udp, "udp", "long.pypi.test", dns.TypeA)
		if resp.Answer[0].Header().Ttl != 3600 {
			t.Errorf("reply TTL = %d, want 3600", resp.Answer[0].Header().Ttl)
		}
		if c := rec.allowsFor("long.pypi.test"); len(c) != 1 || c[0].ttl != time.Hour {
			t.Errorf("Allow = %+v", c)
		}
		resp = query(t, s.udp, "udp", "short.pypi.test", dns.TypeA)
		if resp.Answer[0].Header().Ttl != 10 {
			t.Errorf("reply TTL = %d, want 10", resp.Answer[0].Header().Ttl)
		}
		if c := rec.allowsFor("short.pypi.test"); len(c) != 1 || c[0].ttl != 10*time.Second || c[0].ports != nil {
			t.Errorf("Allow = %+v (ports of *.pypi.test: every port)", c)
		}
	})

	t.Run("aaaa and other types are empty", func(t *testing.T) {
		for _, qt := range []uint16{dns.TypeAAAA, dns.TypeTXT, dns.TypeHTTPS} {
			resp := query(t, s.udp, "udp", "index.pypi.test", qt)
			if resp.Rcode != dns.RcodeSuccess || len(resp.Answer) != 0 {
				t.Errorf("%s: reply %v", dns.TypeToString[qt], resp)
			}
		}
		if e := rec.lastEvent(t, "index.pypi.test"); e.Verdict != "allow" || e.QType != "HTTPS" {
			t.Errorf("event = %+v", e)
		}
		// A denied name is refused whatever the type.
		if resp := query(t, s.udp, "udp", "evil.test", dns.TypeAAAA); resp.Rcode != dns.RcodeRefused {
			t.Errorf("AAAA of denied name: %v", resp)
		}
	})

	t.Run("nxdomain", func(t *testing.T) {
		resp := query(t, s.udp, "udp", "missing.pypi.test", dns.TypeA)
		if resp.Rcode != dns.RcodeNameError {
			t.Errorf("reply: %v", resp)
		}
		if e := rec.lastEvent(t, "missing.pypi.test"); e.Verdict != "allow" || !strings.Contains(e.Detail, "NXDOMAIN") {
			t.Errorf("event = %+v", e)
		}
	})

	t.Run("mirror hosts", func(t *testing.T) {
		for _, name := range []string{"mirrored.pkg.test", "mirror.internal.test"} {
			resp := query(t, s.udp, "udp", name, dns.TypeA)
			if strings.Join(aRecords(resp), ",") != "10.20.0.5" {
				t.Errorf("%s: reply %v", name, resp)
			}
			if up.count(dns.Fqdn(name)) != 0 {
				t.Errorf("%s reached upstream", name)
			}
			if c := rec.allowsFor(name); len(c) != 1 || c[0].addr != netip.MustParseAddr("10.20.0.5") {
				t.Errorf("%s: Allow = %+v", name, c)
			}
		}
	})

	t.Run("allow failure", func(t *testing.T) {
		resp := query(t, s.udp, "udp", "refuse.pypi.test", dns.TypeA)
		if resp.Rcode != dns.RcodeServerFailure || len(resp.Answer) != 0 {
			t.Errorf("reply: %v", resp)
		}
		if e := rec.lastEvent(t, "refuse.pypi.test"); !strings.Contains(e.Detail, "set is full") {
			t.Errorf("event = %+v", e)
		}
	})

	t.Run("policy change and forget", func(t *testing.T) {
		p, _, err := Compile(map[string]bool{"index.pypi.test": false, "*.pypi.test": true}, testCatalog())
		if err != nil {
			t.Fatal(err)
		}
		r.SetPolicy("sb-1", p)
		if resp := query(t, s.udp, "udp", "index.pypi.test", dns.TypeA); resp.Rcode != dns.RcodeRefused {
			t.Errorf("after SetPolicy: %v", resp)
		}
		r.Forget("sb-1")
		if resp := query(t, s.udp, "udp", "multi.pypi.test", dns.TypeA); resp.Rcode != dns.RcodeRefused {
			t.Errorf("after Forget: %v", resp)
		}
		r.SetPolicy("sb-1", testResolverPolicy(t))
	})

	t.Run("edns", func(t *testing.T) {
		m := new(dns.Msg)
		m.SetQuestion("multi.pypi.test.", dns.TypeA)
		m.SetEdns0(4096, false)
		resp, _, err := (&dns.Client{Timeout: 10 * time.Second}).Exchange(m, s.udp)
		if err != nil {
			t.Fatal(err)
		}
		if opt := resp.IsEdns0(); opt == nil || opt.UDPSize() != 1232 || len(aRecords(resp)) != 2 {
			t.Errorf("reply: %v", resp)
		}
	})

	t.Run("serve returns when a socket closes", func(t *testing.T) {
		pc, err := net.ListenPacket("udp4", "127.0.0.1:0")
		if err != nil {
			t.Fatal(err)
		}
		ln, err := net.Listen("tcp4", "127.0.0.1:0")
		if err != nil {
			t.Fatal(err)
		}
		done := make(chan error, 1)
		go func() { done <- r.Serve(context.Background(), "sb-3", pc, ln) }()
		query(t, ln.Addr().String(), "tcp", "index.pypi.test", dns.TypeA) // running
		ln.Close()
		select {
		case err := <-done:
			if err == nil {
				t.Error("Serve returned nil after its socket closed")
			}
		case <-time.After(30 * time.Second):
			t.Fatal("Serve did not return")
		}
		if _, err := pc.WriteTo([]byte("x"), pc.LocalAddr()); err == nil {
			t.Error("the UDP socket is still open")
		}
	})

	t.Run("serve returns on cancel", func(t *testing.T) {
		s2 := serve(t, r, "sb-2")
		s2.cancel()
		select {
		case err := <-s2.done:
			if err != nil {
				t.Errorf("Serve = %v", err)
			}
			s2.done <- nil // for the cleanup
		case <-time.After(30 * time.Second):
			t.Fatal("Serve did not return")
		}
	})
}

func TestResolverStrictCNAME(t *testing.T) {
	up := startUpstream(t)
	rec := &recorder{}
	r := NewResolver(ResolverConfig{Upstreams: []string{up.addr}, Allow: rec.allow, Audit: rec.audit, StrictCNAME: true})
	r.SetPolicy("sb-s", testResolverPolicy(t))
	s := serve(t, r, "sb-s")
	// edge.cdn.test matches no rule: refused only in strict mode.
	if resp := query(t, s.udp, "udp", "cdn.pypi.test", dns.TypeA); resp.Rcode != dns.RcodeRefused {
		t.Errorf("reply: %v", resp)
	}
	if len(rec.allowsFor("cdn.pypi.test")) != 0 {
		t.Error("Allow called for a refused chain")
	}
}

func TestResolverUpstreamDown(t *testing.T) {
	// A port that was just free: nothing answers there.
	pc, err := net.ListenPacket("udp4", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	dead := pc.LocalAddr().String()
	pc.Close()

	rec := &recorder{}
	r := NewResolver(ResolverConfig{Upstreams: []string{dead}, Allow: rec.allow, Audit: rec.audit, UpstreamTimeout: 500 * time.Millisecond})
	r.SetPolicy("sb-d", testResolverPolicy(t))
	s := serve(t, r, "sb-d")
	resp := query(t, s.udp, "udp", "index.pypi.test", dns.TypeA)
	if resp.Rcode != dns.RcodeServerFailure {
		t.Fatalf("reply: %v", resp)
	}
	e := rec.lastEvent(t, "index.pypi.test")
	if e.Verdict != "allow" || !strings.Contains(e.Detail, "upstream") {
		t.Errorf("event = %+v", e)
	}
	if len(rec.allowsFor("index.pypi.test")) != 0 {
		t.Error("Allow called without an answer")
	}
	// Hosts answers need no upstream.
	if resp := query(t, s.udp, "udp", "mirrored.pkg.test", dns.TypeA); strings.Join(aRecords(resp), ",") != "10.20.0.5" {
		t.Errorf("mirror reply: %v", resp)
	}
}

func TestResolverConcurrencyCap(t *testing.T) {
	up := startUpstream(t)
	rec := &recorder{}
	r := NewResolver(ResolverConfig{Upstreams: []string{up.addr}, Allow: rec.allow, Audit: rec.audit, MaxConcurrent: 1, UpstreamTimeout: 20 * time.Second})
	r.SetPolicy("sb-c", testResolverPolicy(t))
	s := serve(t, r, "sb-c")

	slowDone := make(chan *dns.Msg, 1)
	go func() {
		m := new(dns.Msg)
		m.SetQuestion("slow.pypi.test.", dns.TypeA)
		c := &dns.Client{Net: "udp", Timeout: 30 * time.Second}
		resp, _, _ := c.Exchange(m, s.udp)
		slowDone <- resp
	}()
	<-up.gotSlow // the only slot is taken
	resp := query(t, s.udp, "udp", "fast.pypi.test", dns.TypeA)
	if resp.Rcode != dns.RcodeServerFailure {
		t.Errorf("second query: %v", resp)
	}
	if e := rec.lastEvent(t, "fast.pypi.test"); e.Verdict != "deny" || !strings.Contains(e.Detail, "in flight") {
		t.Errorf("event = %+v", e)
	}
	close(up.slow)
	if resp := <-slowDone; resp == nil || strings.Join(aRecords(resp), ",") != "192.0.2.50" {
		t.Errorf("slow reply: %v", resp)
	}
	// The slot is free again.
	if resp := query(t, s.udp, "udp", "fast.pypi.test", dns.TypeA); resp.Rcode != dns.RcodeSuccess {
		t.Errorf("after release: %v", resp)
	}
}

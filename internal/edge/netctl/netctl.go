// Package netctl is the edge's network control: it compiles a sandbox's
// rules against the node's service catalog (netpolicy), attaches the sandbox
// to the node's network and enforces the rules in the kernel (network),
// serves the sandbox's DNS through the policy-checking resolver, and keeps
// the audit log of every connection attempt and query.
package netctl

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/netip"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"time"

	"dsec.dev/dsec/internal/edge/netpolicy"
	"dsec.dev/dsec/internal/edge/network"
	"dsec.dev/dsec/internal/metrics"
)

// Config is the node's network configuration.
type Config struct {
	Dir string // state: netns mounts, audit logs, the sandboxes' resolv.conf
	// Services is an operator JSON file of named services and mirrors,
	// merged over the built-in names and what the host's own package
	// configuration names; "" = those alone.
	Services string
	// Upstreams are the DNS servers (host:port) the resolver asks; empty =
	// the nameservers of the host's /etc/resolv.conf.
	Upstreams         []string
	Pool              netip.Prefix // sandbox addresses; zero = the network package's default
	EgressBytesPerSec int64        // per sandbox; 0 = default
	MaxConns          int          // concurrent connections per sandbox; 0 = default
	AuditPerSandbox   int          // audit records kept per sandbox; 0 = 10000
	// Table, VethPrefix and LogGroup name the node's nftables table, host
	// veths and NFLOG group (see network.Config); two edges on one host
	// need different ones, and different pools. Zero = the defaults.
	Table      string
	VethPrefix string
	LogGroup   uint16
	Log        *slog.Logger
	// Metrics counts the audit's events by kind and verdict; nil counts
	// nothing.
	Metrics *metrics.Edge
}

// Attachment is what a sandbox needs from its network to start.
type Attachment struct {
	NetnsPath  string            // network namespace for the runtime to join
	Addr       string            // the sandbox's address
	ResolvConf string            // host file to mount at /etc/resolv.conf
	Env        map[string]string // variables of the mirrors its rules allow
	// Warnings say which rules do less than they read as on this node
	// (e.g. a service it knows no hosts for); the caller sees them.
	Warnings []string
}

// Controller owns the node's sandbox networks.
type Controller struct {
	cfg      Config
	log      *slog.Logger
	catalog  *netpolicy.Catalog
	node     *network.Node
	resolver *netpolicy.Resolver
	audit    *netpolicy.AuditLog
	resolv   string

	mu    sync.Mutex
	dns   map[string]*dnsServer // by sandbox id
	close sync.Once
}

type dnsServer struct {
	cancel context.CancelFunc
	udp    net.PacketConn
	tcp    net.Listener
	done   chan struct{}
}

// Open sets the node's network up (idempotently: a restarted daemon finds
// what it made before; call Recover next) and loads the service catalog.
func Open(ctx context.Context, cfg Config) (*Controller, error) {
	if cfg.Log == nil {
		cfg.Log = slog.New(slog.DiscardHandler)
	}
	if cfg.AuditPerSandbox == 0 {
		cfg.AuditPerSandbox = 10000
	}
	for _, d := range []string{cfg.Dir, filepath.Join(cfg.Dir, "netns"), filepath.Join(cfg.Dir, "audit")} {
		if err := os.MkdirAll(d, 0o700); err != nil {
			return nil, fmt.Errorf("open node network: %w", err)
		}
	}
	cat := netpolicy.DefaultCatalog()
	home, _ := os.UserHomeDir()
	for _, note := range netpolicy.DiscoverHost(cat, netpolicy.DefaultHostFiles(home)) {
		cfg.Log.Info("network services from the host's package configuration", "note", note)
	}
	if cfg.Services != "" {
		loaded, err := netpolicy.LoadCatalog(cfg.Services)
		if err != nil {
			return nil, fmt.Errorf("open node network: %w", err)
		}
		for name, svc := range loaded.Services {
			cat.Services[name] = svc
		}
	}
	if len(cfg.Upstreams) == 0 {
		cfg.Upstreams = hostNameservers("/etc/resolv.conf")
	}
	c := &Controller{cfg: cfg, log: cfg.Log, catalog: cat, dns: map[string]*dnsServer{}}
	c.audit = netpolicy.NewAuditLog(filepath.Join(cfg.Dir, "audit"), cfg.AuditPerSandbox)
	c.audit.Log = cfg.Log.With("component", "audit")
	node, err := network.Setup(ctx, network.Config{
		NetnsDir: filepath.Join(cfg.Dir, "netns"), Pool: cfg.Pool,
		EgressBytesPerSec: cfg.EgressBytesPerSec, MaxConns: cfg.MaxConns,
		Table: cfg.Table, VethPrefix: cfg.VethPrefix, LogGroup: cfg.LogGroup,
		Audit: c.record, Log: cfg.Log.With("component", "network"),
	})
	if err != nil {
		return nil, fmt.Errorf("open node network: %w", err)
	}
	c.node = node
	c.resolver = netpolicy.NewResolver(netpolicy.ResolverConfig{
		Upstreams: cfg.Upstreams, Allow: node.AllowResolved, Audit: c.record,
		Log: cfg.Log.With("component", "dns"),
	})
	// The sandbox's resolver listens on its own loopback, inside its
	// network namespace: nothing on the host is reachable for DNS.
	c.resolv = filepath.Join(cfg.Dir, "resolv.conf")
	if err := os.WriteFile(c.resolv, []byte("nameserver 127.0.0.53\noptions timeout:2 attempts:2\n"), 0o644); err != nil {
		return nil, fmt.Errorf("open node network: write resolv.conf: %w", err)
	}
	return c, nil
}

// Catalog is the node's service catalog.
func (c *Controller) Catalog() *netpolicy.Catalog { return c.catalog }

func (c *Controller) compile(rules map[string]bool) (*netpolicy.Policy, []string, error) {
	pol, warnings, err := netpolicy.Compile(rules, c.catalog)
	if err != nil {
		return nil, nil, fmt.Errorf("network rules: %w", err)
	}
	return pol, warnings, nil
}

// Attach gives sandbox id its own network with rules enforced.
func (c *Controller) Attach(ctx context.Context, id string, rules map[string]bool) (*Attachment, error) {
	pol, warnings, err := c.compile(rules)
	if err != nil {
		return nil, err
	}
	for _, w := range warnings {
		c.log.Warn("network rules", "id", id, "warning", w)
	}
	a, err := c.node.Attach(ctx, id, pol)
	if err != nil {
		return nil, err
	}
	if err := c.serveDNS(id, pol); err != nil {
		c.node.Detach(context.WithoutCancel(ctx), id)
		return nil, err
	}
	return &Attachment{NetnsPath: a.NetnsPath, Addr: a.Addr.String(), ResolvConf: c.resolv, Env: pol.Env, Warnings: warnings}, nil
}

func (c *Controller) serveDNS(id string, pol *netpolicy.Policy) error {
	udp, tcp, err := c.node.ListenDNS(id)
	if err != nil {
		return fmt.Errorf("listen for the DNS of %s: %w", id, err)
	}
	c.resolver.SetPolicy(id, pol)
	ctx, cancel := context.WithCancel(context.Background())
	s := &dnsServer{cancel: cancel, udp: udp, tcp: tcp, done: make(chan struct{})}
	c.mu.Lock()
	old := c.dns[id]
	c.dns[id] = s
	c.mu.Unlock()
	if old != nil {
		old.stop()
	}
	go func() {
		defer close(s.done)
		if err := c.resolver.Serve(ctx, id, udp, tcp); err != nil && ctx.Err() == nil {
			c.log.Warn("DNS for sandbox stopped", "id", id, "err", err)
		}
	}()
	return nil
}

func (s *dnsServer) stop() {
	s.cancel()
	s.udp.Close()
	s.tcp.Close()
	<-s.done
}

// Update replaces the rules of sandbox id; new connections follow them at
// once, and with cut established ones no longer allowed are broken.
func (c *Controller) Update(ctx context.Context, id string, rules map[string]bool, cut bool) ([]string, error) {
	pol, warnings, err := c.compile(rules)
	if err != nil {
		return nil, err
	}
	if err := c.node.Update(ctx, id, pol, cut); err != nil {
		return nil, err
	}
	c.resolver.SetPolicy(id, pol)
	return warnings, nil
}

// record keeps e in the audit log and counts it.
func (c *Controller) record(e netpolicy.Event) {
	c.audit.Record(e)
	c.cfg.Metrics.Network(e.Kind, e.Verdict)
}

// Log returns the audit records of sandbox id since the given time.
func (c *Controller) Log(id string, since time.Time, limit int) ([]netpolicy.Event, error) {
	return c.audit.Read(id, since, limit)
}

// Detach removes the network of sandbox id. Its audit log stays until Forget.
func (c *Controller) Detach(ctx context.Context, id string) error {
	c.mu.Lock()
	s := c.dns[id]
	delete(c.dns, id)
	c.mu.Unlock()
	if s != nil {
		s.stop()
	}
	c.resolver.Forget(id)
	return c.node.Detach(ctx, id)
}

// EgressBytes is what sandbox id sent out of its network namespace so far
// (its host veth's receive counter); errdefs.ErrNotFound without one.
func (c *Controller) EgressBytes(id string) (int64, error) { return c.node.EgressBytes(id) }

// Forget drops the audit log of a sandbox that is gone.
func (c *Controller) Forget(id string) {
	if err := c.audit.Remove(id); err != nil {
		c.log.Warn("remove network audit log", "id", id, "err", err)
	}
}

// Recover keeps the networks of the sandboxes in keep (serving their DNS
// again) and removes every other network this node made.
func (c *Controller) Recover(ctx context.Context, keep map[string]map[string]bool) error {
	pols := make(map[string]*netpolicy.Policy, len(keep))
	var errs []error
	for id, rules := range keep {
		pol, _, err := c.compile(rules)
		if err != nil {
			errs = append(errs, fmt.Errorf("sandbox %s: %w", id, err))
			pol = &netpolicy.Policy{} // deny everything rather than lose the sandbox
		}
		pols[id] = pol
	}
	if err := c.node.Recover(ctx, pols); err != nil {
		return errors.Join(append(errs, err)...)
	}
	for id, pol := range pols {
		if err := c.serveDNS(id, pol); err != nil {
			errs = append(errs, err)
		}
	}
	return errors.Join(errs...)
}

// Close stops serving DNS. Sandbox networks stay in the kernel for the next
// run to recover.
func (c *Controller) Close() {
	c.close.Do(func() {
		c.mu.Lock()
		servers := c.dns
		c.dns = map[string]*dnsServer{}
		c.mu.Unlock()
		for _, s := range servers {
			s.stop()
		}
	})
}

// Teardown removes everything the node's network made.
func (c *Controller) Teardown(ctx context.Context) error {
	c.Close()
	return c.node.Teardown(ctx)
}

// hostNameservers reads the nameservers of a resolv.conf as host:53.
func hostNameservers(path string) []string {
	f, err := os.Open(path)
	if err != nil {
		return nil
	}
	defer f.Close()
	var out []string
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		fields := strings.Fields(sc.Text())
		if len(fields) >= 2 && fields[0] == "nameserver" {
			if a, err := netip.ParseAddr(fields[1]); err == nil && a.Is4() {
				out = append(out, netip.AddrPortFrom(a, 53).String())
			}
		}
	}
	return out
}

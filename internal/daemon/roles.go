package daemon

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"net/http/pprof"
	"os"
	"runtime"
	"runtime/debug"
	"strings"
	"sync"
	"time"

	edgev1 "dsec.dev/dsec/api/gen/dsec/edge/v1"
	"dsec.dev/dsec/internal/apiserver"
	"dsec.dev/dsec/internal/clustertls"
	"dsec.dev/dsec/internal/config"
	"dsec.dev/dsec/internal/edge/edgesvc"
	"dsec.dev/dsec/internal/edge/eventlog"
	"dsec.dev/dsec/internal/edge/hollow"
	"dsec.dev/dsec/internal/edge/layers"
	"dsec.dev/dsec/internal/edge/ledger"
	"dsec.dev/dsec/internal/edgeclient"
	"dsec.dev/dsec/internal/errdefs"
	"dsec.dev/dsec/internal/metrics"
	"dsec.dev/dsec/internal/receipt"
	"dsec.dev/dsec/internal/store"
	"dsec.dev/dsec/internal/watcher"
	sdkreceipt "dsec.dev/dsec/sdk/go/receipt"
)

// The cluster's roles. `dsecd edge` is one node: the all-in-one's edge
// (runtimes, layers, network, admission; its sandboxes' truth on local
// disk), serving EdgeService to apiservers over mutual TLS. `dsecd
// apiserver` is stateless: the public API in front of every edge, with the
// metadata store shared by all its replicas.

// DefaultEdgeAddr is where an edge serves EdgeService unless told otherwise.
const DefaultEdgeAddr = config.DefaultEdgeAddr

// EdgeConfig is `dsecd edge`'s configuration.
type EdgeConfig struct {
	// Node is the node, as the all-in-one dsecd has it (root, runtime,
	// network, storage, limits). Runtime "fake" makes a hollow edge that
	// starts nothing (package hollow), for control-plane scale tests.
	Node Config
	// Listen is EdgeService's TCP address; default DefaultEdgeAddr.
	Listen string
	// DebugListen, if set, serves Go's profiles (net/http/pprof) on this
	// address; keep it on loopback.
	DebugListen string
	// TLS is the edge's certificate (role edge, named for the node), its
	// key, and the cluster's CA bundle; edges accept apiservers only.
	TLS clustertls.Files
	// Hollow shapes a fake-runtime edge.
	Hollow hollow.Config
	// Registry is the cluster's metadata store (postgres://…), where the
	// edge registers and heartbeats: it gets its slot and generation there,
	// which every sandbox ID it mints carries. "" = not registered; the
	// apiservers are told of it (--edge) and its IDs carry slot 0.
	Registry string
	// Advertise is the URL apiservers reach it at; default
	// https://<Listen>.
	Advertise string
	// Heartbeat is how often it tells the registry it lives; default 2 s.
	Heartbeat time.Duration
}

func (c *EdgeConfig) fill() error {
	if c.Listen == "" {
		c.Listen = DefaultEdgeAddr
	}
	if c.Node.Node == "" {
		c.Node.Node = nodeName()
	}
	if c.TLS.Cert == "" || c.TLS.Key == "" || c.TLS.CABundle == "" {
		return fmt.Errorf("edge %s: a certificate, its key and the cluster's CA bundle are required (dsecd init-cluster makes them): %w",
			c.Node.Node, errdefs.ErrInvalidArgument)
	}
	if c.Heartbeat == 0 {
		c.Heartbeat = config.DefaultEdge(func(string) string { return "" }).Heartbeat
	}
	return nil
}

// liveWindow is how long a registered node's name stays its own after its
// last heartbeat: another machine claiming it sooner is refused.
const liveWindow = 30 * time.Second

// register puts the edge in the registry under the identity of its
// certificate and returns its record (slot, generation).
func register(ctx context.Context, reg store.Store, cfg EdgeConfig, backends []string, maxSandboxes int) (store.Node, error) {
	id, err := clustertls.FileIdentity(cfg.TLS.Cert)
	if err != nil {
		return store.Node{}, err
	}
	if id.Role != clustertls.RoleEdge || id.Name != cfg.Node.Node {
		return store.Node{}, fmt.Errorf("register edge %s: its certificate is %s's: %w", cfg.Node.Node, id, errdefs.ErrInvalidArgument)
	}
	n, err := reg.RegisterNode(ctx, store.Node{Name: cfg.Node.Node, Addr: cfg.Advertise, Backends: backends,
		MaxSandboxes: maxSandboxes, Identity: id.Fingerprint}, liveWindow)
	if err != nil {
		return store.Node{}, fmt.Errorf("register edge %s: %w", cfg.Node.Node, err)
	}
	if n.Slot > 65535 || n.Generation > 1<<32-1 {
		return store.Node{}, fmt.Errorf("register edge %s: slot %d generation %d do not fit a sandbox ID: %w", n.Name, n.Slot, n.Generation, errdefs.ErrInternal)
	}
	return n, nil
}

// heartbeat tells the registry the edge lives until ctx ends. Losing the
// registry for a while is survivable (apiservers poll the edge itself);
// losing the slot to another machine is not: the edge must stop serving.
func heartbeat(ctx context.Context, reg store.Store, n store.Node, every time.Duration, log *slog.Logger) error {
	t := time.NewTicker(every)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return nil
		case <-t.C:
		}
		err := reg.Heartbeat(ctx, n.Name, n.Generation, time.Now())
		switch {
		case err == nil:
		case errors.Is(err, errdefs.ErrFailedPrecondition), errors.Is(err, errdefs.ErrNotFound):
			return fmt.Errorf("edge %s lost its registration (slot %d, generation %d): %w", n.Name, n.Slot, n.Generation, err)
		case ctx.Err() == nil:
			log.Warn("heartbeat", "err", err)
		}
	}
}

// RunEdge serves one node's EdgeService until ctx ends. Sandboxes keep
// running after it returns, as with the all-in-one dsecd.
func RunEdge(ctx context.Context, cfg EdgeConfig, log *slog.Logger) error {
	var reg store.Store
	if cfg.Registry != "" {
		var err error
		if reg, err = store.Open(ctx, cfg.Registry); err != nil {
			return err
		}
		defer reg.Close()
	}
	return runEdge(ctx, cfg, reg, log)
}

// runEdge is RunEdge with the registry open already (nil: none).
func runEdge(ctx context.Context, cfg EdgeConfig, reg store.Store, log *slog.Logger) error {
	if err := cfg.fill(); err != nil {
		return err
	}
	tlsConfig, err := clustertls.ServerConfig(cfg.TLS, clustertls.RoleAPIServer)
	if err != nil {
		return err
	}
	// Listen first: with port 0 the address to advertise is known only now.
	ln, err := net.Listen("tcp", cfg.Listen)
	if err != nil {
		return fmt.Errorf("listen on %s: %w", cfg.Listen, err)
	}
	defer ln.Close()
	if cfg.Advertise == "" || strings.HasSuffix(cfg.Advertise, ":0") {
		cfg.Advertise = "https://" + ln.Addr().String()
	}
	if cfg.DebugListen != "" {
		go servePprof(ctx, cfg.DebugListen, log)
	}
	var rec store.Node
	var svc *edgesvc.Service
	var metricsReg *metrics.Registry
	if !cfg.Node.NoMetrics {
		metricsReg = metrics.New()
	}
	if metricsOn(cfg.Node.MetricsListen) && metricsReg != nil {
		// An edge has no IAM: off loopback, only the scrape token reads it.
		tok, err := metrics.ReadScrapeToken(cfg.Node.MetricsTokenFile)
		if err != nil {
			return err
		}
		mln, err := listenMetrics(cfg.Node.MetricsListen)
		if err != nil {
			return err
		}
		go serveMetrics(ctx, mln, metrics.Guard(metricsReg.Handler(), tok.Allow), log)
	}
	if failed := metricsReg.StoreErrors().Of(store.Backend(cfg.Registry)); reg != nil && failed != nil {
		reg = store.Observe(reg, failed)
	}
	if cfg.Node.Runtime == "fake" {
		h := cfg.Hollow
		h.Node = cfg.Node.Node
		if reg != nil {
			if rec, err = register(ctx, reg, cfg, []string{"container"}, h.MaxSandboxes); err != nil {
				return err
			}
			h.Slot, h.Generation = uint16(rec.Slot), uint32(rec.Generation)
		}
		if !cfg.Node.NoEvents {
			h.Events = eventlog.New(h.Node, 0)
		}
		if !cfg.Node.NoLedger {
			// In memory: a hollow node's sandboxes do not outlive it.
			if h.Ledger, err = ledger.Open(h.Node, "", log.With("component", "ledger")); err != nil {
				return err
			}
			h.Ledger.SetCheckpoint(cfg.Node.LedgerCheckpoint)
			h.LedgerInterval = cfg.Node.LedgerInterval
		}
		h.Metrics = metricsReg.Edge()
		he := hollow.New(h)
		svc = edgesvc.New(he, nil, log.With("component", "edgesvc"))
		svc.SetMetrics(h.Metrics)
		svc.SetEvents(h.Events)
		svc.SetLedger(h.Ledger)
		lctx, stopLedger := context.WithCancel(ctx)
		defer stopLedger()
		go he.RunLedger(lctx)
		go he.RunExpiry(lctx)
		stopRecorder, err := startRecorder(ctx, cfg.Node, svc, he, log)
		if err != nil {
			return err
		}
		defer stopRecorder()
	} else {
		ncfg := cfg.Node
		if err := ncfg.fill(); err != nil {
			return err
		}
		if err := checkAgent(ncfg.AgentPath); err != nil {
			return err
		}
		if reg != nil {
			if rec, err = register(ctx, reg, cfg, []string{"container", "fncall"}, ncfg.Limits.MaxSandboxes); err != nil {
				return err
			}
			ncfg.Slot, ncfg.Generation = uint16(rec.Slot), uint32(rec.Generation)
		}
		ncfg.metrics = metricsReg
		n, err := open(ctx, ncfg, log)
		if err != nil {
			return err
		}
		defer n.close()
		if err := n.edge.Recover(ctx); err != nil {
			return err
		}
		defer n.edge.Shutdown()
		if n.net != nil {
			defer n.net.Close()
		}
		svc = edgesvc.New(n.edge, layers.NewHandler(n.layers, n.layerInUse), log.With("component", "edgesvc"))
		svc.SetMetrics(n.metrics)
		svc.SetEvents(n.events)
		svc.SetLedger(n.ledger)
		stopRecorder, err := startRecorder(ctx, ncfg, svc, n.edge, log)
		if err != nil {
			return err
		}
		defer stopRecorder()
		fn, err := n.startFnCall(ctx, log.With("component", "fncall"))
		if err != nil {
			return err
		}
		if fn != nil {
			defer fn.Close()
			svc.SetFnCall(fn)
		}
	}
	// Grade receipts are signed with the edge's leaf key from the cluster
	// CA, the one it serves TLS with, read again for each (a rotated
	// certificate signs from then on).
	svc.SetReceipts(func() (*sdkreceipt.Signer, error) { return receipt.EdgeSigner(cfg.TLS) })
	// Another node's attestation of a graded sandbox it holds is checked
	// against the cluster's CA bundle, read again for each.
	svc.SetTrust(func() (*sdkreceipt.Verifier, error) { return sdkreceipt.NewVerifierFile(cfg.TLS.CABundle) })
	mux := http.NewServeMux()
	mux.Handle(svc.Handler())
	if metricsReg != nil {
		// Behind the edge's mutual TLS, as its EdgeService is: a scraper
		// needs a certificate of the cluster's CA (or --metrics-listen).
		mux.Handle("/metrics", metricsReg.Handler())
	}
	ctx, stop := context.WithCancelCause(ctx)
	defer stop(nil)
	if reg != nil {
		go func() {
			if err := heartbeat(ctx, reg, rec, cfg.Heartbeat, log); err != nil {
				stop(err)
			}
		}()
	}
	log.Info("edge ready", "node", cfg.Node.Node, "listen", ln.Addr().String(), "runtime", cfg.Node.Runtime,
		"slot", rec.Slot, "generation", rec.Generation)
	err = serve(ctx, log, mux, tlsConfig, ln)
	if cause := context.Cause(ctx); err == nil && cause != nil && !errors.Is(cause, context.Canceled) {
		err = cause
	}
	log.Info("edge stopped; sandboxes keep running")
	return err
}

// StaticEdge is an edge an apiserver is told of, rather than one it finds
// in the registry.
type StaticEdge struct {
	Name string
	URL  string // https://HOST:PORT
}

// ParseStaticEdge reads NAME=https://HOST:PORT.
func ParseStaticEdge(s string) (StaticEdge, error) {
	name, url, ok := strings.Cut(s, "=")
	if !ok || name == "" || !strings.HasPrefix(url, "https://") {
		return StaticEdge{}, fmt.Errorf("edge %q: want NAME=https://HOST:PORT: %w", s, errdefs.ErrInvalidArgument)
	}
	return StaticEdge{Name: name, URL: url}, nil
}

// APIServerConfig is `dsecd apiserver`'s configuration.
type APIServerConfig struct {
	Name string // this replica's name, in its certificate and logs
	// Listen is the public API's TCP address; default DefaultAddr. Socket,
	// if set, is a Unix socket it serves too.
	Listen string
	Socket string
	// TLS is the apiserver's certificate (role apiserver), its key and the
	// cluster's CA bundle: it proves the apiserver to the edges, which
	// prove themselves back.
	TLS clustertls.Files
	// Edges are the nodes, when they are listed rather than registered.
	Edges []StaticEdge
	// DB is the metadata store every replica shares: postgres://… (a
	// cluster) or a SQLite file (one replica).
	DB string
	// PollInterval is how often the watcher polls each edge; 0 = its
	// default.
	PollInterval time.Duration
	// Replicas is how many apiservers place onto these edges; default 1.
	Replicas int
	// PlacementGroup is how many sandboxes of a batch one placement pick
	// puts on one node; 0 = placement's default.
	PlacementGroup int
	// DebugListen, if set, serves Go's profiles (net/http/pprof) on this
	// address; keep it on loopback.
	DebugListen string
	// MetricsListen, if set, serves the apiserver's Prometheus metrics
	// (/metrics) on this address too (its API port serves them already);
	// from off loopback a scrape needs the token in MetricsTokenFile or a
	// viewer's token on the root project.
	MetricsListen    string
	MetricsTokenFile string
	// NoMetrics records no metrics at all (/metrics answers 404): for
	// measuring what recording them costs.
	NoMetrics bool
	// NoEvents pulls no lifecycle events from the edges: for measuring
	// what they cost.
	NoEvents bool
	// NoLedger stores no cost ledger: the edges' records are not pulled
	// and `dsec usage` is refused; for measuring what it costs.
	NoLedger bool
	// UsagePullEvery is the least time between two pulls of one node's
	// ledger (apiserver.Config.UsagePullEvery).
	UsagePullEvery time.Duration
	// SandboxFusionListen, if set, serves SandboxFusion's HTTP API on this
	// address.
	SandboxFusionListen string
	// SandboxFusionProject, if set, is the project a SandboxFusion call
	// without a token runs in, as a runner there ("/": the root); unset,
	// such a call is refused (401) saying it needs a token.
	SandboxFusionProject string
	// E2BListen, if set, serves E2B's API (package e2b) on this address,
	// its sandboxes' access tokens signed with the secret in
	// E2BSecretFile, which every apiserver must share (dsecd init-cluster
	// makes one).
	E2BListen     string
	E2BSecretFile string
	// ReconcileInterval and AbandonAfter tune reconciliation (see
	// apiserver.Config); 0 = their defaults.
	ReconcileInterval time.Duration
	AbandonAfter      time.Duration
	// AuditRetention is how long audit records are kept (0 =
	// apiserver.DefaultAuditRetention; negative: forever).
	AuditRetention time.Duration
	// EventRetention is how long lifecycle events are kept (0 =
	// apiserver.DefaultEventRetention; negative: forever).
	EventRetention time.Duration
	// WebhookAllowPrivate allows webhooks on http:// and on loopback and
	// private addresses (docs/events.md).
	WebhookAllowPrivate bool
	// MaxBatch, CreateConcurrency, WebhookTimeout, WebhookBackoff and
	// WebhookMaxActive tune the apiserver (apiserver.Config); 0 = their
	// defaults.
	MaxBatch          int
	CreateConcurrency int
	WebhookTimeout    time.Duration
	WebhookBackoff    time.Duration
	WebhookMaxActive  int
	// UsageRetention is how long an ended sandbox's cost ledger row is
	// kept (0 = apiserver.DefaultUsageRetention; negative: forever).
	UsageRetention time.Duration
	// GradePool is the clean rooms of each shape grades keep ready on a
	// node (apiserver.Config.GradePool).
	GradePool int
}

// APITuning tunes the all-in-one's apiserver as APIServerConfig's fields
// of the same names tune a cluster's (apiserver.Config); zeros take
// apiserver's defaults.
type APITuning struct {
	MaxBatch          int
	CreateConcurrency int
	ReconcileInterval time.Duration
	AbandonAfter      time.Duration
	WebhookTimeout    time.Duration
	WebhookBackoff    time.Duration
	WebhookMaxActive  int
	GradePool         int
}

func (c *APIServerConfig) fill() error {
	if c.Name == "" {
		c.Name = nodeName()
	}
	if c.Listen == "" {
		c.Listen = DefaultAddr
	}
	if c.E2BListen != "" && c.E2BSecretFile == "" {
		return fmt.Errorf("apiserver %s: serving E2B's API needs the cluster's E2B secret (--e2b-secret-file; dsecd init-cluster writes %s): %w",
			c.Name, E2BSecretFile, errdefs.ErrInvalidArgument)
	}
	if c.TLS.Cert == "" || c.TLS.Key == "" || c.TLS.CABundle == "" {
		return fmt.Errorf("apiserver %s: a certificate, its key and the cluster's CA bundle are required (dsecd init-cluster makes them): %w",
			c.Name, errdefs.ErrInvalidArgument)
	}
	if c.DB == "" {
		return fmt.Errorf("apiserver %s: a metadata store is required (--db postgres://… or a SQLite file): %w", c.Name, errdefs.ErrInvalidArgument)
	}
	return nil
}

// registryMembers lists the registered edges as the watcher's members.
func registryMembers(reg store.Store) func(ctx context.Context) ([]watcher.Member, error) {
	return func(ctx context.Context) ([]watcher.Member, error) {
		nodes, err := reg.Nodes(ctx)
		if err != nil {
			return nil, err
		}
		out := make([]watcher.Member, 0, len(nodes))
		for _, n := range nodes {
			out = append(out, watcher.Member{Name: n.Name, Addr: n.Addr, Slot: uint16(n.Slot), Generation: uint32(n.Generation)})
		}
		return out, nil
	}
}

// RunAPIServer serves the public API in front of the cluster's edges until
// ctx ends.
func RunAPIServer(ctx context.Context, cfg APIServerConfig, log *slog.Logger) error {
	if err := cfg.fill(); err != nil {
		return err
	}
	tokenless, err := tokenlessProject(cfg.SandboxFusionProject, "")
	if err != nil {
		return err
	}
	lessGC()
	meta, err := store.Open(ctx, cfg.DB)
	if err != nil {
		return err
	}
	defer meta.Close()
	var reg *metrics.Registry
	if !cfg.NoMetrics {
		reg = metrics.New()
		meta = store.Observe(meta, reg.StoreErrors().Of(store.Backend(cfg.DB)))
	}
	scrapeToken, err := metrics.ReadScrapeToken(cfg.MetricsTokenFile)
	if err != nil {
		return err
	}
	// Edges named on the command line, else the registry's.
	members := registryMembers(meta)
	if len(cfg.Edges) > 0 {
		static := make([]watcher.Member, 0, len(cfg.Edges))
		for _, e := range cfg.Edges {
			static = append(static, watcher.Member{Name: e.Name, Addr: e.URL})
		}
		members = func(context.Context) ([]watcher.Member, error) { return static, nil }
	}
	var api *apiserver.Server
	w := watcher.New(watcher.Config{
		Members:  members,
		Dial:     func(m watcher.Member, answered func()) (watcher.Edge, error) { return dialEdge(cfg.TLS, m, answered) },
		Interval: cfg.PollInterval,
		OnReport: func(node string, _ *edgev1.NodeStatus) { api.Observe(node) },
		// Reconciliation runs apart: a node is routable at once, and the
		// poll round waits for nobody's reaping.
		OnReturn: func(_ context.Context, n watcher.Node) error {
			api.NodeReturned(n)
			return nil
		},
		Log: log.With("component", "watcher"),
	})
	var ledgerStore apiserver.LedgerStore
	if !cfg.NoLedger {
		ledgerStore = meta
	}
	api = apiserver.New(apiserver.Config{Name: cfg.Name, Replicas: cfg.Replicas, PlacementGroup: cfg.PlacementGroup, Auth: meta, Audit: meta, Quotas: meta, IAM: meta, Objects: meta,
		ReconcileInterval: cfg.ReconcileInterval, AbandonAfter: cfg.AbandonAfter, AuditRetention: cfg.AuditRetention,
		Events: meta, EventRetention: cfg.EventRetention, EventsOff: cfg.NoEvents, Webhooks: meta, WebhookAllowPrivate: cfg.WebhookAllowPrivate,
		Ledger: ledgerStore, UsageRetention: cfg.UsageRetention, UsagePullEvery: cfg.UsagePullEvery, ConsoleSessions: meta,
		TokenlessFnCall: tokenless, Metrics: reg, ScrapeToken: scrapeToken,
		MaxBatch: cfg.MaxBatch, CreateConcurrency: cfg.CreateConcurrency, WebhookTimeout: cfg.WebhookTimeout,
		WebhookBackoff: cfg.WebhookBackoff, WebhookMaxActive: cfg.WebhookMaxActive, GradePool: cfg.GradePool}, meta, w, log.With("component", "apiserver"))
	wctx, stopWatch := context.WithCancel(ctx)
	defer stopWatch()
	w.Poll(ctx) // routable edges from the first call on
	go w.Run(wctx)
	stopReconciler := runReconciler(ctx, api)
	defer stopReconciler()

	var lns []net.Listener
	if cfg.Socket != "" {
		uln, err := listenUnix(cfg.Socket)
		if err != nil {
			return err
		}
		lns = append(lns, uln)
	}
	tln, err := net.Listen("tcp", cfg.Listen)
	if err != nil {
		for _, l := range lns {
			l.Close()
		}
		return fmt.Errorf("listen on %s: %w", cfg.Listen, err)
	}
	lns = append(lns, tln)
	if cfg.DebugListen != "" {
		go servePprof(ctx, cfg.DebugListen, log)
	}
	if metricsOn(cfg.MetricsListen) && reg != nil {
		mln, err := listenMetrics(cfg.MetricsListen)
		if err != nil {
			for _, l := range lns {
				l.Close()
			}
			return err
		}
		go serveMetrics(ctx, mln, api.MetricsHandler(), log)
	}
	var sfAddr, e2bAddr string
	if cfg.SandboxFusionListen != "" {
		addr, wait, err := serveSandboxFusion(ctx, cfg.SandboxFusionListen, false, api, log)
		if err != nil {
			for _, l := range lns {
				l.Close()
			}
			return err
		}
		defer wait()
		sfAddr = addr
	}
	if cfg.E2BListen != "" {
		addr, wait, err := serveE2B(ctx, cfg.E2BListen, cfg.E2BSecretFile, false, api, meta, log)
		if err != nil {
			for _, l := range lns {
				l.Close()
			}
			return err
		}
		defer wait()
		e2bAddr = addr
	}
	api.SetEndpoints(e2bAddr, sfAddr)
	log.Info("apiserver ready", "name", cfg.Name, "listen", tln.Addr().String(), "edges", len(w.Nodes()))
	go endFollowers(ctx, api)
	err = serve(ctx, log, api.Handler(), nil, lns...)
	log.Info("apiserver stopped", "name", cfg.Name)
	return err
}

// endFollowers ends the API's event followers as the daemon begins to
// stop (they would otherwise hold its shutdown for the whole grace
// period, sending nothing); their clients follow again elsewhere.
func endFollowers(ctx context.Context, api *apiserver.Server) {
	<-ctx.Done()
	api.EndFollowers()
}

// runReconciler runs the apiserver's reconciliation, its audit writer and
// its audit records' expiry (and its other loops: events, usage, webhooks,
// idle grade pools) until the returned stop is called, which waits for them
// to end (before the store closes).
func runReconciler(ctx context.Context, api *apiserver.Server) (stop func()) {
	ctx, cancel := context.WithCancel(ctx)
	var wg sync.WaitGroup
	wg.Go(func() { api.RunReconciler(ctx) })
	wg.Go(func() { api.RunAuditExpiry(ctx) })
	wg.Go(func() { api.RunAudit(ctx) })
	wg.Go(func() { api.RunEvents(ctx) })
	wg.Go(func() { api.RunEventExpiry(ctx) })
	wg.Go(func() { api.RunUsageExpiry(ctx) })
	wg.Go(func() { api.RunWebhooks(ctx) })
	wg.Go(func() { api.RunGradePools(ctx) })
	return func() {
		cancel()
		wg.Wait()
	}
}

// dialEdge returns the EdgeService client of an edge, with the apiserver's
// certificate, checking that the peer is that very node.
func dialEdge(files clustertls.Files, m watcher.Member, answered func()) (watcher.Edge, error) {
	tc, err := clustertls.ClientConfig(files, clustertls.RoleEdge, m.Name)
	if err != nil {
		return nil, err
	}
	return edgeclient.Dial(tc, m.Addr, answered), nil
}

// HollowFleetConfig is `dsecd hollow-fleet`'s configuration: many hollow
// edges in one process, each with its own certificate, listener and
// registration, for measuring the control plane at the scale of a fleet on
// one machine.
type HollowFleetConfig struct {
	Count    int    // edges; default 160
	Prefix   string // their names are PREFIX1…PREFIXn; default "h"
	TLSDir   string // dsecd init-cluster's directory, with a certificate per edge
	Registry string // the cluster's metadata store (postgres://…), shared by all
	Hollow   hollow.Config
}

// RunHollowFleet serves the fleet until ctx ends or an edge fails.
func RunHollowFleet(ctx context.Context, cfg HollowFleetConfig, log *slog.Logger) error {
	if cfg.Count == 0 {
		cfg.Count = 160
	}
	if cfg.Prefix == "" {
		cfg.Prefix = "h"
	}
	if cfg.Registry == "" || cfg.TLSDir == "" {
		return fmt.Errorf("hollow fleet: --registry and --tls-dir are required: %w", errdefs.ErrInvalidArgument)
	}
	lessGC()
	reg, err := store.Open(ctx, cfg.Registry)
	if err != nil {
		return err
	}
	defer reg.Close()
	ctx, cancel := context.WithCancelCause(ctx)
	defer cancel(nil)
	var wg sync.WaitGroup
	for i := range cfg.Count {
		name := fmt.Sprintf("%s%d", cfg.Prefix, i+1)
		ecfg := EdgeConfig{Node: Config{Node: name, Runtime: "fake"}, Listen: "127.0.0.1:0", Hollow: cfg.Hollow,
			TLS: clustertls.ComponentFiles(cfg.TLSDir, clustertls.RoleEdge, name)}
		wg.Add(1)
		go func() {
			defer wg.Done()
			if err := runEdge(ctx, ecfg, reg, log.With("node", name)); err != nil {
				cancel(fmt.Errorf("hollow edge %s: %w", name, err))
			}
		}()
	}
	log.Info("hollow fleet started", "edges", cfg.Count)
	wg.Wait()
	if err := context.Cause(ctx); err != nil && !errors.Is(err, context.Canceled) {
		return err
	}
	return nil
}

// servePprof serves Go's profiles at addr until ctx ends, lock contention
// among them (one contended lock in 20 sampled, from then on).
func servePprof(ctx context.Context, addr string, log *slog.Logger) {
	runtime.SetMutexProfileFraction(20)
	mux := http.NewServeMux()
	mux.HandleFunc("/debug/pprof/", pprof.Index)
	mux.HandleFunc("/debug/pprof/profile", pprof.Profile)
	mux.HandleFunc("/debug/pprof/trace", pprof.Trace)
	srv := &http.Server{Addr: addr, Handler: mux, ReadHeaderTimeout: 10 * time.Second}
	go func() {
		<-ctx.Done()
		srv.Close()
	}()
	if err := srv.ListenAndServe(); err != nil && !errors.Is(err, http.ErrServerClosed) {
		log.Warn("serve profiles", "addr", addr, "err", err)
	}
}

// serveMetrics serves h at addr's /metrics until ctx ends.
func serveMetrics(ctx context.Context, ln net.Listener, h http.Handler, log *slog.Logger) {
	mux := http.NewServeMux()
	mux.Handle("/metrics", h)
	srv := &http.Server{Handler: mux, ReadHeaderTimeout: 10 * time.Second}
	go func() {
		<-ctx.Done()
		srv.Close()
	}()
	if err := srv.Serve(ln); err != nil && !errors.Is(err, http.ErrServerClosed) {
		log.Warn("serve metrics", "addr", ln.Addr().String(), "err", err)
	}
}

// metricsOn says whether a --metrics-listen asks for a port of its own
// ("" and "none": no, the API port serves /metrics already).
func metricsOn(addr string) bool {
	return addr != "" && addr != "none"
}

// metricsAt says where a process serves /metrics, for its ready line.
func metricsAt(listen string, on bool) string {
	switch {
	case !on:
		return "off (--no-metrics)"
	case metricsOn(listen):
		return "the API's /metrics and " + listen
	}
	return "the API's /metrics"
}

// listenMetrics binds --metrics-listen before the daemon says it is
// ready, so a taken or malformed address stops the start with its cause
// rather than leaving the node unscraped behind a warning in its log.
func listenMetrics(addr string) (net.Listener, error) {
	ln, err := net.Listen("tcp", addr)
	if err != nil {
		return nil, fmt.Errorf("metrics: listen on %s (--metrics-listen): %w", addr, err)
	}
	return ln, nil
}

// lessGC lets a process whose heap is small and short-lived (an apiserver
// keeps no per-sandbox state) collect garbage less often, unless GOGC says
// otherwise: in a burst of creates on two cores, garbage collection at the
// default pace took about a tenth of an apiserver's CPU, and raising it to
// 400 lifted the cluster's create rate by about 10 %.
func lessGC() {
	if os.Getenv("GOGC") == "" {
		debug.SetGCPercent(400)
	}
}

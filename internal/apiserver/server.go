// Package apiserver is the only door into dsec: it serves the public Connect
// services, validates requests, places new sandboxes on edges (which name
// them), makes creates idempotent, sets warm pools on every edge, and
// forwards every later call to the edge that owns the sandbox. It keeps no per-sandbox state: the node is read from the sandbox
// ID, so any number of replicas can serve the same cluster.
package apiserver

import (
	"context"
	"fmt"
	"log/slog"
	"net/http"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"connectrpc.com/connect"

	"dsec.dev/dsec/api/gen/dsec/edge/v1/edgev1connect"
	dsecv1 "dsec.dev/dsec/api/gen/dsec/v1"
	"dsec.dev/dsec/api/gen/dsec/v1/dsecv1connect"
	"dsec.dev/dsec/internal/console"
	"dsec.dev/dsec/internal/errdefs"
	"dsec.dev/dsec/internal/flushhold"
	"dsec.dev/dsec/internal/iam"
	"dsec.dev/dsec/internal/metrics"
	"dsec.dev/dsec/internal/placement"
	"dsec.dev/dsec/internal/store"
	"dsec.dev/dsec/internal/watcher"
)

// Edge is one node's edge as the apiserver calls it: EdgeService, with the
// public API's messages only. The all-in-one dsecd passes its in-process
// edge (package edgesvc), handing it the apiserver's own streams; a cluster
// passes a client of each remote edge (package edgeclient). Errors are
// errdefs kinds either way.
type Edge = edgev1connect.EdgeServiceHandler

// Fleet is the set of edges an apiserver routes to and places on: a
// watcher of the cluster's registry, or a fixed set (the all-in-one node).
type Fleet interface {
	// Route returns the edge holding the sandbox an ID names: NotFound
	// when its node is not (or no longer) in the fleet, Unavailable naming
	// the node when it is unreachable.
	Route(id string) (Edge, error)
	// Edge returns the edge of a node, with the same errors.
	Edge(node string) (Edge, error)
	// Nodes is the fleet as last seen.
	Nodes() []watcher.Node
}

// Creates is the apiserver's durable record of creates, shared by every
// replica: which sandboxes a Create with a key made (reservations, their
// leases, idempotency records and sandbox rows) and which creates it sent
// without learning their outcome (doubts). The metadata store (package
// store) implements it; its methods are documented there.
type Creates interface {
	GetIdempotency(ctx context.Context, key string) (store.Idempotency, error)
	ReserveCreate(ctx context.Context, r store.CreateReservation) (got store.CreateReservation, reserved bool, err error)
	CompleteCreate(ctx context.Context, key, nonce string, sbs []store.SandboxRow) error
	ReleaseCreate(ctx context.Context, key string) error
	Reservation(ctx context.Context, key string) (store.CreateReservation, error)
	TouchCreate(ctx context.Context, key, nonce string) error
	StaleCreates(ctx context.Context, before time.Time, limit int) ([]store.CreateReservation, error)
	AbandonCreate(ctx context.Context, key, nonce string, before time.Time, doubts []store.Doubt) (bool, error)
	SandboxRows(ctx context.Context, key string) ([]store.SandboxRow, error)
	NodeSandboxRows(ctx context.Context, node string) ([]store.SandboxRow, error)
	DeleteSandboxRows(ctx context.Context, ids []string) error
	AddDoubts(ctx context.Context, doubts []store.Doubt) error
	Doubts(ctx context.Context) ([]store.Doubt, error)
	ClearDoubts(ctx context.Context, doubts []store.Doubt) error
	ForgetDoubts(ctx context.Context, keep []string, before time.Time) (int, error)
}

// Config tunes the apiserver.
type Config struct {
	// Name is this replica's name, recorded as the owner of the creates it
	// reserves.
	Name string
	// MaxBatch is the largest count one Create may ask for.
	MaxBatch int
	// Replicas is how many apiservers place onto the same nodes; placement
	// weighs its own unreported placements by it (package placement).
	Replicas int
	// PlacementGroup is how many sandboxes of a batch one placement pick
	// puts on one node, in one call to it (placement.Config.Group; 0 =
	// placement.DefaultGroup).
	PlacementGroup int
	// Auth, when set, checks the bearer token of every call that does not
	// come over a Unix socket (see ConnContext), through an iam.Cache, and
	// the token's authority decides every call (iam.Allow); nil trusts
	// every caller as the node's administrator.
	Auth Authenticator
	// IAM, when set, serves dsec.v1.IAMService (projects, quotas,
	// principals, role bindings, tokens, audit) from it.
	IAM store.IAM
	// Quotas, when set, is charged for every sandbox a create makes (in
	// the sandbox's project and every project above it), given back when
	// it is deleted or its create fails, and set from the edges' truth by
	// every reconciliation sweep (quotas.go).
	Quotas Quotas
	// Objects, when set, records the project each layer, image and
	// snapshot belongs to, the bytes charged for it (to Quotas) and whom
	// it is shared with (objects.go); without it every one is the root's.
	Objects store.Objects
	// Audit, when set, receives a record of every management call and
	// every refused call, written apart from the calls by RunAudit.
	Audit Auditor
	// CreateConcurrency bounds how many sandboxes one batch starts at once.
	CreateConcurrency int
	// ReconcileInterval is how often RunReconciler sweeps (doubts, stale
	// reservations, sandbox rows); default 30 s. AbandonAfter is how long
	// a pending reservation may go untouched before any apiserver abandons
	// it; default DefaultAbandonAfter. See reconcile.go.
	ReconcileInterval time.Duration
	AbandonAfter      time.Duration
	// AuditRetention is how long RunAuditExpiry keeps audit records (0 =
	// DefaultAuditRetention; negative: forever).
	AuditRetention time.Duration
	// Events, when set, is where RunEvents stores the nodes' lifecycle
	// events and ListEvents and FollowEvents read them (events.go);
	// EventRetention is how long RunEventExpiry keeps them (0 =
	// DefaultEventRetention; negative: forever). EventsOff stops this
	// apiserver pulling events (dsecd --events-off: the edges keep none).
	Events         EventStore
	EventRetention time.Duration
	EventsOff      bool
	// Ledger, when set (with Events: the ledger rides on the event pull),
	// is where the nodes' cost ledger is stored and Usage reads it
	// (usage.go); UsageRetention is how long RunUsageExpiry keeps an ended
	// sandbox's row (0 = DefaultUsageRetention; negative: forever).
	Ledger         LedgerStore
	UsageRetention time.Duration
	// UsagePullEvery is the least time between two pulls of one node's
	// ledger (0: at the first pull tick after it moved): a node's samples
	// in between make one row a sandbox, not one each.
	UsagePullEvery time.Duration
	// Webhooks, when set, keeps the projects' webhooks, which RunWebhooks
	// delivers (webhooks.go). WebhookAllowPrivate allows http:// and
	// endpoints on loopback and private addresses (refused by default);
	// WebhookTimeout bounds one attempt (0: DefaultWebhookTimeout),
	// WebhookBackoff is the first wait after a failure (0: 1 s, doubled
	// each time up to a minute), WebhookMaxActive how many webhooks one
	// apiserver delivers at once (0: DefaultWebhookMaxActive).
	Webhooks WebhookStore
	// ConsoleSessions, when set, keeps the web console's sessions
	// (console.go), so every apiserver on the store accepts a browser
	// another signed in and a restart keeps them; nil keeps them in this
	// process's memory.
	ConsoleSessions     store.ConsoleSessions
	WebhookAllowPrivate bool
	WebhookTimeout      time.Duration
	// GradePool is how many clean rooms of each shape a grade keeps ready
	// on the graded sandbox's node (a grade pool: warm sandboxes of the
	// room's spec, on the sandbox's layers, into which a grade lays its
	// capture); 0 starts each clean room for its grade (grade_pools.go).
	GradePool        int
	WebhookBackoff   time.Duration
	WebhookMaxActive int
	// TokenlessFnCall, when Auth is set, is the path of the project in
	// which a SandboxFusion call without a token runs, as a runner there
	// (charged to it): "/" is the root. Empty refuses such calls
	// (AuthorizeFnCall).
	TokenlessFnCall string
	// Metrics, when set, is the registry the apiserver records into
	// (requests, placements, reconciliation, events, webhooks) and
	// Handler serves at /metrics; nil records nothing and serves no
	// /metrics. ScrapeToken, besides a viewer's token on the root
	// project, lets a scrape from off loopback read it (MetricsHandler).
	Metrics     *metrics.Registry
	ScrapeToken metrics.ScrapeToken
}

// Server implements the public services.
type Server struct {
	cfg     Config
	fleet   Fleet
	placer  *placement.Placer
	view    atomic.Pointer[cachedView]
	refresh fullRefresh // refresh.go
	idem    Creates
	log     *slog.Logger

	inflightMu sync.Mutex
	inflight   map[string]chan struct{} // idempotency keys being created

	rec   reconciler
	fn    *fnService
	authn *iam.Cache // nil without Config.Auth
	// projects remembers sandboxes' projects (projects.go).
	projects sandboxProjects
	charges  chargeGroup                       // quotas.go
	kept     settleGroup                       // quotas.go
	limits   limitCache                        // quotas.go
	objects  objectCache                       // objects.go
	audit    *auditLog                         // nil without Config.Audit
	events   eventState                        // events.go
	usage    usageState                        // usage.go
	webhooks webhookState                      // webhooks.go
	info     atomic.Pointer[dsecv1.ServerInfo] // SetEndpoints
	loop     loopback                          // grade.go
	grades   gradePools                        // grade_pools.go
	console  webConsole                        // console.go
	metrics  *metrics.API                      // nil without Config.Metrics
}

// The defaults of Config's zeros (dsecd's configuration shows them:
// package config).
const (
	DefaultMaxBatch          = 1000
	DefaultCreateConcurrency = 8
	DefaultReconcileInterval = 30 * time.Second
	DefaultWebhookBackoff    = time.Second
)

// New returns a Server routing to the fleet's edges.
func New(cfg Config, idem Creates, fleet Fleet, log *slog.Logger) *Server {
	if cfg.MaxBatch == 0 {
		cfg.MaxBatch = DefaultMaxBatch
	}
	if cfg.CreateConcurrency == 0 {
		cfg.CreateConcurrency = DefaultCreateConcurrency
	}
	if cfg.ReconcileInterval <= 0 {
		cfg.ReconcileInterval = DefaultReconcileInterval
	}
	if cfg.AbandonAfter <= 0 {
		cfg.AbandonAfter = DefaultAbandonAfter
	}
	if cfg.WebhookTimeout <= 0 {
		cfg.WebhookTimeout = DefaultWebhookTimeout
	}
	if cfg.WebhookBackoff <= 0 {
		cfg.WebhookBackoff = DefaultWebhookBackoff
	}
	if cfg.WebhookMaxActive <= 0 {
		cfg.WebhookMaxActive = DefaultWebhookMaxActive
	}
	s := &Server{cfg: cfg, fleet: fleet, idem: idem, log: log, inflight: map[string]chan struct{}{},
		placer: placement.New(placement.Config{Replicas: cfg.Replicas, Group: cfg.PlacementGroup}), rec: newReconciler(),
		webhooks: webhookState{claim: make(chan struct{}, 1)}}
	s.fn = &fnService{s: s}
	if cfg.Auth != nil {
		s.authn = iam.NewCache(cfg.Auth, 0, 0)
	}
	s.audit = newAuditLog(cfg.Audit, log)
	s.events.init()
	s.registerMetrics()
	s.usage.init()
	return s
}

// Handler returns the HTTP handler serving every service, plus /healthz,
// which needs no token, /metrics (Config.Metrics through MetricsHandler:
// a token only from off loopback), and the web console at /console
// (console.go), which needs a signed-in token.
func (s *Server) Handler() http.Handler {
	mux := http.NewServeMux()
	// Clients accept gzip by default; compressing small messages costs
	// more time than it saves, even off loopback.
	interceptors := []connect.Interceptor{errdefs.Interceptor{}, authInterceptor{cache: s.authn, log: s.log, audit: s.audit, projects: &s.projects}}
	if s.metrics != nil {
		// Outermost: the latency includes authentication.
		interceptors = append([]connect.Interceptor{requestMetrics{s.metrics}}, interceptors...)
	}
	opts := []connect.HandlerOption{connect.WithInterceptors(interceptors...), connect.WithCompressMinBytes(16 << 10)}
	for _, c := range jsonCodecs() {
		opts = append(opts, connect.WithCodec(c))
	}
	mux.Handle(dsecv1connect.NewSandboxServiceHandler(s, opts...))
	mux.Handle(dsecv1connect.NewLayerServiceHandler(&layerService{s: s}, append(opts, connect.WithReadMaxBytes(maxUploadMessage))...))
	mux.Handle(dsecv1connect.NewFnCallServiceHandler(s.fn, append(opts, connect.WithReadMaxBytes(maxCallMessage))...))
	if s.cfg.IAM != nil {
		mux.Handle(dsecv1connect.NewIAMServiceHandler(&iamService{st: s.cfg.IAM, log: s.log, pools: s.allWarmPools}, opts...))
	}
	mux.HandleFunc("/healthz", func(w http.ResponseWriter, r *http.Request) { fmt.Fprintln(w, "ok") })
	if s.cfg.Metrics != nil {
		mux.Handle("/metrics", s.MetricsHandler())
	}
	mux.HandleFunc(console.Prefix, s.serveConsole)
	mux.HandleFunc(console.Prefix+"/", s.serveConsole)
	// Streams of exec events end with the exit: see forwardStream.
	return flushhold.Handler(mux)
}

// edgeFor routes a sandbox ID to its node's edge.
func (s *Server) edgeFor(id string) (Edge, error) {
	if id == "" {
		return nil, fmt.Errorf("sandbox_id is required: %w", errdefs.ErrInvalidArgument)
	}
	return s.fleet.Route(id)
}

// routable is the fleet's nodes that answer now.
func (s *Server) routable() []watcher.Node {
	var out []watcher.Node
	for _, n := range s.fleet.Nodes() {
		if n.Healthy {
			out = append(out, n)
		}
	}
	return out
}

// viewTTL is how long one placement view serves: reports come every
// 750 ms, and placement counts its own placements since each itself.
const viewTTL = 50 * time.Millisecond

type cachedView struct {
	at    time.Time
	nodes []placement.Node
}

// placementView is the fleet as placement sees it: each node's capacity and
// live count as of its last report (a node of a fixed fleet, which is not
// polled, has room without bound). It is rebuilt at most every viewTTL,
// not per create: with 160 nodes that was a tenth of an apiserver's CPU.
// Callers must not change it.
func (s *Server) placementView() []placement.Node {
	if v := s.view.Load(); v != nil && time.Since(v.at) < viewTTL {
		return v.nodes
	}
	nodes := s.buildView()
	s.view.Store(&cachedView{at: time.Now(), nodes: nodes})
	return nodes
}

func (s *Server) buildView() []placement.Node {
	nodes := s.fleet.Nodes()
	out := make([]placement.Node, 0, len(nodes))
	for _, n := range nodes {
		pn := placement.Node{Name: n.Name, Healthy: n.Healthy, Backends: []string{placement.DefaultBackend},
			Capacity: 1 << 30, ReportedAt: n.LastSeen}
		if st := n.Status; st != nil {
			pn.Capacity, pn.Live = int(st.GetMaxSandboxes()), int(st.GetLive())
			pn.Backends = offeredKinds(st)
		} else if st := statusOf(n); st != nil {
			// An in-process edge admits for itself: only what it offers.
			pn.Backends = offeredKinds(st)
		}
		out = append(out, pn)
	}
	return out
}

// backendName is a backend as placement names it ("container").
func backendName(b dsecv1.Backend) string {
	if b == dsecv1.Backend_BACKEND_UNSPECIFIED {
		return placement.DefaultBackend
	}
	return strings.ToLower(strings.TrimPrefix(b.String(), "BACKEND_"))
}

// Observe tells placement that node reported its load now, so placements
// made before it stop counting twice. The watcher calls it on every report.
func (s *Server) Observe(node string) { s.placer.Observe(node, time.Now()) }

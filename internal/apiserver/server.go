// Package apiserver is the only door into dsec: it serves the public Connect
// services, validates requests, places new sandboxes on edges (which name
// them), makes creates idempotent, sets warm pools on every edge, and
// forwards every later call to the edge that owns the sandbox. It keeps no per-sandbox state: the node is read from the sandbox
// ID, so any number of replicas can serve the same cluster.
package apiserver

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net/http"
	"sort"
	"strings"
	"sync"
	"time"

	"connectrpc.com/connect"

	dsecv1 "dsec.dev/dsec/api/gen/dsec/v1"
	"dsec.dev/dsec/api/gen/dsec/v1/dsecv1connect"
	"dsec.dev/dsec/internal/agent/agentclient"
	"dsec.dev/dsec/internal/edge/netpolicy"
	"dsec.dev/dsec/internal/edge/sandbox"
	"dsec.dev/dsec/internal/errdefs"
	"dsec.dev/dsec/internal/flushhold"
	"dsec.dev/dsec/internal/store"
)

// Edge is what the apiserver needs of a node. The in-process edge
// (*sandbox.Manager) implements it; a network client of a remote edge will
// implement the same interface.
type Edge interface {
	Node() string
	// Create makes a sandbox (taking one from a warm pool of its shape when
	// there is one) and names it: the ID encodes the node.
	Create(ctx context.Context, spec *dsecv1.SandboxSpec) (*dsecv1.Sandbox, error)
	Get(ctx context.Context, id string) (*dsecv1.Sandbox, error)
	List(ctx context.Context, labels map[string]string, states []dsecv1.State) ([]*dsecv1.Sandbox, error)
	Delete(ctx context.Context, id string) error
	// Agent returns the channel to the sandbox's agent. The sandbox counts
	// as active until release is called.
	Agent(ctx context.Context, id string) (client agentclient.Client, release func(), err error)
	// SetNetworkRules replaces a running sandbox's network rules.
	SetNetworkRules(ctx context.Context, id string, rules map[string]bool, cut bool) (warnings []string, err error)
	// NetworkLog returns a sandbox's network audit records since a time.
	NetworkLog(ctx context.Context, id string, since time.Time, limit int) ([]netpolicy.Event, error)
	// SetWarmPool keeps size sandboxes of spec's shape ready on the node.
	SetWarmPool(ctx context.Context, spec *dsecv1.SandboxSpec, size int) (*dsecv1.WarmPool, error)
	// WarmPools lists the node's warm pools.
	WarmPools(ctx context.Context) ([]*dsecv1.WarmPool, error)
}

// Idempotency remembers which sandboxes a Create with a key made.
type Idempotency interface {
	GetIdempotency(ctx context.Context, key string) (store.Idempotency, error)
	PutIdempotency(ctx context.Context, rec store.Idempotency) error
}

// Config tunes the apiserver.
type Config struct {
	// MaxBatch is the largest count one Create may ask for.
	MaxBatch int
	// CreateConcurrency bounds how many sandboxes one batch starts at once.
	CreateConcurrency int
}

// Server implements the public services.
type Server struct {
	cfg    Config
	edges  map[string]Edge
	order  []string
	idem   Idempotency
	layers Layers
	log    *slog.Logger

	inflightMu sync.Mutex
	inflight   map[string]chan struct{} // idempotency keys being created
}

// New returns a Server routing to edges.
func New(cfg Config, idem Idempotency, layers Layers, edges []Edge, log *slog.Logger) *Server {
	if cfg.MaxBatch == 0 {
		cfg.MaxBatch = 1000
	}
	if cfg.CreateConcurrency == 0 {
		cfg.CreateConcurrency = 8
	}
	s := &Server{cfg: cfg, edges: map[string]Edge{}, idem: idem, layers: layers, log: log,
		inflight: map[string]chan struct{}{}}
	for _, e := range edges {
		s.edges[e.Node()] = e
		s.order = append(s.order, e.Node())
	}
	sort.Strings(s.order)
	return s
}

// Handler returns the HTTP handler serving every service, plus /healthz.
func (s *Server) Handler() http.Handler {
	mux := http.NewServeMux()
	// Clients accept gzip by default; compressing small messages costs
	// more time than it saves, even off loopback.
	opts := []connect.HandlerOption{connect.WithInterceptors(errorInterceptor{}), connect.WithCompressMinBytes(16 << 10)}
	for _, c := range jsonCodecs() {
		opts = append(opts, connect.WithCodec(c))
	}
	mux.Handle(dsecv1connect.NewSandboxServiceHandler(s, opts...))
	mux.Handle(dsecv1connect.NewLayerServiceHandler(&layerServer{s: s}, opts...))
	mux.HandleFunc("/healthz", func(w http.ResponseWriter, r *http.Request) { fmt.Fprintln(w, "ok") })
	// Streams of exec events end with the exit: see forwardStream.
	return flushhold.Handler(mux)
}

// edgeFor routes a sandbox ID to its node's edge.
func (s *Server) edgeFor(id string) (Edge, error) {
	node, err := sandbox.NodeOf(id)
	if err != nil {
		return nil, err
	}
	e, ok := s.edges[node]
	if !ok {
		return nil, fmt.Errorf("sandbox %s: node %q is not part of this cluster: %w", id, node, errdefs.ErrNotFound)
	}
	return e, nil
}

// place picks the edge for a new sandbox: the one with the fewest live
// sandboxes. With one node that is always the local edge.
func (s *Server) place(ctx context.Context) (Edge, error) {
	if len(s.order) == 0 {
		return nil, fmt.Errorf("no edge is registered: %w", errdefs.ErrUnavailable)
	}
	var best Edge
	bestN := -1
	for _, n := range s.order {
		e := s.edges[n]
		live, err := e.List(ctx, nil, []dsecv1.State{dsecv1.State_STATE_CREATING, dsecv1.State_STATE_RUNNING})
		if err != nil {
			continue
		}
		if bestN < 0 || len(live) < bestN {
			best, bestN = e, len(live)
		}
	}
	if best == nil {
		return nil, fmt.Errorf("no edge answered: %w", errdefs.ErrUnavailable)
	}
	return best, nil
}

// agent finds the agent channel of a running sandbox.
func (s *Server) agent(ctx context.Context, id string) (agentclient.Client, func(), error) {
	if id == "" {
		return nil, nil, fmt.Errorf("sandbox_id is required: %w", errdefs.ErrInvalidArgument)
	}
	e, err := s.edgeFor(id)
	if err != nil {
		return nil, nil, err
	}
	return e.Agent(ctx, id)
}

// agentErr explains an error from an agent call: when the sandbox ended
// meanwhile, say so instead of passing on a transport error.
func (s *Server) agentErr(ctx context.Context, id string, err error) error {
	if e, eerr := s.edgeFor(id); eerr == nil {
		sb, gerr := e.Get(context.WithoutCancel(ctx), id)
		if gerr == nil && sb.GetState() != dsecv1.State_STATE_RUNNING {
			return sandbox.GoneError(sb)
		}
	}
	var ce *connect.Error
	if errors.As(err, &ce) && ce.Code() != connect.CodeUnknown && ce.Code() != connect.CodeInternal &&
		!strings.Contains(ce.Message(), "protocol error") {
		return err // the agent's own verdict (not found, invalid argument…)
	}
	return fmt.Errorf("sandbox %s: agent channel: %v: %w", id, err, errdefs.ErrUnavailable)
}

// errorInterceptor turns errdefs kinds into Connect codes at the API edge.
type errorInterceptor struct{}

func (errorInterceptor) WrapUnary(next connect.UnaryFunc) connect.UnaryFunc {
	return func(ctx context.Context, req connect.AnyRequest) (connect.AnyResponse, error) {
		resp, err := next(ctx, req)
		return resp, errdefs.ToConnect(err)
	}
}

func (errorInterceptor) WrapStreamingClient(next connect.StreamingClientFunc) connect.StreamingClientFunc {
	return next
}

func (errorInterceptor) WrapStreamingHandler(next connect.StreamingHandlerFunc) connect.StreamingHandlerFunc {
	return func(ctx context.Context, conn connect.StreamingHandlerConn) error {
		return errdefs.ToConnect(next(ctx, conn))
	}
}

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
	"sort"
	"sync"

	"connectrpc.com/connect"

	edgev1 "dsec.dev/dsec/api/gen/dsec/edge/v1"
	"dsec.dev/dsec/api/gen/dsec/edge/v1/edgev1connect"
	"dsec.dev/dsec/api/gen/dsec/v1/dsecv1connect"
	"dsec.dev/dsec/internal/errdefs"
	"dsec.dev/dsec/internal/flushhold"
	"dsec.dev/dsec/internal/sandboxid"
	"dsec.dev/dsec/internal/store"
)

// Edge is one node's edge as the apiserver calls it: EdgeService, with the
// public API's messages only. The all-in-one dsecd passes its in-process
// edge (package edgesvc), handing it the apiserver's own streams; a cluster
// passes a client of each remote edge (package edgeclient). Errors are
// errdefs kinds either way.
type Edge = edgev1connect.EdgeServiceHandler

// Node is an edge and the node name its sandbox IDs carry.
type Node struct {
	Name string
	Edge Edge
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
	layers dsecv1connect.LayerServiceHandler
	log    *slog.Logger

	inflightMu sync.Mutex
	inflight   map[string]chan struct{} // idempotency keys being created
}

// New returns a Server routing to the nodes' edges. layers serves the
// LayerService (the all-in-one node's layer store).
func New(cfg Config, idem Idempotency, layers dsecv1connect.LayerServiceHandler, nodes []Node, log *slog.Logger) *Server {
	if cfg.MaxBatch == 0 {
		cfg.MaxBatch = 1000
	}
	if cfg.CreateConcurrency == 0 {
		cfg.CreateConcurrency = 8
	}
	if layers == nil {
		layers = dsecv1connect.UnimplementedLayerServiceHandler{}
	}
	s := &Server{cfg: cfg, edges: map[string]Edge{}, idem: idem, layers: layers, log: log,
		inflight: map[string]chan struct{}{}}
	for _, n := range nodes {
		s.edges[n.Name] = n.Edge
		s.order = append(s.order, n.Name)
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
	mux.Handle(dsecv1connect.NewLayerServiceHandler(s.layers, opts...))
	mux.HandleFunc("/healthz", func(w http.ResponseWriter, r *http.Request) { fmt.Fprintln(w, "ok") })
	// Streams of exec events end with the exit: see forwardStream.
	return flushhold.Handler(mux)
}

// edgeFor routes a sandbox ID to its node's edge.
func (s *Server) edgeFor(id string) (Edge, error) {
	if id == "" {
		return nil, fmt.Errorf("sandbox_id is required: %w", errdefs.ErrInvalidArgument)
	}
	node, err := sandboxid.Node(id)
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
func (s *Server) place(ctx context.Context) (string, Edge, error) {
	if len(s.order) == 0 {
		return "", nil, fmt.Errorf("no edge is registered: %w", errdefs.ErrUnavailable)
	}
	if len(s.order) == 1 {
		return s.order[0], s.edges[s.order[0]], nil
	}
	best, bestN := "", -1
	for _, n := range s.order {
		st, err := s.edges[n].Status(ctx, connect.NewRequest(&edgev1.StatusRequest{}))
		if err != nil {
			continue
		}
		if live := int(st.Msg.GetLive()); bestN < 0 || live < bestN {
			best, bestN = n, live
		}
	}
	if best == "" {
		return "", nil, fmt.Errorf("no edge answered: %w", errdefs.ErrUnavailable)
	}
	return best, s.edges[best], nil
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

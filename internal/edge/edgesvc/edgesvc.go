// Package edgesvc is the edge's face to the apiservers: it implements
// EdgeService (api/dsec/edge/v1) over one node's edge (package sandbox),
// taking and returning the public API's messages only. The all-in-one dsecd
// calls it in-process, handing it the apiserver's own streams; a node of a
// cluster serves the same value over Connect with mutual TLS (Handler). It
// owns what the apiserver must not: the channel to each sandbox's agent,
// the activity accounting of every call that runs in a sandbox, and the
// deduplication of creates an apiserver retries.
package edgesvc

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net/http"
	"strings"
	"sync"
	"time"

	"connectrpc.com/connect"

	edgev1 "dsec.dev/dsec/api/gen/dsec/edge/v1"
	"dsec.dev/dsec/api/gen/dsec/edge/v1/edgev1connect"
	dsecv1 "dsec.dev/dsec/api/gen/dsec/v1"
	"dsec.dev/dsec/api/gen/dsec/v1/dsecv1connect"
	"dsec.dev/dsec/internal/agent/agentclient"
	"dsec.dev/dsec/internal/edge/netpolicy"
	"dsec.dev/dsec/internal/edge/sandbox"
	"dsec.dev/dsec/internal/errdefs"
	"dsec.dev/dsec/internal/flushhold"
	"dsec.dev/dsec/internal/layerupload"
)

// Edge is what the service needs of the node's edge. *sandbox.Manager
// implements it; a hollow edge for scale tests implements it too.
type Edge interface {
	Node() string
	Status() sandbox.Status
	Create(ctx context.Context, spec *dsecv1.SandboxSpec) (*dsecv1.Sandbox, error)
	Get(ctx context.Context, id string) (*dsecv1.Sandbox, error)
	List(ctx context.Context, labels map[string]string, states []dsecv1.State) ([]*dsecv1.Sandbox, error)
	Delete(ctx context.Context, id string) error
	// Agent returns the channel to the sandbox's agent; the sandbox counts
	// as active until release is called.
	Agent(ctx context.Context, id string) (client agentclient.Client, release func(), err error)
	SetNetworkRules(ctx context.Context, id string, rules map[string]bool, cut bool) ([]string, error)
	NetworkLog(ctx context.Context, id string, since time.Time, limit int) ([]netpolicy.Event, error)
	SetWarmPool(ctx context.Context, spec *dsecv1.SandboxSpec, size int) (*dsecv1.WarmPool, error)
	WarmPools(ctx context.Context) ([]*dsecv1.WarmPool, error)
}

// Layers is what the service needs of the node's layer service: the
// public LayerService, and what an apiserver asks of a node of a cluster.
// *layers.Handler implements it.
type Layers interface {
	dsecv1connect.LayerServiceHandler
	// ImportImageTo is ImportImage with progress sent through send.
	ImportImageTo(ctx context.Context, m *dsecv1.ImportImageRequest, send func(*dsecv1.ImportImageProgress) error) error
	// UploadLayerFrom is UploadLayer from any upload stream.
	UploadLayerFrom(ctx context.Context, s layerupload.Stream) (*dsecv1.Layer, error)
	// AdoptLayers records ref, naming digests, from the blob store.
	AdoptLayers(ctx context.Context, ref string, digests []string) error
	// BlobStore names the node's blob store alike on nodes sharing it.
	BlobStore() string
}

// noLayers is the layer service of a node that keeps none (a hollow one).
type noLayers struct {
	dsecv1connect.UnimplementedLayerServiceHandler
}

var errNoLayers = fmt.Errorf("this node keeps no layers: %w", errdefs.ErrNotSupported)

func (noLayers) ImportImageTo(context.Context, *dsecv1.ImportImageRequest, func(*dsecv1.ImportImageProgress) error) error {
	return errNoLayers
}
func (noLayers) UploadLayerFrom(context.Context, layerupload.Stream) (*dsecv1.Layer, error) {
	return nil, errNoLayers
}
func (noLayers) AdoptLayers(context.Context, string, []string) error { return errNoLayers }
func (noLayers) BlobStore() string                                   { return "" }

// Version is reported by Status.
const Version = "0.2.0"

// tokenTTL is how long a create token is remembered: far longer than any
// apiserver waits before retrying a create.
const tokenTTL = time.Hour

// Service implements edgev1connect.EdgeServiceHandler. It is safe for
// concurrent use.
type Service struct {
	edgev1connect.UnimplementedEdgeServiceHandler
	edge   Edge
	layers Layers
	log    *slog.Logger

	mu     sync.Mutex
	tokens map[string]*tokenEntry // create token -> the create it names
	order  []string               // tokens, oldest first, for forgetting them in O(1)
}

type tokenEntry struct {
	done chan struct{} // closed once sb or err is set
	sb   *dsecv1.Sandbox
	err  error
	at   time.Time
}

// New returns the service of edge e, whose layers layers serves (nil: a
// node without layers, such as a hollow one, answers their calls with
// Unimplemented).
func New(e Edge, layers Layers, log *slog.Logger) *Service {
	if layers == nil {
		layers = noLayers{}
	}
	return &Service{edge: e, layers: layers, log: log, tokens: map[string]*tokenEntry{}}
}

// Node is the name of the node the service's edge owns.
func (s *Service) Node() string { return s.edge.Node() }

// Handler serves the service over Connect (HTTP/2 with the cluster's TLS in
// front, set up by the caller), errors mapped to Connect codes.
func (s *Service) Handler() (string, http.Handler) {
	path, h := edgev1connect.NewEdgeServiceHandler(s, connect.WithInterceptors(errdefs.Interceptor{}),
		connect.WithCompressMinBytes(16<<10))
	return path, flushhold.Handler(h)
}

func (s *Service) Status(ctx context.Context, req *connect.Request[edgev1.StatusRequest]) (*connect.Response[edgev1.NodeStatus], error) {
	st := s.edge.Status()
	return connect.NewResponse(&edgev1.NodeStatus{
		Node: st.Node, Backends: []dsecv1.Backend{dsecv1.Backend_BACKEND_CONTAINER},
		MaxSandboxes: int32(st.MaxSandboxes), Live: int32(st.Live), Creating: int32(st.Creating), Pooled: int32(st.Pooled),
		MaxCpus: st.MaxCPUs, MaxMemoryMb: st.MaxMemoryMB, MemAvailableMb: st.MemAvailableMB,
		ReportedUnixMs: st.At.UnixMilli(), Version: Version, Refusing: st.Refusing, BlobStore: s.layers.BlobStore(),
	}), nil
}

// Create makes a sandbox. A create token seen before returns what its first
// call made (or is waiting for it), so a retried create never makes two.
func (s *Service) Create(ctx context.Context, req *connect.Request[edgev1.CreateRequest]) (*connect.Response[dsecv1.Sandbox], error) {
	token := req.Msg.GetCreateToken()
	if token == "" {
		sb, err := s.edge.Create(ctx, req.Msg.GetSpec())
		if err != nil {
			return nil, err
		}
		return connect.NewResponse(sb), nil
	}
	for {
		s.mu.Lock()
		s.forgetTokens(time.Now())
		e, seen := s.tokens[token]
		if !seen {
			e = &tokenEntry{done: make(chan struct{}), at: time.Now()}
			s.tokens[token] = e
			s.order = append(s.order, token)
		}
		s.mu.Unlock()
		if !seen {
			return s.createFor(ctx, req.Msg.GetSpec(), token, e)
		}
		select {
		case <-e.done:
		case <-ctx.Done():
			return nil, fmt.Errorf("wait for the create with token %q: %w", token, errdefs.ErrDeadlineExceeded)
		}
		if e.err != nil {
			return nil, e.err
		}
		sb, err := s.edge.Get(ctx, e.sb.GetId())
		if err == nil && live(sb) {
			return connect.NewResponse(sb), nil
		}
		// The token's sandbox is gone (the apiserver deleted it when it
		// could not record the create): the retry makes a new one.
		s.mu.Lock()
		if s.tokens[token] == e {
			delete(s.tokens, token)
		}
		s.mu.Unlock()
	}
}

func live(sb *dsecv1.Sandbox) bool {
	st := sb.GetState()
	return st == dsecv1.State_STATE_CREATING || st == dsecv1.State_STATE_RUNNING
}

// createFor runs the create a token names and records its outcome in e.
func (s *Service) createFor(ctx context.Context, spec *dsecv1.SandboxSpec, token string, e *tokenEntry) (*connect.Response[dsecv1.Sandbox], error) {
	// The create runs to its end even if this caller goes: a retry with the
	// same token then finds the sandbox it made.
	sb, err := s.edge.Create(context.WithoutCancel(ctx), spec)
	s.mu.Lock()
	e.sb, e.err = sb, err
	if err != nil && s.tokens[token] == e {
		delete(s.tokens, token) // a failed create may be tried again
	}
	s.mu.Unlock()
	close(e.done)
	if err != nil {
		return nil, err
	}
	return connect.NewResponse(sb), nil
}

// forgetTokens drops tokens older than tokenTTL whose create has ended,
// oldest first: each call forgets what expired since the last. The caller
// holds s.mu.
func (s *Service) forgetTokens(now time.Time) {
	n := 0
	for ; n < len(s.order); n++ {
		e := s.tokens[s.order[n]]
		if e == nil {
			continue // forgotten already: its create failed
		}
		ended := false
		select {
		case <-e.done:
			ended = true
		default:
		}
		if now.Sub(e.at) <= tokenTTL || !ended {
			break
		}
		delete(s.tokens, s.order[n])
	}
	s.order = s.order[n:]
}

func (s *Service) Get(ctx context.Context, req *connect.Request[dsecv1.GetRequest]) (*connect.Response[dsecv1.Sandbox], error) {
	sb, err := s.edge.Get(ctx, req.Msg.GetId())
	if err != nil {
		return nil, err
	}
	return connect.NewResponse(sb), nil
}

func (s *Service) List(ctx context.Context, req *connect.Request[dsecv1.ListRequest]) (*connect.Response[dsecv1.ListResponse], error) {
	sbs, err := s.edge.List(ctx, req.Msg.GetLabels(), req.Msg.GetStates())
	if err != nil {
		return nil, err
	}
	return connect.NewResponse(&dsecv1.ListResponse{Sandboxes: sbs}), nil
}

func (s *Service) Delete(ctx context.Context, req *connect.Request[dsecv1.DeleteRequest]) (*connect.Response[dsecv1.DeleteResponse], error) {
	if err := s.edge.Delete(ctx, req.Msg.GetId()); err != nil {
		return nil, err
	}
	return connect.NewResponse(&dsecv1.DeleteResponse{}), nil
}

func (s *Service) SetNetworkRules(ctx context.Context, req *connect.Request[dsecv1.SetNetworkRulesRequest]) (*connect.Response[dsecv1.SetNetworkRulesResponse], error) {
	m := req.Msg
	warnings, err := s.edge.SetNetworkRules(ctx, m.GetSandboxId(), m.GetRules(), m.GetCut())
	if err != nil {
		return nil, err
	}
	return connect.NewResponse(&dsecv1.SetNetworkRulesResponse{Warnings: warnings}), nil
}

func (s *Service) NetworkLog(ctx context.Context, req *connect.Request[dsecv1.NetworkLogRequest]) (*connect.Response[dsecv1.NetworkLogResponse], error) {
	m := req.Msg
	var since time.Time
	if m.GetSinceUnixMs() > 0 {
		since = time.UnixMilli(m.GetSinceUnixMs())
	}
	events, err := s.edge.NetworkLog(ctx, m.GetSandboxId(), since, int(m.GetLimit()))
	if err != nil {
		return nil, err
	}
	out := &dsecv1.NetworkLogResponse{}
	for _, ev := range events {
		pe := &dsecv1.NetworkEvent{
			TimeUnixMs: ev.Time.UnixMilli(), Kind: ev.Kind, Verdict: ev.Verdict, Protocol: ev.Proto,
			Port: int32(ev.Port), Name: ev.Name, BytesOut: ev.BytesOut, BytesIn: ev.BytesIn, Rule: ev.Rule,
		}
		if ev.Dest.IsValid() {
			pe.Destination = ev.Dest.String()
		}
		out.Events = append(out.Events, pe)
	}
	return connect.NewResponse(out), nil
}

func (s *Service) SetWarmPool(ctx context.Context, req *connect.Request[dsecv1.SetWarmPoolRequest]) (*connect.Response[dsecv1.WarmPool], error) {
	p, err := s.edge.SetWarmPool(ctx, req.Msg.GetSpec(), int(req.Msg.GetSize()))
	if err != nil {
		return nil, err
	}
	return connect.NewResponse(p), nil
}

func (s *Service) ListWarmPools(ctx context.Context, req *connect.Request[dsecv1.ListWarmPoolsRequest]) (*connect.Response[dsecv1.ListWarmPoolsResponse], error) {
	ps, err := s.edge.WarmPools(ctx)
	if err != nil {
		return nil, err
	}
	return connect.NewResponse(&dsecv1.ListWarmPoolsResponse{Pools: ps}), nil
}

func (s *Service) ImportLayer(ctx context.Context, req *connect.Request[dsecv1.ImportLayerRequest]) (*connect.Response[dsecv1.Layer], error) {
	return s.layers.ImportLayer(ctx, req)
}

func (s *Service) ListLayers(ctx context.Context, req *connect.Request[dsecv1.ListLayersRequest]) (*connect.Response[dsecv1.ListLayersResponse], error) {
	return s.layers.ListLayers(ctx, req)
}

func (s *Service) RemoveLayer(ctx context.Context, req *connect.Request[dsecv1.RemoveLayerRequest]) (*connect.Response[dsecv1.RemoveLayerResponse], error) {
	return s.layers.RemoveLayer(ctx, req)
}

func (s *Service) ListEnvironments(ctx context.Context, req *connect.Request[dsecv1.ListEnvironmentsRequest]) (*connect.Response[dsecv1.ListEnvironmentsResponse], error) {
	return s.layers.ListEnvironments(ctx, req)
}

func (s *Service) ImportImage(ctx context.Context, req *connect.Request[dsecv1.ImportImageRequest], out *connect.ServerStream[dsecv1.ImportImageProgress]) error {
	return s.layers.ImportImageTo(ctx, req.Msg, out.Send)
}

// ImportImageTo is ImportImage with progress sent through send (see
// layers.Handler.ImportImageTo).
func (s *Service) ImportImageTo(ctx context.Context, m *dsecv1.ImportImageRequest, send func(*dsecv1.ImportImageProgress) error) error {
	return s.layers.ImportImageTo(ctx, m, send)
}

func (s *Service) UploadLayer(ctx context.Context, stream *connect.ClientStream[dsecv1.UploadLayerRequest]) (*connect.Response[dsecv1.Layer], error) {
	l, err := s.layers.UploadLayerFrom(ctx, stream)
	if err != nil {
		return nil, err
	}
	return connect.NewResponse(l), nil
}

// UploadLayerFrom is UploadLayer from any upload stream: the all-in-one
// apiserver hands over its own, with the header it read put back.
func (s *Service) UploadLayerFrom(ctx context.Context, in layerupload.Stream) (*dsecv1.Layer, error) {
	return s.layers.UploadLayerFrom(ctx, in)
}

func (s *Service) AdoptLayers(ctx context.Context, req *connect.Request[edgev1.AdoptLayersRequest]) (*connect.Response[edgev1.AdoptLayersResponse], error) {
	if err := s.layers.AdoptLayers(ctx, req.Msg.GetRef(), req.Msg.GetLayerDigests()); err != nil {
		return nil, err
	}
	return connect.NewResponse(&edgev1.AdoptLayersResponse{}), nil
}

func (s *Service) LayerStats(ctx context.Context, req *connect.Request[dsecv1.LayerStatsRequest]) (*connect.Response[dsecv1.LayerStatsResponse], error) {
	return s.layers.LayerStats(ctx, req)
}

// agentErr explains an error from an agent call: when the sandbox ended
// meanwhile, say so instead of passing on a transport error.
func (s *Service) agentErr(ctx context.Context, id string, err error) error {
	sb, gerr := s.edge.Get(context.WithoutCancel(ctx), id)
	if gerr == nil && sb.GetState() != dsecv1.State_STATE_RUNNING {
		return sandbox.GoneError(sb)
	}
	var ce *connect.Error
	if errors.As(err, &ce) && ce.Code() != connect.CodeUnknown && ce.Code() != connect.CodeInternal &&
		!strings.Contains(ce.Message(), "protocol error") {
		return err // the agent's own verdict (not found, invalid argument…)
	}
	return fmt.Errorf("sandbox %s: agent channel: %v: %w", id, err, errdefs.ErrUnavailable)
}

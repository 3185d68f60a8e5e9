// Package edgesvc is the edge's face to the apiservers: it implements
// EdgeService (api/dsec/edge/v1) over one node's edge (package sandbox),
// taking and returning the public API's messages only. The all-in-one dsecd
// calls it in-process, handing it the apiserver's own streams; a node of a
// cluster serves the same value over Connect with mutual TLS (Handler). It
// owns what the apiserver must not: the channel to each sandbox's agent,
// the activity accounting of every call that runs in a sandbox, the
// deduplication of creates an apiserver retries (by the create token the
// edge keeps with each sandbox), and the reaping of sandboxes whose create
// an apiserver gave up on (Reap).
package edgesvc

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"maps"
	"net/http"
	"os"
	"slices"
	"strings"
	"sync"
	"time"

	"connectrpc.com/connect"
	"google.golang.org/protobuf/proto"

	edgev1 "dsec.dev/dsec/api/gen/dsec/edge/v1"
	"dsec.dev/dsec/api/gen/dsec/edge/v1/edgev1connect"
	dsecv1 "dsec.dev/dsec/api/gen/dsec/v1"
	"dsec.dev/dsec/api/gen/dsec/v1/dsecv1connect"
	"dsec.dev/dsec/internal/agent/agentclient"
	"dsec.dev/dsec/internal/edge/eventlog"
	"dsec.dev/dsec/internal/edge/ledger"
	"dsec.dev/dsec/internal/edge/netpolicy"
	"dsec.dev/dsec/internal/edge/sandbox"
	"dsec.dev/dsec/internal/edge/snapshot"
	"dsec.dev/dsec/internal/edge/trajectory"
	"dsec.dev/dsec/internal/errdefs"
	"dsec.dev/dsec/internal/flushhold"
	"dsec.dev/dsec/internal/layerupload"
	"dsec.dev/dsec/internal/metrics"
	"dsec.dev/dsec/internal/sandboxpage"
)

// Edge is what the service needs of the node's edge. *sandbox.Manager
// implements it; a hollow edge for scale tests implements it too.
type Edge interface {
	Node() string
	Status() sandbox.Status
	// Create makes a sandbox for the create token names ("" for none) and
	// keeps the token with it while it lives (on disk too, where the edge
	// keeps its sandboxes across restarts); it records the token before it
	// returns.
	Create(ctx context.Context, spec *dsecv1.SandboxSpec, token string) (*dsecv1.Sandbox, error)
	// SandboxOf returns the live (creating or running) sandbox a create
	// token made.
	SandboxOf(token string) (id string, ok bool)
	// Tokens returns the create token of every live sandbox that has one,
	// token to sandbox ID.
	Tokens() map[string]string
	Get(ctx context.Context, id string) (*dsecv1.Sandbox, error)
	// Gone returns those of ids that name no live sandbox (ended, or
	// unknown), reading states without copying records: the
	// reconciler's check of a node's rows asks for all of them at once.
	Gone(ids []string) []string
	// Query answers List: the sandboxes q matches, or its page of them,
	// and how many match in all.
	Query(ctx context.Context, q sandboxpage.Query) ([]*dsecv1.Sandbox, int, error)
	Delete(ctx context.Context, id string) error
	// Pause freezes a sandbox and releases its memory (keepMemory: freeze
	// only); already says it was paused before. Resume undoes it.
	Pause(ctx context.Context, id string, keepMemory bool) (sb *dsecv1.Sandbox, already bool, err error)
	Resume(ctx context.Context, id string, skipPrefetch bool) (sb *dsecv1.Sandbox, already bool, prefetch time.Duration, err error)
	// SetTimeout moves the sandbox's expiry to timeout from now (only
	// later, with extendOnly) and returns its record.
	SetTimeout(ctx context.Context, id string, timeout time.Duration, extendOnly bool) (*dsecv1.Sandbox, error)
	// EndPhase ends the sandbox's phase (setup or agent) now and returns
	// its record; Phase is its phase now (spec.phases; unspecified
	// without them).
	EndPhase(ctx context.Context, id string, phase dsecv1.Phase) (*dsecv1.Sandbox, error)
	Phase(id string) dsecv1.Phase
	// Isolation is the sandbox's isolation as users write it
	// ("container", "gvisor", "microvm"), for the exec metric; "" for an
	// unknown sandbox.
	Isolation(id string) string
	// Metrics reads the sandbox's resource use now.
	Metrics(ctx context.Context, id string, since time.Time) (*dsecv1.SandboxMetrics, error)
	// Snapshot packs the sandbox's writable layer into layer snap:NAME.
	Snapshot(ctx context.Context, id, name string, sel snapshot.Select) (*dsecv1.SnapshotInfo, error)
	// Lay captures the sandbox's writable layer and lays the paths
	// sel.Include names into running sandbox room of this node (a grade's
	// clean room) instead of packing a layer.
	Lay(ctx context.Context, id, room, name string, sel snapshot.Select) (*dsecv1.SnapshotInfo, error)
	// Agent returns the channel to the sandbox's agent; the sandbox counts
	// as active until release is called.
	Agent(ctx context.Context, id string) (client agentclient.Client, release func(), err error)
	// AgentStarting is Agent for a call a pause must not cut off before it
	// started (started, or release): a unary call, or a command's stream
	// until its first event. A pause waits a moment for it; a started
	// command's stream carries on across a pause.
	AgentStarting(ctx context.Context, id string) (client agentclient.Client, started, release func(), err error)
	SetNetworkRules(ctx context.Context, id string, rules map[string]bool, cut bool) ([]string, error)
	NetworkLog(ctx context.Context, id string, since time.Time, limit int) ([]netpolicy.Event, error)
	// Provenance says how the sandbox's state came to be (package
	// provenance); SetProvenancePaths replaces the paths it judges by and
	// returns the protected ones it cannot watch.
	Provenance(ctx context.Context, id string, flagsOnly bool) (*dsecv1.SandboxProvenance, error)
	SetProvenancePaths(ctx context.Context, id string, paths *dsecv1.ProvenancePaths) ([]string, error)
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
	// RenameRef moves the name to onto what from names.
	RenameRef(ctx context.Context, from, to string) error
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
func (noLayers) RenameRef(context.Context, string, string) error     { return errNoLayers }
func (noLayers) BlobStore() string                                   { return "" }

// Version is reported by Status.
const Version = "0.2.0"

// reapedTTL is how long a reaped create token (or prefix) stays refused:
// far longer than a create can wait in a node's queue. A create sent to a
// frozen node waits in its socket until the node thaws, and runs within
// moments of it; an apiserver reaps its token only once the node answers.
const reapedTTL = time.Hour

// Service implements edgev1connect.EdgeServiceHandler. It is safe for
// concurrent use.
type Service struct {
	edgev1connect.UnimplementedEdgeServiceHandler
	edge    Edge
	layers  Layers
	metrics *metrics.Edge        // nil records nothing
	fncall  FnCall               // nil on a node without the fncall backend
	rec     *trajectory.Recorder // nil: no trajectories recorded
	events  *eventlog.Log        // nil: the node reports no events
	ledger  *ledger.Ledger       // nil: the node keeps no cost ledger
	log     *slog.Logger

	receipts Receipts // nil: the node signs no receipts
	trust    Trust    // nil: the node checks no other node's attestations
	execs    execLog  // the execs the node ran to their end, for receipts

	mu       sync.Mutex
	inflight map[string]chan struct{} // create tokens whose create runs now; closed when it ends
	// Tokens and token prefixes Reap killed, refused from then on, and
	// both oldest first for forgetting them in O(1). Prefixes are few: one
	// per abandoned batch.
	reapedTokens   map[string]time.Time
	reapedPrefixes map[string]time.Time
	order          []reapMark
}

type reapMark struct {
	token  string
	prefix bool
}

// New returns the service of edge e, whose layers layers serves (nil: a
// node without layers, such as a hollow one, answers their calls with
// Unimplemented).
func New(e Edge, layers Layers, log *slog.Logger) *Service {
	if layers == nil {
		layers = noLayers{}
	}
	return &Service{edge: e, layers: layers, log: log, inflight: map[string]chan struct{}{},
		reapedTokens: map[string]time.Time{}, reapedPrefixes: map[string]time.Time{}}
}

// FnCall is the node's fncall backend (*fncall.Service implements it).
type FnCall interface {
	RunCode(ctx context.Context, req *dsecv1.RunCodeRequest) (*dsecv1.RunCodeResponse, error)
	Languages() []*dsecv1.Language
	Load() (busy, queue, idle int)
}

// SetRecorder has the service record the trajectory of every sandbox of
// its node in rec; call it before serving.
func (s *Service) SetRecorder(rec *trajectory.Recorder) { s.rec = rec }

// SetMetrics has the service record its execs' latency in m; call it
// before serving.
func (s *Service) SetMetrics(m *metrics.Edge) { s.metrics = m }

// begin starts recording a call that acts on sandbox id (nil: not
// recorded), and notes it in the node's exec log for receipts.
func (s *Service) begin(ctx context.Context, id, call string, req any) *trajectory.Step {
	step, _ := s.beginSeq(ctx, id, call, req)
	return step
}

// beginSeq is begin, also returning the call's number among the calls
// that acted on the sandbox (execLog.act).
func (s *Service) beginSeq(ctx context.Context, id, call string, req any) (*trajectory.Step, int64) {
	var user string
	if x, ok := req.(*dsecv1.ExecRequest); ok {
		user = x.GetUser()
	}
	seq := s.execs.act(id, call, user)
	if s.rec == nil {
		return nil, seq
	}
	m, _ := req.(proto.Message)
	return s.rec.Begin(ctx, id, call, m), seq
}

// Trajectory reads a sandbox's trajectory from an offset: this node's, or
// the blob store's copy of another's.
func (s *Service) Trajectory(ctx context.Context, req *connect.Request[dsecv1.TrajectoryRequest]) (*connect.Response[dsecv1.TrajectoryResponse], error) {
	m := req.Msg
	if m.GetSandboxId() == "" {
		return nil, fmt.Errorf("sandbox_id is required: %w", errdefs.ErrInvalidArgument)
	}
	if s.rec == nil {
		return nil, fmt.Errorf("trajectory: node %s records none: %w", s.edge.Node(), errdefs.ErrNotSupported)
	}
	rd, err := s.rec.Read(ctx, m.GetSandboxId(), m.GetOffset(), int(m.GetLimitBytes()))
	if err != nil {
		return nil, err
	}
	return connect.NewResponse(&dsecv1.TrajectoryResponse{Lines: rd.Lines, NextOffset: rd.NextOffset, Size: rd.Size,
		Ended: rd.Ended, Sha256: rd.SHA256, Project: rd.Project}), nil
}

// SetEvents has the service answer Events from the node's event log (the
// one its edge adds to); call it before serving.
func (s *Service) SetEvents(l *eventlog.Log) { s.events = l }

// SetLedger has the service report the node's cost ledger on the
// apiservers' Events pulls; call it before serving.
func (s *Service) SetLedger(l *ledger.Ledger) { s.ledger = l }

// eventPage is the most events one Events call returns.
const eventPage = 1000

// Events reads the node's lifecycle events after a sequence number.
func (s *Service) Events(ctx context.Context, req *connect.Request[edgev1.EventsRequest]) (*connect.Response[edgev1.EventsResponse], error) {
	m := req.Msg
	limit := int(m.GetLimit())
	if limit <= 0 || limit > eventPage {
		limit = eventPage
	}
	// The ledger's changed records ride on the same pull.
	out := &edgev1.EventsResponse{Epoch: s.events.Epoch()}
	if m.GetPacked() {
		out.PackedEvents, _, out.Next, out.Lost = s.events.ReadPacked(m.GetEpoch(), m.GetAfter(), limit, nil)
		out.PackedUsage, _, out.UsageEpoch, out.UsageNext = s.ledger.ChangedPacked(m.GetUsageEpoch(), m.GetUsageAfter(), nil)
	} else {
		out.Events, out.Next, out.Lost = s.events.Read(m.GetEpoch(), m.GetAfter(), limit)
		out.Usage, out.UsageEpoch, out.UsageNext = s.ledger.Changed(m.GetUsageEpoch(), m.GetUsageAfter())
	}
	return connect.NewResponse(out), nil
}

// LiveUsage reads the node's cost ledger as it stands: its live
// sandboxes' records (and those just ended) of the projects asked, for an
// apiserver's Usage to add to the store's rows.
func (s *Service) LiveUsage(ctx context.Context, req *connect.Request[edgev1.LiveUsageRequest]) (*connect.Response[edgev1.LiveUsageResponse], error) {
	return connect.NewResponse(&edgev1.LiveUsageResponse{Usage: s.ledger.Live(req.Msg.GetProjects(), time.Now())}), nil
}

// SetFnCall gives the node the fncall backend; call it before serving.
func (s *Service) SetFnCall(f FnCall) { s.fncall = f }

// RunCode runs one fncall call on this node.
func (s *Service) RunCode(ctx context.Context, req *connect.Request[dsecv1.RunCodeRequest]) (*connect.Response[dsecv1.RunCodeResponse], error) {
	if s.fncall == nil {
		return nil, fmt.Errorf("run code: node %s has no fncall backend: %w", s.edge.Node(), errdefs.ErrNotSupported)
	}
	resp, err := s.fncall.RunCode(ctx, req.Msg)
	if err != nil {
		return nil, err
	}
	return connect.NewResponse(resp), nil
}

// ListLanguages lists the languages this node's fncall backend runs.
func (s *Service) ListLanguages(ctx context.Context, req *connect.Request[dsecv1.ListLanguagesRequest]) (*connect.Response[dsecv1.ListLanguagesResponse], error) {
	if s.fncall == nil {
		return nil, fmt.Errorf("list languages: node %s has no fncall backend: %w", s.edge.Node(), errdefs.ErrNotSupported)
	}
	return connect.NewResponse(&dsecv1.ListLanguagesResponse{Languages: s.fncall.Languages()}), nil
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

// Offers is the node's status now, for an apiserver that calls this edge
// in-process (the all-in-one dsecd's) and so has no watcher's report of
// what it offers.
func (s *Service) Offers() *edgev1.NodeStatus {
	resp, _ := s.Status(context.Background(), connect.NewRequest(&edgev1.StatusRequest{}))
	return resp.Msg
}

func (s *Service) Status(ctx context.Context, req *connect.Request[edgev1.StatusRequest]) (*connect.Response[edgev1.NodeStatus], error) {
	st := s.edge.Status()
	// A node serves fncall calls when it runs the backend's pools, whatever
	// runtimes it has.
	var backends []dsecv1.Backend
	for _, b := range st.Backends {
		if b != dsecv1.Backend_BACKEND_FNCALL {
			backends = append(backends, b)
		}
	}
	// The kinds a create may ask for; fncall's sandboxes come from its
	// pools (RunCode), not creates, like its backend above.
	var kinds []*dsecv1.SandboxKind
	for _, k := range st.Kinds {
		if k.GetProfile() != dsecv1.Backend_BACKEND_FNCALL {
			kinds = append(kinds, k)
		}
	}
	if len(backends) == 0 {
		backends = []dsecv1.Backend{dsecv1.Backend_BACKEND_CONTAINER} // a hollow edge's
	}
	if len(kinds) == 0 {
		kinds = []*dsecv1.SandboxKind{{Isolation: dsecv1.Isolation_ISOLATION_CONTAINER, Profile: dsecv1.Backend_BACKEND_CONTAINER}} // a hollow edge's
	}
	ns := &edgev1.NodeStatus{
		Node: st.Node, Backends: backends, Kinds: kinds, Missing: st.Missing,
		MaxSandboxes: int32(st.MaxSandboxes), Live: int32(st.Live), Creating: int32(st.Creating), Pooled: int32(st.Pooled),
		MaxCpus: st.MaxCPUs, MaxMemoryMb: st.MaxMemoryMB, MemAvailableMb: st.MemAvailableMB,
		Cpus: st.CPUs, CpuBusy: st.CPUBusy, MemTotalMb: st.MemTotalMB,
		ReportedUnixMs: st.At.UnixMilli(), Version: Version, Refusing: st.Refusing, BlobStore: s.layers.BlobStore(),
		Ended:          st.Ended,
		CoreScheduling: &dsecv1.CoreScheduling{Available: st.CoreSched.Available, Reason: st.CoreSched.Reason},
	}
	ns.EventEpoch, ns.EventSeq = s.events.Head()
	ns.UsageEpoch, ns.UsageSeq = s.ledger.Head()
	if !st.Started.IsZero() {
		ns.StartedUnixMs = st.Started.UnixMilli()
	}
	if s.fncall != nil {
		ns.Backends = append(ns.Backends, dsecv1.Backend_BACKEND_FNCALL)
		ns.Kinds = append(ns.Kinds, &dsecv1.SandboxKind{Isolation: dsecv1.Isolation_ISOLATION_CONTAINER, Profile: dsecv1.Backend_BACKEND_FNCALL})
		busy, queue, idle := s.fncall.Load()
		ns.FncallBusy, ns.FncallQueue, ns.FncallIdle = int32(busy), int32(queue), int32(idle)
	}
	return connect.NewResponse(ns), nil
}

// Create makes a sandbox. A create token whose sandbox lives returns that
// sandbox (or waits for the create making it), so a retried create never
// makes two; a token Reap killed is refused.
func (s *Service) Create(ctx context.Context, req *connect.Request[edgev1.CreateRequest]) (*connect.Response[dsecv1.Sandbox], error) {
	sb, err := s.create(ctx, req.Msg.GetSpec(), req.Msg.GetCreateToken())
	if err != nil {
		return nil, err
	}
	return connect.NewResponse(sb), nil
}

// maxCreateMany bounds the sandboxes of one CreateMany, and
// createManyParallel how many of them start at once.
const (
	maxCreateMany      = 256
	createManyParallel = 8
)

// CreateMany makes one sandbox per token, as Create does for each, and
// answers each on its own.
func (s *Service) CreateMany(ctx context.Context, req *connect.Request[edgev1.CreateManyRequest]) (*connect.Response[edgev1.CreateManyResponse], error) {
	spec, tokens := req.Msg.GetSpec(), req.Msg.GetCreateTokens()
	switch {
	case len(tokens) == 0:
		return nil, fmt.Errorf("create many: no create tokens: %w", errdefs.ErrInvalidArgument)
	case len(tokens) > maxCreateMany:
		return nil, fmt.Errorf("create many: %d create tokens, at most %d: %w", len(tokens), maxCreateMany, errdefs.ErrInvalidArgument)
	}
	seen := make(map[string]bool, len(tokens))
	for _, t := range tokens {
		if t == "" {
			return nil, fmt.Errorf("create many: an empty create token: %w", errdefs.ErrInvalidArgument)
		}
		if seen[t] {
			return nil, fmt.Errorf("create many: create token %q given twice: %w", t, errdefs.ErrInvalidArgument)
		}
		seen[t] = true
	}
	results := make([]*edgev1.CreateResult, len(tokens))
	sem := make(chan struct{}, createManyParallel)
	var wg sync.WaitGroup
	for i, t := range tokens {
		wg.Add(1)
		sem <- struct{}{}
		go func() {
			defer func() { <-sem; wg.Done() }()
			sb, err := s.create(ctx, spec, t)
			if err != nil {
				results[i] = &edgev1.CreateResult{ErrorCode: uint32(errdefs.Code(err)), ErrorMessage: err.Error()}
				return
			}
			results[i] = &edgev1.CreateResult{Sandbox: sb}
		}()
	}
	wg.Wait()
	return connect.NewResponse(&edgev1.CreateManyResponse{Results: results}), nil
}

// Forker is an edge that forks sandboxes from a memory snapshot
// (*sandbox.Manager); a hollow edge is none.
type Forker interface {
	Fork(ctx context.Context, id string, tokens []string) ([]sandbox.ForkResult, time.Duration, error)
}

// maxFork bounds the children of one Fork (the public API's own bound).
const maxFork = 16

// Fork makes one child of the sandbox per token from one memory snapshot
// of it, and answers each on its own. A token Reap killed is refused.
func (s *Service) Fork(ctx context.Context, req *connect.Request[edgev1.ForkRequest]) (*connect.Response[edgev1.ForkResponse], error) {
	id, tokens := req.Msg.GetSandboxId(), req.Msg.GetCreateTokens()
	switch {
	case id == "":
		return nil, fmt.Errorf("fork: sandbox_id is required: %w", errdefs.ErrInvalidArgument)
	case len(tokens) == 0 || len(tokens) > maxFork:
		return nil, fmt.Errorf("fork: %d create tokens, want 1 to %d: %w", len(tokens), maxFork, errdefs.ErrInvalidArgument)
	}
	seen := make(map[string]bool, len(tokens))
	s.mu.Lock()
	s.forgetReaped(time.Now())
	for _, t := range tokens {
		var err error
		switch {
		case t == "":
			err = fmt.Errorf("fork: an empty create token: %w", errdefs.ErrInvalidArgument)
		case seen[t]:
			err = fmt.Errorf("fork: create token %q given twice: %w", t, errdefs.ErrInvalidArgument)
		case s.isReaped(t):
			err = fmt.Errorf("create token %q was reaped on node %s: its create was given up: %w", t, s.edge.Node(), errdefs.ErrFailedPrecondition)
		}
		if err != nil {
			s.mu.Unlock()
			return nil, err
		}
		seen[t] = true
	}
	s.mu.Unlock()
	f, ok := s.edge.(Forker)
	if !ok {
		return nil, fmt.Errorf("fork: node %s cannot fork sandboxes: %w", s.edge.Node(), errdefs.ErrNotSupported)
	}
	made, todo, release, err := s.claimTokens(ctx, tokens)
	if err != nil {
		return nil, err
	}
	defer release()
	out := &edgev1.ForkResponse{Results: make([]*edgev1.CreateResult, len(tokens))}
	for i, sb := range made {
		if sb != nil {
			out.Results[i] = &edgev1.CreateResult{Sandbox: sb}
		}
	}
	if len(todo) == 0 {
		// A retry: every child is there, and the parent stands still for
		// no second save.
		return connect.NewResponse(out), nil
	}
	left := make([]string, len(todo))
	for j, i := range todo {
		left[j] = tokens[i]
	}
	step := s.begin(ctx, id, "fork", req.Msg)
	results, frozen, err := f.Fork(ctx, id, left)
	step.End(ctx, err)
	if err != nil {
		return nil, err
	}
	out.FrozenUs = frozen.Microseconds()
	for j, r := range results {
		i := todo[j]
		if r.Err != nil {
			out.Results[i] = &edgev1.CreateResult{ErrorCode: uint32(errdefs.Code(r.Err)), ErrorMessage: r.Err.Error()}
			continue
		}
		out.Results[i] = &edgev1.CreateResult{Sandbox: r.Sandbox}
	}
	return connect.NewResponse(out), nil
}

// claimTokens sorts a fork's create tokens: the children a call with the
// same token made already (live: made[i]), and the rest (todo, indexes of
// tokens), which it holds in flight, as a create holds its token, until
// release: a fork retried with its tokens gets the children the first made
// and makes only those missing, and two at once never both make one.
func (s *Service) claimTokens(ctx context.Context, tokens []string) (made []*dsecv1.Sandbox, todo []int, release func(), err error) {
	for {
		s.mu.Lock()
		var busy chan struct{}
		for _, t := range tokens {
			if done, ok := s.inflight[t]; ok {
				busy = done
				break
			}
		}
		if busy != nil {
			s.mu.Unlock()
			select {
			case <-busy:
				continue
			case <-ctx.Done():
				return nil, nil, nil, ctx.Err()
			}
		}
		made = make([]*dsecv1.Sandbox, len(tokens))
		ids := make([]string, len(tokens))
		done := make(chan struct{})
		for i, t := range tokens {
			if id, ok := s.edge.SandboxOf(t); ok {
				ids[i] = id
				continue
			}
			todo = append(todo, i)
			s.inflight[t] = done
		}
		s.mu.Unlock()
		release = func() {
			s.mu.Lock()
			for _, i := range todo {
				delete(s.inflight, tokens[i])
			}
			s.mu.Unlock()
			close(done)
		}
		for i, id := range ids {
			if id == "" {
				continue
			}
			sb, gerr := s.edge.Get(ctx, id)
			if gerr != nil {
				// It ended just now: its result says so.
				sb = &dsecv1.Sandbox{Id: id, State: dsecv1.State_STATE_STOPPED, Message: gerr.Error()}
			}
			made[i] = sb
		}
		return made, todo, release, nil
	}
}

// create makes the sandbox of one create token, or finds the one a create
// with it made ("": no deduplication).
func (s *Service) create(ctx context.Context, spec *dsecv1.SandboxSpec, token string) (*dsecv1.Sandbox, error) {
	if token == "" {
		return s.edge.Create(ctx, spec, "")
	}
	for {
		// Under s.mu, a token is in flight or its sandbox is known to the
		// edge (Create records the token before it returns): two calls with
		// one token never both start a create.
		s.mu.Lock()
		s.forgetReaped(time.Now())
		if s.isReaped(token) {
			s.mu.Unlock()
			return nil, fmt.Errorf("create token %q was reaped on node %s: its create was given up: %w", token, s.edge.Node(), errdefs.ErrFailedPrecondition)
		}
		if done, busy := s.inflight[token]; busy {
			s.mu.Unlock()
			select {
			case <-done:
				continue
			case <-ctx.Done():
				return nil, fmt.Errorf("wait for the create with token %q: %w", token, errdefs.ErrDeadlineExceeded)
			}
		}
		if id, ok := s.edge.SandboxOf(token); ok {
			s.mu.Unlock()
			sb, err := s.edge.Get(ctx, id)
			if err == nil && live(sb) {
				return sb, nil
			}
			continue // it ended just now: the retry makes a new one
		}
		done := make(chan struct{})
		s.inflight[token] = done
		s.mu.Unlock()
		// The create runs to its end even if this caller goes: a retry with
		// the same token then finds the sandbox it made, and a reconciling
		// apiserver can reap it.
		sb, err := s.edge.Create(context.WithoutCancel(ctx), spec, token)
		s.mu.Lock()
		delete(s.inflight, token)
		s.mu.Unlock()
		close(done)
		return sb, err
	}
}

func live(sb *dsecv1.Sandbox) bool { return sandbox.Live(sb.GetState()) }

// isReaped says whether Reap killed token or a prefix of it; the caller
// holds s.mu.
func (s *Service) isReaped(token string) bool {
	if _, ok := s.reapedTokens[token]; ok {
		return true
	}
	for p := range s.reapedPrefixes {
		if strings.HasPrefix(token, p) {
			return true
		}
	}
	return false
}

// marks returns the map of reaped tokens or of reaped prefixes m belongs to.
func (s *Service) marks(m reapMark) map[string]time.Time {
	if m.prefix {
		return s.reapedPrefixes
	}
	return s.reapedTokens
}

// forgetReaped drops the reaped marks older than reapedTTL, oldest first:
// each call forgets what expired since the last. The caller holds s.mu.
func (s *Service) forgetReaped(now time.Time) {
	n := 0
	for ; n < len(s.order); n++ {
		m := s.order[n]
		marks := s.marks(m)
		if now.Sub(marks[m.token]) <= reapedTTL {
			break
		}
		delete(marks, m.token)
	}
	s.order = s.order[n:]
}

// Reap removes the live sandboxes made by creates of the given tokens or
// token prefixes, except keep_ids. It marks them reaped first, so that no
// create of theirs starts any more, and waits for those already running.
func (s *Service) Reap(ctx context.Context, req *connect.Request[edgev1.ReapRequest]) (*connect.Response[edgev1.ReapResponse], error) {
	tokens, prefixes := req.Msg.GetTokens(), req.Msg.GetTokenPrefixes()
	for _, t := range append(slices.Clip(tokens), prefixes...) {
		if t == "" {
			return nil, fmt.Errorf("reap: an empty token or token prefix: %w", errdefs.ErrInvalidArgument)
		}
	}
	now := time.Now()
	var running []chan struct{}
	s.mu.Lock()
	s.forgetReaped(now)
	mark := func(m reapMark) {
		if marks := s.marks(m); marks[m.token].IsZero() {
			marks[m.token] = now
			s.order = append(s.order, m)
		}
	}
	for _, t := range tokens {
		mark(reapMark{token: t})
		if done, ok := s.inflight[t]; ok {
			running = append(running, done)
		}
	}
	for _, p := range prefixes {
		mark(reapMark{token: p, prefix: true})
		for t, done := range s.inflight {
			if strings.HasPrefix(t, p) {
				running = append(running, done)
			}
		}
	}
	s.mu.Unlock()
	for _, done := range running {
		select {
		case <-done:
		case <-ctx.Done():
			return nil, fmt.Errorf("reap: wait for %d creates in progress: %w", len(running), errdefs.ErrDeadlineExceeded)
		}
	}
	// No create of these tokens runs now, nor will one start.
	victims := map[string]bool{}
	for _, t := range tokens {
		if id, ok := s.edge.SandboxOf(t); ok {
			victims[id] = true
		}
	}
	if len(prefixes) > 0 {
		for t, id := range s.edge.Tokens() {
			if slices.ContainsFunc(prefixes, func(p string) bool { return strings.HasPrefix(t, p) }) {
				victims[id] = true
			}
		}
	}
	for _, id := range req.Msg.GetKeepIds() {
		delete(victims, id)
	}
	out := &edgev1.ReapResponse{}
	for _, id := range slices.Sorted(maps.Keys(victims)) {
		if err := s.edge.Delete(ctx, id); err != nil {
			return nil, fmt.Errorf("reap sandbox %s: %w", id, err)
		}
		out.RemovedIds = append(out.RemovedIds, id)
	}
	if len(out.RemovedIds) > 0 {
		s.log.Info("reaped sandboxes of creates given up", "removed", len(out.RemovedIds), "tokens", len(tokens), "prefixes", len(prefixes))
	}
	return connect.NewResponse(out), nil
}

// Gone answers which of the given IDs the node holds no live sandbox for.
func (s *Service) Gone(ctx context.Context, req *connect.Request[edgev1.GoneRequest]) (*connect.Response[edgev1.GoneResponse], error) {
	return connect.NewResponse(&edgev1.GoneResponse{Ids: s.edge.Gone(req.Msg.GetIds())}), nil
}

func (s *Service) Get(ctx context.Context, req *connect.Request[dsecv1.GetRequest]) (*connect.Response[dsecv1.Sandbox], error) {
	sb, err := s.edge.Get(ctx, req.Msg.GetId())
	if err != nil {
		return nil, err
	}
	return connect.NewResponse(sb), nil
}

func (s *Service) List(ctx context.Context, req *connect.Request[edgev1.ListRequest]) (*connect.Response[edgev1.ListResponse], error) {
	q := sandboxpage.QueryOf(req.Msg)
	sbs, total, err := s.edge.Query(ctx, q)
	if err != nil {
		return nil, err
	}
	resp := &edgev1.ListResponse{Sandboxes: sbs, Total: int32(total), Filtered: true}
	if q.Tally != nil {
		resp.Tallied, resp.Tallies = true, q.Tally.List()
	}
	return connect.NewResponse(resp), nil
}

func (s *Service) Delete(ctx context.Context, req *connect.Request[dsecv1.DeleteRequest]) (*connect.Response[dsecv1.DeleteResponse], error) {
	id := req.Msg.GetId()
	step := s.begin(ctx, id, "delete", req.Msg)
	err := s.edge.Delete(ctx, id)
	step.End(ctx, err)
	if err != nil {
		return nil, err
	}
	s.rec.Finish(ctx, id, "deleted")
	s.execs.forget(id)
	return connect.NewResponse(&dsecv1.DeleteResponse{}), nil
}

func (s *Service) Pause(ctx context.Context, req *connect.Request[dsecv1.PauseRequest]) (*connect.Response[dsecv1.PauseResponse], error) {
	step := s.begin(ctx, req.Msg.GetSandboxId(), "pause", req.Msg)
	sb, already, err := s.edge.Pause(ctx, req.Msg.GetSandboxId(), req.Msg.GetKeepMemory())
	step.End(ctx, err)
	if err != nil {
		return nil, err
	}
	return connect.NewResponse(&dsecv1.PauseResponse{Sandbox: sb, AlreadyPaused: already}), nil
}

func (s *Service) Resume(ctx context.Context, req *connect.Request[dsecv1.ResumeRequest]) (*connect.Response[dsecv1.ResumeResponse], error) {
	step := s.begin(ctx, req.Msg.GetSandboxId(), "resume", req.Msg)
	sb, already, prefetch, err := s.edge.Resume(ctx, req.Msg.GetSandboxId(), req.Msg.GetSkipPrefetch())
	step.End(ctx, err)
	if err != nil {
		return nil, err
	}
	return connect.NewResponse(&dsecv1.ResumeResponse{Sandbox: sb, AlreadyRunning: already, PrefetchMs: prefetch.Milliseconds()}), nil
}

func (s *Service) SetTimeout(ctx context.Context, req *connect.Request[dsecv1.SetTimeoutRequest]) (*connect.Response[dsecv1.SetTimeoutResponse], error) {
	m := req.Msg
	sb, err := s.edge.SetTimeout(ctx, m.GetSandboxId(), time.Duration(m.GetTimeoutSeconds())*time.Second, m.GetExtendOnly())
	if err != nil {
		return nil, err
	}
	return connect.NewResponse(&dsecv1.SetTimeoutResponse{Sandbox: sb}), nil
}

func (s *Service) EndPhase(ctx context.Context, req *connect.Request[dsecv1.EndPhaseRequest]) (*connect.Response[dsecv1.EndPhaseResponse], error) {
	sb, err := s.edge.EndPhase(ctx, req.Msg.GetSandboxId(), req.Msg.GetPhase())
	if err != nil {
		return nil, err
	}
	return connect.NewResponse(&dsecv1.EndPhaseResponse{Sandbox: sb}), nil
}

func (s *Service) Metrics(ctx context.Context, req *connect.Request[dsecv1.MetricsRequest]) (*connect.Response[dsecv1.SandboxMetrics], error) {
	var since time.Time
	if ms := req.Msg.GetSinceUnixMs(); ms > 0 {
		since = time.UnixMilli(ms)
	}
	mt, err := s.edge.Metrics(ctx, req.Msg.GetSandboxId(), since)
	if err != nil {
		return nil, err
	}
	return connect.NewResponse(mt), nil
}

func (s *Service) Snapshot(ctx context.Context, req *connect.Request[dsecv1.SnapshotRequest]) (*connect.Response[dsecv1.SnapshotInfo], error) {
	// The graded sandbox's trajectory records the call without the files
	// a grade lays beside its capture: they are the grader's trusted tests
	// (hidden from the agent), written into the clean room, not into it.
	var recorded proto.Message = req.Msg
	if len(req.Msg.GetLayFiles()) > 0 {
		m := proto.Clone(req.Msg).(*dsecv1.SnapshotRequest)
		for _, f := range m.GetLayFiles() {
			f.Data = nil
		}
		recorded = m
	}
	step := s.begin(ctx, req.Msg.GetSandboxId(), "snapshot", recorded)
	sel := snapshot.Select{Include: req.Msg.GetInclude(), Exclude: req.Msg.GetExclude(), Trusted: req.Msg.GetTrusted()}
	for _, f := range req.Msg.GetLayFiles() {
		sel.Files = append(sel.Files, snapshot.File{Path: f.GetPath(), Data: f.GetData(), Mode: os.FileMode(f.GetMode()).Perm()})
	}
	var info *dsecv1.SnapshotInfo
	var err error
	if len(sel.Files) > 0 && req.Msg.GetLayInto() == "" {
		err = fmt.Errorf("snapshot %s: lay_files go with lay_into only: %w", req.Msg.GetName(), errdefs.ErrInvalidArgument)
		step.End(ctx, err)
		return nil, err
	}
	if room := req.Msg.GetLayInto(); room != "" {
		info, err = s.edge.Lay(ctx, req.Msg.GetSandboxId(), room, req.Msg.GetName(), sel)
	} else {
		info, err = s.edge.Snapshot(ctx, req.Msg.GetSandboxId(), req.Msg.GetName(), sel)
	}
	step.End(ctx, err)
	if err != nil {
		return nil, err
	}
	return connect.NewResponse(info), nil
}

func (s *Service) SetNetworkRules(ctx context.Context, req *connect.Request[dsecv1.SetNetworkRulesRequest]) (*connect.Response[dsecv1.SetNetworkRulesResponse], error) {
	m := req.Msg
	step := s.begin(ctx, m.GetSandboxId(), "set_network_rules", m)
	warnings, err := s.edge.SetNetworkRules(ctx, m.GetSandboxId(), m.GetRules(), m.GetCut())
	if err == nil {
		s.rec.NetworkRules(m.GetSandboxId(), len(m.GetRules()) > 0)
	}
	step.End(ctx, err)
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

func (s *Service) Provenance(ctx context.Context, req *connect.Request[dsecv1.ProvenanceRequest]) (*connect.Response[dsecv1.SandboxProvenance], error) {
	p, err := s.edge.Provenance(ctx, req.Msg.GetSandboxId(), req.Msg.GetFlagsOnly())
	if err != nil {
		return nil, err
	}
	// A grade's receipt is checked against the flags reported here.
	s.execs.reported(req.Msg.GetSandboxId(), flagNames(p.GetFlags()))
	return connect.NewResponse(p), nil
}

func (s *Service) SetProvenancePaths(ctx context.Context, req *connect.Request[dsecv1.SetProvenancePathsRequest]) (*connect.Response[dsecv1.SetProvenancePathsResponse], error) {
	unwatched, err := s.edge.SetProvenancePaths(ctx, req.Msg.GetSandboxId(), req.Msg.GetPaths())
	if err != nil {
		return nil, err
	}
	return connect.NewResponse(&dsecv1.SetProvenancePathsResponse{Unwatched: unwatched}), nil
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

// RenameRef moves a layer's or image's name onto what another names.
func (s *Service) RenameRef(ctx context.Context, req *connect.Request[edgev1.RenameRefRequest]) (*connect.Response[edgev1.RenameRefResponse], error) {
	if req.Msg.GetFrom() == "" || req.Msg.GetTo() == "" {
		return nil, fmt.Errorf("rename ref: from and to (name:tag) are required: %w", errdefs.ErrInvalidArgument)
	}
	if err := s.layers.RenameRef(ctx, req.Msg.GetFrom(), req.Msg.GetTo()); err != nil {
		return nil, err
	}
	return connect.NewResponse(&edgev1.RenameRefResponse{}), nil
}

func (s *Service) LayerStats(ctx context.Context, req *connect.Request[dsecv1.LayerStatsRequest]) (*connect.Response[dsecv1.LayerStatsResponse], error) {
	return s.layers.LayerStats(ctx, req)
}

// stoppingWait bounds how long agentErr waits for a stopping sandbox to
// end, so that its error says why it stopped.
const stoppingWait = 5 * time.Second

// agentErr explains an error from an agent call: when the sandbox ended
// meanwhile, say so instead of passing on a transport error; when the
// call's context ended, that is the cause, not an unavailable agent. A
// sandbox still stopping (its channel closes before its record says why:
// a stream in flight when a paused microVM is deleted) is waited for a
// moment.
func (s *Service) agentErr(ctx context.Context, id string, err error) error {
	bg := context.WithoutCancel(ctx)
	sb, gerr := s.edge.Get(bg, id)
	for deadline := time.Now().Add(stoppingWait); gerr == nil && sb.GetState() == dsecv1.State_STATE_STOPPING && time.Now().Before(deadline); {
		time.Sleep(20 * time.Millisecond)
		sb, gerr = s.edge.Get(bg, id)
	}
	if gerr == nil && !live(sb) {
		return sandbox.GoneError(sb)
	}
	switch cerr := ctx.Err(); {
	case errors.Is(cerr, context.DeadlineExceeded):
		return fmt.Errorf("sandbox %s: %v: %w", id, err, errdefs.ErrDeadlineExceeded)
	case cerr != nil:
		return fmt.Errorf("sandbox %s: %v: %w", id, err, cerr)
	}
	var ce *connect.Error
	if errors.As(err, &ce) && ce.Code() != connect.CodeUnknown && ce.Code() != connect.CodeInternal &&
		!strings.Contains(ce.Message(), "protocol error") {
		// The agent's own verdict (not found, invalid argument…), as an
		// errdefs kind: errors.Is holds in process as across the wire.
		return errdefs.FromConnect(err)
	}
	return fmt.Errorf("sandbox %s: agent channel: %v: %w", id, err, errdefs.ErrUnavailable)
}

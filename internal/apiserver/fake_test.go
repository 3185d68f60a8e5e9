package apiserver

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"io"
	"log/slog"
	"slices"
	"strings"
	"sync"
	"time"

	"connectrpc.com/connect"
	"google.golang.org/protobuf/proto"

	edgev1 "dsec.dev/dsec/api/gen/dsec/edge/v1"
	dsecv1 "dsec.dev/dsec/api/gen/dsec/v1"
	"dsec.dev/dsec/api/gen/dsec/v1/dsecv1connect"
	"dsec.dev/dsec/internal/agent/agentclient"
	"dsec.dev/dsec/internal/edge/edgesvc"
	"dsec.dev/dsec/internal/edge/netpolicy"
	"dsec.dev/dsec/internal/edge/sandbox"
	"dsec.dev/dsec/internal/edge/snapshot"
	"dsec.dev/dsec/internal/errdefs"
	"dsec.dev/dsec/internal/layerupload"
	"dsec.dev/dsec/internal/sandboxid"
	"dsec.dev/dsec/internal/sandboxpage"
	"dsec.dev/dsec/internal/watcher"
)

// fakeEdge is an in-memory Edge: sandboxes are records only.
type fakeEdge struct {
	node   string
	mu     sync.Mutex
	sbs    map[string]*dsecv1.Sandbox
	tokens map[string]string // create token -> sandbox ID
	// failAfter makes every create after this many succeed fail (<0: never).
	failAfter int
	// failWith, if set, is every create's answer.
	failWith error
	creates  int
	forks    int // Fork calls (fork_test.go)
	pools    []*dsecv1.WarmPool
	// hold, while set, makes creates wait until it is closed, as on a
	// frozen node; entered gets a value as each create starts waiting.
	hold    chan struct{}
	entered chan struct{}
	queries []sandboxpage.Query // every List the edge answered
}

func newFakeEdge(node string) *fakeEdge {
	return &fakeEdge{node: node, sbs: map[string]*dsecv1.Sandbox{}, tokens: map[string]string{}, failAfter: -1,
		entered: make(chan struct{}, 1000)}
}

func (f *fakeEdge) Node() string  { return f.node }
func (f *fakeEdge) NewID() string { return sandboxid.New(f.node, 0, 0) }

func (f *fakeEdge) Status() sandbox.Status {
	return sandbox.Status{Node: f.node, Live: f.running(), At: time.Now()}
}

func (f *fakeEdge) Create(ctx context.Context, spec *dsecv1.SandboxSpec, token string) (*dsecv1.Sandbox, error) {
	if spec.GetEnvironment() == "" {
		return nil, fmt.Errorf("environment is required: %w", errdefs.ErrInvalidArgument)
	}
	id := f.NewID()
	f.mu.Lock()
	hold := f.hold
	f.mu.Unlock()
	if hold != nil {
		f.entered <- struct{}{}
		<-hold
	}
	f.mu.Lock()
	defer f.mu.Unlock()
	f.creates++
	if f.failWith != nil {
		return nil, f.failWith
	}
	if f.failAfter >= 0 && f.creates > f.failAfter {
		return nil, fmt.Errorf("node %s is full: %w", f.node, errdefs.ErrResourceExhausted)
	}
	sb := &dsecv1.Sandbox{Id: id, Node: f.node, Spec: proto.Clone(spec).(*dsecv1.SandboxSpec), State: dsecv1.State_STATE_RUNNING}
	f.sbs[id] = sb
	if token != "" {
		f.tokens[token] = id
	}
	return proto.Clone(sb).(*dsecv1.Sandbox), nil
}

// freeze makes creates wait from now on, until thaw.
func (f *fakeEdge) freeze() {
	f.mu.Lock()
	f.hold = make(chan struct{})
	f.mu.Unlock()
}

// thaw lets waiting creates go on; thawing a thawed edge is a no-op.
func (f *fakeEdge) thaw() {
	f.mu.Lock()
	if f.hold != nil {
		close(f.hold)
		f.hold = nil
	}
	f.mu.Unlock()
}

func (f *fakeEdge) SandboxOf(token string) (string, bool) {
	f.mu.Lock()
	defer f.mu.Unlock()
	id, ok := f.tokens[token]
	if !ok || !sandbox.Live(f.sbs[id].GetState()) {
		return "", false
	}
	return id, true
}

func (f *fakeEdge) Tokens() map[string]string {
	f.mu.Lock()
	defer f.mu.Unlock()
	out := map[string]string{}
	for tok, id := range f.tokens {
		if sandbox.Live(f.sbs[id].GetState()) {
			out[tok] = id
		}
	}
	return out
}

func (f *fakeEdge) Get(ctx context.Context, id string) (*dsecv1.Sandbox, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	sb, ok := f.sbs[id]
	if !ok {
		return nil, fmt.Errorf("sandbox %s: %w", id, errdefs.ErrNotFound)
	}
	return proto.Clone(sb).(*dsecv1.Sandbox), nil
}

func (f *fakeEdge) Gone(ids []string) []string {
	f.mu.Lock()
	defer f.mu.Unlock()
	var out []string
	for _, id := range ids {
		if sb, ok := f.sbs[id]; !ok || !sandbox.Live(sb.GetState()) {
			out = append(out, id)
		}
	}
	return out
}

func (f *fakeEdge) List(ctx context.Context, labels map[string]string, states []dsecv1.State) ([]*dsecv1.Sandbox, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	var out []*dsecv1.Sandbox
	for _, sb := range f.sbs {
		if len(states) > 0 && !slices.Contains(states, sb.GetState()) {
			continue
		}
		match := true
		for k, v := range labels {
			match = match && sb.GetSpec().GetLabels()[k] == v
		}
		if match {
			out = append(out, proto.Clone(sb).(*dsecv1.Sandbox))
		}
	}
	return out, nil
}

// Query answers an edge's List as sandbox.Manager's does.
func (f *fakeEdge) Query(ctx context.Context, q sandboxpage.Query) ([]*dsecv1.Sandbox, int, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.queries = append(f.queries, q)
	page, total := sandboxpage.PickRecords(q, f.sbs)
	return page, total, nil
}

func (f *fakeEdge) Delete(ctx context.Context, id string) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	if sb, ok := f.sbs[id]; ok && sb.State != dsecv1.State_STATE_STOPPED {
		sb.State, sb.Reason = dsecv1.State_STATE_STOPPED, dsecv1.Reason_REASON_DELETED
	}
	return nil
}

func (f *fakeEdge) SetWarmPool(ctx context.Context, spec *dsecv1.SandboxSpec, size int) (*dsecv1.WarmPool, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	// One pool per shape, as an edge keeps them: a new size replaces it.
	f.pools = slices.DeleteFunc(f.pools, func(p *dsecv1.WarmPool) bool { return proto.Equal(p.GetSpec(), spec) })
	p := &dsecv1.WarmPool{Node: f.node, Spec: spec, Size: int32(size)}
	f.pools = append(f.pools, p)
	return proto.Clone(p).(*dsecv1.WarmPool), nil
}

func (f *fakeEdge) WarmPools(ctx context.Context) ([]*dsecv1.WarmPool, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.pools, nil
}

// Pause marks a running sandbox paused; there is nothing to freeze.
func (f *fakeEdge) Pause(ctx context.Context, id string, keepMemory bool) (*dsecv1.Sandbox, bool, error) {
	return f.flip(id, dsecv1.State_STATE_RUNNING, dsecv1.State_STATE_PAUSED)
}

// Resume marks a paused sandbox running.
func (f *fakeEdge) Resume(ctx context.Context, id string, skipPrefetch bool) (*dsecv1.Sandbox, bool, time.Duration, error) {
	sb, already, err := f.flip(id, dsecv1.State_STATE_PAUSED, dsecv1.State_STATE_RUNNING)
	return sb, already, 0, err
}

// flip moves a sandbox from state from to state to; already when it is in
// to. An ended one says so.
func (f *fakeEdge) flip(id string, from, to dsecv1.State) (*dsecv1.Sandbox, bool, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	sb, ok := f.sbs[id]
	switch {
	case !ok:
		return nil, false, fmt.Errorf("sandbox %s: %w", id, errdefs.ErrNotFound)
	case sb.GetState() == to:
		return proto.Clone(sb).(*dsecv1.Sandbox), true, nil
	case sb.GetState() == from:
		sb.State = to
		return proto.Clone(sb).(*dsecv1.Sandbox), false, nil
	}
	return nil, false, sandbox.GoneError(sb)
}

// refuse is the answer of the calls the fake has nothing for: NotFound
// for a sandbox it never made, FailedPrecondition for one that ended, as
// an edge answers, else NotSupported saying what the fake lacks.
func (f *fakeEdge) refuse(id, lacks string) error {
	sb, err := f.Get(context.Background(), id)
	switch {
	case err != nil:
		return err
	case !sandbox.Live(sb.GetState()):
		return sandbox.GoneError(sb)
	}
	return fmt.Errorf("fake edge %s: %w", lacks, errdefs.ErrNotSupported)
}

func (f *fakeEdge) SetTimeout(ctx context.Context, id string, timeout time.Duration, extendOnly bool) (*dsecv1.Sandbox, error) {
	return nil, f.refuse(id, "keeps no clocks")
}

func (f *fakeEdge) EndPhase(ctx context.Context, id string, phase dsecv1.Phase) (*dsecv1.Sandbox, error) {
	return nil, f.refuse(id, "keeps no phases")
}

func (f *fakeEdge) Phase(id string) dsecv1.Phase { return dsecv1.Phase_PHASE_UNSPECIFIED }
func (f *fakeEdge) Isolation(id string) string   { return "container" }

func (f *fakeEdge) Metrics(ctx context.Context, id string, since time.Time) (*dsecv1.SandboxMetrics, error) {
	return nil, f.refuse(id, "has no cgroups")
}

func (f *fakeEdge) Snapshot(ctx context.Context, id, name string, sel snapshot.Select) (*dsecv1.SnapshotInfo, error) {
	return nil, f.refuse(id, "cannot snapshot")
}

func (f *fakeEdge) Lay(ctx context.Context, id, room, name string, sel snapshot.Select) (*dsecv1.SnapshotInfo, error) {
	return nil, f.refuse(id, "cannot capture")
}

func (f *fakeEdge) Agent(ctx context.Context, id string) (agentclient.Client, func(), error) {
	return nil, nil, f.refuse(id, "has no agents")
}

func (f *fakeEdge) AgentStarting(ctx context.Context, id string) (agentclient.Client, func(), func(), error) {
	c, release, err := f.Agent(ctx, id)
	return c, release, release, err
}

func (f *fakeEdge) SetNetworkRules(ctx context.Context, id string, rules map[string]bool, cut bool) ([]string, error) {
	return nil, f.refuse(id, "has no network")
}

func (f *fakeEdge) NetworkLog(ctx context.Context, id string, since time.Time, limit int) ([]netpolicy.Event, error) {
	return nil, f.refuse(id, "has no network")
}

func (f *fakeEdge) Provenance(ctx context.Context, id string, flagsOnly bool) (*dsecv1.SandboxProvenance, error) {
	sb, err := f.Get(ctx, id)
	if err != nil {
		return nil, err
	}
	if !sandbox.Live(sb.GetState()) {
		return nil, sandbox.GoneError(sb)
	}
	return &dsecv1.SandboxProvenance{SandboxId: id, Flags: &dsecv1.ProvenanceFlags{}}, nil
}

func (f *fakeEdge) SetProvenancePaths(ctx context.Context, id string, paths *dsecv1.ProvenancePaths) ([]string, error) {
	if err := sandbox.CheckProvenancePaths(paths); err != nil {
		return nil, err
	}
	if _, err := f.Get(ctx, id); err != nil {
		return nil, err
	}
	return nil, nil
}

func (f *fakeEdge) running() int {
	n, _ := f.List(context.Background(), nil, []dsecv1.State{dsecv1.State_STATE_RUNNING})
	return len(n)
}

// nodesOf serves fake edges through the real edge service, in-process, as
// the all-in-one dsecd does.
func nodesOf(edges ...*fakeEdge) []watcher.Node {
	var out []watcher.Node
	for _, e := range edges {
		out = append(out, watcher.Node{Member: watcher.Member{Name: e.node}, Edge: edgesvc.New(e, nil, slog.New(slog.DiscardHandler))})
	}
	return out
}

// fakeBlobStore is what a fake node's layers publish to: ref -> digests.
// Nodes sharing one share a fakeBlobStore.
type fakeBlobStore struct {
	mu   sync.Mutex
	refs map[string][]string
}

func newFakeBlobStore() *fakeBlobStore { return &fakeBlobStore{refs: map[string][]string{}} }

// fakeLayers is a node's layer service (edgesvc.Layers) that builds
// nothing: an image import yields fixed digests, an upload one layer whose
// digest is the archive's sha256. It counts what it was asked to do.
type fakeLayers struct {
	dsecv1connect.UnimplementedLayerServiceHandler
	name  string // the blob store's name, as the node reports it
	store *fakeBlobStore
	// refuse, if set, is an upload's answer once its header came.
	refuse error

	mu       sync.Mutex
	imports  int      // ImportImageTo and ImportLayer calls
	uploaded int64    // bytes of archive received
	uploads  []error  // how each upload's stream ended (nil: cleanly)
	adopted  []string // refs adopted
}

var fakeImageDigests = []string{"sha256:" + strings.Repeat("1", 64), "sha256:" + strings.Repeat("2", 64)}

func (f *fakeLayers) publish(ref string, digests []string) {
	f.store.mu.Lock()
	defer f.store.mu.Unlock()
	f.store.refs[ref] = digests
}

func (f *fakeLayers) ImportImageTo(ctx context.Context, m *dsecv1.ImportImageRequest, send func(*dsecv1.ImportImageProgress) error) error {
	f.mu.Lock()
	f.imports++
	f.mu.Unlock()
	if err := send(&dsecv1.ImportImageProgress{Phase: "fetch", Layer: 1, Layers: 2, Bytes: 10, TotalBytes: 10}); err != nil {
		return err
	}
	f.publish(m.GetRef(), fakeImageDigests)
	return send(&dsecv1.ImportImageProgress{Phase: "done", Done: true, LayerDigests: fakeImageDigests, OciLayers: 3})
}

func (f *fakeLayers) ImportLayer(ctx context.Context, req *connect.Request[dsecv1.ImportLayerRequest]) (*connect.Response[dsecv1.Layer], error) {
	f.mu.Lock()
	f.imports++
	f.mu.Unlock()
	f.publish(req.Msg.GetRef(), fakeImageDigests[:1])
	return connect.NewResponse(&dsecv1.Layer{Digest: fakeImageDigests[0], Refs: []string{req.Msg.GetRef()}}), nil
}

func (f *fakeLayers) UploadLayerFrom(ctx context.Context, in layerupload.Stream) (*dsecv1.Layer, error) {
	_, h, err := layerupload.ReadHeader(in)
	if err != nil {
		return nil, err
	}
	if f.refuse != nil {
		return nil, f.refuse
	}
	sum := sha256.New()
	_, err = io.Copy(sum, &countingReader{r: layerupload.NewBody(in, h.GetRef(), 1<<30, "the fake's limit"), f: f})
	f.mu.Lock()
	f.uploads = append(f.uploads, err)
	f.mu.Unlock()
	if err != nil {
		return nil, err
	}
	d := "sha256:" + hex.EncodeToString(sum.Sum(nil))
	f.publish(h.GetRef(), []string{d})
	return &dsecv1.Layer{Digest: d, Refs: []string{h.GetRef()}}, nil
}

// countingReader counts in f.uploaded what an upload's body has given.
type countingReader struct {
	r io.Reader
	f *fakeLayers
}

func (c *countingReader) Read(p []byte) (int, error) {
	n, err := c.r.Read(p)
	c.f.mu.Lock()
	c.f.uploaded += int64(n)
	c.f.mu.Unlock()
	return n, err
}

func (f *fakeLayers) AdoptLayers(ctx context.Context, ref string, digests []string) error {
	f.store.mu.Lock()
	have, ok := f.store.refs[ref]
	f.store.mu.Unlock()
	switch {
	case !ok:
		return fmt.Errorf("adopt %s: not in the blob store: %w", ref, errdefs.ErrNotFound)
	case !slices.Equal(have, digests):
		return fmt.Errorf("adopt %s: the store names %v: %w", ref, have, errdefs.ErrFailedPrecondition)
	}
	f.mu.Lock()
	defer f.mu.Unlock()
	f.adopted = append(f.adopted, ref)
	return nil
}

// RenameRef moves the blob store's record; a node sharing the store that
// renames after another finds it moved.
func (f *fakeLayers) RenameRef(ctx context.Context, from, to string) error {
	f.store.mu.Lock()
	defer f.store.mu.Unlock()
	have, ok := f.store.refs[from]
	if !ok {
		return fmt.Errorf("rename %s: %w", from, errdefs.ErrNotFound)
	}
	f.store.refs[to] = have
	delete(f.store.refs, from)
	return nil
}

func (f *fakeLayers) BlobStore() string { return f.name }

// counts returns what the node was asked to do.
func (f *fakeLayers) counts() (imports int, uploaded int64, adopted int) {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.imports, f.uploaded, len(f.adopted)
}

// layerNode is a fake node with fake layers, reporting its blob store as a
// watcher would have seen it.
func layerNode(name string, l *fakeLayers) watcher.Node {
	return watcher.Node{Member: watcher.Member{Name: name}, Status: &edgev1.NodeStatus{Node: name, BlobStore: l.name},
		Edge: edgesvc.New(newFakeEdge(name), l, slog.New(slog.DiscardHandler))}
}

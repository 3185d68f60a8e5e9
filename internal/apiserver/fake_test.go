package apiserver

import (
	"context"
	"fmt"
	"log/slog"
	"sync"
	"time"

	"google.golang.org/protobuf/proto"

	dsecv1 "dsec.dev/dsec/api/gen/dsec/v1"
	"dsec.dev/dsec/internal/agent/agentclient"
	"dsec.dev/dsec/internal/edge/edgesvc"
	"dsec.dev/dsec/internal/edge/netpolicy"
	"dsec.dev/dsec/internal/edge/sandbox"
	"dsec.dev/dsec/internal/errdefs"
	"dsec.dev/dsec/internal/sandboxid"
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
	creates   int
	pools     []*dsecv1.WarmPool
	// hold, while set, makes creates wait until it is closed, as on a
	// frozen node; entered gets a value as each create starts waiting.
	hold    chan struct{}
	entered chan struct{}
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
	if f.failAfter >= 0 && f.creates > f.failAfter {
		return nil, fmt.Errorf("node %s is full: %w", f.node, errdefs.ErrResourceExhausted)
	}
	sb := &dsecv1.Sandbox{Id: id, Node: f.node, Spec: spec, State: dsecv1.State_STATE_RUNNING}
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
	if !ok || f.sbs[id].GetState() != dsecv1.State_STATE_RUNNING {
		return "", false
	}
	return id, true
}

func (f *fakeEdge) Tokens() map[string]string {
	f.mu.Lock()
	defer f.mu.Unlock()
	out := map[string]string{}
	for tok, id := range f.tokens {
		if f.sbs[id].GetState() == dsecv1.State_STATE_RUNNING {
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

func (f *fakeEdge) List(ctx context.Context, labels map[string]string, states []dsecv1.State) ([]*dsecv1.Sandbox, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	var out []*dsecv1.Sandbox
	for _, sb := range f.sbs {
		if sb.State == dsecv1.State_STATE_RUNNING {
			out = append(out, proto.Clone(sb).(*dsecv1.Sandbox))
		}
	}
	return out, nil
}

func (f *fakeEdge) Delete(ctx context.Context, id string) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	if sb, ok := f.sbs[id]; ok {
		sb.State = dsecv1.State_STATE_STOPPED
	}
	return nil
}

func (f *fakeEdge) SetWarmPool(ctx context.Context, spec *dsecv1.SandboxSpec, size int) (*dsecv1.WarmPool, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.pools = append(f.pools, &dsecv1.WarmPool{Node: f.node, Spec: spec, Size: int32(size)})
	return proto.Clone(f.pools[len(f.pools)-1]).(*dsecv1.WarmPool), nil
}

func (f *fakeEdge) WarmPools(ctx context.Context) ([]*dsecv1.WarmPool, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.pools, nil
}

func (f *fakeEdge) Pause(ctx context.Context, id string, keepMemory bool) (*dsecv1.Sandbox, bool, error) {
	return nil, false, fmt.Errorf("fake edge cannot pause: %w", errdefs.ErrNotSupported)
}

func (f *fakeEdge) Resume(ctx context.Context, id string, skipPrefetch bool) (*dsecv1.Sandbox, bool, time.Duration, error) {
	return nil, false, 0, fmt.Errorf("fake edge cannot resume: %w", errdefs.ErrNotSupported)
}

func (f *fakeEdge) Snapshot(ctx context.Context, id, name string, exclude []string) (*dsecv1.SnapshotInfo, error) {
	return nil, fmt.Errorf("fake edge cannot snapshot: %w", errdefs.ErrNotSupported)
}

func (f *fakeEdge) Agent(ctx context.Context, id string) (agentclient.Client, func(), error) {
	return nil, nil, fmt.Errorf("fake edge has no agents: %w", errdefs.ErrNotSupported)
}

func (f *fakeEdge) SetNetworkRules(ctx context.Context, id string, rules map[string]bool, cut bool) ([]string, error) {
	return nil, fmt.Errorf("fake edge has no network: %w", errdefs.ErrNotSupported)
}

func (f *fakeEdge) NetworkLog(ctx context.Context, id string, since time.Time, limit int) ([]netpolicy.Event, error) {
	return nil, fmt.Errorf("fake edge has no network: %w", errdefs.ErrNotSupported)
}

func (f *fakeEdge) running() int {
	n, _ := f.List(context.Background(), nil, nil)
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

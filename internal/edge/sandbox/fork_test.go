package sandbox

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"testing"
	"time"

	"google.golang.org/protobuf/proto"

	dsecv1 "dsec.dev/dsec/api/gen/dsec/v1"
	"dsec.dev/dsec/internal/edge/backend"
	"dsec.dev/dsec/internal/edge/backend/fake"
	"dsec.dev/dsec/internal/errdefs"
)

// forkingFake is a fake runtime that forks: a save is a name, a child a
// fake sandbox started from it; fail makes the StartFork of that index
// fail, having made nothing.
type forkingFake struct {
	*fake.Runtime
	// frozenRefused makes SaveFork of a frozen sandbox FailedPrecondition,
	// as the microvm backend's of a VM paused in memory.
	frozenRefused bool
	mu            sync.Mutex
	saves         map[string]string // save name -> the sandbox saved
	starts        int
	fail          map[int]error
	specs         []backend.Spec
}

func (f *forkingFake) SaveFork(ctx context.Context, id, name string) (time.Duration, error) {
	if _, err := f.Status(ctx, id); err != nil {
		return 0, err
	}
	if frozen, err := f.Frozen(ctx, id); err != nil || (frozen && f.frozenRefused) {
		return 0, fmt.Errorf("save %s: frozen: %w", id, errors.Join(err, errdefs.ErrFailedPrecondition))
	}
	f.mu.Lock()
	defer f.mu.Unlock()
	f.saves[name] = id
	return 2 * time.Millisecond, nil
}

func (f *forkingFake) StartFork(ctx context.Context, name string, s backend.Spec) (backend.Dialer, error) {
	f.mu.Lock()
	_, ok := f.saves[name]
	n := f.starts
	f.starts++
	err := f.fail[n]
	f.specs = append(f.specs, s)
	f.mu.Unlock()
	if !ok {
		return nil, fmt.Errorf("no save %s: %w", name, errdefs.ErrNotFound)
	}
	if err != nil {
		return nil, err
	}
	return f.Start(ctx, s)
}

func (f *forkingFake) DropFork(ctx context.Context, name string) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	delete(f.saves, name)
	return nil
}

// TestFork: a fork's children are sandboxes of the parent's spec, each
// with its own ID, host name and token, started from one save that is
// dropped afterwards; a child whose start fails has its error and leaves
// nothing, the others live; a runtime that cannot fork is refused.
func TestFork(t *testing.T) {
	rt := &forkingFake{Runtime: newFake(t), saves: map[string]string{}, fail: map[int]error{1: errors.New("clone: no space left on device")}}
	m := newTestManagerOf(t, t.TempDir(), map[Kind]backend.Runtime{ContainerKind: rt}, &fakeImages{}, nil)
	ctx := context.Background()
	parent, err := m.Create(ctx, &dsecv1.SandboxSpec{Environment: "base:1", TtlSeconds: 600, MemoryMb: 256, Labels: map[string]string{"job": "j"}}, "")
	if err != nil {
		t.Fatal(err)
	}
	tokens := []string{"b#0@n1", "b#1@n1", "b#2@n1"}
	results, frozen, err := m.Fork(ctx, parent.GetId(), tokens)
	if err != nil {
		t.Fatal(err)
	}
	if frozen != 2*time.Millisecond || len(results) != 3 {
		t.Fatalf("fork: %d results, frozen %s", len(results), frozen)
	}
	ids := map[string]bool{parent.GetId(): true}
	failed := -1
	for i, r := range results {
		if r.Err != nil {
			if failed >= 0 || r.Sandbox != nil {
				t.Errorf("child %d: %+v, and child %d failed too", i, r, failed)
			}
			failed = i
			continue
		}
		sb := r.Sandbox
		if ids[sb.GetId()] || sb.GetState() != dsecv1.State_STATE_RUNNING || !proto.Equal(sb.GetSpec(), parent.GetSpec()) ||
			sb.GetExpiresUnixMs() == 0 {
			t.Errorf("child %d: %v, want a new running sandbox with the parent's spec %v", i, sb, parent.GetSpec())
		}
		ids[sb.GetId()] = true
		if id, ok := m.SandboxOf(tokens[i]); !ok || id != sb.GetId() {
			t.Errorf("token %s names %q, want child %s", tokens[i], id, sb.GetId())
		}
	}
	if failed < 0 {
		t.Fatal("no child failed, want the one whose start failed")
	}
	if _, ok := m.SandboxOf(tokens[failed]); ok {
		t.Errorf("the failed child's token names a sandbox")
	}
	for _, s := range rt.specs {
		if s.Hostname != s.ID || len(s.Layers) != 1 || s.MemoryBytes != 256<<20 {
			t.Errorf("a child's runtime spec: %+v, want its ID as host name and the parent's layer and memory", s)
		}
	}
	list, err := m.List(ctx, nil, nil)
	if err != nil {
		t.Fatal(err)
	}
	if len(list) != 3 {
		t.Errorf("%d sandboxes after the fork, want the parent and two children: %v", len(list), list)
	}
	left, _ := rt.List(ctx)
	if len(left) != 3 {
		t.Errorf("the runtime holds %d sandboxes, want 3: %v", len(left), left)
	}
	rt.mu.Lock()
	if len(rt.saves) != 0 {
		t.Errorf("saves left: %v", rt.saves)
	}
	rt.mu.Unlock()

	// A paused parent its runtime saves as it is stays paused; one it
	// cannot is resumed first.
	if _, _, err := m.Pause(ctx, parent.GetId(), false); err != nil {
		t.Fatal(err)
	}
	for _, refused := range []bool{false, true} {
		rt.mu.Lock()
		rt.frozenRefused, rt.fail = refused, nil
		rt.mu.Unlock()
		token := fmt.Sprintf("p#%v@n1", refused)
		results, _, err := m.Fork(ctx, parent.GetId(), []string{token})
		if err != nil || len(results) != 1 || results[0].Err != nil {
			t.Fatalf("fork of a paused parent (its save refused: %v): %+v, %v", refused, results, err)
		}
		got, err := m.Get(ctx, parent.GetId())
		if err != nil {
			t.Fatal(err)
		}
		if want := map[bool]dsecv1.State{false: dsecv1.State_STATE_PAUSED, true: dsecv1.State_STATE_RUNNING}[refused]; got.GetState() != want {
			t.Errorf("a paused parent after a fork (its save refused while paused: %v): %v, want %v", refused, got.GetState(), want)
		}
	}

	plain := newFake(t)
	m2 := newTestManager(t, t.TempDir(), plain)
	sb, err := m2.Create(ctx, &dsecv1.SandboxSpec{Environment: "base:1"}, "")
	if err != nil {
		t.Fatal(err)
	}
	if _, _, err := m2.Fork(ctx, sb.GetId(), tokens); !errors.Is(err, errdefs.ErrFailedPrecondition) {
		t.Errorf("fork on a runtime that cannot: %v, want failed precondition", err)
	}
}

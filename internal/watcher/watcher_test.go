package watcher

import (
	"context"
	"errors"
	"log/slog"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"connectrpc.com/connect"

	edgev1 "dsec.dev/dsec/api/gen/dsec/edge/v1"
	dsecv1 "dsec.dev/dsec/api/gen/dsec/v1"
	"dsec.dev/dsec/internal/edge/edgesvc"
	"dsec.dev/dsec/internal/edge/hollow"
	"dsec.dev/dsec/internal/errdefs"
	"dsec.dev/dsec/internal/sandboxid"
)

// stoppable is an edge that can be frozen, as SIGSTOP freezes a process:
// its calls then hang until their deadline.
type stoppable struct {
	Edge
	stopped atomic.Bool
}

func (s *stoppable) Status(ctx context.Context, req *connect.Request[edgev1.StatusRequest]) (*connect.Response[edgev1.NodeStatus], error) {
	if s.stopped.Load() {
		<-ctx.Done()
		return nil, ctx.Err()
	}
	return s.Edge.Status(ctx, req)
}

func TestWatcher(t *testing.T) {
	ctx := context.Background()
	edges := map[string]*stoppable{}
	members := []Member{}
	for i, name := range []string{"a", "b"} {
		h := hollow.New(hollow.Config{Node: name, Slot: uint16(i + 1), Generation: 1})
		edges[name] = &stoppable{Edge: edgesvc.New(h, nil, slog.New(slog.DiscardHandler))}
		members = append(members, Member{Name: name, Addr: "x", Slot: uint16(i + 1), Generation: 1})
	}
	var returned atomic.Int32
	var reports atomic.Int32
	w := New(Config{
		Members:  func(ctx context.Context) ([]Member, error) { return members, nil },
		Dial:     func(m Member, _ func()) (Edge, error) { return edges[m.Name], nil },
		Interval: 50 * time.Millisecond,
		OnReturn: func(ctx context.Context, n Node) error { returned.Add(1); return nil },
		OnReport: func(string, *edgev1.NodeStatus) { reports.Add(1) },
	})
	// Before its first answer a node is not routable.
	if _, err := w.Edge("a"); !errors.Is(err, errdefs.ErrNotFound) {
		t.Fatalf("edge before any poll: %v", err)
	}
	w.Poll(ctx)
	for _, n := range w.Nodes() {
		if !n.Healthy || n.Status.GetNode() != n.Name {
			t.Fatalf("after a poll: %+v", n)
		}
	}
	if reports.Load() != 2 {
		t.Errorf("%d reports, want 2", reports.Load())
	}

	resp, err := edges["a"].Create(ctx, connect.NewRequest(&edgev1.CreateRequest{Spec: &dsecv1.SandboxSpec{Environment: "b:1"}}))
	if err != nil {
		t.Fatal(err)
	}
	id := resp.Msg.GetId()
	if e, err := w.Route(id); err != nil || e != edges["a"] {
		t.Fatalf("route %s: %v", id, err)
	}
	// An ID of the slot's earlier owner, or of another slot, is not routed.
	for _, stale := range []string{sandboxid.New("a", 1, 0), sandboxid.New("a", 2, 1), sandboxid.New("gone", 3, 1)} {
		if _, err := w.Route(stale); !errors.Is(err, errdefs.ErrNotFound) {
			t.Errorf("route %s: %v, want not found", stale, err)
		}
	}

	// Frozen: unroutable after MissLimit polls, failing fast and naming it.
	edges["a"].stopped.Store(true)
	for range 2 {
		w.Poll(ctx)
	}
	if _, err := w.Route(id); err != nil {
		t.Fatalf("after 2 missed polls the node should still route: %v", err)
	}
	w.Poll(ctx)
	start := time.Now()
	_, err = w.Route(id)
	if !errors.Is(err, errdefs.ErrUnavailable) || !strings.Contains(err.Error(), "node a is unreachable") || time.Since(start) > 10*time.Millisecond {
		t.Fatalf("route to a frozen node: %v", err)
	}
	if _, err := w.Edge("b"); err != nil {
		t.Fatalf("the other node: %v", err)
	}
	// Thawed: reconciled, then routable again.
	edges["a"].stopped.Store(false)
	w.Poll(ctx)
	if returned.Load() != 3 { // both at first sight, and a on its return
		t.Errorf("OnReturn ran %d times, want 3", returned.Load())
	}
	if _, err := w.Route(id); err != nil {
		t.Fatalf("route after the node returned: %v", err)
	}

	// A failed reconcile keeps the node out until one succeeds.
	w.cfg.OnReturn = func(ctx context.Context, n Node) error { return errors.New("registry away") }
	edges["b"].stopped.Store(true)
	for range 3 {
		w.Poll(ctx)
	}
	edges["b"].stopped.Store(false)
	w.Poll(ctx)
	if _, err := w.Edge("b"); !errors.Is(err, errdefs.ErrUnavailable) {
		t.Fatalf("a node whose reconcile failed is routable: %v", err)
	}

	// A member removed from the registry is forgotten.
	members = members[:1]
	w.Poll(ctx)
	if _, err := w.Edge("b"); !errors.Is(err, errdefs.ErrNotFound) {
		t.Fatalf("removed member: %v", err)
	}
}

// TestRunDetectsAStoppedEdgeWithin3s: with the default interval. (Not a
// timing assertion of dsec's speed: a bound of the detection rule, with
// slack for a loaded machine.)
func TestRunDetectsAStoppedEdgeWithin3s(t *testing.T) {
	if testing.Short() {
		t.Skip("takes seconds")
	}
	e := &stoppable{Edge: edgesvc.New(hollow.New(hollow.Config{Node: "a"}), nil, slog.New(slog.DiscardHandler))}
	w := New(Config{
		Members: func(ctx context.Context) ([]Member, error) { return []Member{{Name: "a"}}, nil },
		Dial:    func(m Member, _ func()) (Edge, error) { return e, nil },
	})
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	go w.Run(ctx)
	deadline := time.Now().Add(3 * time.Second)
	for {
		if _, err := w.Edge("a"); err == nil {
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("node never became routable")
		}
		time.Sleep(10 * time.Millisecond)
	}
	e.stopped.Store(true)
	stoppedAt := time.Now()
	for {
		if _, err := w.Edge("a"); errors.Is(err, errdefs.ErrUnavailable) {
			break
		}
		if time.Since(stoppedAt) > 6*time.Second {
			t.Fatal("a stopped edge stayed routable for 6 s")
		}
		time.Sleep(20 * time.Millisecond)
	}
	t.Logf("unroutable %s after the edge stopped answering", time.Since(stoppedAt).Round(10*time.Millisecond))
}

// TestBusyEdgeStaysRoutable: polls that time out while the edge answers
// other calls are no misses; once it answers nothing, they are.
func TestBusyEdgeStaysRoutable(t *testing.T) {
	ctx := context.Background()
	e := &stoppable{Edge: edgesvc.New(hollow.New(hollow.Config{Node: "a"}), nil, slog.New(slog.DiscardHandler))}
	var answered func()
	w := New(Config{
		Members:  func(ctx context.Context) ([]Member, error) { return []Member{{Name: "a"}}, nil },
		Dial:     func(m Member, a func()) (Edge, error) { answered = a; return e, nil },
		Interval: 50 * time.Millisecond,
	})
	w.Poll(ctx)
	if _, err := w.Edge("a"); err != nil {
		t.Fatalf("after a poll: %v", err)
	}
	e.stopped.Store(true)
	for range 6 {
		answered() // a call of the burst came back
		w.Poll(ctx)
	}
	if _, err := w.Edge("a"); err != nil {
		t.Fatalf("a node answering other calls became unroutable: %v", err)
	}
	for i := range 4 {
		if i > 0 {
			time.Sleep(w.cfg.Interval) // as Run's ticker would
		}
		w.Poll(ctx)
	}
	if _, err := w.Edge("a"); !errors.Is(err, errdefs.ErrUnavailable) {
		t.Fatalf("a node answering nothing for 4 polls is routable: %v", err)
	}
}

// held is an edge whose next Status, once hold is set, waits for release
// before it asks the edge: a round's poll overtaken by a refresh.
type held struct {
	Edge
	hold    atomic.Bool
	entered chan struct{}
	release chan struct{}
}

func (h *held) Status(ctx context.Context, req *connect.Request[edgev1.StatusRequest]) (*connect.Response[edgev1.NodeStatus], error) {
	if h.hold.CompareAndSwap(true, false) {
		resp, err := h.Edge.Status(ctx, req)
		close(h.entered)
		<-h.release
		return resp, err
	}
	return h.Edge.Status(ctx, req)
}

// TestRefresh: a refresh brings a node's report up to date outside the
// rounds; a failed one is no miss; and a round's poll sent before a
// refresh does not put its older report back.
func TestRefresh(t *testing.T) {
	ctx := context.Background()
	h := hollow.New(hollow.Config{Node: "a", Slot: 1, Generation: 1})
	e := &held{Edge: &stoppable{Edge: edgesvc.New(h, nil, slog.New(slog.DiscardHandler))},
		entered: make(chan struct{}), release: make(chan struct{})}
	var reports atomic.Int32
	w := New(Config{
		Members: func(ctx context.Context) ([]Member, error) {
			return []Member{{Name: "a", Addr: "x", Slot: 1, Generation: 1}}, nil
		},
		Dial:     func(m Member, _ func()) (Edge, error) { return e, nil },
		Interval: 50 * time.Millisecond,
		OnReport: func(string, *edgev1.NodeStatus) { reports.Add(1) },
	})
	w.Poll(ctx)
	live := func() int32 { return w.Nodes()[0].Status.GetLive() }
	create := func() {
		if _, err := e.Create(ctx, connect.NewRequest(&edgev1.CreateRequest{Spec: &dsecv1.SandboxSpec{Environment: "b:1"}})); err != nil {
			t.Fatal(err)
		}
	}
	create()
	if live() != 0 {
		t.Fatalf("before a refresh the report says %d live, want the round's 0", live())
	}
	w.Refresh(ctx, []string{"a", "not-a-member"})
	if live() != 1 || reports.Load() != 2 {
		t.Fatalf("after a refresh: %d live, %d reports; want 1 and 2", live(), reports.Load())
	}

	// A refresh of a frozen node fails without counting a miss.
	e.Edge.(*stoppable).stopped.Store(true)
	w.Refresh(ctx, []string{"a"})
	if n := w.Nodes()[0]; n.Misses != 0 || !n.Healthy || n.Status.GetLive() != 1 {
		t.Fatalf("after a failed refresh: misses %d, healthy %v, live %d", n.Misses, n.Healthy, n.Status.GetLive())
	}
	e.Edge.(*stoppable).stopped.Store(false)

	// A round's poll measured before a refresh reports after it: dropped.
	e.hold.Store(true)
	done := make(chan struct{})
	go func() { w.Poll(ctx); close(done) }()
	<-e.entered // the round has its report of 1 live
	create()
	w.Refresh(ctx, []string{"a"})
	close(e.release)
	<-done
	if live() != 2 {
		t.Fatalf("a round's older report replaced a refresh's: %d live, want 2", live())
	}
}

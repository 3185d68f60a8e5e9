package apiserver

import (
	"context"
	"log/slog"
	"net/http/httptest"
	"path/filepath"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"connectrpc.com/connect"

	edgev1 "dsec.dev/dsec/api/gen/dsec/edge/v1"
	dsecv1 "dsec.dev/dsec/api/gen/dsec/v1"
	"dsec.dev/dsec/api/gen/dsec/v1/dsecv1connect"
	"dsec.dev/dsec/internal/edge/edgesvc"
	"dsec.dev/dsec/internal/edge/hollow"
	"dsec.dev/dsec/internal/store"
	"dsec.dev/dsec/internal/watcher"
)

// countedEdge counts the Status polls an edge answers.
type countedEdge struct {
	watcher.Edge
	polls atomic.Int32
}

func (c *countedEdge) Status(ctx context.Context, req *connect.Request[edgev1.StatusRequest]) (*connect.Response[edgev1.NodeStatus], error) {
	c.polls.Add(1)
	return c.Edge.Status(ctx, req)
}

// TestCreateAfterRoomIsMade: a node full by its last report takes a
// create as soon as a delete makes room, not a report round later: before
// refusing, the apiserver polls the nodes again. A node that is full
// indeed is still refused, and refusals in a row poll at most once per
// minRefresh.
func TestCreateAfterRoomIsMade(t *testing.T) {
	ctx := context.Background()
	edge := &countedEdge{Edge: edgesvc.New(hollow.New(hollow.Config{Node: "n1", Slot: 1, Generation: 1, MaxSandboxes: 2}),
		nil, slog.New(slog.DiscardHandler))}
	w := watcher.New(watcher.Config{
		Members: func(context.Context) ([]watcher.Member, error) {
			return []watcher.Member{{Name: "n1", Addr: "x", Slot: 1, Generation: 1}}, nil
		},
		Dial: func(watcher.Member, func()) (watcher.Edge, error) { return edge, nil },
		// No rounds run: the test polls once, and the refreshes do the rest.
		Interval: time.Hour,
	})
	st, err := store.Open(ctx, filepath.Join(t.TempDir(), "meta.db"))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { st.Close() })
	s := New(Config{}, st, w, slog.New(slog.DiscardHandler))
	w.Poll(ctx)
	hs := httptest.NewServer(s.Handler())
	t.Cleanup(hs.Close)
	c := dsecv1connect.NewSandboxServiceClient(hs.Client(), hs.URL)
	create := func() (*dsecv1.Sandbox, error) {
		resp, err := c.Create(ctx, connect.NewRequest(&dsecv1.CreateRequest{Spec: &dsecv1.SandboxSpec{Environment: "base:1"}}))
		if err != nil {
			return nil, err
		}
		return resp.Msg.GetSandboxes()[0], nil
	}

	a, err := create()
	if err != nil {
		t.Fatal(err)
	}
	if _, err := create(); err != nil {
		t.Fatal(err)
	}
	if _, err := c.Delete(ctx, connect.NewRequest(&dsecv1.DeleteRequest{Id: a.GetId()})); err != nil {
		t.Fatal(err)
	}
	// The last report predates both creates; this apiserver counts its
	// two placements, so by its view the node of 2 is full.
	polls := edge.polls.Load()
	if _, err := create(); err != nil {
		t.Fatalf("a create after a delete made room: %v", err)
	}
	if edge.polls.Load() != polls+1 {
		t.Errorf("%d polls before placing, want 1", edge.polls.Load()-polls)
	}

	// Full indeed: refused after one refresh, and the refusals right
	// after it poll no more.
	s.refresh.last.Store(0)
	polls = edge.polls.Load()
	for range 3 {
		_, err := create()
		if connect.CodeOf(err) != connect.CodeResourceExhausted || !strings.Contains(err.Error(), "2 of 2 sandboxes") {
			t.Fatalf("a create on a full node: %v, want ResourceExhausted saying 2 of 2", err)
		}
	}
	if got := edge.polls.Load() - polls; got != 1 {
		t.Errorf("three refusals in a row polled %d times, want 1", got)
	}
}

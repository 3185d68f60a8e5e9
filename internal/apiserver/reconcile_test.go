package apiserver

import (
	"context"
	"slices"
	"strings"
	"testing"
	"time"

	"connectrpc.com/connect"

	edgev1 "dsec.dev/dsec/api/gen/dsec/edge/v1"
	dsecv1 "dsec.dev/dsec/api/gen/dsec/v1"
	"dsec.dev/dsec/api/gen/dsec/v1/dsecv1connect"
	"dsec.dev/dsec/internal/store"
	"dsec.dev/dsec/internal/testutil"
)

func doubts(t *testing.T, st store.Store) []store.Doubt {
	t.Helper()
	ds, err := st.Doubts(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	return ds
}

func runningIDs(e *fakeEdge) []string {
	sbs, _ := e.List(context.Background(), nil, []dsecv1.State{dsecv1.State_STATE_RUNNING})
	var ids []string
	for _, sb := range sbs {
		ids = append(ids, sb.GetId())
	}
	slices.Sort(ids)
	return ids
}

// TestGivenUpCreateIsReaped: a create the apiserver gave up on while the
// node was frozen is recorded as a doubt; the sandbox the node makes once
// it thaws is reaped by the next reconciliation, and the doubt is cleared.
func TestGivenUpCreateIsReaped(t *testing.T) {
	e := newFakeEdge("n1")
	s, st, c := newRig(t, true, Config{}, e)
	e.freeze()
	defer e.thaw() // a frozen handler would hold the edge's server open
	ctx, cancel := context.WithTimeout(context.Background(), 300*time.Millisecond)
	defer cancel()
	_, err := c.Create(ctx, connect.NewRequest(&dsecv1.CreateRequest{Spec: &dsecv1.SandboxSpec{Environment: "base:1"}}))
	if err == nil {
		t.Fatal("a create on a frozen node succeeded")
	}
	<-e.entered
	testutil.WaitFor(t, 5*time.Second, "the doubt is recorded", func() bool { return len(doubts(t, st)) == 1 })
	d := doubts(t, st)[0]
	if d.Node != "n1" || d.Key != "" || d.Prefix || !strings.HasSuffix(d.Token, "#0@n1") {
		t.Fatalf("doubt %+v", d)
	}
	e.thaw()
	testutil.WaitFor(t, 5*time.Second, "the thawed node makes the sandbox nobody owns", func() bool { return len(runningIDs(e)) == 1 })

	s.Reconcile(context.Background())
	if ids := runningIDs(e); len(ids) != 0 {
		t.Fatalf("after reconciliation the node runs %v", ids)
	}
	if ds := doubts(t, st); len(ds) != 0 {
		t.Fatalf("doubts left: %+v", ds)
	}
	if got := s.ReconcileStats(); got.DoubtsRecorded != 1 || got.DoubtsSettled != 1 || got.SandboxesReaped != 1 {
		t.Fatalf("stats %+v", got)
	}
	// The node serves on; reconciling again changes nothing.
	sb, err := c.Create(context.Background(), connect.NewRequest(&dsecv1.CreateRequest{Spec: &dsecv1.SandboxSpec{Environment: "base:1"}}))
	if err != nil {
		t.Fatal(err)
	}
	s.Reconcile(context.Background())
	if ids := runningIDs(e); !slices.Equal(ids, []string{sb.Msg.GetSandboxes()[0].GetId()}) {
		t.Fatalf("running %v, want only the acknowledged sandbox", ids)
	}
}

// TestDoubtSparesAcknowledged: a doubt of a keyed create that completed
// spares the sandboxes the key recorded on the node and reaps the rest of
// what the tokens made; a doubt of a key still pending waits.
func TestDoubtSparesAcknowledged(t *testing.T) {
	for _, remote := range []bool{false, true} {
		e := newFakeEdge("n1")
		s, st, c := newRig(t, remote, Config{}, e)
		ctx := context.Background()
		resp, err := c.Create(ctx, connect.NewRequest(&dsecv1.CreateRequest{Spec: &dsecv1.SandboxSpec{Environment: "base:1"}, Count: 2, IdempotencyKey: "k"}))
		if err != nil {
			t.Fatal(err)
		}
		acked := []string{resp.Msg.GetSandboxes()[0].GetId(), resp.Msg.GetSandboxes()[1].GetId()}
		r, err := st.Reservation(ctx, "k")
		if err != nil {
			t.Fatal(err)
		}
		// What an attempt that hopped away might have left: a sandbox
		// of the same batch under an index the key's record has elsewhere.
		batch := batchOf(r)
		orphan, err := s.fleet.Edge("n1")
		if err != nil {
			t.Fatal(err)
		}
		made, err := orphan.Create(ctx, connect.NewRequest(&edgev1.CreateRequest{Spec: &dsecv1.SandboxSpec{Environment: "base:1"},
			CreateToken: nodeToken(createToken(batch, 7), "n1")}))
		if err != nil {
			t.Fatal(err)
		}
		pending, _, err := st.ReserveCreate(ctx, store.CreateReservation{Key: "pending", RequestHash: "h", Owner: "other", Placements: []string{"n1"}})
		if err != nil {
			t.Fatal(err)
		}
		if err := st.AddDoubts(ctx, []store.Doubt{
			{Node: "n1", Token: nodeToken(createToken(batch, 0), "n1"), Key: "k"},
			{Node: "n1", Token: batchPrefix(batch), Prefix: true, Key: "k"},
			{Node: "n1", Token: nodeToken(createToken(batchOf(pending), 0), "n1"), Key: "pending"},
		}); err != nil {
			t.Fatal(err)
		}
		s.Reconcile(ctx)
		want := slices.Clone(acked)
		slices.Sort(want)
		if got := runningIDs(e); !slices.Equal(got, want) {
			t.Fatalf("running %v, want the acknowledged %v (and not %s)", got, want, made.Msg.GetId())
		}
		ds := doubts(t, st)
		if len(ds) != 1 || ds[0].Key != "pending" {
			t.Fatalf("doubts left %+v, want only the pending key's", ds)
		}
	}
}

// TestAbandonedReservation: a reservation whose owner died mid-batch (no
// lease renewed for AbandonAfter) is abandoned: what its creates made is
// reaped, on every node, and the key is free for a new create, whose
// sandboxes stay.
func TestAbandonedReservation(t *testing.T) {
	e1, e2 := newFakeEdge("n1"), newFakeEdge("n2")
	s, st, c := newRig(t, false, Config{AbandonAfter: 400 * time.Millisecond}, e1, e2)
	ctx := context.Background()
	spec := &dsecv1.SandboxSpec{Environment: "base:1"}
	req := &dsecv1.CreateRequest{Spec: spec, Count: 3, IdempotencyKey: "k"}
	r, reserved, err := st.ReserveCreate(ctx, store.CreateReservation{Key: "k", RequestHash: requestHash(req), Owner: "dead",
		Placements: []string{"n1", "n2", "n1"}})
	if err != nil || !reserved {
		t.Fatal(reserved, err)
	}
	// The dead owner's creates: two made, one hopped from n1 to n2.
	for i, node := range []string{"n1", "n2", "n2"} {
		edge, _ := s.fleet.Edge(node)
		if _, err := edge.Create(ctx, connect.NewRequest(&edgev1.CreateRequest{Spec: spec,
			CreateToken: nodeToken(createToken(batchOf(r), i), node)})); err != nil {
			t.Fatal(err)
		}
	}
	s.Reconcile(ctx)
	if n := len(runningIDs(e1)) + len(runningIDs(e2)); n != 3 {
		t.Fatalf("a fresh reservation's sandboxes were touched: %d left of 3", n)
	}
	time.Sleep(500 * time.Millisecond)
	s.Reconcile(ctx)
	if a, b := runningIDs(e1), runningIDs(e2); len(a)+len(b) != 0 {
		t.Fatalf("after abandonment: n1 runs %v, n2 runs %v", a, b)
	}
	if _, err := st.Reservation(ctx, "k"); err == nil {
		t.Fatal("the abandoned reservation is still there")
	}
	if got := s.ReconcileStats(); got.ReservationsAbandoned != 1 || got.SandboxesReaped != 3 {
		t.Fatalf("stats %+v", got)
	}
	// The key is free: a retry makes a new batch, which stays.
	resp, err := c.Create(ctx, connect.NewRequest(req))
	if err != nil {
		t.Fatal(err)
	}
	s.Reconcile(ctx)
	if n := len(runningIDs(e1)) + len(runningIDs(e2)); n != 3 || len(resp.Msg.GetSandboxes()) != 3 {
		t.Fatalf("the retry's batch: %d running, %d returned", n, len(resp.Msg.GetSandboxes()))
	}
}

// TestFollowerRenewsLease: a retry that finds a stale reservation pending
// renews its lease and follows its plan, with its tokens: the sandboxes the
// dead owner made are the ones acknowledged, and nothing is abandoned.
func TestFollowerRenewsLease(t *testing.T) {
	e := newFakeEdge("n1")
	s, st, c := newRig(t, false, Config{AbandonAfter: 400 * time.Millisecond}, e)
	ctx := context.Background()
	spec := &dsecv1.SandboxSpec{Environment: "base:1"}
	req := &dsecv1.CreateRequest{Spec: spec, Count: 2, IdempotencyKey: "k"}
	r, _, err := st.ReserveCreate(ctx, store.CreateReservation{Key: "k", RequestHash: requestHash(req), Owner: "dead",
		Placements: []string{"n1", "n1"}, Created: time.Now().Add(-time.Hour)})
	if err != nil {
		t.Fatal(err)
	}
	edge, _ := s.fleet.Edge("n1")
	first, err := edge.Create(ctx, connect.NewRequest(&edgev1.CreateRequest{Spec: spec, CreateToken: nodeToken(createToken(batchOf(r), 0), "n1")}))
	if err != nil {
		t.Fatal(err)
	}
	resp, err := c.Create(ctx, connect.NewRequest(req))
	if err != nil {
		t.Fatal(err)
	}
	if got := resp.Msg.GetSandboxes()[0].GetId(); got != first.Msg.GetId() {
		t.Fatalf("the follower got %s for index 0, want the dead owner's %s", got, first.Msg.GetId())
	}
	s.Reconcile(ctx)
	if got := s.ReconcileStats(); got.ReservationsAbandoned != 0 {
		t.Fatalf("stats %+v", got)
	}
	if ids := runningIDs(e); len(ids) != 2 {
		t.Fatalf("running %v", ids)
	}
}

// TestRowsOfGoneSandboxesRemoved: the rows of sandboxes their node no
// longer has are removed; a replay still answers for them from the key's
// record.
func TestRowsOfGoneSandboxesRemoved(t *testing.T) {
	e := newFakeEdge("n1")
	s, st, c := newRig(t, true, Config{}, e)
	ctx := context.Background()
	req := &dsecv1.CreateRequest{Spec: &dsecv1.SandboxSpec{Environment: "base:1"}, Count: 2, IdempotencyKey: "k"}
	resp, err := c.Create(ctx, connect.NewRequest(req))
	if err != nil {
		t.Fatal(err)
	}
	gone, kept := resp.Msg.GetSandboxes()[0].GetId(), resp.Msg.GetSandboxes()[1].GetId()
	if _, err := c.Delete(ctx, connect.NewRequest(&dsecv1.DeleteRequest{Id: gone})); err != nil {
		t.Fatal(err)
	}
	s.Reconcile(ctx)
	rows, err := st.SandboxRows(ctx, "k")
	if err != nil || len(rows) != 1 || rows[0].ID != kept {
		t.Fatalf("rows %+v, %v; want only %s", rows, err, kept)
	}
	if got := s.ReconcileStats().RowsRemoved; got != 1 {
		t.Fatalf("rows removed %d", got)
	}
	again, err := c.Create(ctx, connect.NewRequest(req))
	if err != nil {
		t.Fatal(err)
	}
	if sb := again.Msg.GetSandboxes()[0]; sb.GetId() != gone || sb.GetState() != dsecv1.State_STATE_STOPPED {
		t.Fatalf("replay of a removed sandbox: %v", sb)
	}
}

// TestRowCheckSkippedWhileNothingEnded: a node's rows are checked only when
// its count of ended sandboxes (or its start) moved since the last check,
// or the last full check is fullRowCheck old.
func TestRowCheckSkippedWhileNothingEnded(t *testing.T) {
	e := newFakeEdge("n1")
	nodes := nodesOf(e)
	status := &edgev1.NodeStatus{Node: "n1", Backends: []dsecv1.Backend{dsecv1.Backend_BACKEND_CONTAINER}, MaxSandboxes: 100, StartedUnixMs: 1000}
	nodes[0].Status = status
	s, st, hs := startRig(t, false, false, Config{}, nodes)
	c := dsecv1connect.NewSandboxServiceClient(hs.Client(), hs.URL)
	ctx := context.Background()
	resp, err := c.Create(ctx, connect.NewRequest(&dsecv1.CreateRequest{Spec: &dsecv1.SandboxSpec{Environment: "base:1"}, Count: 3, IdempotencyKey: "k"}))
	if err != nil {
		t.Fatal(err)
	}
	sbs := resp.Msg.GetSandboxes()
	rowsLeft := func(want int, what string) {
		t.Helper()
		s.Reconcile(ctx)
		rows, err := st.SandboxRows(ctx, "k")
		if err != nil || len(rows) != want {
			t.Fatalf("%s: %d rows (%v), want %d", what, len(rows), err, want)
		}
	}
	del := func(i int) {
		t.Helper()
		if _, err := c.Delete(ctx, connect.NewRequest(&dsecv1.DeleteRequest{Id: sbs[i].GetId()})); err != nil {
			t.Fatal(err)
		}
	}
	del(0)
	rowsLeft(2, "first check")
	del(1)
	rowsLeft(2, "the node reports nothing ended since: the check is skipped")
	if got := s.ReconcileStats().RowChecksSkipped; got != 1 {
		t.Fatalf("%d row checks skipped, want 1", got)
	}
	status.Ended = 1
	rowsLeft(1, "the node reports a sandbox ended")
	del(2)
	s.rec.mu.Lock()
	m := s.rec.checked["n1"]
	m.at = m.at.Add(-fullRowCheck)
	s.rec.checked["n1"] = m
	s.rec.mu.Unlock()
	rowsLeft(0, "the last full check is fullRowCheck old")
	status.StartedUnixMs = 2000 // the edge restarted: its count starts again
	resp, err = c.Create(ctx, connect.NewRequest(&dsecv1.CreateRequest{Spec: &dsecv1.SandboxSpec{Environment: "base:1"}, IdempotencyKey: "k2"}))
	if err != nil {
		t.Fatal(err)
	}
	sbs = resp.Msg.GetSandboxes()
	del(0)
	s.Reconcile(ctx)
	if rows, err := st.SandboxRows(ctx, "k2"); err != nil || len(rows) != 0 {
		t.Fatalf("after the edge restarted: %d rows (%v), want 0", len(rows), err)
	}
}

package apiserver

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net/http/httptest"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"connectrpc.com/connect"
	"google.golang.org/protobuf/proto"

	edgev1 "dsec.dev/dsec/api/gen/dsec/edge/v1"
	dsecv1 "dsec.dev/dsec/api/gen/dsec/v1"
	"dsec.dev/dsec/api/gen/dsec/v1/dsecv1connect"
	"dsec.dev/dsec/internal/errdefs"
	"dsec.dev/dsec/internal/iam"
	"dsec.dev/dsec/internal/store"
	"dsec.dev/dsec/internal/watcher"
)

// TestQuotas: a project's sandbox quota is charged by its creates, on the
// resources limited on its path (a
// refusal is ResourceExhausted with the store's words, and makes nothing),
// given back by deletes, and set from the edges' truth by reconciliation:
// a sandbox that ended by itself and the charge of a create whose
// apiserver died are corrected; a create under no limit is not charged,
// and reconciliation counts it.
func TestQuotas(t *testing.T) {
	ctx := context.Background()
	st, err := store.Open(ctx, filepath.Join(t.TempDir(), "meta.db"))
	if err != nil {
		t.Fatal(err)
	}
	defer st.Close()
	if _, err := st.CreateProject(ctx, iam.NodeAdmin(), "a"); err != nil {
		t.Fatal(err)
	}
	if err := st.SetLimit(ctx, iam.NodeAdmin(), "a", store.Sandboxes, 3); err != nil {
		t.Fatal(err)
	}
	if err := st.SetLimit(ctx, iam.NodeAdmin(), "a", store.MemoryMB, 10000); err != nil {
		t.Fatal(err)
	}
	if _, err := st.CreatePrincipal(ctx, iam.NodeAdmin(), store.PrincipalSpec{Name: "run", Project: "a"}); err != nil {
		t.Fatal(err)
	}
	if err := st.Grant(ctx, iam.NodeAdmin(), "run", "a", iam.Runner); err != nil {
		t.Fatal(err)
	}
	tok, _, err := st.MintToken(ctx, iam.NodeAdmin(), store.TokenSpec{Principal: "run", Project: "a", Role: iam.Runner})
	if err != nil {
		t.Fatal(err)
	}
	edge := newFakeEdge("n1")
	s := New(Config{Auth: st, Quotas: st}, st, watcher.NewFixed(nodesOf(edge)...), slog.New(slog.DiscardHandler))
	hs := httptest.NewUnstartedServer(s.Handler())
	hs.Config.ConnContext = ConnContext
	hs.EnableHTTP2 = true
	hs.Start()
	defer hs.Close()
	c := dsecv1connect.NewSandboxServiceClient(hs.Client(), hs.URL, connect.WithInterceptors(bearerBoth(tok)))
	create := func(n int) ([]*dsecv1.Sandbox, error) {
		resp, err := c.Create(ctx, connect.NewRequest(&dsecv1.CreateRequest{Spec: &dsecv1.SandboxSpec{Environment: "base:1", MemoryMb: 256}, Count: int32(n)}))
		if err != nil {
			return nil, err
		}
		return resp.Msg.GetSandboxes(), nil
	}
	used := func(project string) map[store.Resource]int64 {
		t.Helper()
		parent, _ := iam.Parent(project)
		if project == "" {
			parent = ""
		}
		qs, err := st.Quota(ctx, parent)
		if err != nil {
			t.Fatal(err)
		}
		for _, q := range qs {
			if q.Project == project {
				return q.Used
			}
		}
		t.Fatalf("no quota of %q", project)
		return nil
	}

	sbs, err := create(2)
	if err != nil {
		t.Fatal(err)
	}
	more, err := create(1)
	if err != nil {
		t.Fatal(err)
	}
	sbs = append(sbs, more...)
	// The limited resources are charged; vcpus, which nothing limits, are
	// left to reconciliation.
	if u := used("a"); u[store.Sandboxes] != 3 || u[store.MemoryMB] != 768 || u[store.VCPUs] != 0 {
		t.Errorf("use after 3 creates: %v", u)
	}
	_, err = create(1)
	if connect.CodeOf(err) != connect.CodeResourceExhausted || !strings.Contains(err.Error(), "quota of project a: 3 of 3 sandboxes in use") {
		t.Errorf("a create past the quota: %v", err)
	}
	if _, err := create(5); connect.CodeOf(err) != connect.CodeResourceExhausted {
		t.Errorf("a batch past the quota: %v", err)
	}
	if n := len(edge.sbs); n != 3 {
		t.Errorf("the refused creates made sandboxes: %d on the edge", n)
	}
	if _, err := c.Delete(ctx, connect.NewRequest(&dsecv1.DeleteRequest{Id: sbs[0].GetId()})); err != nil {
		t.Fatal(err)
	}
	if _, err := c.Delete(ctx, connect.NewRequest(&dsecv1.DeleteRequest{Id: sbs[0].GetId()})); err != nil {
		t.Fatal(err) // deleted again: nothing more given back
	}
	if u := used("a"); u[store.Sandboxes] != 2 || u[store.MemoryMB] != 512 {
		t.Errorf("use after a delete: %v", u)
	}
	if _, err := create(1); err != nil {
		t.Errorf("a create after a delete: %v", err)
	}

	// A sandbox ends by itself (its TTL), and an apiserver died after
	// charging a create: reconciliation sets the use from the edge.
	edge.mu.Lock()
	edge.sbs[sbs[1].GetId()].State = dsecv1.State_STATE_STOPPED
	edge.mu.Unlock()
	if err := st.Charge(ctx, "a", store.Amounts{store.Sandboxes: 1, store.MemoryMB: 256}); err == nil {
		t.Error("a charge past the quota passed")
	}
	if err := st.SetUse(ctx, "a", store.Sandboxes, 3); err != nil {
		t.Fatal(err)
	}
	// The node's own create, under no limit, is not charged...
	if _, err := s.Create(iam.WithAuthority(ctx, iam.NodeAdmin()), connect.NewRequest(&dsecv1.CreateRequest{Spec: &dsecv1.SandboxSpec{Environment: "base:1"}})); err != nil {
		t.Fatal(err)
	}
	if u := used(""); u[store.Sandboxes] != 3 {
		t.Errorf("the root's use after an uncharged create: %v, want its child's 3", u)
	}
	s.kept.wait()
	s.Reconcile(ctx)
	if u := used("a"); u[store.Sandboxes] != 2 || u[store.MemoryMB] != 512 || u[store.VCPUs] != 2000 {
		t.Errorf("use after reconciliation: %v, want the 2 live sandboxes'", u)
	}
	// ...and reconciliation counts it.
	if u := used(""); u[store.Sandboxes] != 3 {
		t.Errorf("the root's use: %v, want its child's 2 and its own 1", u)
	}

	// A create charged while a sweep counts, its sandbox not on the edge
	// yet: the sweep does not correct its charge away, so the quota holds
	// during the burst.
	edge.freeze()
	done := make(chan error, 1)
	go func() {
		_, err := create(1)
		done <- err
	}()
	<-edge.entered
	s.kept.wait()
	s.Reconcile(ctx)
	if u := used("a"); u[store.Sandboxes] != 3 || heldOf(t, s, st, "a") != 1 {
		t.Errorf("use after a sweep during a create: %v, %d held; want the 2 live and the 1 held", u, heldOf(t, s, st, "a"))
	}
	if _, err := create(1); connect.CodeOf(err) != connect.CodeResourceExhausted {
		t.Errorf("a create past the quota while another is under way: %v", err)
	}
	edge.thaw()
	if err := <-done; err != nil {
		t.Fatal(err)
	}
	s.kept.wait()
	s.Reconcile(ctx)
	if u := used("a"); u[store.Sandboxes] != 3 || heldOf(t, s, st, "a") != 0 {
		t.Errorf("use after the create: %v, %d held; want 3 and none", u, heldOf(t, s, st, "a"))
	}

	// Two deletes of one sandbox that both saw it live give it back once.
	live := liveIn(edge, "a")
	if _, err := c.Delete(ctx, connect.NewRequest(&dsecv1.DeleteRequest{Id: live[0].GetId()})); err != nil {
		t.Fatal(err)
	}
	s.releaseSandbox(ctx, "a", live[0].GetId(), amountsOf(live[0].GetSpec(), 1))
	if u := used("a"); u[store.Sandboxes] != 2 {
		t.Errorf("use after a sandbox was released twice: %v, want 2", u)
	}

	// A keyed create is charged in the transaction that reserves its key
	// and holds nothing once made; its repeat charges nothing.
	keyed := func() (*dsecv1.CreateResponse, error) {
		resp, err := c.Create(ctx, connect.NewRequest(&dsecv1.CreateRequest{Spec: &dsecv1.SandboxSpec{Environment: "base:1", MemoryMb: 256}, IdempotencyKey: "k1"}))
		if err != nil {
			return nil, err
		}
		return resp.Msg, nil
	}
	first, err := keyed()
	if err != nil {
		t.Fatal(err)
	}
	again, err := keyed()
	if err != nil || again.GetSandboxes()[0].GetId() != first.GetSandboxes()[0].GetId() {
		t.Fatalf("the repeat of a keyed create: %v, %v", again, err)
	}
	if u := used("a"); u[store.Sandboxes] != 3 || heldOf(t, s, st, "a") != 0 {
		t.Errorf("use after a keyed create and its repeat: %v, %d held; want 3 and none", u, heldOf(t, s, st, "a"))
	}
	if _, err := c.Create(ctx, connect.NewRequest(&dsecv1.CreateRequest{Spec: &dsecv1.SandboxSpec{Environment: "base:1"}, IdempotencyKey: "k2"})); connect.CodeOf(err) != connect.CodeResourceExhausted {
		t.Errorf("a keyed create past the quota: %v", err)
	}

	// A microVM's fork is charged its children when it forks, not at the
	// next sweep: past the quota it is refused. (The microVM is made on
	// the edge directly, uncharged: the fake node offers no microVMs.)
	vm, err := edge.Create(ctx, &dsecv1.SandboxSpec{Environment: "base:1", MemoryMb: 256, Isolation: dsecv1.Isolation_ISOLATION_MICROVM,
		Labels: map[string]string{ProjectLabel: "a"}}, "")
	if err != nil {
		t.Fatal(err)
	}
	fork := func() error {
		_, err := c.Fork(ctx, connect.NewRequest(&dsecv1.ForkRequest{SandboxId: vm.GetId(), Count: 1}))
		return err
	}
	if err := fork(); connect.CodeOf(err) != connect.CodeResourceExhausted {
		t.Errorf("a fork past the quota: %v", err)
	}
	if _, err := c.Delete(ctx, connect.NewRequest(&dsecv1.DeleteRequest{Id: first.GetSandboxes()[0].GetId()})); err != nil {
		t.Fatal(err)
	}
	if err := fork(); err != nil {
		t.Fatal(err)
	}
	if u := used("a"); u[store.Sandboxes] != 3 || u[store.MemoryMB] != 768 || heldOf(t, s, st, "a") != 0 {
		t.Errorf("use after a fork: %v, %d held; want 3 sandboxes of 256 MiB and none held", u, heldOf(t, s, st, "a"))
	}
	s.kept.wait()
	s.Reconcile(ctx)
	if u := used("a"); u[store.Sandboxes] != 4 || len(liveIn(edge, "a")) != 4 {
		t.Errorf("use after the sweep: %v, %d live; want the 4 live (the microVM counted)", u, len(liveIn(edge, "a")))
	}

	// A keyed fork is charged by the reservation's owner; its repeat
	// charges nothing.
	for _, sb := range liveIn(edge, "a") {
		if sb.GetId() != vm.GetId() && len(liveIn(edge, "a")) > 2 {
			if _, err := c.Delete(ctx, connect.NewRequest(&dsecv1.DeleteRequest{Id: sb.GetId()})); err != nil {
				t.Fatal(err)
			}
		}
	}
	keyedFork := func(key string) (*dsecv1.ForkResponse, error) {
		resp, err := c.Fork(ctx, connect.NewRequest(&dsecv1.ForkRequest{SandboxId: vm.GetId(), Count: 1, IdempotencyKey: key}))
		if err != nil {
			return nil, err
		}
		return resp.Msg, nil
	}
	f1, err := keyedFork("f1")
	if err != nil {
		t.Fatal(err)
	}
	f1again, err := keyedFork("f1")
	if err != nil || f1again.GetChildren()[0].GetSandbox().GetId() != f1.GetChildren()[0].GetSandbox().GetId() {
		t.Fatalf("the repeat of a keyed fork: %v, %v", f1again, err)
	}
	if u := used("a"); u[store.Sandboxes] != 3 || heldOf(t, s, st, "a") != 0 {
		t.Errorf("use after a keyed fork and its repeat: %v, %d held; want 3 and none", u, heldOf(t, s, st, "a"))
	}
	if _, err := keyedFork("f2"); connect.CodeOf(err) != connect.CodeResourceExhausted {
		t.Errorf("a keyed fork past the quota: %v", err)
	}

	// creates_per_second: a batch of more creates than a second's worth is
	// refused by name whenever it comes, and makes nothing.
	if err := st.SetLimit(ctx, iam.NodeAdmin(), "a", store.Sandboxes, 100); err != nil {
		t.Fatal(err)
	}
	if err := st.SetLimit(ctx, iam.NodeAdmin(), "a", store.CreatesPerSecond, 2); err != nil {
		t.Fatal(err)
	}
	s.limits.mu.Lock()
	s.limits.m = nil // which resources are limited is read once a second
	s.limits.mu.Unlock()
	before := len(liveIn(edge, "a"))
	if _, err := create(3); connect.CodeOf(err) != connect.CodeResourceExhausted || !strings.Contains(err.Error(), "quota of project a: more than 2 creates per second") {
		t.Errorf("a batch past creates_per_second: %v", err)
	}
	if n := len(liveIn(edge, "a")); n != before {
		t.Errorf("the refused batch made sandboxes: %d live, %d before", n, before)
	}
}

// TestQuotaSweepTally: a sweep asks each node for its live sandboxes
// summed by project, not for the sandboxes, and sets each project's use
// from the sums as it did from the sandboxes: the same from an edge from
// before tallies, which answers the sandboxes.
func TestQuotaSweepTally(t *testing.T) {
	ctx := context.Background()
	st := openWithProjects(t, "a", "b")
	specs := map[string][]*dsecv1.SandboxSpec{
		"a": {{Cpus: 0.25, MemoryMb: 300}, {}, {Cpus: 2, DiskMb: 2048}},
		"b": {{Cpus: 1.0001}},
		"":  {{MemoryMb: 64}},
	}
	edges := []*fakeEdge{newFakeEdge("n1"), newFakeEdge("n2")}
	want := map[string]store.Amounts{}
	i := 0
	for project, ss := range specs {
		want[project] = store.Amounts{}
		for _, spec := range ss {
			spec.Environment = "base:1"
			spec.Labels = map[string]string{}
			if project != "" {
				spec.Labels[ProjectLabel] = project
			}
			e := edges[i%2]
			i++
			id := e.NewID()
			e.sbs[id] = &dsecv1.Sandbox{Id: id, State: dsecv1.State_STATE_RUNNING, Spec: spec}
			for r, v := range amountsOf(spec, 1) {
				want[project][r] += v
			}
		}
	}
	// Neither an ended sandbox nor a pooled one counts.
	edges[0].sbs["gone"] = &dsecv1.Sandbox{Id: "gone", State: dsecv1.State_STATE_STOPPED, Spec: &dsecv1.SandboxSpec{Labels: map[string]string{ProjectLabel: "a"}}}
	edges[1].sbs["pooled"] = &dsecv1.Sandbox{Id: "pooled", State: dsecv1.State_STATE_RUNNING, Spec: &dsecv1.SandboxSpec{Labels: map[string]string{FnCallPoolLabel: "python"}}}
	for _, old := range []bool{false, true} {
		nodes := nodesOf(edges...)
		if old {
			for i := range nodes {
				nodes[i].Edge = untallied{nodes[i].Edge}
			}
		}
		s := New(Config{Auth: st, Quotas: st}, st, watcher.NewFixed(nodes...), slog.New(slog.DiscardHandler))
		for _, p := range []string{"a", "b"} {
			if err := st.SetUse(ctx, p, store.Sandboxes, 9); err != nil {
				t.Fatal(err)
			}
		}
		for _, e := range edges {
			e.queries = nil
		}
		s.reconcileQuotas(ctx)
		for _, e := range edges {
			if len(e.queries) != 1 || (e.queries[0].Tally == nil) != old {
				t.Errorf("old edge %v: node %s was asked %+v, want one question, a tally unless old", old, e.node, e.queries)
			}
		}
		us, err := st.Uses(ctx, countedResources)
		if err != nil {
			t.Fatal(err)
		}
		for _, u := range us {
			if w, ok := want[u.Project][u.Resource]; ok && u.Own != w {
				t.Errorf("old edge %v: project %q's own %s after a sweep: %d, want %d", old, u.Project, u.Resource, u.Own, w)
			}
		}
	}
}

// untallied is an edge from before tallies: it answers a List's sandboxes,
// its tally unread.
type untallied struct{ watcher.Edge }

func (u untallied) List(ctx context.Context, req *connect.Request[edgev1.ListRequest]) (*connect.Response[edgev1.ListResponse], error) {
	m := proto.Clone(req.Msg).(*edgev1.ListRequest)
	m.Tally = false
	return u.Edge.List(ctx, connect.NewRequest(m))
}

// openWithProjects opens a store of the test's own, closed when the test
// ends, with the projects given under the root.
func openWithProjects(t *testing.T, projects ...string) store.Store {
	t.Helper()
	st, err := store.Open(t.Context(), filepath.Join(t.TempDir(), "meta.db"))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { st.Close() })
	for _, p := range projects {
		if _, err := st.CreateProject(t.Context(), iam.NodeAdmin(), p); err != nil {
			t.Fatal(err)
		}
	}
	return st
}

// heldOf is what project's holds hold of sandboxes.
func heldOf(t *testing.T, s *Server, st store.Store, project string) int64 {
	t.Helper()
	s.kept.wait() // the settles that keep their charge, in the background
	us, err := st.Uses(t.Context(), []store.Resource{store.Sandboxes})
	if err != nil {
		t.Fatal(err)
	}
	for _, u := range us {
		if u.Project == project {
			return u.Held
		}
	}
	return 0
}

// liveIn lists the live sandboxes of project on e.
func liveIn(e *fakeEdge, project string) []*dsecv1.Sandbox {
	e.mu.Lock()
	defer e.mu.Unlock()
	var out []*dsecv1.Sandbox
	for _, sb := range e.sbs {
		if projectOf(sb) == project && live(sb.GetState()) {
			out = append(out, sb)
		}
	}
	return out
}

// TestFnCallQuota: a FnCall call is charged to its caller's project as
// one call in flight while it runs, when a limit applies: past it a call
// is refused by name; a call that ended gives it back; a call with no
// limit on its path is not charged.
func TestFnCallQuota(t *testing.T) {
	ctx := context.Background()
	st := openWithProjects(t, "ml", "free")
	if err := st.SetLimit(ctx, iam.NodeAdmin(), "ml", store.FnCallInflight, 2); err != nil {
		t.Fatal(err)
	}
	s := New(Config{Auth: st, Quotas: st, TokenlessFnCall: "/ml"}, st, watcher.NewFixed(), slog.New(slog.DiscardHandler))
	// A call without a token runs in the project named for such calls.
	tctx, err := s.AuthorizeFnCall(ctx, "", "peer")
	if err != nil {
		t.Fatal(err)
	}
	var calls []held
	for range 2 {
		h, err := s.chargeCall(tctx)
		if err != nil || len(h) != 1 {
			t.Fatalf("a call under the limit: %v, %v", h, err)
		}
		calls = append(calls, h)
	}
	_, err = s.chargeCall(tctx)
	if !errors.Is(err, errdefs.ErrResourceExhausted) || !strings.Contains(err.Error(), "quota of project ml: 2 of 2 FnCall calls in flight") {
		t.Errorf("a call past the limit: %v", err)
	}
	s.settleHolds(ctx, calls[0], false)
	if _, err := s.chargeCall(tctx); err != nil {
		t.Errorf("a call after one ended: %v", err)
	}
	// A call ended by its apiserver's death: the sweep counts its hold
	// until it expires, then corrects the use to the calls in flight.
	s.reconcileQuotas(ctx)
	if qs, _ := st.Quota(ctx, "ml"); qs[0].Used[store.FnCallInflight] != 2 {
		t.Errorf("calls in flight after a sweep: %d, want the 2 held", qs[0].Used[store.FnCallInflight])
	}
	if n, err := st.ExpireHolds(ctx, time.Now().Add(store.DefaultHoldExpiry+time.Minute)); err != nil || n != 2 {
		t.Errorf("expired %d holds (%v), want 2", n, err)
	}
	s.reconcileQuotas(ctx)
	if qs, _ := st.Quota(ctx, "ml"); qs[0].Used[store.FnCallInflight] != 0 {
		t.Errorf("calls in flight after the holds expired: %d, want 0", qs[0].Used[store.FnCallInflight])
	}
	free := iam.WithAuthority(ctx, iam.Authority{Principal: "p", Project: "free", Role: iam.Runner, Bindings: []iam.Binding{{Project: "free", Role: iam.Runner}}})
	if h, err := s.chargeCall(free); err != nil || h != nil {
		t.Errorf("a call under no limit: charged %v, %v", h, err)
	}
}

// countingQuotas counts the store's charges.
type countingQuotas struct {
	Quotas
	charges atomic.Int32
}

func (c *countingQuotas) ReserveCharged(ctx context.Context, project string, amounts store.Amounts, holds []store.Hold, rs []store.CreateReservation) ([]store.CreateReservation, []bool, error) {
	c.charges.Add(1)
	return c.Quotas.ReserveCharged(ctx, project, amounts, holds, rs)
}

func (c *countingQuotas) ChargeHeld(ctx context.Context, project string, amounts store.Amounts, holds []store.Hold) error {
	c.charges.Add(1)
	return c.Quotas.ChargeHeld(ctx, project, amounts, holds)
}

// TestChargeGroup: concurrent charges of one project, keyed creates' with
// their reservations, go to the store in groups, and a group past the
// limit is charged one by one, so the quota fills exactly: of 200 racing
// for 50, 50 pass.
func TestChargeGroup(t *testing.T) {
	ctx := context.Background()
	st, err := store.Open(ctx, filepath.Join(t.TempDir(), "meta.db"))
	if err != nil {
		t.Fatal(err)
	}
	defer st.Close()
	if _, err := st.CreateProject(ctx, iam.NodeAdmin(), "a"); err != nil {
		t.Fatal(err)
	}
	if err := st.SetLimit(ctx, iam.NodeAdmin(), "a", store.Sandboxes, 50); err != nil {
		t.Fatal(err)
	}
	q := &countingQuotas{Quotas: st}
	var g chargeGroup
	var wg sync.WaitGroup
	var ok, refused atomic.Int32
	for i := range 200 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			one := store.Amounts{store.Sandboxes: 1}
			var err error
			if i%2 == 0 {
				err = g.charge(ctx, q, "a", one, []store.Hold{{ID: fmt.Sprint("h", i), Amounts: one}})
			} else {
				// A keyed create: reserved and charged together.
				var reserved bool
				_, reserved, err = g.reserve(ctx, q, store.CreateReservation{Key: fmt.Sprint("k", i), RequestHash: "h",
					Charge: &store.QuotaCharge{Project: "a", Amounts: one, Held: one}})
				if err == nil && !reserved {
					t.Errorf("key k%d: charged and not reserved", i)
				}
			}
			switch {
			case err == nil:
				ok.Add(1)
			case errors.Is(err, errdefs.ErrResourceExhausted):
				refused.Add(1)
			default:
				t.Error(err)
			}
		}()
	}
	wg.Wait()
	if ok.Load() != 50 || refused.Load() != 150 {
		t.Errorf("%d charges passed and %d were refused, want 50 and 150", ok.Load(), refused.Load())
	}
	qs, err := st.Quota(ctx, "a")
	if err != nil || qs[0].Used[store.Sandboxes] != 50 {
		t.Errorf("use %v (%v), want 50", qs, err)
	}
	us, err := st.Uses(ctx, []store.Resource{store.Sandboxes})
	if err != nil {
		t.Fatal(err)
	}
	for _, u := range us {
		if u.Project == "a" && u.Held != 50 {
			t.Errorf("a holds %d sandboxes, want the 50 charged", u.Held)
		}
	}
	t.Logf("%d store charges for 200 charges", q.charges.Load())
}

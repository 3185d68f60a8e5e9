package apiserver

import (
	"context"
	"errors"
	"log/slog"
	"net/http/httptest"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"testing"

	"connectrpc.com/connect"

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
	s.Reconcile(ctx)
	if u := used("a"); u[store.Sandboxes] != 2 || u[store.MemoryMB] != 512 || u[store.VCPUs] != 2000 {
		t.Errorf("use after reconciliation: %v, want the 2 live sandboxes'", u)
	}
	// ...and reconciliation counts it.
	if u := used(""); u[store.Sandboxes] != 3 {
		t.Errorf("the root's use: %v, want its child's 2 and its own 1", u)
	}
}

// countingQuotas counts the store's charges.
type countingQuotas struct {
	Quotas
	charges atomic.Int32
}

func (c *countingQuotas) Charge(ctx context.Context, project string, amounts store.Amounts) error {
	c.charges.Add(1)
	return c.Quotas.Charge(ctx, project, amounts)
}

// TestChargeGroup: concurrent charges of one project go to the store in
// groups, and a group past the limit is charged one by one, so the quota
// fills exactly: of 200 racing for 50, 50 pass.
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
	for range 200 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			err := g.charge(ctx, q, "a", store.Amounts{store.Sandboxes: 1})
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
	t.Logf("%d store charges for 200 charges", q.charges.Load())
}

package cluster

import (
	"context"
	"fmt"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"connectrpc.com/connect"

	dsecv1 "dsec.dev/dsec/api/gen/dsec/v1"
	"dsec.dev/dsec/internal/bench"
	"dsec.dev/dsec/internal/iam"
	"dsec.dev/dsec/internal/store"
	"dsec.dev/dsec/internal/testutil"
	dsec "dsec.dev/dsec/sdk/go"
)

// iamRig is a cluster of two apiservers and two hollow edges on one
// metadata store with projects run and other, a runner token in each, and
// a limit of limit sandboxes on run.
type iamRig struct {
	c          *testutil.Cluster
	st         store.Store
	run, other string // tokens
}

// iamStores are the metadata stores the IAM rig runs on: PostgreSQL, whose
// edges register in it, and one SQLite file both apiservers open (and the
// test a third handle), the edges named to them by --edge.
var iamStores = []string{"postgres", "sqlite"}

func startIAMRig(t *testing.T, db string, limit int64, apiserverArgs ...string) *iamRig {
	t.Helper()
	o := testutil.ClusterOptions{APIServers: 2, Edges: 2,
		EdgeArgs: []string{"--runtime", "fake", "--hollow-max-sandboxes", "2000"}, APIServerArgs: apiserverArgs}
	switch db {
	case "postgres":
		o.DB, o.Registry = testutil.StartPostgres(t), true
	case "sqlite":
		o.DB = filepath.Join(t.TempDir(), "meta.db")
	default:
		t.Fatalf("startIAMRig: no store %q", db)
	}
	c := testutil.StartCluster(t, o)
	ctx := context.Background()
	st, err := store.Open(ctx, o.DB)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { st.Close() })
	r := &iamRig{c: c, st: st}
	for _, p := range []string{"run", "other"} {
		if _, err := st.CreateProject(ctx, iam.NodeAdmin(), p); err != nil {
			t.Fatal(err)
		}
		if _, err := st.CreatePrincipal(ctx, iam.NodeAdmin(), store.PrincipalSpec{Name: p + "-runner", Kind: store.KindService, Project: p}); err != nil {
			t.Fatal(err)
		}
		if err := st.Grant(ctx, iam.NodeAdmin(), p+"-runner", p, iam.Runner); err != nil {
			t.Fatal(err)
		}
		tok, _, err := st.MintToken(ctx, iam.NodeAdmin(), store.TokenSpec{Principal: p + "-runner", Project: p, Role: iam.Runner})
		if err != nil {
			t.Fatal(err)
		}
		if p == "run" {
			r.run = tok
		} else {
			r.other = tok
		}
	}
	if err := st.SetLimit(ctx, iam.NodeAdmin(), "run", store.Sandboxes, limit); err != nil {
		t.Fatal(err)
	}
	return r
}

// client dials apiserver i (-1: all of them) with token.
func (r *iamRig) client(t *testing.T, i int, token string) *dsec.Conn {
	t.Helper()
	var addrs []string
	for j, a := range r.c.APIServers {
		if i < 0 || i == j {
			addrs = append(addrs, a.Addr)
		}
	}
	cl, err := dsec.Dial(strings.Join(addrs, ","), dsec.DialOptions{Token: token})
	if err != nil {
		t.Fatal(err)
	}
	return cl
}

// used is run's use of sandboxes.
func (r *iamRig) used(t *testing.T) int64 {
	t.Helper()
	qs, err := r.st.Quota(context.Background(), "run")
	if err != nil {
		t.Fatal(err)
	}
	return qs[0].Used[store.Sandboxes]
}

// TestProjectsAndQuotaRace: through the Go SDK against two apiservers on
// one store (PostgreSQL, SQLite), a runner of one project finds no sandbox
// of another (NotFound by ID, absent from its list) and may not make
// layers; then 1,000 creates racing through both apiservers for a quota of
// 100 give exactly 100 sandboxes, every other create refused by the
// quota's name, and the project's use is back to 0 once they are deleted.
func TestProjectsAndQuotaRace(t *testing.T) {
	for _, db := range iamStores {
		t.Run(db, func(t *testing.T) { testProjectsAndQuotaRace(t, db) })
	}
}

func testProjectsAndQuotaRace(t *testing.T, db string) {
	r := startIAMRig(t, db, 100, "--reconcile-interval", "1h")
	ctx := context.Background()
	run, other := r.client(t, -1, r.run), r.client(t, -1, r.other)

	resp, err := other.Sandboxes.Create(ctx, connect.NewRequest(&dsecv1.CreateRequest{Spec: &dsecv1.SandboxSpec{Environment: "base:1"}}))
	if err != nil {
		t.Fatal(err)
	}
	theirs := resp.Msg.GetSandboxes()[0].GetId()
	if _, err := run.Sandboxes.Get(ctx, connect.NewRequest(&dsecv1.GetRequest{Id: theirs})); connect.CodeOf(err) != connect.CodeNotFound {
		t.Errorf("a runner of run reading other's sandbox: %v, want not found", err)
	}
	if _, err := run.Sandboxes.Delete(ctx, connect.NewRequest(&dsecv1.DeleteRequest{Id: theirs})); connect.CodeOf(err) != connect.CodeNotFound {
		t.Errorf("a runner of run deleting other's sandbox: %v, want not found", err)
	}
	if _, err := run.Layers.RemoveLayer(ctx, connect.NewRequest(&dsecv1.RemoveLayerRequest{Ref: "base:1"})); connect.CodeOf(err) != connect.CodePermissionDenied {
		t.Errorf("a runner removing a layer: %v, want permission denied", err)
	}
	if _, err := other.Sandboxes.Delete(ctx, connect.NewRequest(&dsecv1.DeleteRequest{Id: theirs})); err != nil {
		t.Fatal(err)
	}

	clients := []*dsec.Conn{r.client(t, 0, r.run), r.client(t, 1, r.run)}
	var mu sync.Mutex
	var made []string
	var refused atomic.Int32
	var wrong []error
	var wg sync.WaitGroup
	next := atomic.Int32{}
	for w := range 32 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			cl := clients[w%2]
			for next.Add(1) <= 1000 {
				cctx, cancel := context.WithTimeout(ctx, 30*time.Second)
				resp, err := cl.Sandboxes.Create(cctx, connect.NewRequest(&dsecv1.CreateRequest{Spec: &dsecv1.SandboxSpec{Environment: "base:1"}}))
				cancel()
				mu.Lock()
				switch {
				case err == nil:
					made = append(made, resp.Msg.GetSandboxes()[0].GetId())
				case connect.CodeOf(err) == connect.CodeResourceExhausted && strings.Contains(err.Error(), "quota of project run: 100 of 100 sandboxes in use"):
					refused.Add(1)
				default:
					wrong = append(wrong, err)
				}
				mu.Unlock()
			}
		}()
	}
	wg.Wait()
	for _, err := range wrong[:min(len(wrong), 5)] {
		t.Errorf("a create neither made nor refused by the quota: %v", err)
	}
	if len(made) != 100 || refused.Load() != 900 {
		t.Fatalf("%d creates made sandboxes and %d were refused by the quota, want 100 and 900", len(made), refused.Load())
	}
	if u := r.used(t); u != 100 {
		t.Errorf("run's use after the race: %d, want 100", u)
	}
	list, err := r.client(t, -1, r.other).Sandboxes.List(ctx, connect.NewRequest(&dsecv1.ListRequest{}))
	if err != nil || len(list.Msg.GetSandboxes()) != 0 {
		t.Errorf("other lists %d sandboxes (%v), want none of run's", len(list.Msg.GetSandboxes()), err)
	}
	for _, id := range made {
		if _, err := run.Sandboxes.Delete(ctx, connect.NewRequest(&dsecv1.DeleteRequest{Id: id})); err != nil {
			t.Fatal(err)
		}
	}
	if u := r.used(t); u != 0 {
		t.Errorf("run's use after the deletes: %d, want 0", u)
	}
}

// TestKilledApiserverQuota: an apiserver killed while creates (keyed and
// not) charge run's quota through it leaves charges held for sandboxes
// never made; once they expire (their creates' deadlines) the other
// apiserver's reconciliation sets run's use to the sandboxes that live.
// On PostgreSQL and on SQLite (the killed process may have held the
// file's write lock at its death), side by side: each mostly waits for the
// holds to expire.
func TestKilledApiserverQuota(t *testing.T) {
	for _, db := range iamStores {
		t.Run(db, func(t *testing.T) {
			t.Parallel()
			testKilledApiserverQuota(t, db)
		})
	}
}

func testKilledApiserverQuota(t *testing.T, db string) {
	r := startIAMRig(t, db, 10000, "--reconcile-interval", "1s")
	ctx := context.Background()
	cl := r.client(t, 0, r.run)
	var started atomic.Int32
	var wg sync.WaitGroup
	for w := range 8 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := 0; ; i++ {
				started.Add(1)
				req := &dsecv1.CreateRequest{Spec: &dsecv1.SandboxSpec{Environment: "base:1"}, Count: 5}
				if w%2 == 1 {
					req.IdempotencyKey = fmt.Sprintf("w%d-%d", w, i) // charged with its reservation
				}
				cctx, cancel := context.WithTimeout(ctx, 5*time.Second)
				_, err := cl.Sandboxes.Create(cctx, connect.NewRequest(req))
				cancel()
				if err != nil {
					return // the apiserver is gone
				}
			}
		}()
	}
	for started.Load() < 40 {
		time.Sleep(time.Millisecond)
	}
	r.c.APIServers[0].Kill()
	wg.Wait()
	survivor := r.client(t, 1, r.run)
	deadline := time.Now().Add(60 * time.Second)
	for {
		list, err := survivor.Sandboxes.List(ctx, connect.NewRequest(&dsecv1.ListRequest{}))
		if err != nil {
			t.Fatal(err)
		}
		n, u := int64(len(list.Msg.GetSandboxes())), r.used(t)
		if n == u && n > 0 && held(t, r.st, "run") == 0 {
			t.Logf("run's use is its %d live sandboxes", n)
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("run's use is %d with %d sandboxes live, 60 s after the kill", u, n)
		}
		time.Sleep(200 * time.Millisecond)
	}
}

// TestQuotaSweepRace: 40 callers create and delete sandboxes of run (a
// quota of 20) through both apiservers, keyed and not, while both sweep
// every 50 ms: no sweep corrects away the charge of a create under way, so
// run never holds more than 20 live sandboxes (a watcher lists them
// throughout), every create is made or refused by the quota's name, and
// once the callers stop run's use is what lives, none of it held.
func TestQuotaSweepRace(t *testing.T) {
	r := startIAMRig(t, "postgres", 20, "--reconcile-interval", "50ms")
	ctx := context.Background()
	clients := []*dsec.Conn{r.client(t, 0, r.run), r.client(t, 1, r.run)}
	watch := r.client(t, -1, r.run)
	stop := make(chan struct{})
	var most atomic.Int64
	var listed atomic.Int32
	var wg sync.WaitGroup
	wg.Add(1)
	go func() {
		defer wg.Done()
		for {
			select {
			case <-stop:
				return
			default:
			}
			list, err := watch.Sandboxes.List(ctx, connect.NewRequest(&dsecv1.ListRequest{}))
			if err != nil {
				continue // an edge call of a busy cluster: the next list
			}
			listed.Add(1)
			if n := int64(len(list.Msg.GetSandboxes())); n > most.Load() {
				most.Store(n)
			}
		}
	}()
	var made, refused atomic.Int32
	var mu sync.Mutex
	var wrong []error
	var callers sync.WaitGroup
	for w := range 40 {
		callers.Add(1)
		go func() {
			defer callers.Done()
			cl := clients[w%2]
			for i := range 15 {
				req := &dsecv1.CreateRequest{Spec: &dsecv1.SandboxSpec{Environment: "base:1"}}
				if i%2 == 1 {
					req.IdempotencyKey = fmt.Sprintf("w%d-%d", w, i)
				}
				cctx, cancel := context.WithTimeout(ctx, 30*time.Second)
				resp, err := cl.Sandboxes.Create(cctx, connect.NewRequest(req))
				cancel()
				switch {
				case err == nil:
					made.Add(1)
					time.Sleep(20 * time.Millisecond) // held a while: demand past the quota
					if _, err := cl.Sandboxes.Delete(ctx, connect.NewRequest(&dsecv1.DeleteRequest{Id: resp.Msg.GetSandboxes()[0].GetId()})); err != nil {
						mu.Lock()
						wrong = append(wrong, err)
						mu.Unlock()
					}
				case connect.CodeOf(err) == connect.CodeResourceExhausted && strings.Contains(err.Error(), "quota of project run: "):
					refused.Add(1)
				default:
					mu.Lock()
					wrong = append(wrong, err)
					mu.Unlock()
				}
			}
		}()
	}
	callers.Wait()
	close(stop)
	wg.Wait()
	for _, err := range wrong[:min(len(wrong), 5)] {
		t.Errorf("a create or delete neither done nor refused by the quota: %v", err)
	}
	t.Logf("%d creates made, %d refused by the quota; at most %d live in %d lists", made.Load(), refused.Load(), most.Load(), listed.Load())
	if made.Load() == 0 || refused.Load() == 0 || listed.Load() == 0 {
		t.Fatalf("no race: %d made, %d refused, %d lists", made.Load(), refused.Load(), listed.Load())
	}
	if most.Load() > 20 {
		t.Errorf("run held %d live sandboxes at once, over its quota of 20", most.Load())
	}
	deadline := time.Now().Add(30 * time.Second)
	for {
		us, err := r.st.Uses(ctx, []store.Resource{store.Sandboxes})
		if err != nil {
			t.Fatal(err)
		}
		var u store.Use
		for _, x := range us {
			if x.Project == "run" {
				u = x
			}
		}
		if u.Own == 0 && u.Held == 0 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("run's use after every sandbox was deleted: %+v, want none", u)
		}
		time.Sleep(100 * time.Millisecond)
	}
}

// held is what project's holds hold of sandboxes.
func held(t *testing.T, st store.Store, project string) int64 {
	t.Helper()
	us, err := st.Uses(context.Background(), []store.Resource{store.Sandboxes})
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

// TestQuotaDoubleDelete: each of 20 sandboxes of run deleted twice at
// once, through both apiservers, with no sweep to correct anything: each
// is given back once, so run's use is exactly the 20 others that live.
func TestQuotaDoubleDelete(t *testing.T) {
	r := startIAMRig(t, "postgres", 100, "--reconcile-interval", "1h")
	ctx := context.Background()
	clients := []*dsec.Conn{r.client(t, 0, r.run), r.client(t, 1, r.run)}
	resp, err := clients[0].Sandboxes.Create(ctx, connect.NewRequest(&dsecv1.CreateRequest{Spec: &dsecv1.SandboxSpec{Environment: "base:1"}, Count: 40}))
	if err != nil {
		t.Fatal(err)
	}
	if u := r.used(t); u != 40 {
		t.Fatalf("run's use after 40 creates: %d", u)
	}
	var wg sync.WaitGroup
	var deleted, notFound atomic.Int32
	for _, sb := range resp.Msg.GetSandboxes()[:20] {
		for _, cl := range clients {
			wg.Add(1)
			go func() {
				defer wg.Done()
				_, err := cl.Sandboxes.Delete(ctx, connect.NewRequest(&dsecv1.DeleteRequest{Id: sb.GetId()}))
				switch {
				case err == nil:
					deleted.Add(1)
				case connect.CodeOf(err) == connect.CodeNotFound:
					notFound.Add(1) // the other delete was first
				default:
					t.Error(err)
				}
			}()
		}
	}
	wg.Wait()
	t.Logf("%d deletes answered ok, %d not found", deleted.Load(), notFound.Load())
	if u := r.used(t); u != 20 {
		t.Errorf("run's use after 20 of 40 sandboxes were each deleted twice at once: %d, want 20", u)
	}
}

// BenchmarkClusterQuota is `dsec bench cluster --quota-token` on two
// apiservers over PostgreSQL and three hollow edges: the create rate of a
// project under a quota limit (every create charged) against one under
// none, in alternating rounds (ABBA), and their ratio (target ≥ 0.9×).
//
//	go test -run '^$' -bench ClusterQuota -benchtime 1x ./test/cluster   # as root
func BenchmarkClusterQuota(b *testing.B) {
	pg := testutil.StartPostgres(b)
	c := testutil.StartCluster(b, testutil.ClusterOptions{APIServers: 2, Edges: 3, DB: pg, Registry: true,
		EdgeArgs: []string{"--runtime", "fake", "--hollow-max-sandboxes", "200000"}})
	ctx := context.Background()
	st, err := store.Open(ctx, pg)
	if err != nil {
		b.Fatal(err)
	}
	defer st.Close()
	tokens := map[string]string{}
	for _, p := range []string{"free", "charged"} {
		if _, err := st.CreateProject(ctx, iam.NodeAdmin(), p); err != nil {
			b.Fatal(err)
		}
		if _, err := st.CreatePrincipal(ctx, iam.NodeAdmin(), store.PrincipalSpec{Name: p, Kind: store.KindService, Project: p}); err != nil {
			b.Fatal(err)
		}
		if err := st.Grant(ctx, iam.NodeAdmin(), p, p, iam.Runner); err != nil {
			b.Fatal(err)
		}
		if tokens[p], _, err = st.MintToken(ctx, iam.NodeAdmin(), store.TokenSpec{Principal: p, Project: p, Role: iam.Runner}); err != nil {
			b.Fatal(err)
		}
	}
	if err := st.SetLimit(ctx, iam.NodeAdmin(), "charged", store.Sandboxes, 1<<40); err != nil {
		b.Fatal(err)
	}
	dial := func(tok string) []*dsec.Conn {
		var out []*dsec.Conn
		for _, a := range c.APIServers {
			cl, err := dsec.Dial(a.Addr, dsec.DialOptions{Token: tok})
			if err != nil {
				b.Fatal(err)
			}
			out = append(out, cl)
		}
		return out
	}
	for range b.N {
		rep, err := bench.RunClusterQuota(ctx, dial(tokens["free"]), dial(tokens["charged"]),
			bench.ClusterOptions{Env: "base:1", Duration: 36 * time.Second, Batch: 50, BatchWorkers: 6, SingleWorkers: 40}, 4)
		if err != nil {
			b.Fatal(err)
		}
		var out strings.Builder
		rep.Print(&out)
		b.Log("\n" + out.String())
	}
}

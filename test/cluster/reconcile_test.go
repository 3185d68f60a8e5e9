package cluster

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"net/http"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"connectrpc.com/connect"

	edgev1 "dsec.dev/dsec/api/gen/dsec/edge/v1"
	"dsec.dev/dsec/api/gen/dsec/edge/v1/edgev1connect"
	dsecv1 "dsec.dev/dsec/api/gen/dsec/v1"
	"dsec.dev/dsec/internal/clustertls"
	"dsec.dev/dsec/internal/errdefs"
	"dsec.dev/dsec/internal/iam"
	"dsec.dev/dsec/internal/store"
	"dsec.dev/dsec/internal/testutil"
)

// edgeClient calls edge i directly, as apiserver api1 would.
func edgeClient(t *testing.T, c *testutil.Cluster, i int) edgev1connect.EdgeServiceClient {
	t.Helper()
	e := c.Edges[i]
	tc, err := clustertls.ClientConfig(clustertls.ComponentFiles(filepath.Join(c.Dir, "pki"), clustertls.RoleAPIServer, "api1"), clustertls.RoleEdge, e.Name)
	if err != nil {
		t.Fatal(err)
	}
	tr := &http.Transport{TLSClientConfig: tc, ForceAttemptHTTP2: true}
	t.Cleanup(tr.CloseIdleConnections)
	return edgev1connect.NewEdgeServiceClient(&http.Client{Transport: tr}, "https://"+e.Addr)
}

func edgeStatus(t *testing.T, e edgev1connect.EdgeServiceClient) *edgev1.NodeStatus {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	st, err := e.Status(ctx, connect.NewRequest(&edgev1.StatusRequest{}))
	if err != nil {
		t.Fatal(err)
	}
	return st.Msg
}

// metric reads a counter from an apiserver's /metrics.
func metric(t *testing.T, a *testutil.Proc, name string) int64 {
	t.Helper()
	resp, err := http.Get("http://" + a.Addr + "/metrics")
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	sc := bufio.NewScanner(resp.Body)
	for sc.Scan() {
		if v, ok := strings.CutPrefix(sc.Text(), name+" "); ok {
			n, err := strconv.ParseInt(v, 10, 64)
			if err != nil {
				t.Fatal(err)
			}
			return n
		}
	}
	t.Fatalf("apiserver %s has no metric %s", a.Name, name)
	return 0
}

// metricSum adds a counter over every apiserver still running.
func metricSum(t *testing.T, apis []*testutil.Proc, name string) int64 {
	t.Helper()
	var n int64
	for _, a := range apis {
		n += metric(t, a, name)
	}
	return n
}

// live lists the live sandboxes of the cluster, through apiserver i.
func live(t *testing.T, c *testutil.Cluster, i int) map[string]bool {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	resp, err := c.Client(i).Sandboxes.List(ctx, connect.NewRequest(&dsecv1.ListRequest{}))
	if err != nil {
		t.Fatal(err)
	}
	out := map[string]bool{}
	for _, sb := range resp.Msg.GetSandboxes() {
		out[sb.GetId()] = true
	}
	return out
}

// TestStoppedEdgeLeaksNothing: an edge frozen (SIGSTOP) while creates are
// in flight to it, longer than the clients wait: the apiservers give those
// creates up and the clients retry elsewhere (keyed) or take the error
// (unkeyed). Once the edge thaws it makes the sandboxes it was asked for;
// reconciliation reaps them, so the sandboxes on all edges are exactly the
// ones acknowledged to clients; and the root's quota (limited, so every
// create is charged) comes back to what lives, none of it held (issue 31:
// an edge dying mid-create is reconciled).
func TestStoppedEdgeLeaksNothing(t *testing.T) {
	pg := testutil.StartPostgres(t)
	c := testutil.StartCluster(t, testutil.ClusterOptions{APIServers: 2, Edges: 3, DB: pg, Registry: true,
		EdgeArgs:      []string{"--runtime", "fake", "--hollow-max-sandboxes", "2000", "--hollow-start-delay", "300ms"},
		APIServerArgs: []string{"--reconcile-interval", "1s"}})
	st, err := store.Open(context.Background(), pg)
	if err != nil {
		t.Fatal(err)
	}
	defer st.Close()
	if err := st.SetLimit(context.Background(), iam.NodeAdmin(), "", store.Sandboxes, 1_000_000); err != nil {
		t.Fatal(err)
	}
	cl := c.ClientAll()
	e1 := edgeClient(t, c, 0)
	const clientWait = 3 * time.Second // shorter than the freeze

	var mu sync.Mutex
	acked := map[string]bool{}
	ack := func(sbs []*dsecv1.Sandbox) {
		mu.Lock()
		defer mu.Unlock()
		for _, sb := range sbs {
			if acked[sb.GetId()] {
				t.Errorf("sandbox %s acknowledged twice", sb.GetId())
			}
			acked[sb.GetId()] = true
		}
	}
	create := func(req *dsecv1.CreateRequest) ([]*dsecv1.Sandbox, error) {
		ctx, cancel := context.WithTimeout(context.Background(), clientWait)
		defer cancel()
		resp, err := cl.Sandboxes.Create(ctx, connect.NewRequest(req))
		if err != nil {
			return nil, err
		}
		return resp.Msg.GetSandboxes(), nil
	}
	stop := make(chan struct{})
	var wg sync.WaitGroup
	var unkeyedFailed int
	spec := &dsecv1.SandboxSpec{Environment: "base:1"}
	for w := range 6 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for r := 0; ; r++ {
				select {
				case <-stop:
					return
				default:
				}
				if w%2 == 0 {
					// Unkeyed: no retry; a failure may leave a sandbox behind.
					sbs, err := create(&dsecv1.CreateRequest{Spec: spec, Count: 2})
					if err != nil {
						mu.Lock()
						unkeyedFailed++
						mu.Unlock()
						continue
					}
					ack(sbs)
					continue
				}
				req := &dsecv1.CreateRequest{Spec: spec, Count: 3, IdempotencyKey: fmt.Sprintf("w%d-r%d", w, r)}
				deadline := time.Now().Add(60 * time.Second)
				for {
					sbs, err := create(req)
					if err == nil {
						ack(sbs)
						break
					}
					if time.Now().After(deadline) {
						t.Errorf("request %s never acknowledged: %v", req.IdempotencyKey, err)
						return
					}
					time.Sleep(100 * time.Millisecond)
				}
			}
		}()
	}
	// Freeze e1 while it is in the middle of creates.
	testutil.WaitFor(t, 20*time.Second, "e1 starts creates", func() bool { return edgeStatus(t, e1).GetCreating() > 0 })
	c.Edges[0].Stop()
	time.Sleep(clientWait + 2*time.Second)
	c.Edges[0].Cont()
	// The burst goes on with e1 back, then ends.
	time.Sleep(2 * time.Second)
	close(stop)
	wg.Wait()
	if t.Failed() {
		return
	}

	// Reconciliation (every second, and when e1 returned) reaps what the
	// given-up creates made.
	var got map[string]bool
	deadline := time.Now().Add(20 * time.Second)
	for {
		got = live(t, c, 0)
		if len(got) == len(acked) && edgeStatus(t, e1).GetCreating() == 0 {
			break
		}
		if time.Now().After(deadline) {
			break
		}
		time.Sleep(200 * time.Millisecond)
	}
	for id := range got {
		if !acked[id] {
			t.Errorf("sandbox %s lives, but no client was told of it (leaked)", id)
		}
	}
	for id := range acked {
		if !got[id] {
			t.Errorf("acknowledged sandbox %s is gone (lost)", id)
		}
	}
	rootUse := func() int64 {
		qs, err := st.Quota(context.Background(), "")
		if err != nil {
			t.Fatal(err)
		}
		return qs[0].Used[store.Sandboxes]
	}
	for deadline := time.Now().Add(30 * time.Second); ; {
		u, h := rootUse(), held(t, st, "")
		if u == int64(len(got)) && h == 0 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("the root's use is %d sandboxes (%d held) with %d live, 30 s after the burst", u, h, len(got))
		}
		time.Sleep(200 * time.Millisecond)
	}
	reaped := metricSum(t, c.APIServers, "dsec_reconcile_sandboxes_reaped_total")
	doubts := metricSum(t, c.APIServers, "dsec_reconcile_doubts_recorded_total")
	if reaped == 0 {
		t.Errorf("nothing was reaped (%d doubts recorded): the freeze caught no create in flight", doubts)
	}
	t.Logf("%d sandboxes acknowledged, %d live; %d unkeyed creates failed; %d doubts recorded, %d sandboxes reaped",
		len(acked), len(got), unkeyedFailed, doubts, reaped)
}

// TestKilledApiserverKeyedCreateReaped: an apiserver SIGKILLed in the
// middle of a keyed batch, with no client retrying: the edges finish the
// creates they had, nobody owns those sandboxes, and the reservation is
// pending with no one to renew it. After --abandon-after the other
// apiserver abandons it, the sandboxes are reaped on every edge, and the
// key is free for a new create, which stays.
func TestKilledApiserverKeyedCreateReaped(t *testing.T) {
	pg := testutil.StartPostgres(t)
	c := testutil.StartCluster(t, testutil.ClusterOptions{APIServers: 2, Edges: 2, DB: pg, Registry: true,
		EdgeArgs:      []string{"--runtime", "fake", "--hollow-max-sandboxes", "400", "--hollow-start-delay", "1s"},
		APIServerArgs: []string{"--abandon-after", "2s", "--reconcile-interval", "500ms"}})
	meta, err := store.Open(context.Background(), pg)
	if err != nil {
		t.Fatal(err)
	}
	defer meta.Close()
	edges := []edgev1connect.EdgeServiceClient{edgeClient(t, c, 0), edgeClient(t, c, 1)}
	count := func(f func(*edgev1.NodeStatus) int32) int32 {
		var n int32
		for _, e := range edges {
			n += f(edgeStatus(t, e))
		}
		return n
	}
	req := &dsecv1.CreateRequest{Spec: &dsecv1.SandboxSpec{Environment: "base:1"}, Count: 16, IdempotencyKey: "orphaned"}
	sent := make(chan error, 1)
	go func() {
		_, err := c.Client(0).Sandboxes.Create(context.Background(), connect.NewRequest(req))
		sent <- err
	}()
	testutil.WaitFor(t, 10*time.Second, "the edges start the batch", func() bool { return count((*edgev1.NodeStatus).GetCreating) > 0 })
	c.APIServers[0].Kill()
	if err := <-sent; err == nil {
		t.Fatal("the create through the killed apiserver succeeded")
	}
	// The edges finish what they were sent: sandboxes nobody owns.
	testutil.WaitFor(t, 10*time.Second, "the orphans are made", func() bool { return count((*edgev1.NodeStatus).GetLive) > 0 })
	orphans := count((*edgev1.NodeStatus).GetLive)
	r, err := meta.Reservation(context.Background(), "orphaned")
	if err != nil || r.State != store.StatePending || r.Owner != "api1" {
		t.Fatalf("the killed apiserver's reservation: %+v, %v", r, err)
	}
	abandonedAt := time.Now()
	testutil.WaitFor(t, 15*time.Second, "the orphans are reaped", func() bool { return count((*edgev1.NodeStatus).GetLive) == 0 })
	if _, err := meta.Reservation(context.Background(), "orphaned"); !errors.Is(err, errdefs.ErrNotFound) {
		t.Fatalf("the reservation after abandonment: %v", err)
	}
	t.Logf("%d orphans reaped %s after they were counted", orphans, time.Since(abandonedAt).Round(100*time.Millisecond))
	if n := metric(t, c.APIServers[1], "dsec_reconcile_reservations_abandoned_total"); n != 1 {
		t.Errorf("api2 abandoned %d reservations, want 1", n)
	}

	// The key is free: the request made again gets a new batch, which the
	// doubts left by the old one do not touch.
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	resp, err := c.Client(1).Sandboxes.Create(ctx, connect.NewRequest(req))
	if err != nil {
		t.Fatal(err)
	}
	if n := len(resp.Msg.GetSandboxes()); n != 16 {
		t.Fatalf("the retry made %d sandboxes, want 16", n)
	}
	time.Sleep(1500 * time.Millisecond) // three sweeps
	got := live(t, c, 1)
	for _, sb := range resp.Msg.GetSandboxes() {
		if !got[sb.GetId()] {
			t.Errorf("sandbox %s of the new batch was removed", sb.GetId())
		}
	}
	if len(got) != 16 {
		t.Errorf("%d sandboxes live, want the new batch's 16", len(got))
	}
	testutil.WaitFor(t, 5*time.Second, "every doubt is settled", func() bool {
		ds, err := meta.Doubts(context.Background())
		return err == nil && len(ds) == 0
	})
}

// TestRowsOfRemovedSandboxesCleaned: the store's rows of sandboxes an edge
// no longer has (deleted through the API, or removed on the edge itself, as
// a TTL does) are removed by reconciliation; the others stay.
func TestRowsOfRemovedSandboxesCleaned(t *testing.T) {
	pg := testutil.StartPostgres(t)
	c := testutil.StartCluster(t, testutil.ClusterOptions{APIServers: 1, Edges: 2, DB: pg, Registry: true,
		EdgeArgs: hollow, APIServerArgs: []string{"--reconcile-interval", "500ms"}})
	meta, err := store.Open(context.Background(), pg)
	if err != nil {
		t.Fatal(err)
	}
	defer meta.Close()
	ctx := context.Background()
	resp, err := c.Client(0).Sandboxes.Create(ctx, connect.NewRequest(&dsecv1.CreateRequest{
		Spec: &dsecv1.SandboxSpec{Environment: "base:1"}, Count: 4, IdempotencyKey: "rows"}))
	if err != nil {
		t.Fatal(err)
	}
	sbs := resp.Msg.GetSandboxes()
	rowIDs := func() []string {
		rows, err := meta.SandboxRows(ctx, "rows")
		if err != nil {
			t.Fatal(err)
		}
		var ids []string
		for _, r := range rows {
			ids = append(ids, r.ID)
		}
		return ids
	}
	if ids := rowIDs(); len(ids) != 4 {
		t.Fatalf("rows %v, want 4", ids)
	}
	if _, err := c.Client(0).Sandboxes.Delete(ctx, connect.NewRequest(&dsecv1.DeleteRequest{Id: sbs[0].GetId()})); err != nil {
		t.Fatal(err)
	}
	edge := edgeClient(t, c, slices.IndexFunc(c.Edges, func(p *testutil.Proc) bool { return p.Name == sbs[1].GetNode() }))
	if _, err := edge.Delete(ctx, connect.NewRequest(&dsecv1.DeleteRequest{Id: sbs[1].GetId()})); err != nil {
		t.Fatal(err)
	}
	want := []string{sbs[2].GetId(), sbs[3].GetId()}
	slices.Sort(want)
	testutil.WaitFor(t, 10*time.Second, "the rows of removed sandboxes go", func() bool { return slices.Equal(rowIDs(), want) })
	if n := metric(t, c.APIServers[0], "dsec_reconcile_rows_removed_total"); n != 2 {
		t.Errorf("rows removed: %d, want 2", n)
	}
}

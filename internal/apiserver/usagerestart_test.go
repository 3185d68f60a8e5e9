package apiserver_test

import (
	"context"
	"log/slog"
	"path/filepath"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"connectrpc.com/connect"

	edgev1 "dsec.dev/dsec/api/gen/dsec/edge/v1"
	"dsec.dev/dsec/internal/apiserver"
	"dsec.dev/dsec/internal/apiserver/iamtest"
	"dsec.dev/dsec/internal/edge/edgesvc"
	"dsec.dev/dsec/internal/edge/hollow"
	"dsec.dev/dsec/internal/edge/ledger"
	"dsec.dev/dsec/internal/metrics"
	"dsec.dev/dsec/internal/pullpack"
	"dsec.dev/dsec/internal/store"
	"dsec.dev/dsec/internal/testutil"
	"dsec.dev/dsec/internal/watcher"
)

// restartingEdge is a node whose edge process can be restarted: its Events
// go to the current one (a new ledger, a new epoch), counted with the
// usage records they carry.
type restartingEdge struct {
	*edgesvc.Service
	now          atomic.Pointer[edgesvc.Service]
	pulls, usage atomic.Int64
}

func (e *restartingEdge) Events(ctx context.Context, req *connect.Request[edgev1.EventsRequest]) (*connect.Response[edgev1.EventsResponse], error) {
	resp, err := e.now.Load().Events(ctx, req)
	if err != nil {
		return nil, err
	}
	n := len(resp.Msg.GetUsage())
	if packed := resp.Msg.GetPackedUsage(); len(packed) > 0 {
		if err := pullpack.ReadRecords(packed, func(string, pullpack.Record) { n++ }); err != nil {
			return nil, err
		}
	}
	e.pulls.Add(1)
	e.usage.Add(int64(n))
	return resp, nil
}

// usageRows records the ledger records an apiserver stores with its
// pulls, and how many times each.
type usageRows struct {
	apiserver.EventStore
	mu    sync.Mutex
	rows  map[string]store.UsageRow
	times map[string]int
}

func newUsageRows(st apiserver.EventStore) *usageRows {
	return &usageRows{EventStore: st, rows: map[string]store.UsageRow{}, times: map[string]int{}}
}

func (u *usageRows) PullEvents(ctx context.Context, owner string, to []store.EventPull, evs ...store.Event) (int, error) {
	n, err := u.EventStore.PullEvents(ctx, owner, to, evs...)
	if err != nil {
		return n, err
	}
	u.mu.Lock()
	defer u.mu.Unlock()
	for _, c := range to {
		for _, r := range c.Usage {
			u.rows[r.SandboxID] = r
			u.times[r.SandboxID]++
		}
	}
	return n, nil
}

func (u *usageRows) has(id string) bool {
	u.mu.Lock()
	defer u.mu.Unlock()
	_, ok := u.rows[id]
	return ok
}

// TestUsageNodeRestartedNotDue: with --usage-pull-interval, a pull not due
// that finds the node's ledger in another epoch (its edge restarted)
// stores the whole ledger it carries, and the pulls after it carry none:
// before, every event pull until the interval passed asked with the old
// epoch, which the node answers with its whole ledger, and threw it away.
func TestUsageNodeRestartedNotDue(t *testing.T) {
	ctx := t.Context()
	st, err := store.Open(ctx, filepath.Join(t.TempDir(), "meta.db"))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { st.Close() })
	discard := slog.New(slog.DiscardHandler)
	node := func() (*edgesvc.Service, *ledger.Ledger) {
		l, err := ledger.Open("n1", "", discard)
		if err != nil {
			t.Fatal(err)
		}
		l.SetCheckpoint(time.Millisecond) // each sample below is stored
		svc := edgesvc.New(hollow.New(hollow.Config{Node: "n1"}), nil, discard)
		svc.SetLedger(l)
		return svc, l
	}
	svc1, l1 := node()
	edge := &restartingEdge{Service: svc1}
	edge.now.Store(svc1)
	rows := newUsageRows(st)
	api := apiserver.New(apiserver.Config{Name: "u", Auth: st, IAM: st, Events: rows, Ledger: st, UsagePullEvery: time.Hour, Metrics: metrics.New()},
		st, watcher.NewFixed(watcher.Node{Member: watcher.Member{Name: "n1"}, Edge: edge}), discard)
	// sb-1 is on the node before the first pull: a pull that found the
	// ledger empty would make the next due only an hour later.
	t0 := time.Now()
	l1.Start("sb-1", "", nil, t0, true)
	l1.Observe("sb-1", "", nil, ledger.Sample{At: t0.Add(time.Second), CPUUsec: 1})
	pctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { defer close(done); api.RunEvents(pctx) }()
	t.Cleanup(func() { cancel(); <-done })
	testutil.WaitFor(t, 20*time.Second, "sb-1 stored (a node never pulled is due)", func() bool { return rows.has("sb-1") })

	svc2, l2 := node()
	edge.now.Store(svc2)
	l2.Start("sb-2", "", nil, t0, true)
	l2.Observe("sb-2", "", nil, ledger.Sample{At: t0.Add(time.Second), CPUUsec: 1})
	testutil.WaitFor(t, 20*time.Second, "sb-2 stored: the restarted node's ledger, pulled an hour before the next pull is due", func() bool { return rows.has("sb-2") })
	sent, pulls := edge.usage.Load(), edge.pulls.Load()
	testutil.WaitFor(t, 20*time.Second, "three more pulls", func() bool { return edge.pulls.Load() >= pulls+3 })
	if n := edge.usage.Load() - sent; n != 0 {
		t.Fatalf("the pulls after the new epoch was stored carried %d usage records, want none (nothing changed, nothing due)", n)
	}
}

// TestUsageSoleEnd: a sandbox that ended before any checkpoint reaches
// the store as a sole report (appended, not upserted); another apiserver
// taking the node resumes after it at the cursor stored with it (the
// record is not stored twice); and one that pulls the node's whole ledger
// again (its pull forgotten) appends it a second time without it
// counting twice.
func TestUsageSoleEnd(t *testing.T) {
	for name, dsn := range iamtest.Databases() {
		t.Run(name, func(t *testing.T) { testUsageSoleEnd(t, dsn(t)) })
	}
}

func testUsageSoleEnd(t *testing.T, dsn string) {
	ctx := t.Context()
	st, err := store.Open(ctx, dsn)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { st.Close() })
	discard := slog.New(slog.DiscardHandler)
	l, err := ledger.Open("n1", "", discard)
	if err != nil {
		t.Fatal(err)
	}
	svc := edgesvc.New(hollow.New(hollow.Config{Node: "n1"}), nil, discard)
	svc.SetLedger(l)
	t0 := time.Now().Add(-time.Minute)
	end := func(id string, cpu int64) {
		l.Start(id, "p", map[string]string{"run": "r1"}, t0, true)
		l.Observe(id, "p", nil, ledger.Sample{At: t0.Add(time.Second), CPUUsec: cpu, EgressBytes: 64})
		l.End(id, t0.Add(time.Second))
	}
	// pull runs an apiserver of its own until the sandbox until is
	// stored through it, stops it (its leases given back) and returns
	// what it stored.
	pull := func(name, until string) *usageRows {
		rows := newUsageRows(st)
		api := apiserver.New(apiserver.Config{Name: name, Auth: st, IAM: st, Events: rows, Ledger: st, Metrics: metrics.New()},
			st, watcher.NewFixed(watcher.Node{Member: watcher.Member{Name: "n1"}, Edge: svc}), discard)
		pctx, cancel := context.WithCancel(context.Background())
		done := make(chan struct{})
		go func() { defer close(done); api.RunEvents(pctx) }()
		defer func() { cancel(); <-done }()
		testutil.WaitFor(t, 20*time.Second, until+" stored through "+name, func() bool { return rows.has(until) })
		return rows
	}
	once := func(after string, want int) {
		t.Helper()
		sums, err := st.SumUsage(ctx, store.UsageQuery{By: "sandbox"})
		if err != nil {
			t.Fatal(err)
		}
		if len(sums) != want {
			t.Fatalf("after %s: the store sums %d sandboxes (%+v), want %d", after, len(sums), sums, want)
		}
		for _, s := range sums {
			if s.Key == "sb-1" && (s.Sandboxes != 1 || s.CPUUsec != 2_000_000 || s.EgressBytes != 64) {
				t.Fatalf("after %s: the store sums sb-1 as %+v, want it once, 2 s of CPU, 64 egress bytes", after, s)
			}
		}
	}

	end("sb-1", 2_000_000)
	rows := pull("api-1", "sb-1")
	if r := rows.rows["sb-1"]; !r.Sole || r.CPUUsec != 2_000_000 {
		t.Fatalf("api-1 stored sb-1 as %+v, want its sole report of 2 s of CPU", r)
	}
	once("api-1", 1)

	end("sb-2", 3_000_000)
	rows = pull("api-2", "sb-2")
	if n := rows.times["sb-1"]; n != 0 {
		t.Fatalf("api-2, taking n1 after api-1, stored sb-1 %d times, want none (api-1 stored it, and its cursor with it)", n)
	}
	once("api-2", 2)

	// n1's pull forgotten (as a node that left the fleet): the next
	// apiserver pulls its whole ledger again.
	if _, err := st.ForgetEventPulls(ctx, nil, time.Now().Add(time.Minute)); err != nil {
		t.Fatal(err)
	}
	rows = pull("api-3", "sb-1")
	if r := rows.rows["sb-1"]; !r.Sole || rows.times["sb-1"] != 1 {
		t.Fatalf("api-3 stored sb-1 %d times, as %+v, want once, its sole report", rows.times["sb-1"], r)
	}
	once("api-3", 2)
}

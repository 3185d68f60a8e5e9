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
	if err == nil {
		e.pulls.Add(1)
		e.usage.Add(int64(len(resp.Msg.GetUsage())))
	}
	return resp, err
}

// usageRows records the usage rows an apiserver stores.
type usageRows struct {
	apiserver.LedgerStore
	mu   sync.Mutex
	rows map[string]store.UsageRow
}

func (u *usageRows) PutUsage(ctx context.Context, rows ...store.UsageRow) error {
	u.mu.Lock()
	defer u.mu.Unlock()
	for _, r := range rows {
		u.rows[r.SandboxID] = r
	}
	return u.LedgerStore.PutUsage(ctx, rows...)
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
	rows := &usageRows{LedgerStore: st, rows: map[string]store.UsageRow{}}
	api := apiserver.New(apiserver.Config{Name: "u", Auth: st, IAM: st, Events: st, Ledger: rows, UsagePullEvery: time.Hour, Metrics: metrics.New()},
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
// the store as a sole report (appended, not upserted), and another
// apiserver, which pulls the node's whole ledger again from no cursor,
// appends it a second time without it counting twice.
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
	l.Start("sb-1", "p", map[string]string{"run": "r1"}, t0, true)
	l.Observe("sb-1", "p", nil, ledger.Sample{At: t0.Add(time.Second), CPUUsec: 2_000_000, EgressBytes: 64})
	l.End("sb-1", t0.Add(time.Second))
	// pull runs an apiserver of its own (a cursor of its own) until sb-1
	// is stored through it, and stops it.
	pull := func(name string) store.UsageRow {
		rows := &usageRows{LedgerStore: st, rows: map[string]store.UsageRow{}}
		api := apiserver.New(apiserver.Config{Name: name, Auth: st, IAM: st, Events: st, Ledger: rows, Metrics: metrics.New()},
			st, watcher.NewFixed(watcher.Node{Member: watcher.Member{Name: "n1"}, Edge: svc}), discard)
		pctx, cancel := context.WithCancel(context.Background())
		done := make(chan struct{})
		go func() { defer close(done); api.RunEvents(pctx) }()
		defer func() { cancel(); <-done }()
		testutil.WaitFor(t, 20*time.Second, "sb-1 stored through "+name, func() bool { return rows.has("sb-1") })
		rows.mu.Lock()
		defer rows.mu.Unlock()
		return rows.rows["sb-1"]
	}
	for _, name := range []string{"api-1", "api-2"} {
		if r := pull(name); !r.Sole || r.CPUUsec != 2_000_000 {
			t.Fatalf("%s stored sb-1 as %+v, want its sole report of 2 s of CPU", name, r)
		}
		// The store alone (no node's live rows): sb-1 once.
		sums, err := st.SumUsage(ctx, store.UsageQuery{By: "sandbox"})
		if err != nil {
			t.Fatal(err)
		}
		if len(sums) != 1 || sums[0].Key != "sb-1" || sums[0].Sandboxes != 1 || sums[0].CPUUsec != 2_000_000 || sums[0].EgressBytes != 64 {
			t.Fatalf("after %s: the store sums %+v, want sb-1 once, 2 s of CPU, 64 egress bytes", name, sums)
		}
	}
}

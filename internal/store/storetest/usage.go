package storetest

import (
	"math"
	"testing"
	"time"

	"dsec.dev/dsec/internal/errdefs"
	"dsec.dev/dsec/internal/store"
)

// usageCases are the conformance cases of the cost ledger.
var usageCases = []struct {
	name string
	fn   func(t *testing.T, st store.Store)
}{
	{"Usage", testUsage},
	{"UsageExpire", testUsageExpire},
	{"UsageLive", testUsageLive},
	{"UsageSole", testUsageSole},
}

// usageReplicaCases need two Stores on one database.
var usageReplicaCases = []struct {
	name string
	fn   func(t *testing.T, a, b store.Store)
}{
	{"UsageTwoWriters", testReplicasUsage},
}

func usageRow(id, project string, labels map[string]string, started, ended time.Time, cpu int64) store.UsageRow {
	return store.UsageRow{Key: id, SandboxID: id, Project: project, Labels: labels, Node: "n1", Started: started, Ended: ended,
		Updated: started, Usage: store.Usage{CPUUsec: cpu, MemoryGiBSec: float64(cpu) / 1e6, DiskGiBHours: 0.5, DiskPeakBytes: cpu,
			SnapshotBytes: 10, EgressBytes: 100, FnCallCalls: 0}}
}

func sumsOf(t *testing.T, st store.Store, q store.UsageQuery) map[string]store.Usage {
	t.Helper()
	sums, err := st.SumUsage(t.Context(), q)
	must(t, "SumUsage", err)
	out := map[string]store.Usage{}
	for i, s := range sums {
		if i > 0 && sums[i-1].Key >= s.Key {
			t.Fatalf("SumUsage: keys out of order: %q then %q", sums[i-1].Key, s.Key)
		}
		out[s.Key] = s.Usage
	}
	return out
}

// testUsage: rows sum by project subtree, sandbox, node and label over a
// window; a report put again, or an older one after a newer, changes
// nothing; an end stays.
func testUsage(t *testing.T, st store.Store) {
	ctx := t.Context()
	t0 := ms(time.Now().Add(-time.Hour))
	run1 := map[string]string{"run": "r1", "task": "t1"}
	run2 := map[string]string{"run": "r2", "task": "t1"}
	must(t, "PutUsage", st.PutUsage(ctx,
		usageRow("sb-1", "a", run1, t0, t0.Add(time.Minute), 1_000_000),
		usageRow("sb-2", "a/b", run1, t0, time.Time{}, 2_000_000),
		usageRow("sb-3", "ab", run2, t0.Add(30*time.Minute), time.Time{}, 4_000_000),
		store.UsageRow{Key: "fncall/api-1/a", Project: "a", Started: t0, Updated: t0, Usage: store.Usage{FnCallCalls: 7}},
	))
	// sb-1 again, older (less CPU, no end): nothing moves back.
	old := usageRow("sb-1", "a", run1, t0, time.Time{}, 500_000)
	must(t, "PutUsage again", st.PutUsage(ctx, old))
	all := sumsOf(t, st, store.UsageQuery{})
	if got := all["a"]; got.CPUUsec != 1_000_000 || got.Sandboxes != 1 || got.FnCallCalls != 7 || got.EgressBytes != 100 {
		t.Fatalf("project a: %+v, want 1 s of CPU, one sandbox, 7 FnCall calls, 100 egress bytes", got)
	}
	by := sumsOf(t, st, store.UsageQuery{Projects: []string{"a"}, By: "label:run"})
	if len(by) != 2 || by["r1"].CPUUsec != 3_000_000 || by["r1"].Sandboxes != 2 || by[""].FnCallCalls != 7 {
		t.Fatalf("project a by run: %+v", by)
	}
	if got := by["r1"].MemoryGiBSec; math.Abs(got-3) > 1e-9 {
		t.Fatalf("r1's memory: %v GiB-s, want 3", got)
	}
	task := sumsOf(t, st, store.UsageQuery{By: "label:task"})
	if task["t1"].CPUUsec != 7_000_000 || task["t1"].SnapshotBytes != 30 || task["t1"].DiskGiBHours != 1.5 {
		t.Fatalf("by task: %+v", task)
	}
	sbs := sumsOf(t, st, store.UsageQuery{By: "sandbox"})
	if len(sbs) != 4 || sbs["sb-3"].CPUUsec != 4_000_000 {
		t.Fatalf("by sandbox: %+v", sbs)
	}
	// sb-1 ended before the window: out; sb-3 started after its end: out.
	win := sumsOf(t, st, store.UsageQuery{Since: t0.Add(2 * time.Minute), Until: t0.Add(10 * time.Minute), By: "sandbox"})
	if len(win) != 2 || win["sb-2"].CPUUsec == 0 || win[""].FnCallCalls != 7 {
		t.Fatalf("window: %+v, want sb-2 and the FnCall counter", win)
	}
	if n := sumsOf(t, st, store.UsageQuery{Projects: []string{"ab"}}); len(n) != 1 || n["ab"].CPUUsec != 4_000_000 {
		t.Fatalf("project ab: %+v", n)
	}
	_, err := st.SumUsage(ctx, store.UsageQuery{By: "colour"})
	wantKind(t, "SumUsage by an unknown grouping", err, errdefs.ErrInvalidArgument)
	_, err = st.SumUsage(ctx, store.UsageQuery{Projects: []string{"../x"}})
	wantKind(t, "SumUsage of a bad path", err, errdefs.ErrInvalidArgument)
	wantKind(t, "PutUsage without a key", st.PutUsage(ctx, store.UsageRow{SandboxID: "x"}), errdefs.ErrInvalidArgument)

	// Two reports of one sandbox in one call count as if put one after
	// the other: the larger figures, the end.
	must(t, "PutUsage of one key twice", st.PutUsage(ctx,
		usageRow("sb-4", "d", nil, t0, time.Time{}, 2_000_000),
		usageRow("sb-5", "d", nil, t0, time.Time{}, 1_000_000),
		usageRow("sb-4", "d", nil, t0.Add(time.Minute), t0.Add(5*time.Minute), 1_000_000)))
	if d := sumsOf(t, st, store.UsageQuery{Projects: []string{"d"}, By: "sandbox"}); len(d) != 2 || d["sb-4"].CPUUsec != 2_000_000 || d["sb-5"].CPUUsec != 1_000_000 {
		t.Fatalf("project d after one key twice in a call: %+v, want sb-4 at 2 s of CPU, sb-5 at 1 s", d)
	}
	if late := sumsOf(t, st, store.UsageQuery{Projects: []string{"d"}, Since: t0.Add(6 * time.Minute), By: "sandbox"}); len(late) != 1 || late["sb-5"].CPUUsec == 0 {
		t.Fatalf("project d after sb-4's end: %+v, want sb-5 alone (sb-4 ended)", late)
	}
}

// testUsageLive: the nodes' live rows read at query time count in place
// of the stored rows of their keys (each figure the larger of the two:
// the store's checkpoint, or a live row older than it, counts no more),
// or alone where none is stored, by the query's projects and window.
func testUsageLive(t *testing.T, st store.Store) {
	ctx := t.Context()
	t0 := ms(time.Now().Add(-time.Hour))
	run := map[string]string{"run": "r1"}
	must(t, "PutUsage", st.PutUsage(ctx,
		usageRow("sb-ended", "a", run, t0, t0.Add(time.Minute), 1_000_000),
		usageRow("sb-ckpt", "a", run, t0, time.Time{}, 2_000_000),
		usageRow("sb-stale", "a", run, t0, time.Time{}, 8_000_000),
	))
	live := []store.UsageRow{
		usageRow("sb-ckpt", "a", run, t0, time.Time{}, 3_000_000),                      // grew since its checkpoint
		usageRow("sb-stale", "a", run, t0, time.Time{}, 7_000_000),                     // behind the store (a node that lost its last round)
		usageRow("sb-new", "a/b", run, t0.Add(time.Minute), time.Time{}, 4_000_000),    // no checkpoint yet
		usageRow("sb-other", "other", run, t0, time.Time{}, 16_000_000),                // another project
		usageRow("sb-late", "a", run, t0.Add(50*time.Minute), time.Time{}, 32_000_000), // after the window below
	}
	got := sumsOf(t, st, store.UsageQuery{Projects: []string{"a"}, By: "label:run", Live: live})
	want := int64(1_000_000 + 3_000_000 + 8_000_000 + 4_000_000 + 32_000_000)
	if got["r1"].CPUUsec != want || got["r1"].Sandboxes != 5 {
		t.Fatalf("project a by run with the live rows: %+v, want %d µs of CPU over 5 sandboxes", got["r1"], want)
	}
	sbs := sumsOf(t, st, store.UsageQuery{By: "sandbox", Live: live})
	if len(sbs) != 6 || sbs["sb-ckpt"].CPUUsec != 3_000_000 || sbs["sb-stale"].CPUUsec != 8_000_000 || sbs["sb-new"].Sandboxes != 1 {
		t.Fatalf("by sandbox with the live rows: %+v", sbs)
	}
	win := sumsOf(t, st, store.UsageQuery{Projects: []string{"a"}, Since: t0.Add(2 * time.Minute), Until: t0.Add(40 * time.Minute), By: "sandbox", Live: live})
	if len(win) != 3 || win["sb-new"].CPUUsec != 4_000_000 || win["sb-ckpt"].CPUUsec != 3_000_000 {
		t.Fatalf("window with the live rows: %+v, want sb-ckpt, sb-stale and sb-new", win)
	}
	// Nothing live: the stored rows alone.
	if got := sumsOf(t, st, store.UsageQuery{Projects: []string{"a"}}); got["a"].CPUUsec != 11_000_000 {
		t.Fatalf("project a without live rows: %+v", got)
	}
}

// testUsageSole: a sandbox's sole report (its end, nothing offered
// before it) counts as any report does: put twice, in one call or two,
// or beside an ordinary report of its key (a node's whole ledger pulled
// again), its sandbox counts once at each figure's largest; windows,
// labels, live rows and the expiry see it as they see the other rows.
func testUsageSole(t *testing.T, st store.Store) {
	ctx := t.Context()
	t0 := ms(time.Now().Add(-48 * time.Hour))
	run := map[string]string{"run": "r1"}
	sole := func(id string, ended time.Time, cpu int64) store.UsageRow {
		r := usageRow(id, "s", run, t0, ended, cpu)
		r.Sole = true
		return r
	}
	must(t, "PutUsage", st.PutUsage(ctx, sole("sb-1", t0.Add(time.Minute), 1_000_000), sole("sb-2", t0.Add(time.Hour), 2_000_000),
		sole("sb-1", t0.Add(time.Minute), 1_000_000)))
	must(t, "PutUsage again", st.PutUsage(ctx, sole("sb-2", t0.Add(time.Hour), 2_000_000)))
	// Sole without an end is an ordinary report (a live sandbox's).
	must(t, "PutUsage of a live sole", st.PutUsage(ctx, sole("sb-live", time.Time{}, 4_000_000)))
	got := sumsOf(t, st, store.UsageQuery{Projects: []string{"s"}, By: "label:run"})
	if got["r1"].CPUUsec != 7_000_000 || got["r1"].Sandboxes != 3 || got["r1"].EgressBytes != 300 {
		t.Fatalf("project s by run: %+v, want 7 s of CPU, 3 sandboxes, 300 egress bytes (each sandbox once)", got["r1"])
	}
	// An ordinary report of sb-1 beside its sole ones: the larger figures.
	must(t, "PutUsage of an ordinary report", st.PutUsage(ctx, usageRow("sb-1", "s", run, t0, t0.Add(time.Minute), 1_500_000)))
	sbs := sumsOf(t, st, store.UsageQuery{Projects: []string{"s"}, By: "sandbox"})
	if len(sbs) != 3 || sbs["sb-1"].CPUUsec != 1_500_000 || sbs["sb-1"].Sandboxes != 1 || sbs["sb-2"].CPUUsec != 2_000_000 {
		t.Fatalf("project s by sandbox: %+v, want sb-1 once at 1.5 s of CPU, sb-2 at 2 s", sbs)
	}
	// sb-1 ended before the window, sb-2 within it.
	win := sumsOf(t, st, store.UsageQuery{Projects: []string{"s"}, Since: t0.Add(10 * time.Minute), By: "sandbox"})
	if len(win) != 2 || win["sb-2"].CPUUsec != 2_000_000 || win["sb-live"].CPUUsec != 4_000_000 {
		t.Fatalf("window: %+v, want sb-2 and sb-live", win)
	}
	// A live row of an ended sandbox (a node holds it a minute after its
	// end) counts in place of its sole report, at the larger figures.
	live := sumsOf(t, st, store.UsageQuery{Projects: []string{"s"}, By: "sandbox", Live: []store.UsageRow{sole("sb-2", t0.Add(time.Hour), 3_000_000)}})
	if live["sb-2"].CPUUsec != 3_000_000 || live["sb-2"].Sandboxes != 1 {
		t.Fatalf("sb-2 with its live row: %+v", live["sb-2"])
	}
	// Both ended 47 hours ago: expired with the ordinary rows, each
	// report counted (sb-1's ordinary row, and the four sole reports put).
	if n, err := st.ExpireUsage(ctx, time.Now().Add(-24*time.Hour)); err != nil || n != 5 {
		t.Fatalf("ExpireUsage: %d rows, %v; want 5", n, err)
	}
	left := sumsOf(t, st, store.UsageQuery{Projects: []string{"s"}, By: "sandbox"})
	if len(left) != 1 || left["sb-live"].CPUUsec != 4_000_000 {
		t.Fatalf("after expiry: %+v, want sb-live alone", left)
	}
}

// testUsageExpire: rows of sandboxes that ended before the cut go, live
// ones stay whatever their age.
func testUsageExpire(t *testing.T, st store.Store) {
	ctx := t.Context()
	t0 := ms(time.Now().Add(-48 * time.Hour))
	must(t, "PutUsage", st.PutUsage(ctx,
		usageRow("sb-old", "a", nil, t0, t0.Add(time.Hour), 1),
		usageRow("sb-live", "a", nil, t0, time.Time{}, 2),
		usageRow("sb-new", "a", nil, t0, time.Now(), 4),
	))
	n, err := st.ExpireUsage(ctx, time.Now().Add(-24*time.Hour))
	must(t, "ExpireUsage", err)
	if n != 1 {
		t.Fatalf("ExpireUsage removed %d rows, want 1", n)
	}
	left := sumsOf(t, st, store.UsageQuery{By: "sandbox"})
	if _, ok := left["sb-old"]; ok || len(left) != 2 {
		t.Fatalf("after expiry: %+v", left)
	}
}

// testReplicasUsage: two stores putting the same sandbox's reports in
// either order keep the largest figures.
func testReplicasUsage(t *testing.T, a, b store.Store) {
	ctx := t.Context()
	t0 := ms(time.Now())
	done := make(chan error, 1)
	go func() {
		var err error
		for i := int64(1); i <= 20 && err == nil; i++ {
			err = a.PutUsage(ctx, usageRow("sb-r", "p", nil, t0, time.Time{}, i*2))
		}
		done <- err
	}()
	for i := int64(1); i <= 20; i++ {
		must(t, "PutUsage on b", b.PutUsage(ctx, usageRow("sb-r", "p", nil, t0, time.Time{}, i*2-1)))
	}
	must(t, "PutUsage on a", <-done)
	if got := sumsOf(t, a, store.UsageQuery{})["p"]; got.CPUUsec != 40 {
		t.Fatalf("CPU after both: %d, want 40", got.CPUUsec)
	}
}

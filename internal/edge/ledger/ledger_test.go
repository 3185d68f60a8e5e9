package ledger

import (
	"log/slog"
	"math"
	"path/filepath"
	"testing"
	"time"
)

// TestObserve: CPU and egress add up the counters' growth (a counter
// made again counts from 0), memory and disk integrate the mean of two
// samples over the time between, a pooled sandbox counts from its claim,
// and an ended one keeps its last sample.
func TestObserve(t *testing.T) {
	l, err := Open("n1", "", slog.Default())
	if err != nil {
		t.Fatal(err)
	}
	t0 := time.Unix(1000, 0)
	l.Start("sb-1", "p", map[string]string{"run": "r1"}, t0, true)
	l.Observe("sb-1", "p", nil, Sample{At: t0.Add(2 * time.Second), CPUUsec: 500, MemoryBytes: 1 << 30, DiskBytes: 2 << 30, EgressBytes: 100})
	l.Observe("sb-1", "p", nil, Sample{At: t0.Add(4 * time.Second), CPUUsec: 800, MemoryBytes: 1 << 30, DiskBytes: 2 << 30, EgressBytes: 150})
	// The cgroup made again (a VM resumed from disk): counters from 0.
	l.Observe("sb-1", "p", nil, Sample{At: t0.Add(6 * time.Second), CPUUsec: 50, MemoryBytes: 3 << 30, DiskBytes: 2 << 30, EgressBytes: 10})
	l.End("sb-1", t0.Add(6*time.Second))
	r, ok := l.Get("sb-1")
	if !ok {
		t.Fatal("no record")
	}
	// 0→1 GiB over 2 s, 1 GiB over 2 s, 1→3 GiB over 2 s: 1 + 2 + 4.
	if r.CPUUsec != 850 || r.EgressBytes != 160 || math.Abs(r.MemoryGiBSec-7) > 1e-9 {
		t.Fatalf("CPU %d, egress %d, memory %v GiB-s; want 850, 160, 7", r.CPUUsec, r.EgressBytes, r.MemoryGiBSec)
	}
	// 0→2 GiB over 2 s, then 2 GiB over 4 s: 10 GiB-s.
	if math.Abs(r.DiskGiBHours-10.0/3600) > 1e-12 || r.DiskPeakBytes != 2<<30 {
		t.Fatalf("disk %v GiB-h, peak %d", r.DiskGiBHours, r.DiskPeakBytes)
	}
	if r.Labels["run"] != "r1" || !r.Ended.Equal(t0.Add(6*time.Second)) {
		t.Fatalf("labels %v, ended %v", r.Labels, r.Ended)
	}

	// From a warm pool: the first sample is the base.
	l.Start("sb-2", "p", nil, t0, false)
	l.Observe("sb-2", "p", nil, Sample{At: t0.Add(time.Second), CPUUsec: 9000, EgressBytes: 70})
	l.Observe("sb-2", "p", nil, Sample{At: t0.Add(2 * time.Second), CPUUsec: 9100, EgressBytes: 75})
	if r, _ := l.Get("sb-2"); r.CPUUsec != 100 || r.EgressBytes != 5 {
		t.Fatalf("pooled: CPU %d, egress %d; want 100, 5", r.CPUUsec, r.EgressBytes)
	}
}

// TestChanged: a pull gets the records changed after its version, all of
// them from another epoch; the ledger survives a save and an open.
func TestChanged(t *testing.T) {
	path := filepath.Join(t.TempDir(), "ledger.json")
	l, err := Open("n1", path, slog.Default())
	if err != nil {
		t.Fatal(err)
	}
	t0 := time.Now()
	l.Start("sb-1", "p", nil, t0, true)
	l.Start("sb-2", "p", nil, t0, true)
	// A start alone has nothing to store: no version, nothing to pull.
	if recs, _, next := l.Changed("", 0); len(recs) != 0 || next != 0 {
		t.Fatalf("pull after the starts: %d records to %d, want none", len(recs), next)
	}
	l.Observe("sb-1", "p", nil, Sample{At: t0.Add(time.Second), CPUUsec: 1})
	l.Observe("sb-2", "p", nil, Sample{At: t0.Add(time.Second), CPUUsec: 2})
	recs, epoch, next := l.Changed("", 0)
	if len(recs) != 2 || next != 2 {
		t.Fatalf("first pull: %d records to %d, want 2 to 2", len(recs), next)
	}
	l.Observe("sb-2", "p", nil, Sample{At: t0.Add(2 * time.Second), CPUUsec: 7})
	recs, _, next = l.Changed(epoch, next)
	if len(recs) != 1 || recs[0].GetSandboxId() != "sb-2" || recs[0].GetUsage().GetCpuUsec() != 7 || next != 3 {
		t.Fatalf("second pull: %v to %d", recs, next)
	}
	// An older change pulled again from its version, with the newer.
	l.Observe("sb-1", "p", nil, Sample{At: t0.Add(2 * time.Second), CPUUsec: 3})
	if recs, _, _ := l.Changed(epoch, next-1); len(recs) != 2 {
		t.Fatalf("pull from version %d: %v, want sb-2 and sb-1", next-1, recs)
	}
	_, _, next = l.Changed(epoch, next)
	if recs, _, _ := l.Changed(epoch, next); len(recs) != 0 {
		t.Fatalf("nothing new: %v", recs)
	}
	l.End("sb-1", t0.Add(-2*Keep))
	if err := l.Save(t0); err != nil {
		t.Fatal(err)
	}
	l2, err := Open("n1", path, slog.Default())
	if err != nil {
		t.Fatal(err)
	}
	recs, epoch2, _ := l2.Changed(epoch, next)
	if epoch2 == epoch || len(recs) != 1 || recs[0].GetUsage().GetCpuUsec() != 7 {
		t.Fatalf("after a restart: epoch %s (was %s), %v; want a new epoch and sb-2 alone (sb-1 ended long ago)", epoch2, epoch, recs)
	}
	// Integration goes on from the saved sample.
	l2.Observe("sb-2", "p", nil, Sample{At: t0.Add(3 * time.Second), CPUUsec: 10})
	if r, _ := l2.Get("sb-2"); r.CPUUsec != 10 {
		t.Fatalf("after a restart: CPU %d, want 10", r.CPUUsec)
	}
	var nilLedger *Ledger
	nilLedger.Observe("x", "", nil, Sample{})
	if _, seq := nilLedger.Head(); seq != 0 {
		t.Fatal("a nil ledger has a version")
	}
}

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
	l.SetCheckpoint(time.Second) // each sample below is a checkpoint
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

// TestCheckpoint: a live sandbox's samples are offered to the pulls once
// each checkpoint, its end and a snapshot at once; Live reads every live
// record as it stands (and those just ended) of a project and those under
// it.
func TestCheckpoint(t *testing.T) {
	l, err := Open("n1", "", slog.Default())
	if err != nil {
		t.Fatal(err)
	}
	t0 := time.Now()
	l.Start("sb-1", "ml/run", map[string]string{"run": "r1"}, t0, true)
	l.Start("sb-2", "ml", nil, t0, true)
	l.Start("sb-3", "other", nil, t0, true)
	labels := map[string]string{"run": "r1"}
	for i := 1; i <= 10; i++ {
		at := t0.Add(time.Duration(i) * 10 * time.Second)
		l.Observe("sb-1", "ml/run", labels, Sample{At: at, CPUUsec: int64(i) * 100})
		l.Observe("sb-2", "ml", nil, Sample{At: at, CPUUsec: int64(i)})
		l.Observe("sb-3", "other", nil, Sample{At: at, CPUUsec: int64(i)})
	}
	if recs, _, next := l.Changed("", 0); len(recs) != 0 || next != 0 {
		t.Fatalf("100 s of samples, before a checkpoint: %d records to pull (version %d), want none", len(recs), next)
	}
	live := l.Live([]string{"/ml"}, t0.Add(100*time.Second))
	if len(live) != 2 {
		t.Fatalf("live of ml: %v, want sb-1 and sb-2", live)
	}
	for _, r := range live {
		if r.GetSandboxId() == "sb-1" && (r.GetUsage().GetCpuUsec() != 1000 || r.GetLabels()["run"] != "r1") {
			t.Fatalf("sb-1 live: %v, want 1000 µs of CPU and its labels", r)
		}
	}
	if n := len(l.Live(nil, t0.Add(100*time.Second))); n != 3 {
		t.Fatalf("live of every project: %d, want 3", n)
	}
	// The checkpoint: sb-1's sample DefaultCheckpoint after its start.
	l.Observe("sb-1", "ml/run", labels, Sample{At: t0.Add(DefaultCheckpoint), CPUUsec: 2000})
	recs, epoch, next := l.Changed("", 0)
	if len(recs) != 1 || recs[0].GetSandboxId() != "sb-1" || recs[0].GetUsage().GetCpuUsec() != 2000 {
		t.Fatalf("after sb-1's checkpoint: %v, want sb-1 at 2000 µs", recs)
	}
	// Its next sample waits for the next checkpoint; sb-2's end does not.
	l.Observe("sb-1", "ml/run", labels, Sample{At: t0.Add(DefaultCheckpoint + 10*time.Second), CPUUsec: 2100})
	l.Observe("sb-2", "ml", nil, Sample{At: t0.Add(DefaultCheckpoint + 10*time.Second), CPUUsec: 50})
	l.End("sb-2", t0.Add(DefaultCheckpoint+10*time.Second))
	recs, _, next = l.Changed(epoch, next)
	if len(recs) != 1 || recs[0].GetSandboxId() != "sb-2" || recs[0].GetUsage().GetCpuUsec() != 50 || recs[0].GetEndedUnixMs() == 0 {
		t.Fatalf("after sb-2's end: %v, want sb-2 ended at 50 µs", recs)
	}
	// Live reads an ended record for LiveEnded after its end, and after
	// that for as long as the store is not known to hold it.
	ended := t0.Add(DefaultCheckpoint + 10*time.Second)
	if n := len(l.Live([]string{"ml"}, ended.Add(LiveEnded/2))); n != 2 {
		t.Fatalf("live of ml just after sb-2's end: %d, want 2", n)
	}
	if n := len(l.Live([]string{"ml"}, ended.Add(2*LiveEnded))); n != 2 {
		t.Fatalf("live of ml long after sb-2's end, no pull past it: %d, want 2", n)
	}
	// A pull asks past sb-2's end: StoredAfter later the store holds it.
	l.Changed(epoch, next)
	if err := l.Save(time.Now().Add(StoredAfter + time.Second)); err != nil {
		t.Fatal(err)
	}
	if n := len(l.Live([]string{"ml"}, ended.Add(LiveEnded/2))); n != 2 {
		t.Fatalf("live of ml just after sb-2's end, stored: %d, want 2", n)
	}
	if n := len(l.Live([]string{"ml"}, ended.Add(2*LiveEnded))); n != 1 {
		t.Fatalf("live of ml long after sb-2's end, stored: %d, want 1", n)
	}
}

// BenchmarkObserve is one sample of a live sandbox between checkpoints,
// what a node pays per sandbox each ledger interval.
func BenchmarkObserve(b *testing.B) {
	l, err := Open("n1", "", slog.Default())
	if err != nil {
		b.Fatal(err)
	}
	labels := map[string]string{"dsec.dev/project": "ml", "run": "r1"}
	t0 := time.Now()
	l.Start("sb-1", "ml", labels, t0, true)
	b.ReportAllocs()
	for i := range b.N {
		l.Observe("sb-1", "ml", labels, Sample{At: t0.Add(time.Duration(i) * time.Millisecond), CPUUsec: int64(i)})
	}
}

// TestObserveAll: a round observed at once is what observing each of its
// samples in turn makes, a sandbox the ledger did not know included.
func TestObserveAll(t *testing.T) {
	t0 := time.Unix(1000, 0)
	round := func(at time.Duration, cpu int64) []Observation {
		return []Observation{
			{ID: "sb-1", Project: "p", Labels: map[string]string{"run": "r1"}, Sample: Sample{At: t0.Add(at), CPUUsec: cpu, MemoryBytes: 1 << 30}},
			{ID: "sb-new", Project: "q", Sample: Sample{At: t0.Add(at), CPUUsec: 2 * cpu, DiskBytes: 1 << 30}},
		}
	}
	each, err := Open("n1", "", slog.Default())
	if err != nil {
		t.Fatal(err)
	}
	all, err := Open("n1", "", slog.Default())
	if err != nil {
		t.Fatal(err)
	}
	for _, l := range []*Ledger{each, all} {
		l.Start("sb-1", "p", map[string]string{"run": "r1"}, t0, true)
	}
	for i, at := range []time.Duration{2 * time.Second, 4 * time.Second} {
		obs := round(at, int64(100*(i+1)))
		for _, o := range obs {
			each.Observe(o.ID, o.Project, o.Labels, o.Sample)
		}
		all.ObserveAll(obs)
	}
	for _, id := range []string{"sb-1", "sb-new"} {
		a, ok := each.Get(id)
		b, ok2 := all.Get(id)
		if !ok || !ok2 {
			t.Fatalf("%s: kept %v one at a time, %v at once", id, ok, ok2)
		}
		if a.CPUUsec != b.CPUUsec || a.MemoryGiBSec != b.MemoryGiBSec || a.DiskGiBHours != b.DiskGiBHours || a.Project != b.Project ||
			!a.Updated.Equal(b.Updated) || a.CPUUsec == 0 {
			t.Fatalf("%s: one at a time %+v, at once %+v", id, a, b)
		}
	}
	var nilLedger *Ledger
	nilLedger.ObserveAll(round(time.Second, 1)) // records nothing, and does not panic
}

// TestInMemoryDrops: a ledger kept in memory only drops what ended more
// than Keep ago at each Save, and nothing else, however its records came
// and went (a round with nothing ended reads none of them).
func TestInMemoryDrops(t *testing.T) {
	l, err := Open("n1", "", slog.Default())
	if err != nil {
		t.Fatal(err)
	}
	t0 := time.Now()
	l.Start("z", "p", nil, t0, true)
	l.End("z", t0.Add(-2*Keep))
	if err := l.Save(t0); err != nil {
		t.Fatal(err)
	}
	if _, ok := l.Get("z"); ok {
		t.Error("z kept past Keep")
	}
	for _, id := range []string{"a", "b", "c"} {
		l.Start(id, "p", nil, t0, true)
	}
	l.End("a", t0.Add(-2*Keep))
	l.Start("a", "p", nil, t0, true) // made again under the same ID: a new record
	l.End("b", t0.Add(-2*Keep))
	l.End("c", t0)
	if err := l.Save(t0); err != nil {
		t.Fatal(err)
	}
	for id, kept := range map[string]bool{"a": true, "b": false, "c": true} {
		if _, ok := l.Get(id); ok != kept {
			t.Errorf("after a save: %s kept %v, want %v", id, ok, kept)
		}
	}
	if err := l.Save(t0.Add(Keep + time.Second)); err != nil {
		t.Fatal(err)
	}
	if _, ok := l.Get("c"); ok {
		t.Error("c kept past Keep")
	}
	if _, ok := l.Get("a"); !ok {
		t.Error("a, live, dropped")
	}
	l.End("a", t0)
	if err := l.Save(t0.Add(Keep + time.Second)); err != nil {
		t.Fatal(err)
	}
	if _, ok := l.Get("a"); ok {
		t.Error("a kept past Keep")
	}
}

// TestSole: a sandbox's end is its sole report when nothing of it was
// offered before (no checkpoint, no snapshot, made by Start in this run
// of the ledger); a checkpointed, snapshotted, adopted or reloaded one's
// end is not, so the store never appends an end beside a stored
// checkpoint of its key.
func TestSole(t *testing.T) {
	path := filepath.Join(t.TempDir(), "ledger.json")
	l, err := Open("n1", path, slog.Default())
	if err != nil {
		t.Fatal(err)
	}
	l.SetCheckpoint(time.Minute)
	t0 := time.Unix(1000, 0)
	for _, id := range []string{"short", "ckpt", "snap", "reloaded"} {
		l.Start(id, "p", nil, t0, true)
		l.Observe(id, "p", nil, Sample{At: t0.Add(time.Second), CPUUsec: 10})
	}
	l.Observe("ckpt", "p", nil, Sample{At: t0.Add(2 * time.Minute), CPUUsec: 20}) // a checkpoint
	l.AddSnapshot("snap", 1<<20)
	// Sampled with no Start: a sandbox a restarted edge adopted.
	l.Observe("adopted", "p", nil, Sample{At: t0.Add(time.Second), CPUUsec: 10})
	for _, id := range []string{"short", "ckpt", "snap", "adopted"} {
		l.End(id, t0.Add(3*time.Minute))
	}
	want := map[string]bool{"short": true, "ckpt": false, "snap": false, "adopted": false}
	recs, epoch, next := l.Changed("", 0)
	for _, r := range recs {
		if w, ok := want[r.GetSandboxId()]; ok && r.GetSole() != w {
			t.Errorf("%s: sole %v, want %v", r.GetSandboxId(), r.GetSole(), w)
		}
		delete(want, r.GetSandboxId())
	}
	if len(want) != 0 {
		t.Fatalf("not pulled: %v", want)
	}

	// Read back from its file, a live record's end is not sole (its
	// record was offered in the new epoch); an ended one stays as it was.
	if err := l.Save(t0.Add(3 * time.Minute)); err != nil {
		t.Fatal(err)
	}
	l2, err := Open("n1", path, slog.Default())
	if err != nil {
		t.Fatal(err)
	}
	l2.End("reloaded", t0.Add(4*time.Minute))
	recs, _, _ = l2.Changed(epoch, next)
	got := map[string]bool{}
	for _, r := range recs {
		got[r.GetSandboxId()] = r.GetSole()
	}
	if s, ok := got["reloaded"]; !ok || s {
		t.Fatalf("reloaded: pulled %v, sole %v; want pulled, not sole", ok, s)
	}
	if !got["short"] || got["ckpt"] {
		t.Fatalf("ended before the reload: short sole %v, ckpt sole %v; want true, false", got["short"], got["ckpt"])
	}
}

// TestReloadedDrops: the records a ledger read back from its file are
// dropped Keep after their ends as its own are, oldest first, whatever
// order the file held them in.
func TestReloadedDrops(t *testing.T) {
	path := filepath.Join(t.TempDir(), "ledger.json")
	l, err := Open("n1", path, slog.Default())
	if err != nil {
		t.Fatal(err)
	}
	t0 := time.Now()
	ends := map[string]time.Time{"late": t0, "early": t0.Add(-time.Minute), "live": {}}
	for id, at := range ends {
		l.Start(id, "p", nil, t0.Add(-time.Hour), true)
		if !at.IsZero() {
			l.End(id, at)
		}
	}
	if err := l.Save(t0); err != nil {
		t.Fatal(err)
	}
	l, err = Open("n1", path, slog.Default())
	if err != nil {
		t.Fatal(err)
	}
	for _, step := range []struct {
		at   time.Time
		kept map[string]bool
	}{
		{t0, map[string]bool{"late": true, "early": true, "live": true}},
		{t0.Add(Keep - time.Second), map[string]bool{"late": true, "early": false, "live": true}},
		{t0.Add(Keep + time.Second), map[string]bool{"late": false, "early": false, "live": true}},
	} {
		if err := l.Save(step.at); err != nil {
			t.Fatal(err)
		}
		for id, kept := range step.kept {
			if _, ok := l.Get(id); ok != kept {
				t.Errorf("a save at t0+%s: %s kept %v, want %v", step.at.Sub(t0), id, ok, kept)
			}
		}
	}
}

// TestEndQueue: the queue of ends gives back what it was given in order,
// across its chunks, however pushes and pops interleave.
func TestEndQueue(t *testing.T) {
	var q endQueue
	next, want := int64(0), int64(0)
	for round := range 7 {
		for range endChunk/2 + round*1000 {
			q.push(ending{at: next})
			next++
		}
		for range endChunk / 3 {
			d, ok := q.front()
			if !ok || d.at != want {
				t.Fatalf("round %d: front %d (%v), want %d", round, d.at, ok, want)
			}
			q.pop()
			want++
		}
	}
	for ; want < next; want++ {
		if d, ok := q.front(); !ok || d.at != want {
			t.Fatalf("front %d (%v), want %d", d.at, ok, want)
		}
		q.pop()
	}
	if _, ok := q.front(); ok || len(q.chunks) != 0 {
		t.Errorf("emptied queue holds %d chunks", len(q.chunks))
	}
}

// TestStoredDrops: an ended record is dropped once the store holds it (a
// pull asked after a version at or past its end's at least StoredAfter
// before the save) and LiveEnded has passed since its end, not before
// either; a pull not due (asking after the largest version) or of another
// epoch says nothing of what the store holds.
func TestStoredDrops(t *testing.T) {
	l, err := Open("n1", "", slog.Default())
	if err != nil {
		t.Fatal(err)
	}
	t0 := time.Now()
	for _, id := range []string{"a", "b", "c"} {
		l.Start(id, "p", nil, t0, true)
	}
	l.End("a", t0)
	l.End("b", t0)
	epoch, _ := l.Head()
	kept := func(at time.Time, want map[string]bool) {
		t.Helper()
		if err := l.Save(at); err != nil {
			t.Fatal(err)
		}
		for id, k := range want {
			if _, ok := l.Get(id); ok != k {
				t.Errorf("save at t0+%s: %s kept %v, want %v", at.Sub(t0), id, ok, k)
			}
		}
	}
	// Pulls that say nothing: not due, another epoch.
	l.ChangedPacked(epoch, math.MaxUint64, nil)
	l.ChangedPacked("another", 0, nil)
	kept(t0.Add(10*time.Minute), map[string]bool{"a": true, "b": true, "c": true})

	// A pull stores up to b's end (the store's cursor past it): asked now,
	// taken for stored StoredAfter later.
	_, _, _, next := l.ChangedPacked(epoch, 0, nil)
	l.ChangedPacked(epoch, next, nil)
	asked := time.Now()
	l.End("c", time.Now())
	kept(asked.Add(StoredAfter/2), map[string]bool{"a": true, "b": true, "c": true})
	kept(asked.Add(StoredAfter+time.Second), map[string]bool{"a": false, "b": false, "c": true})
	// c's end is past the version asked: it waits for the next ask, or Keep.
	_, _, _, next = l.ChangedPacked(epoch, next, nil)
	l.ChangedPacked(epoch, next, nil)
	at := time.Now()
	kept(at.Add(StoredAfter+time.Second), map[string]bool{"c": false})
}

// TestFinish: Finish is the last sample and the end at its time, as
// Observe then End: the figures the sample brings, the record ended and
// offered to the pulls once.
func TestFinish(t *testing.T) {
	l, err := Open("n1", "", slog.Default())
	if err != nil {
		t.Fatal(err)
	}
	t0 := time.Now()
	l.Start("sb-1", "p", nil, t0, true)
	l.Finish("sb-1", "p", nil, Sample{At: t0.Add(3 * time.Second), CPUUsec: 700, EgressBytes: 9})
	r, ok := l.Get("sb-1")
	if !ok || !r.Ended.Equal(t0.Add(3*time.Second)) || r.CPUUsec != 700 || r.EgressBytes != 9 {
		t.Fatalf("after Finish: %+v, %v; want ended at its sample, 700 µs of CPU, 9 bytes out", r, ok)
	}
	if recs, _, _ := l.Changed("", 0); len(recs) != 1 || recs[0].GetEndedUnixMs() != t0.Add(3*time.Second).UnixMilli() || !recs[0].GetSole() {
		t.Fatalf("pulled after Finish: %v; want sb-1's sole end", recs)
	}
}

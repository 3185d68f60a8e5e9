package store

import (
	"errors"
	"fmt"
	"math"
	"reflect"
	"testing"
	"time"
)

// TestEndPacks: sole ends go into packs by project, endPackMax at most to
// a pack, each with its records' earliest start and latest end, and come
// back out of a pack as they went in (labels as the labels column's JSON).
func TestEndPacks(t *testing.T) {
	t0 := time.UnixMilli(1_700_000_000_000)
	var rows []UsageRow
	for i := range 2*endPackMax + 10 {
		project := "a"
		if i%3 == 0 {
			project = "b/c"
		}
		rows = append(rows, UsageRow{Key: fmt.Sprintf("n1/sb-%d", i), SandboxID: fmt.Sprintf("sb-%d", i), Project: project,
			Labels: map[string]string{"run": "r1", "step": fmt.Sprint(i % 7), "quote": `"é"`}, Node: "n1",
			Started: t0.Add(time.Duration(i) * time.Millisecond), Ended: t0.Add(time.Hour - time.Duration(i)*time.Millisecond),
			Updated: t0.Add(time.Hour), Sole: true, Usage: Usage{CPUUsec: int64(i) * 1000, MemoryGiBSec: float64(i) / 3, DiskGiBHours: math.Pi,
				DiskPeakBytes: -1, SnapshotBytes: math.MaxInt64, EgressBytes: 0, FnCallCalls: int64(i)}})
	}
	packs := packEnds(rows)
	byKey := map[string]UsageRow{}
	for _, r := range rows {
		byKey[r.Key] = r
	}
	seen := map[string]UsageRow{}
	for _, p := range packs {
		if p.n == 0 || p.n > endPackMax {
			t.Fatalf("a pack of %d records; want 1 to %d", p.n, endPackMax)
		}
		n := 0
		var started, ended time.Time
		err := decodeEnds(p.project, p.records, func(r *UsageRow, labels string) {
			n++
			if r.Project != p.project {
				t.Errorf("%s in a pack of %s", r.Key, p.project)
			}
			if started.IsZero() || r.Started.Before(started) {
				started = r.Started
			}
			if r.Ended.After(ended) {
				ended = r.Ended
			}
			if want := string(appendLabelsJSON(nil, byKey[r.Key].Labels)); labels != want {
				t.Errorf("labels of %s: %s, want %s", r.Key, labels, want)
			}
			seen[r.Key] = *r
		})
		if err != nil || n != p.n {
			t.Fatalf("pack of %s: %d records, %v; want %d", p.project, n, err, p.n)
		}
		if !started.Equal(p.started) || !ended.Equal(p.ended) {
			t.Errorf("pack of %s spans %s–%s; its records %s–%s", p.project, p.started, p.ended, started, ended)
		}
	}
	// Project a's 1,372 records in two packs, b/c's 686 in one.
	if len(packs) != 3 || len(seen) != len(rows) {
		t.Fatalf("%d packs of %d records; want 3 of %d", len(packs), len(seen), len(rows))
	}
	for _, r := range rows {
		got := seen[r.Key]
		r.Labels = nil
		if !reflect.DeepEqual(got, r) {
			t.Fatalf("record %s came back as %+v; went in as %+v", r.Key, got, r)
		}
	}
}

// TestEndPackCorrupt: a pack cut anywhere, or of an unknown format,
// fails to decode with errEndPack, not a panic or a record made up.
func TestEndPackCorrupt(t *testing.T) {
	t0 := time.UnixMilli(1_700_000_000_000)
	rows := []UsageRow{{Key: "n1/sb-1", SandboxID: "sb-1", Project: "p", Labels: map[string]string{"run": "r"}, Node: "n1", Started: t0, Ended: t0.Add(time.Second), Updated: t0,
		Usage: Usage{CPUUsec: 5, MemoryGiBSec: 1.5}, Sole: true}}
	b := packEnds(rows)[0].records
	for cut := 0; cut < len(b); cut++ {
		n := 0
		err := decodeEnds("p", b[:cut], func(*UsageRow, string) { n++ })
		if !errors.Is(err, errEndPack) && !(cut == 1 && err == nil && n == 0) {
			t.Fatalf("pack cut at %d of %d bytes: %v after %d records; want errEndPack", cut, len(b), err, n)
		}
	}
	bad := append([]byte{endPackFormat + 1}, b[1:]...)
	if err := decodeEnds("p", bad, func(*UsageRow, string) {}); !errors.Is(err, errEndPack) {
		t.Fatalf("pack of format %d: %v; want errEndPack", bad[0], err)
	}
}

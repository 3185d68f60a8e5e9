package eventlog

import (
	"fmt"
	"slices"
	"testing"
)

func keys(l *Log, from, to int) []string {
	var out []string
	for i := from; i <= to; i++ {
		out = append(out, fmt.Sprintf("n1/%s/%d", l.epoch, i))
	}
	return out
}

// TestRead: events come back in order from a cursor, in pages; a cursor of
// another epoch reads from the oldest kept; past the capacity the oldest
// are dropped and counted as lost.
func TestRead(t *testing.T) {
	l := New("n1", 4)
	if e, s := l.Head(); e == "" || s != 0 {
		t.Fatalf("Head of an empty log: %q %d", e, s)
	}
	for i := range 3 {
		l.Add(Created, fmt.Sprintf("sb-%d", i), "p", "", "")
	}
	read := func(epoch string, after uint64, limit int) ([]string, uint64, uint64) {
		evs, next, lost := l.Read(epoch, after, limit)
		var got []string
		for _, e := range evs {
			got = append(got, e.GetKey())
		}
		return got, next, lost
	}
	check := func(what string, got []string, next, lost uint64, want []string, wantNext, wantLost uint64) {
		t.Helper()
		if !slices.Equal(got, want) || next != wantNext || lost != wantLost {
			t.Fatalf("%s: got %q next %d lost %d, want %q next %d lost %d", what, got, next, lost, want, wantNext, wantLost)
		}
	}
	got, next, lost := read(l.Epoch(), 0, 10)
	check("all", got, next, lost, keys(l, 1, 3), 3, 0)
	got, next, lost = read(l.Epoch(), 1, 1)
	check("a page", got, next, lost, keys(l, 2, 2), 2, 0)
	got, next, lost = read(l.Epoch(), 3, 10)
	check("nothing new", got, next, lost, nil, 3, 0)
	got, next, lost = read("other", 2, 10)
	check("another epoch", got, next, lost, keys(l, 1, 3), 3, 0)
	for i := 3; i < 7; i++ {
		l.Add(Deleted, fmt.Sprintf("sb-%d", i), "p", "", "")
	}
	got, next, lost = read(l.Epoch(), 1, 10)
	check("past the capacity", got, next, lost, keys(l, 4, 7), 7, 2)
	if _, s := l.Head(); s != 7 {
		t.Fatalf("Head's seq %d, want 7", s)
	}
	evs, _, _ := l.Read(l.Epoch(), 6, 1)
	if e := evs[0]; e.GetKind() != Deleted || e.GetSandboxId() != "sb-6" || e.GetProject() != "p" || e.GetNode() != "n1" || e.GetAtUnixMs() == 0 {
		t.Fatalf("event 7: %v", e)
	}
	if New("n1", 4).Epoch() == l.Epoch() {
		t.Fatal("two logs share an epoch")
	}
	var nilLog *Log
	nilLog.Add(Created, "sb", "", "", "")
	if evs, next, _ := nilLog.Read("", 5, 10); evs != nil || next != 5 {
		t.Fatalf("a nil log read %v next %d", evs, next)
	}
}

// BenchmarkAdd is what recording one event costs the edge (a create or a
// delete records one).
func BenchmarkAdd(b *testing.B) {
	l := New("n1", 0)
	for b.Loop() {
		l.Add(Created, "sb-n1-0a1b2c3d4e5f", "ml/run-1", "", "")
	}
}

package eventlog

import (
	"bytes"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
)

// open opens n1's log in dir in boot, logging to what.
func open(t *testing.T, dir, boot string, capacity int, what *bytes.Buffer) *Log {
	t.Helper()
	o := Options{Capacity: capacity, BootID: boot}
	if what != nil {
		o.Log = slog.New(slog.NewTextHandler(what, nil))
	}
	l, err := Open("n1", dir, o)
	if err != nil {
		t.Fatalf("Open: %v", err)
	}
	return l
}

// add records n events of sandboxes sb-FROM…
func add(l *Log, from, n int) {
	for i := range n {
		l.Add(Created, fmt.Sprintf("sb-%d", from+i), "p", "", "")
	}
}

// all reads every event l keeps: their keys, and how many it lost.
func all(l *Log) ([]string, uint64) {
	evs, _, lost := l.Read(l.Epoch(), 0, 1<<20)
	var out []string
	for _, e := range evs {
		out = append(out, e.GetKey()+" "+e.GetSandboxId())
	}
	return out, lost
}

// want is what all returns for events FROM..TO (sandbox sb-(seq-1)).
func want(l *Log, from, to int) []string {
	var out []string
	for seq := from; seq <= to; seq++ {
		out = append(out, fmt.Sprintf("n1/%s/%d sb-%d", l.Epoch(), seq, seq-1))
	}
	return out
}

// TestReopen: a log opened again in its directory (its edge killed: never
// closed) goes on in its epoch at the next sequence number, its events
// there to read, in the same boot; after the machine restarted only if it
// was closed; else, and for another node's files, in a new epoch.
func TestReopen(t *testing.T) {
	dir := t.TempDir()
	l := open(t, dir, "boot-1", 8, nil)
	add(l, 0, 5)
	epoch := l.Epoch()
	// Killed: no Close.
	l2 := open(t, dir, "boot-1", 8, nil)
	if e, s := l2.Head(); e != epoch || s != 5 {
		t.Fatalf("reopened: epoch %q seq %d, want %q 5", e, s, epoch)
	}
	add(l2, 5, 2)
	if got, lost := all(l2); !slices.Equal(got, want(l2, 1, 7)) || lost != 0 {
		t.Fatalf("reopened and added to: %q lost %d, want %q", got, lost, want(l2, 1, 7))
	}
	if err := l2.Close(); err != nil {
		t.Fatal(err)
	}
	l2.Add(Deleted, "sb-late", "p", "", "")
	if _, s := l2.Head(); s != 7 {
		t.Fatalf("an Add after Close was recorded: seq %d", s)
	}
	// Closed, then the machine restarted: it goes on.
	l3 := open(t, dir, "boot-2", 8, nil)
	if got, _ := all(l3); l3.Epoch() != epoch || !slices.Equal(got, want(l3, 1, 7)) {
		t.Fatalf("closed and reopened in another boot: epoch %q %q, want %q %q", l3.Epoch(), got, epoch, want(l3, 1, 7))
	}
	add(l3, 7, 1)
	// Not closed, and the machine restarted: a new epoch, empty.
	var said bytes.Buffer
	l4 := open(t, dir, "boot-3", 8, &said)
	if e, s := l4.Head(); e == epoch || s != 0 || !strings.Contains(said.String(), "new epoch") {
		t.Fatalf("killed and reopened in another boot: epoch %q seq %d (was %q), said %q; want a new epoch, empty, and a word", e, s, epoch, said.String())
	}
	add(l4, 0, 2)
	if got, _ := all(l4); !slices.Equal(got, want(l4, 1, 2)) {
		t.Fatalf("the new epoch's events: %q", got)
	}
	// Another node's directory.
	other, err := Open("n2", dir, Options{Capacity: 8, BootID: "boot-3"})
	if err != nil {
		t.Fatal(err)
	}
	if e, s := other.Head(); e == l4.Epoch() || s != 0 {
		t.Fatalf("n2 opened n1's log: epoch %q seq %d", e, s)
	}
}

// TestTornTail: a last record cut short (the edge killed mid-write), or
// followed by zeros (a machine crash's tail), is dropped with a word and
// the log goes on after the whole ones; the next start reads them all.
func TestTornTail(t *testing.T) {
	for _, tail := range []struct {
		name string
		cut  func(rec []byte) []byte
	}{
		{"short", func(rec []byte) []byte { return rec[:len(rec)-3] }},
		{"frame only", func(rec []byte) []byte { return rec[:5] }},
		{"zeros", func(rec []byte) []byte { return make([]byte, 4096) }},
		{"bad crc", func(rec []byte) []byte { r := slices.Clone(rec); r[len(r)-1] ^= 0xff; return r }},
	} {
		t.Run(tail.name, func(t *testing.T) {
			dir := t.TempDir()
			l := open(t, dir, "b", 8, nil)
			add(l, 0, 3)
			rec := slices.Clone(l.rec)
			f, err := os.OpenFile(filepath.Join(dir, segmentName), os.O_WRONLY|os.O_APPEND, 0)
			if err != nil {
				t.Fatal(err)
			}
			f.Write(tail.cut(rec))
			f.Close()
			var said bytes.Buffer
			l2 := open(t, dir, "b", 8, &said)
			if l2.Epoch() != l.Epoch() || !strings.Contains(said.String(), "torn") {
				t.Fatalf("epoch %q (was %q), said %q", l2.Epoch(), l.Epoch(), said.String())
			}
			add(l2, 3, 2)
			l3 := open(t, dir, "b", 8, nil)
			if got, _ := all(l3); l3.Epoch() != l.Epoch() || !slices.Equal(got, want(l3, 1, 5)) {
				t.Fatalf("after the torn tail: %q, want %q", got, want(l3, 1, 5))
			}
		})
	}
}

// TestCorrupt: a segment damaged before its end (a record's bytes changed,
// a header not a log's) does not stop the log: it starts a new epoch,
// says so, and keeps the file aside.
func TestCorrupt(t *testing.T) {
	for _, damage := range []struct {
		name string
		at   func(data []byte) int
	}{
		{"a record", func(data []byte) int { return len(data) / 2 }},
		{"the header", func(data []byte) int { return frameLen + 2 }},
	} {
		t.Run(damage.name, func(t *testing.T) {
			dir := t.TempDir()
			l := open(t, dir, "b", 8, nil)
			add(l, 0, 4)
			path := filepath.Join(dir, segmentName)
			data, err := os.ReadFile(path)
			if err != nil {
				t.Fatal(err)
			}
			data[damage.at(data)] ^= 0x5a
			if err := os.WriteFile(path, data, 0o600); err != nil {
				t.Fatal(err)
			}
			var said bytes.Buffer
			l2 := open(t, dir, "b", 8, &said)
			if e, s := l2.Head(); e == l.Epoch() || s != 0 || !strings.Contains(said.String(), "corrupt") {
				t.Fatalf("a corrupt segment: epoch %q seq %d (was %q), said %q; want a new epoch, empty, and a word", e, s, l.Epoch(), said.String())
			}
			if kept, err := os.ReadFile(filepath.Join(dir, corruptName)); err != nil || !bytes.Equal(kept, data) {
				t.Fatalf("the corrupt segment was not kept aside: %v", err)
			}
			add(l2, 0, 1)
			if got, _ := all(open(t, dir, "b", 8, nil)); !slices.Equal(got, want(l2, 1, 1)) {
				t.Fatalf("the new epoch after it: %q", got)
			}
		})
	}
}

// TestCapacity: the directory holds at most two segments of Capacity
// events, however many are added; a reopened log keeps the last Capacity
// and counts the older as lost to a cursor before them; a rotation cut
// short (the current segment renamed, no new one yet) loses nothing.
func TestCapacity(t *testing.T) {
	dir := t.TempDir()
	l := open(t, dir, "b", 4, nil)
	add(l, 0, 11)
	var size int64
	for i := range 50 {
		add(l, 11+i, 1)
		names, _ := filepath.Glob(filepath.Join(dir, "log*"))
		var now int64
		for _, n := range names {
			fi, _ := os.Stat(n)
			now += fi.Size()
		}
		if i == 1 {
			size = now
		}
		if len(names) > 2 || i > 1 && now > size+size/2 {
			t.Fatalf("after %d events the log's files are %q, %d bytes (%d at 13)", 12+i, names, now, size)
		}
	}
	l2 := open(t, dir, "b", 4, nil)
	got, lost := all(l2)
	if !slices.Equal(got, want(l2, 58, 61)) || lost != 57 {
		t.Fatalf("reopened: %q lost %d, want %q lost 57", got, lost, want(l2, 58, 61))
	}
	if _, evs, err := ReadDir(dir); err != nil || len(evs) < 4 || len(evs) > 8 {
		t.Fatalf("ReadDir: %d events, %v", len(evs), err)
	}
	// A rotation cut short: only the previous segment is there.
	add(l2, 61, 3) // seq 62..64: the current segment holds 4 now
	if err := os.Rename(filepath.Join(dir, segmentName), filepath.Join(dir, previousName)); err != nil {
		t.Fatal(err)
	}
	l3 := open(t, dir, "b", 4, nil)
	if got, _ := all(l3); l3.Epoch() != l.Epoch() || !slices.Equal(got, want(l3, 61, 64)) {
		t.Fatalf("after a rotation cut short: %q, want %q", got, want(l3, 61, 64))
	}
	add(l3, 64, 1)
	if got, _ := all(open(t, dir, "b", 4, nil)); !slices.Equal(got, want(l3, 62, 65)) {
		t.Fatalf("after a rotation cut short and an event more: %q, want %q", got, want(l3, 62, 65))
	}
}

// BenchmarkAddFile is what recording one event costs an edge whose log is
// on its disk (one write a event, no fsync), beside BenchmarkAdd's memory.
func BenchmarkAddFile(b *testing.B) {
	l, err := Open("n1", b.TempDir(), Options{BootID: "b"})
	if err != nil {
		b.Fatal(err)
	}
	defer l.Close()
	for b.Loop() {
		l.Add(Created, "sb-n1-0a1b2c3d4e5f", "ml/run-1", "", "")
	}
}

// TestWriteFails: a log whose file cannot be written goes on in memory
// and removes its files, so the next start begins a new epoch rather
// than number events again that an apiserver may have pulled; so does a
// directory whose state file is gone.
func TestWriteFails(t *testing.T) {
	dir := t.TempDir()
	l := open(t, dir, "b", 8, nil)
	add(l, 0, 2)
	ro, err := os.Open(filepath.Join(dir, segmentName))
	if err != nil {
		t.Fatal(err)
	}
	l.f.Close()
	l.f = ro // a write to it fails, as on a full or failed disk
	var said bytes.Buffer
	l.log = slog.New(slog.NewTextHandler(&said, nil))
	add(l, 2, 2)
	if got, _ := all(l); !slices.Equal(got, want(l, 1, 4)) || !strings.Contains(said.String(), "cannot write") {
		t.Fatalf("after a failed write: %q, said %q", got, said.String())
	}
	if names, _ := filepath.Glob(filepath.Join(dir, "*")); len(names) != 0 {
		t.Fatalf("after a failed write the log's files remain: %q", names)
	}
	if e, s := open(t, dir, "b", 8, nil).Head(); e == l.Epoch() || s != 0 {
		t.Fatalf("reopened after a failed write: epoch %q seq %d (was %q)", e, s, l.Epoch())
	}

	dir = t.TempDir()
	l = open(t, dir, "b", 8, nil)
	add(l, 0, 2)
	if err := os.Remove(filepath.Join(dir, stateName)); err != nil {
		t.Fatal(err)
	}
	if e, s := open(t, dir, "b", 8, nil).Head(); e == l.Epoch() || s != 0 {
		t.Fatalf("reopened without its state: epoch %q seq %d (was %q)", e, s, l.Epoch())
	}
}

package pullpack

import (
	"errors"
	"fmt"
	"maps"
	"reflect"
	"testing"
)

// TestRoundTrip: what a Writer packs, Read gives back in order, numbered
// from the first, times going back and forth, empty and odd strings.
func TestRoundTrip(t *testing.T) {
	var evs []Event
	for i := range 300 {
		evs = append(evs, Event{AtUnixMs: 1_700_000_000_000 + int64(i%5)*1000 - int64(i%3)*7000, Kind: []string{"created", "deleted", "expired"}[i%3],
			SandboxID: fmt.Sprintf("sb-%d", i), Project: []string{"", "/ml", "/ml/tëam\x00"}[i%3], Reason: []string{"", "ttl"}[i%2],
			Message: fmt.Sprintf("its TTL of %ds ran out", i%4)})
	}
	w := NewWriter(make([]byte, 3), "node-7", 41)
	for i := range evs {
		w.Add(&evs[i])
	}
	if w.Len() != len(evs) {
		t.Fatalf("Len %d, want %d", w.Len(), len(evs))
	}
	var got []Event
	err := Read(w.Bytes(), func(node string, seq uint64, e Event) {
		if node != "node-7" || seq != 41+uint64(len(got)) {
			t.Fatalf("event %d read as node %q number %d", len(got), node, seq)
		}
		got = append(got, e)
	})
	if err != nil {
		t.Fatal(err)
	}
	if len(got) != len(evs) {
		t.Fatalf("read %d events, want %d", len(got), len(evs))
	}
	for i := range evs {
		if got[i] != evs[i] {
			t.Fatalf("event %d read as %+v, want %+v", i, got[i], evs[i])
		}
	}
	// An empty page reads as none.
	if err := Read(NewWriter(nil, "n", 1).Bytes(), func(string, uint64, Event) { t.Fatal("an event in an empty page") }); err != nil {
		t.Fatal(err)
	}
}

// FuzzRead: no input makes Read panic, and what it refuses is
// ErrMalformed.
func FuzzRead(f *testing.F) {
	w := NewWriter(nil, "n1", 7)
	w.Add(&Event{AtUnixMs: 5, Kind: "created", SandboxID: "sb", Project: "/p", Message: "m"})
	f.Add(w.Bytes())
	f.Add([]byte{})
	f.Add([]byte{format, 0, 1, 0xff, 0xff, 0xff, 0xff})
	f.Fuzz(func(t *testing.T, data []byte) {
		if err := Read(data, func(string, uint64, Event) {}); err != nil && !errors.Is(err, ErrMalformed) {
			t.Fatalf("Read: %v, not ErrMalformed", err)
		}
	})
}

// TestRecordsRoundTrip: what a RecordWriter packs, ReadRecords gives back
// in order, every figure, live and ended, labels in any order read as one
// map where they are the same, and a page cut anywhere is refused.
func TestRecordsRoundTrip(t *testing.T) {
	var recs []Record
	for i := range 50 {
		r := Record{SandboxID: fmt.Sprintf("sb-%d", i), Project: []string{"", "/ml/team"}[i%2], StartedUnixMs: 1_700_000_000_000 + int64(i),
			UpdatedUnixMs: 1_700_000_100_000, CPUUsec: int64(i) * 1_000_003, MemoryGiBSeconds: 0.1 * float64(i), DiskGiBHours: 1e-9 * float64(i),
			DiskPeakBytes: int64(i) << 20, SnapshotBytes: int64(i%3) << 30, EgressBytes: -1 + int64(i%2)}
		switch i % 4 {
		case 1:
			r.Labels = map[string]string{"dsec.dev/project": "/ml/team", "run": "grpo-7", "b": "", "a": "x"}
		case 2:
			r.Labels = map[string]string{"run": "grpo-7", "a": "x", "dsec.dev/project": "/ml/team", "b": ""}
		case 3:
			r.Labels = map[string]string{"run": fmt.Sprint(i)}
		}
		if i%3 != 0 {
			r.EndedUnixMs, r.Sole = r.UpdatedUnixMs, i%2 == 0
		}
		recs = append(recs, r)
	}
	w := NewRecordWriter(nil, "node-7")
	for i := range recs {
		w.Add(&recs[i])
	}
	var got []Record
	err := ReadRecords(w.Bytes(), func(node string, r Record) {
		if node != "node-7" {
			t.Fatalf("record %d read as node %q's", len(got), node)
		}
		got = append(got, r)
	})
	if err != nil {
		t.Fatal(err)
	}
	if len(got) != len(recs) {
		t.Fatalf("read %d records, want %d", len(got), len(recs))
	}
	for i := range recs {
		a, b := got[i], recs[i]
		if !maps.Equal(a.Labels, b.Labels) || (a.Labels == nil) != (b.Labels == nil) {
			t.Fatalf("record %d's labels read as %v, want %v", i, a.Labels, b.Labels)
		}
		a.Labels, b.Labels = nil, nil
		if !reflect.DeepEqual(a, b) {
			t.Fatalf("record %d read as %+v, want %+v", i, a, b)
		}
	}
	if reflect.ValueOf(got[1].Labels).UnsafePointer() != reflect.ValueOf(got[2].Labels).UnsafePointer() {
		t.Error("the same labels in another order read as two maps")
	}
	page := w.Bytes()
	if n := RecordCount(page); n != len(recs) {
		t.Fatalf("RecordCount: %d, want %d", n, len(recs))
	}
	// A page that claims more records than it has bytes for, or is not
	// a page at all, gets no room made for it.
	if n := RecordCount([]byte{format, 0, 0xff, 0xff, 0xff, 0xff, 1, 2}); n != 2 {
		t.Fatalf("RecordCount of a page claiming 2^32-1 records in 2 bytes: %d, want 2", n)
	}
	for _, bad := range [][]byte{nil, {format}, {format, 0, 0}, {0x7f, 0, 0, 0, 0, 1}} {
		if n := RecordCount(bad); n != 0 {
			t.Fatalf("RecordCount(%v): %d, want 0", bad, n)
		}
	}
	for cut := range len(page) - 1 {
		if err := ReadRecords(page[:cut+1], func(string, Record) {}); err == nil {
			t.Fatalf("a page cut at %d of %d bytes reads", cut+1, len(page))
		}
	}
	if err := ReadRecords(append(page, 0), func(string, Record) {}); err == nil {
		t.Fatal("a page with a byte past its end reads")
	}
}

// FuzzReadRecords: no input makes ReadRecords panic, and what it refuses
// is ErrMalformed.
func FuzzReadRecords(f *testing.F) {
	w := NewRecordWriter(nil, "n1")
	w.Add(&Record{SandboxID: "sb", Project: "/p", Labels: map[string]string{"run": "r"}, EndedUnixMs: 9, Sole: true})
	f.Add(w.Bytes())
	f.Add([]byte{format, 0, 0, 0, 0, 9})
	f.Fuzz(func(t *testing.T, data []byte) {
		if err := ReadRecords(data, func(string, Record) {}); err != nil && !errors.Is(err, ErrMalformed) {
			t.Fatalf("ReadRecords: %v, not ErrMalformed", err)
		}
	})
}

package pullpack

import (
	"errors"
	"fmt"
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

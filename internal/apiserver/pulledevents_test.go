package apiserver

import (
	"fmt"
	"log/slog"
	"maps"
	"reflect"
	"slices"
	"testing"
	"time"

	edgev1 "dsec.dev/dsec/api/gen/dsec/edge/v1"
	"dsec.dev/dsec/internal/edge/eventlog"
	"dsec.dev/dsec/internal/edge/ledger"
	"dsec.dev/dsec/internal/store"
	"google.golang.org/protobuf/proto"
)

// TestPulledEventsPackedOrNot: a page of a node's events reads the same
// packed (what the pulls ask for) and as messages (what an edge that
// predates packing answers): keys, times, nodes and every field, pages
// that start past the oldest kept, after a wrap of the log's ring, and
// across another epoch's cursor.
func TestPulledEventsPackedOrNot(t *testing.T) {
	l := eventlog.New("n1", 64)
	for i := range 150 {
		kind, why, msg := eventlog.Created, "", ""
		if i%3 == 2 {
			kind, why, msg = eventlog.Expired, "ttl", fmt.Sprintf("its TTL of %ds ran out", i%7)
		}
		l.Add(kind, fmt.Sprintf("sb-%d", i/3), []string{"", "/ml", "/ml/team"}[i%3], why, msg)
	}
	epoch := l.Epoch()
	for _, c := range []struct {
		epoch        string
		after        uint64
		limit        int
		wantN, first uint64
	}{
		{epoch, 0, 1000, 64, 87},    // from the oldest kept: 86 lost
		{epoch, 100, 20, 20, 101},   // a page
		{epoch, 140, 1000, 10, 141}, // to the newest
		{epoch, 150, 1000, 0, 0},    // nothing new
		{"other", 120, 10, 10, 87},  // another epoch: from the oldest kept
	} {
		msgs, next, lost := l.Read(c.epoch, c.after, c.limit)
		page, n, pnext, plost := l.ReadPacked(c.epoch, c.after, c.limit, nil)
		if n != len(msgs) || pnext != next || plost != lost || uint64(n) != c.wantN {
			t.Fatalf("after %d of %q: packed %d events to %d (%d lost), messages %d to %d (%d lost), want %d", c.after, c.epoch, n, pnext,
				plost, len(msgs), next, lost, c.wantN)
		}
		want, err := pulledEvents(&edgev1.EventsResponse{Epoch: epoch, Events: msgs})
		if err != nil {
			t.Fatal(err)
		}
		got, err := pulledEvents(&edgev1.EventsResponse{Epoch: epoch, PackedEvents: page})
		if err != nil {
			t.Fatal(err)
		}
		if !slices.EqualFunc(got, want, func(a, b store.Event) bool { return a == b }) {
			t.Fatalf("after %d of %q: packed reads\n%+v\nmessages\n%+v", c.after, c.epoch, got, want)
		}
		if len(got) > 0 && got[0].Key != fmt.Sprintf("n1/%s/%d", epoch, c.first) {
			t.Fatalf("after %d of %q: the first event's key %q, want number %d", c.after, c.epoch, got[0].Key, c.first)
		}
	}
	// A page cut anywhere, or with bytes past its end, is refused: never
	// read short, which would move the cursor past what it lost.
	page, _, _, _ := l.ReadPacked(epoch, 140, 1000, nil)
	for cut := range len(page) - 1 {
		if evs, err := pulledEvents(&edgev1.EventsResponse{Epoch: epoch, PackedEvents: page[:cut+1]}); err == nil {
			t.Fatalf("a page cut at %d of %d bytes reads as %d events", cut+1, len(page), len(evs))
		}
	}
	if _, err := pulledEvents(&edgev1.EventsResponse{Epoch: epoch, PackedEvents: append(page, 0)}); err == nil {
		t.Fatal("a page with a byte past its end reads")
	}
}

// TestPulledUsagePackedOrNot: the ledger's records a pull brings read as
// the same store rows packed and as messages: live, ended, sole and
// not, with labels and without, from the start and after a version.
func TestPulledUsagePackedOrNot(t *testing.T) {
	l, err := ledger.Open("n1", "", slog.New(slog.DiscardHandler))
	if err != nil {
		t.Fatal(err)
	}
	l.SetCheckpoint(time.Minute)
	t0 := time.Now().Add(-time.Hour)
	for i := range 20 {
		id := fmt.Sprintf("sb-%d", i)
		var labels map[string]string
		if i%2 == 1 {
			labels = map[string]string{"dsec.dev/project": "/ml", "run": fmt.Sprint(i % 3)}
		}
		l.Start(id, "/ml", labels, t0, true)
		l.Observe(id, "/ml", labels, ledger.Sample{At: t0.Add(time.Duration(i%4) * time.Minute), CPUUsec: int64(i) * 1000, MemoryBytes: 1 << 28,
			DiskBytes: int64(i) << 20, EgressBytes: int64(i)})
		if i%5 != 0 {
			l.End(id, t0.Add(5*time.Minute))
		}
	}
	epoch, mid := l.Head()
	mid /= 2
	for _, after := range []uint64{0, mid} {
		msgs, cur, next := l.Changed(epoch, after)
		page, n, pcur, pnext := l.ChangedPacked(epoch, after, nil)
		if n != len(msgs) || pcur != cur || pnext != next || n == 0 {
			t.Fatalf("after %d: packed %d records to %s/%d, messages %d to %s/%d", after, n, pcur, pnext, len(msgs), cur, next)
		}
		want, err := pulledUsage(&edgev1.EventsResponse{Usage: msgs})
		if err != nil {
			t.Fatal(err)
		}
		got, err := pulledUsage(&edgev1.EventsResponse{PackedUsage: page})
		if err != nil {
			t.Fatal(err)
		}
		sole := 0
		if !slices.EqualFunc(got, want, func(a, b store.UsageRow) bool {
			if a.Sole {
				sole++
			}
			la, lb := a.Labels, b.Labels
			a.Labels, b.Labels = nil, nil
			return maps.Equal(la, lb) && reflect.DeepEqual(a, b)
		}) {
			t.Fatalf("after %d: packed reads\n%+v\nmessages\n%+v", after, got, want)
		}
		if after == 0 && sole == 0 {
			t.Fatal("no sole end among the rows: the comparison misses the flag")
		}
	}
	if _, err := pulledUsage(&edgev1.EventsResponse{PackedUsage: []byte{9}}); err == nil {
		t.Fatal("a page of another format reads")
	}
}

// BenchmarkPulled is what reading a pull's answer costs an apiserver a
// sandbox, from the bytes on the wire to the store's rows: a page of 500
// sandboxes' lives (1,000 events, 500 ended records), packed (what the
// pulls ask for) and as messages (what they asked for before).
//
//	go test -run '^$' -bench Pulled ./internal/apiserver
func BenchmarkPulled(b *testing.B) {
	const sandboxes = 500
	evs := eventlog.New("n1", 0)
	l, err := ledger.Open("n1", "", slog.New(slog.DiscardHandler))
	if err != nil {
		b.Fatal(err)
	}
	t0 := time.Now()
	labels := map[string]string{"dsec.dev/project": "/ml/team", "run": "grpo-7"}
	for i := range sandboxes {
		id := fmt.Sprintf("n1-0001-%08d", i)
		evs.Add(eventlog.Created, id, "/ml/team", "", "")
		l.Start(id, "/ml/team", labels, t0, true)
		l.Observe(id, "/ml/team", labels, ledger.Sample{At: t0.Add(5 * time.Second), CPUUsec: 40_000, MemoryBytes: 64 << 20, DiskBytes: 1 << 20})
		l.End(id, t0.Add(5*time.Second))
		evs.Add(eventlog.Expired, id, "/ml/team", "ttl", "its TTL of 5s ran out")
	}
	epoch := evs.Epoch()
	for _, packed := range []bool{false, true} {
		m := &edgev1.EventsResponse{Epoch: epoch}
		if packed {
			m.PackedEvents, _, m.Next, _ = evs.ReadPacked("", 0, 2*sandboxes, nil)
			m.PackedUsage, _, m.UsageEpoch, m.UsageNext = l.ChangedPacked("", 0, nil)
		} else {
			m.Events, m.Next, _ = evs.Read("", 0, 2*sandboxes)
			m.Usage, m.UsageEpoch, m.UsageNext = l.Changed("", 0)
		}
		wire, err := proto.Marshal(m)
		if err != nil {
			b.Fatal(err)
		}
		b.Run(fmt.Sprintf("packed=%v", packed), func(b *testing.B) {
			b.ReportAllocs()
			for b.Loop() {
				var got edgev1.EventsResponse
				if err := proto.Unmarshal(wire, &got); err != nil {
					b.Fatal(err)
				}
				events, err := pulledEvents(&got)
				if err != nil || len(events) != 2*sandboxes {
					b.Fatalf("%d events, %v", len(events), err)
				}
				rows, err := pulledUsage(&got)
				if err != nil || len(rows) != sandboxes {
					b.Fatalf("%d rows, %v", len(rows), err)
				}
			}
			b.ReportMetric(float64(b.Elapsed().Nanoseconds())/float64(b.N*sandboxes), "ns/sandbox")
			b.ReportMetric(float64(len(wire))/sandboxes, "wire-B/sandbox")
		})
	}
}

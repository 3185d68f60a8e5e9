package store_test

import (
	"fmt"
	"path/filepath"
	"testing"
	"time"

	"dsec.dev/dsec/internal/store"
	"dsec.dev/dsec/internal/testutil"
)

// BenchmarkAppendEvents is what storing events costs per event on SQLite,
// in the batches an apiserver's pull makes (one event a call when nodes
// are quiet, more under load).
func BenchmarkAppendEvents(b *testing.B) {
	for _, batch := range []int{1, 16, 100} {
		b.Run(fmt.Sprintf("batch=%d", batch), func(b *testing.B) {
			st := openStore(b, filepath.Join(b.TempDir(), "meta.db"))
			n := 0
			for b.Loop() {
				evs := make([]store.Event, batch)
				for i := range evs {
					n++
					evs[i] = store.Event{Key: fmt.Sprintf("n1/e/%d", n), At: time.Now(), Project: "ml", SandboxID: "sb-n1-0a1b2c3d", Kind: "created", Node: "n1"}
				}
				if _, err := st.AppendEvents(b.Context(), evs...); err != nil {
					b.Fatal(err)
				}
			}
			b.ReportMetric(float64(b.Elapsed().Nanoseconds())/float64(n)/1000, "µs/event")
		})
	}
}

// BenchmarkPullEvents is what one pull of a node's events costs the store,
// per event, the way apiservers pull now against how they did: before,
// each of two apiservers appended every batch it pulled (AppendEvents:
// the second storing nothing, each event offered twice); now the holder
// of the node's lease alone stores it with the node's cursor in one
// transaction (PullEvents). Both run in the same loop, on SQLite and on
// PostgreSQL, and the ratio is reported (before/after).
func BenchmarkPullEvents(b *testing.B) {
	backends := []struct {
		name string
		open func(b *testing.B) (a, c store.Store)
	}{
		{"sqlite", func(b *testing.B) (store.Store, store.Store) {
			path := filepath.Join(b.TempDir(), "meta.db")
			return openStore(b, path), openStore(b, path)
		}},
		{"postgres", func(b *testing.B) (store.Store, store.Store) {
			dsn := testutil.StartPostgres(b)
			return openStore(b, dsn), openStore(b, dsn)
		}},
	}
	for _, be := range backends {
		for _, batch := range []int{1, 16} {
			b.Run(fmt.Sprintf("%s/batch=%d", be.name, batch), func(b *testing.B) {
				ctx := b.Context()
				a, c := be.open(b)
				now := time.Now()
				if _, err := a.ClaimEventPulls(ctx, "a", []string{"n1"}, now, now.Add(time.Hour)); err != nil {
					b.Fatal(err)
				}
				seq := 0
				next := func(node string) []store.Event {
					evs := make([]store.Event, batch)
					for i := range evs {
						seq++
						evs[i] = store.Event{Key: fmt.Sprintf("%s/e/%d", node, seq), At: time.Now(), Project: "ml", SandboxID: "sb-n1-0a1b2c3d", Kind: "created", Node: node}
					}
					return evs
				}
				var before, after time.Duration
				n := 0
				for b.Loop() {
					evs := next("old")
					t0 := time.Now()
					for _, st := range []store.Store{a, c} {
						if _, err := st.AppendEvents(ctx, evs...); err != nil {
							b.Fatal(err)
						}
					}
					t1 := time.Now()
					if _, err := a.PullEvents(ctx, "a", []store.EventPull{{Node: "n1", Epoch: "e", Seq: uint64(seq)}}, next("n1")...); err != nil {
						b.Fatal(err)
					}
					after += time.Since(t1)
					before += t1.Sub(t0)
					n += batch
				}
				b.ReportMetric(float64(before.Nanoseconds())/float64(n)/1000, "before-µs/event")
				b.ReportMetric(float64(after.Nanoseconds())/float64(n)/1000, "after-µs/event")
				b.ReportMetric(float64(before)/float64(after), "before/after")
			})
		}
	}
}

// BenchmarkPullTick is one tick of an apiserver holding 40 nodes' pulls,
// 4 new events each, on SQLite and PostgreSQL: before, a transaction per
// node (PullEvents of one node at a time); now, one for the tick (the
// nodes' cursors and all their events together). Both in the same loop;
// the ratio is reported (before/after).
func BenchmarkPullTick(b *testing.B) {
	const nodes, per = 40, 4
	for _, be := range []string{"sqlite", "postgres"} {
		b.Run(be, func(b *testing.B) {
			ctx := b.Context()
			var st store.Store
			if be == "sqlite" {
				st = openStore(b, filepath.Join(b.TempDir(), "meta.db"))
			} else {
				st = openStore(b, testutil.StartPostgres(b))
			}
			var names []string
			for i := range nodes {
				names = append(names, fmt.Sprintf("n%d", i))
			}
			now := time.Now()
			if _, err := st.ClaimEventPulls(ctx, "a", names, now, now.Add(time.Hour)); err != nil {
				b.Fatal(err)
			}
			seq := map[string]int{}
			batch := func(node string) (store.EventPull, []store.Event) {
				evs := make([]store.Event, per)
				for i := range evs {
					seq[node]++
					evs[i] = store.Event{Key: fmt.Sprintf("%s/e/%d", node, seq[node]), At: time.Now(), Project: "ml", SandboxID: "sb-" + node, Kind: "created", Node: node}
				}
				return store.EventPull{Node: node, Epoch: "e", Seq: uint64(seq[node])}, evs
			}
			var before, after time.Duration
			for b.Loop() {
				t0 := time.Now()
				for _, n := range names {
					c, evs := batch(n)
					if _, err := st.PullEvents(ctx, "a", []store.EventPull{c}, evs...); err != nil {
						b.Fatal(err)
					}
				}
				t1 := time.Now()
				var to []store.EventPull
				var all []store.Event
				for _, n := range names {
					c, evs := batch(n)
					to, all = append(to, c), append(all, evs...)
				}
				if _, err := st.PullEvents(ctx, "a", to, all...); err != nil {
					b.Fatal(err)
				}
				after += time.Since(t1)
				before += t1.Sub(t0)
			}
			b.ReportMetric(float64(before.Microseconds())/float64(b.N), "before-µs/tick")
			b.ReportMetric(float64(after.Microseconds())/float64(b.N), "after-µs/tick")
			b.ReportMetric(float64(before)/float64(after), "before/after")
		})
	}
}

package store_test

import (
	"database/sql"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"syscall"
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

// BenchmarkPullCopy is what a pull of one node's events costs per event,
// by INSERTs of 100 rows (before) and by COPY (now), in the same loop, at
// the batches a tick brings: a quiet node's few, and a busy one's
// hundreds (bench cluster: ~250 a node a tick). It reports the CPU time
// of PostgreSQL's processes and of the benchmark (the apiserver's side)
// per event, each way, and the ratio of their sums (before/after): the
// wall time is mostly the commits' syncs on this machine's disk.
func BenchmarkPullCopy(b *testing.B) {
	pg := testutil.StartPostgresServer(b)
	st := openStore(b, pg.DSN)
	if drop := os.Getenv("DSEC_BENCH_DROP_INDEXES"); drop != "" {
		db, err := sql.Open("pgx", pg.DSN)
		if err != nil {
			b.Fatal(err)
		}
		defer db.Close()
		for _, ix := range strings.Split(drop, ",") {
			if _, err := db.Exec(ix); err != nil {
				b.Fatal(err)
			}
		}
	}
	insert := store.PullEventsByInsertForTest(st)
	for _, batch := range []int{4, 64, 256} {
		b.Run(fmt.Sprintf("batch=%d", batch), func(b *testing.B) {
			ctx := b.Context()
			now := time.Now()
			node := fmt.Sprintf("n%d-%d", batch, now.UnixNano()) // a node of its own: -count runs it again
			if _, err := st.ClaimEventPulls(ctx, "a", []string{node}, now, now.Add(time.Hour)); err != nil {
				b.Fatal(err)
			}
			seq := 0
			next := func() (store.EventPull, []store.Event) {
				evs := make([]store.Event, batch)
				for i := range evs {
					seq++
					evs[i] = store.Event{Key: fmt.Sprintf("%s/0123456789abcdef/%d", node, seq), At: time.Now(), Project: "ml",
						SandboxID: fmt.Sprintf("sb-%s-%08x", node, seq), Kind: "created", Node: node}
				}
				return store.EventPull{Node: node, Epoch: "0123456789abcdef", Seq: uint64(seq)}, evs
			}
			var pgBefore, pgAfter, selfBefore, selfAfter time.Duration
			// Each way's PostgreSQL time is read around it alone (reading
			// it costs this process, not the server), and this process's
			// inside.
			for b.Loop() {
				c, evs := next()
				p0 := pg.CPU()
				s0 := selfCPU()
				if _, err := insert(ctx, "a", []store.EventPull{c}, evs...); err != nil {
					b.Fatal(err)
				}
				s1 := selfCPU()
				p1 := pg.CPU()
				c, evs = next()
				p2 := pg.CPU()
				s2 := selfCPU()
				if _, err := st.PullEvents(ctx, "a", []store.EventPull{c}, evs...); err != nil {
					b.Fatal(err)
				}
				s3 := selfCPU()
				p3 := pg.CPU()
				pgBefore, pgAfter = pgBefore+p1-p0, pgAfter+p3-p2
				selfBefore, selfAfter = selfBefore+s1-s0, selfAfter+s3-s2
			}
			per := float64(b.N*batch) * 1000
			b.ReportMetric(float64(pgBefore.Nanoseconds())/per, "pg-before-µs/event")
			b.ReportMetric(float64(pgAfter.Nanoseconds())/per, "pg-after-µs/event")
			b.ReportMetric(float64(selfBefore.Nanoseconds())/per, "self-before-µs/event")
			b.ReportMetric(float64(selfAfter.Nanoseconds())/per, "self-after-µs/event")
			b.ReportMetric(float64(pgBefore+selfBefore)/float64(pgAfter+selfAfter), "before/after")
		})
	}
}

// selfCPU is the CPU time this process used so far.
func selfCPU() time.Duration {
	var ru syscall.Rusage
	if err := syscall.Getrusage(syscall.RUSAGE_SELF, &ru); err != nil {
		return 0
	}
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}

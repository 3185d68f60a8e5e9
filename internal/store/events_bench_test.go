package store_test

import (
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

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

// BenchmarkPullPacks is what a pull of one node's events costs per event
// on PostgreSQL, stored as rows, one an event, by COPY into the table
// events had before packs (the benchmark makes it again: its four
// indexes, the unique key, project and time), and as packs now
// (PullEvents), in the same loop, at the batches a tick brings: a quiet
// node's few, and a busy one's hundreds (bench cluster: ~250 a node a
// tick). It reports the CPU time of PostgreSQL's processes and of the
// benchmark (the apiserver's side) per event, each way, and the ratio of
// their sums (before/after): the wall time is mostly the commits' syncs
// on this machine's disk.
func BenchmarkPullPacks(b *testing.B) {
	pg := testutil.StartPostgresServer(b)
	st := openStore(b, pg.DSN)
	pool, err := pgxpool.New(b.Context(), pg.DSN)
	if err != nil {
		b.Fatal(err)
	}
	defer pool.Close()
	if _, err := pool.Exec(b.Context(), `CREATE TABLE event_rows (
		id bigserial PRIMARY KEY, key text NOT NULL UNIQUE, at timestamptz NOT NULL, project text NOT NULL,
		sandbox_id text NOT NULL, kind text NOT NULL, node text NOT NULL, reason text NOT NULL, message text NOT NULL);
		CREATE INDEX event_rows_project_id ON event_rows (project, id);
		CREATE INDEX event_rows_at ON event_rows (at)`); err != nil {
		b.Fatal(err)
	}
	// DSEC_BENCH_SQL: statements to run first (a storage setting to try,
	// say), separated by ";".
	for _, q := range strings.Split(os.Getenv("DSEC_BENCH_SQL"), ";") {
		if strings.TrimSpace(q) == "" {
			continue
		}
		if _, err := pool.Exec(b.Context(), q); err != nil {
			b.Fatalf("DSEC_BENCH_SQL %q: %v", q, err)
		}
	}
	columns := []string{"key", "at", "project", "sandbox_id", "kind", "node", "reason", "message"}
	rows := func(evs []store.Event) error {
		tx, err := pool.Begin(b.Context())
		if err != nil {
			return err
		}
		defer tx.Rollback(b.Context())
		if _, err := tx.Exec(b.Context(), `SELECT pg_advisory_xact_lock(1)`); err != nil {
			return err
		}
		if _, err := tx.CopyFrom(b.Context(), pgx.Identifier{"event_rows"}, columns, pgx.CopyFromSlice(len(evs), func(i int) ([]any, error) {
			e := evs[i]
			return []any{e.Key, e.At, e.Project, e.SandboxID, e.Kind, e.Node, e.Reason, e.Message}, nil
		})); err != nil {
			return err
		}
		return tx.Commit(b.Context())
	}
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
				_, evs := next()
				p0 := pg.CPU()
				s0 := selfCPU()
				if err := rows(evs); err != nil {
					b.Fatal(err)
				}
				s1 := selfCPU()
				p1 := pg.CPU()
				c, evs := next()
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

package store_test

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"path/filepath"
	"runtime"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	_ "github.com/jackc/pgx/v5/stdlib" // database/sql driver "pgx", to read tables as the SQLite test does

	"dsec.dev/dsec/internal/errdefs"
	"dsec.dev/dsec/internal/iam"
	"dsec.dev/dsec/internal/store"
	"dsec.dev/dsec/internal/store/storetest"
	"dsec.dev/dsec/internal/testutil"
)

func openStore(t testing.TB, dsn string) store.Store {
	t.Helper()
	st, err := store.Open(context.Background(), dsn)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { st.Close() })
	return st
}

// TestPostgres runs the conformance suite on one throwaway cluster, with a
// fresh database for each case.
func TestPostgres(t *testing.T) {
	pg := testutil.StartPostgresServer(t)
	storetest.Run(t, func(t *testing.T) store.Store {
		return openStore(t, pg.NewDatabase(t))
	})
}

// TestPostgresReplicas runs the two-replica cases on two Stores (two pools,
// as two apiserver processes have) on one database.
func TestPostgresReplicas(t *testing.T) {
	pg := testutil.StartPostgresServer(t)
	storetest.RunReplicas(t, func(t *testing.T) (store.Store, store.Store) {
		dsn := pg.NewDatabase(t)
		return openStore(t, dsn), openStore(t, dsn)
	})
}

// TestPostgresOpenConcurrently: replicas starting at once on an empty
// database migrate it once between them (the advisory lock) and all open.
func TestPostgresOpenConcurrently(t *testing.T) {
	pg := testutil.StartPostgresServer(t)
	dsn := pg.NewDatabase(t)
	const n = 4
	errs := make([]error, n)
	var wg sync.WaitGroup
	for i := range n {
		wg.Add(1)
		go func() {
			defer wg.Done()
			st, err := store.Open(t.Context(), dsn)
			if err == nil {
				_, _, err = st.ReserveCreate(t.Context(), store.CreateReservation{Key: fmt.Sprint(i), RequestHash: "h"})
				st.Close()
			}
			errs[i] = err
		}()
	}
	wg.Wait()
	for i, err := range errs {
		if err != nil {
			t.Fatalf("replica %d: %v", i, err)
		}
	}
}

// TestPostgresTokensHashOnly reads the tokens table directly: it holds each
// token's SHA-256 and no plaintext.
func TestPostgresTokensHashOnly(t *testing.T) {
	ctx := t.Context()
	dsn := testutil.StartPostgres(t)
	st := openStore(t, dsn)
	if _, err := st.CreatePrincipal(ctx, iam.NodeAdmin(), store.PrincipalSpec{Name: "trainer"}); err != nil {
		t.Fatal(err)
	}
	tok, info, err := st.MintToken(ctx, iam.NodeAdmin(), store.TokenSpec{Principal: "trainer", Role: iam.Admin, TTL: time.Hour})
	if err != nil {
		t.Fatal(err)
	}
	db, err := sql.Open("pgx", dsn)
	if err != nil {
		t.Fatal(err)
	}
	defer db.Close()
	// Every column as text too (bytea shows as hex), so no encoding hides it.
	checkTokenRows(t, tok, info.ID, func() (*sql.Rows, error) { return db.QueryContext(ctx, `SELECT * FROM tokens`) })
	checkTokenRows(t, tok, info.ID, func() (*sql.Rows, error) {
		return db.QueryContext(ctx, `SELECT id, principal_id, hash, encode(hash, 'escape'), created::text FROM tokens`)
	})
	var n int
	if err := db.QueryRowContext(ctx, `SELECT count(*) FROM tokens WHERE hash = $1`, store.TokenHashForTest(tok)).Scan(&n); err != nil || n != 1 {
		t.Fatalf("rows holding the token's SHA-256: %d, %v", n, err)
	}
}

// TestPostgresCombinedCreates: many creates at once reserve and complete
// their keys in shared batches (one round trip and one commit for several),
// yet each call gets the answer it would get alone. Two of them complete
// with the same sandbox ID: the batch holding both fails as a whole, its
// statements run again alone, and exactly one of the two wins.
func TestPostgresCombinedCreates(t *testing.T) {
	pg := testutil.StartPostgresServer(t)
	st := openStore(t, pg.NewDatabase(t))
	ctx := t.Context()
	const n = 64
	var batchedAfterReserve int64
	for round := range 3 {
		reserved := make([]store.CreateReservation, n)
		errs := make([]error, n)
		run := func(f func(i int) error) {
			var wg sync.WaitGroup
			start := make(chan struct{})
			for i := range n {
				wg.Add(1)
				go func() {
					defer wg.Done()
					<-start
					errs[i] = f(i)
				}()
			}
			close(start)
			wg.Wait()
		}
		key := func(i int) string { return fmt.Sprintf("r%d-k%d", round, i) }
		run(func(i int) error {
			got, ok, err := st.ReserveCreate(ctx, store.CreateReservation{Key: key(i), RequestHash: "h"})
			if err == nil && !ok {
				err = fmt.Errorf("key %s: reserved is false for a new key", key(i))
			}
			reserved[i] = got
			return err
		})
		for i, err := range errs {
			if err != nil {
				t.Fatalf("round %d: ReserveCreate #%d: %v", round, i, err)
			}
		}
		batchedAfterReserve, _ = store.CombinedForTest(st)
		run(func(i int) error {
			id := fmt.Sprintf("sb-%d-%d", round, i)
			if i == 1 {
				id = fmt.Sprintf("sb-%d-0", round) // the same sandbox as #0's
			}
			return st.CompleteCreate(ctx, key(i), reserved[i].Nonce, []store.SandboxRow{{ID: id, Node: "n"}})
		})
		won := 0
		for i, err := range errs {
			switch {
			case i <= 1 && err == nil:
				won++
			case i <= 1:
				if !errors.Is(err, errdefs.ErrAlreadyExists) {
					t.Fatalf("round %d: CompleteCreate #%d with a sandbox ID another key holds: %v, want AlreadyExists", round, i, err)
				}
			case err != nil:
				t.Fatalf("round %d: CompleteCreate #%d: %v", round, i, err)
			default:
				rec, err := st.GetIdempotency(ctx, key(i))
				if err != nil || len(rec.IDs) != 1 || rec.IDs[0] != fmt.Sprintf("sb-%d-%d", round, i) {
					t.Fatalf("round %d: key %s after its completion: %+v, %v", round, key(i), rec, err)
				}
			}
		}
		if won != 1 {
			t.Fatalf("round %d: %d of the two creates with one sandbox ID completed, want exactly 1", round, won)
		}
	}
	batched, rerun := store.CombinedForTest(st)
	t.Logf("%d statements sent in shared batches, %d of them run again alone", batched, rerun)
	if batchedAfterReserve == 0 || batched == batchedAfterReserve {
		t.Fatalf("reservations and completions never shared a batch (%d, then %d statements batched): the test did not exercise combining", batchedAfterReserve, batched)
	}
}

// TestPostgresRestart: the server restarts under a live Store; once it is
// back the next calls succeed on the same Store, without reopening.
func TestPostgresRestart(t *testing.T) {
	ctx := t.Context()
	pg := testutil.StartPostgresServer(t)
	st := openStore(t, pg.DSN)
	if _, err := st.CreatePrincipal(ctx, iam.NodeAdmin(), store.PrincipalSpec{Name: "trainer"}); err != nil {
		t.Fatal(err)
	}
	tok, _, err := st.MintToken(ctx, iam.NodeAdmin(), store.TokenSpec{Principal: "trainer", Role: iam.Admin, TTL: 0})
	if err != nil {
		t.Fatal(err)
	}
	n, err := st.RegisterNode(ctx, store.Node{Name: "n1", Identity: "fp"}, time.Minute)
	if err != nil {
		t.Fatal(err)
	}
	// Hold several pooled connections, so each one is cut by the restart.
	var wg sync.WaitGroup
	for i := range 4 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			if _, _, err := st.ReserveCreate(ctx, store.CreateReservation{Key: fmt.Sprintf("before-%d", i), RequestHash: "h"}); err != nil {
				t.Error(err)
			}
		}()
	}
	wg.Wait()

	pg.Restart(t)

	// Straight away, on the connections the restart cut: every call
	// succeeds without reopening the Store.
	if _, err := st.Authenticate(ctx, tok); err != nil {
		t.Fatalf("Authenticate after restart: %v", err)
	}
	if err := st.Heartbeat(ctx, "n1", n.Generation, time.Now()); err != nil {
		t.Fatalf("Heartbeat after restart: %v", err)
	}
	for i := range 4 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			key := fmt.Sprintf("after-%d", i)
			res, reserved, err := st.ReserveCreate(ctx, store.CreateReservation{Key: key, RequestHash: "h"})
			if err != nil || !reserved {
				t.Errorf("ReserveCreate %s after restart: reserved=%v, %v", key, reserved, err)
				return
			}
			if err := st.CompleteCreate(ctx, key, res.Nonce, []store.SandboxRow{{ID: "sb-" + key, Node: "n1"}}); err != nil {
				t.Errorf("CompleteCreate %s after restart: %v", key, err)
			}
		}()
	}
	wg.Wait()
	// What was written before the restart is still there.
	if _, reserved, err := st.ReserveCreate(ctx, store.CreateReservation{Key: "before-0", RequestHash: "h"}); err != nil || reserved {
		t.Fatalf("reservation from before the restart: reserved=%v, %v", reserved, err)
	}
}

// TestPostgresDown: with the server gone, calls fail with ErrUnavailable
// within their retry budget instead of hanging.
func TestPostgresDown(t *testing.T) {
	pg := testutil.StartPostgresServer(t)
	st := openStore(t, pg.DSN)
	pg.Stop(t)
	start := time.Now()
	_, err := st.GetIdempotency(t.Context(), "k")
	if !errors.Is(err, errdefs.ErrUnavailable) {
		t.Fatalf("GetIdempotency with the server down: %v, want ErrUnavailable", err)
	}
	if d := time.Since(start); d > 10*time.Second {
		t.Fatalf("GetIdempotency with the server down took %s", d)
	}
}

// BenchmarkCreateBatch measures ReserveCreate + CompleteCreate of a batch of
// 50 sandboxes, reported as creates/s, on PostgreSQL with durable commits
// (fsync and synchronous_commit on; only initdb skipped its syncs) and, as
// the baseline measured in the same run, on the all-in-one SQLite store.
func BenchmarkCreateBatch(b *testing.B) {
	const batch = 50
	pg := testutil.StartPostgresServer(b)
	db, err := sql.Open("pgx", pg.DSN)
	if err != nil {
		b.Fatal(err)
	}
	for _, setting := range []string{"fsync", "synchronous_commit"} {
		var v string
		if err := db.QueryRow("SHOW " + setting).Scan(&v); err != nil || v != "on" {
			b.Fatalf("%s is %q (%v): the figures would not be of durable commits", setting, v, err)
		}
	}
	db.Close()
	backends := []struct {
		name string
		open func(b *testing.B) store.Store
	}{
		{"sqlite", func(b *testing.B) store.Store { return openStore(b, filepath.Join(b.TempDir(), "meta.db")) }},
		{"postgres", func(b *testing.B) store.Store { return openStore(b, pg.NewDatabase(b)+" pool_max_conns=16") }},
	}
	rate := map[string]float64{}
	for _, clients := range []int{1, 16} {
		for _, be := range backends {
			name := fmt.Sprintf("%s/clients=%d", be.name, clients)
			b.Run(name, func(b *testing.B) {
				st := be.open(b)
				ctx := context.Background()
				var seq atomic.Int64
				create := func() {
					i := seq.Add(1)
					key := fmt.Sprintf("bench-%d", i)
					res, _, err := st.ReserveCreate(ctx, store.CreateReservation{Key: key, RequestHash: "h", Owner: "api-1"})
					if err != nil {
						b.Fatal(err)
					}
					rows := make([]store.SandboxRow, batch)
					for j := range rows {
						rows[j] = store.SandboxRow{ID: fmt.Sprintf("sb-%d-%d", i, j), Node: fmt.Sprintf("n%d", j%8)}
					}
					if err := st.CompleteCreate(ctx, key, res.Nonce, rows); err != nil {
						b.Fatal(err)
					}
				}
				if clients == 1 {
					for b.Loop() {
						create()
					}
				} else {
					b.SetParallelism(max(1, clients/runtime.GOMAXPROCS(0)))
					b.RunParallel(func(pb *testing.PB) {
						for pb.Next() {
							create()
						}
					})
				}
				r := float64(b.N*batch) / b.Elapsed().Seconds()
				rate[name] = r
				b.ReportMetric(r, "creates/s")
			})
		}
	}
	for _, clients := range []int{1, 16} {
		base, pgRate := rate[fmt.Sprintf("sqlite/clients=%d", clients)], rate[fmt.Sprintf("postgres/clients=%d", clients)]
		if base > 0 && pgRate > 0 {
			b.Logf("clients=%d: postgres %.0f creates/s, sqlite %.0f creates/s (postgres/sqlite = %.2f)", clients, pgRate, base, pgRate/base)
		}
	}
}

// TestPostgresEventsDurableWhenRead: a pull of events commits without
// waiting for the disk, and reading the events makes them durable before
// they are returned (a crash may take back a pull, never what a reader
// was given). The WAL writer is slowed to 10 s so that only the store
// flushes in between.
func TestPostgresEventsDurableWhenRead(t *testing.T) {
	pg := testutil.StartPostgresServer(t)
	db, err := sql.Open("pgx", pg.DSN)
	if err != nil {
		t.Fatal(err)
	}
	defer db.Close()
	ctx := t.Context()
	for _, q := range []string{`ALTER SYSTEM SET wal_writer_delay = '10s'`, `SELECT pg_reload_conf()`} {
		if _, err := db.ExecContext(ctx, q); err != nil {
			t.Fatal(err)
		}
	}
	st := openStore(t, pg.DSN)
	lsns := func() (insert, flush string, behind bool) {
		t.Helper()
		if err := db.QueryRowContext(ctx, `SELECT pg_current_wal_insert_lsn(), pg_current_wal_flush_lsn(),
			pg_current_wal_flush_lsn() < pg_current_wal_insert_lsn()`).Scan(&insert, &flush, &behind); err != nil {
			t.Fatal(err)
		}
		return insert, flush, behind
	}
	now := time.Now()
	if _, err := st.ClaimEventPulls(ctx, "a", []string{"n1"}, now, now.Add(time.Hour)); err != nil {
		t.Fatal(err)
	}
	time.Sleep(300 * time.Millisecond) // the reload applied
	for round := range 3 {
		var evs []store.Event
		for i := range 50 {
			evs = append(evs, store.Event{Key: fmt.Sprintf("n1/e/%d-%d", round, i), Project: "p", SandboxID: fmt.Sprintf("sb-%d", i), Kind: "created", Node: "n1"})
		}
		if _, err := st.PullEvents(ctx, "a", []store.EventPull{{Node: "n1", Epoch: "e", Seq: uint64(50 * (round + 1))}}, evs...); err != nil {
			t.Fatal(err)
		}
		insert, flush, behind := lsns()
		if !behind {
			t.Errorf("round %d: the WAL is on the disk up to %s right after a pull (inserted to %s): the pull waited for it", round, flush, insert)
		}
		got, err := st.ListEvents(ctx, store.EventQuery{Projects: []string{"p"}, Limit: 1000})
		if err != nil || len(got) != 50*(round+1) {
			t.Fatalf("round %d: read %d events (%v), want %d", round, len(got), err, 50*(round+1))
		}
		var durable bool
		if err := db.QueryRowContext(ctx, `SELECT pg_current_wal_flush_lsn() >= $1::pg_lsn`, insert).Scan(&durable); err != nil {
			t.Fatal(err)
		}
		if !durable {
			t.Errorf("round %d: events read before the pull that stored them reached the disk (WAL inserted to %s)", round, insert)
		}
	}
}

// TestPostgresEventPacksLZ4: a migrated database compresses its event
// packs and its packs of ends with LZ4 (Debian's PostgreSQL has it), where
// PostgreSQL's own pglz cost a third of storing an event pack, and more
// than half of storing a pack of ends (BenchmarkPutUsagePG).
func TestPostgresEventPacksLZ4(t *testing.T) {
	pg := testutil.StartPostgresServer(t)
	dsn := pg.NewDatabase(t)
	openStore(t, dsn)
	db, err := sql.Open("pgx", dsn)
	if err != nil {
		t.Fatal(err)
	}
	defer db.Close()
	for _, col := range []struct{ table, column string }{{"event_packs", "events"}, {"ledger_end_packs", "records"}} {
		var c string
		if err := db.QueryRow(`SELECT attcompression::text FROM pg_attribute WHERE attrelid = $1::regclass AND attname = $2`, col.table, col.column).Scan(&c); err != nil {
			t.Fatal(err)
		}
		if c != "l" {
			t.Fatalf("%s.%s compression %q, want l (LZ4)", col.table, col.column, c)
		}
	}
}

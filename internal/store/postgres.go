package store

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"slices"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/jackc/pgx/v5/stdlib"

	"dsec.dev/dsec/internal/errdefs"
)

// pgStore is the Store on a PostgreSQL database shared by every apiserver
// replica. Statements run at READ COMMITTED; the operations that must be
// atomic across replicas are single statements (ReserveCreate,
// CompleteCreate) or take a transaction-scoped advisory lock (RegisterNode).
//
// The pool reconnects on its own after the server restarts; calls made
// while it is away are retried for a few seconds when that is safe (see
// retry) and then fail with errdefs.ErrUnavailable.
type pgStore struct {
	// sqlDB serves the IAM part through database/sql on the same pool.
	*sqlDB
	pool *pgxpool.Pool
	// reserve and complete combine the statements of concurrent
	// ReserveCreate and CompleteCreate calls.
	reserve, complete *combiner
	// flushed is the newest event ID ListEvents made durable.
	flushed atomic.Int64
}

// registryLockID is the advisory lock every RegisterNode holds for its
// transaction, so two replicas never hand out one slot ("dsecnode").
const registryLockID = 0x647365636e6f6465

func openPostgres(ctx context.Context, dsn string) (Store, error) {
	cfg, err := pgxpool.ParseConfig(dsn)
	if err != nil {
		return nil, fmt.Errorf("open metadata store: parse PostgreSQL DSN: %w: %w", errdefs.ErrInvalidArgument, err)
	}
	name := cfg.ConnConfig.Host + "/" + cfg.ConnConfig.Database // for errors: never the password
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		return nil, fmt.Errorf("open metadata store %s: %w", name, pgKind(err))
	}
	db := stdlib.OpenDBFromPool(pool)
	if err := migrate(ctx, db, dialectPostgres); err != nil {
		db.Close() // leaves the pool open
		pool.Close()
		return nil, fmt.Errorf("open metadata store %s: %w", name, pgKind(err))
	}
	s := &pgStore{pool: pool, reserve: newCombiner(pool), complete: newCombiner(pool)}
	s.sqlDB = &sqlDB{db: db, dialect: dialectPostgres, retry: s.retry, kind: pgKind}
	return s, nil
}

func (s *pgStore) Close() error {
	s.sqlDB.db.Close() // leaves the pool open
	s.pool.Close()
	return nil
}

// pgAttempts bounds retry: with its backoff, about 2.5 s of trying, enough
// to ride out a server restart.
const pgAttempts = 8

// retry runs op until it succeeds, fails for a reason another try cannot
// fix, or pgAttempts run out. Any op is tried again when PostgreSQL undid
// all of it (a serialization failure or deadlock) or nothing reached the
// server (no connection could be made, or pgx knows the request was not
// sent). An idempotent op, one that does the same when run twice as once,
// is tried again also after a connection was lost midway, when it may or may
// not have committed.
func (s *pgStore) retry(ctx context.Context, idempotent bool, op func(ctx context.Context) error) error {
	delay := 25 * time.Millisecond
	for attempt := 1; ; attempt++ {
		err := op(ctx)
		if err == nil || attempt == pgAttempts || !pgRetryable(err, idempotent) || ctx.Err() != nil {
			return err
		}
		select {
		case <-time.After(delay):
		case <-ctx.Done():
			return err
		}
		delay = min(2*delay, time.Second)
	}
}

func pgRetryable(err error, idempotent bool) bool {
	var pgErr *pgconn.PgError
	if errors.As(err, &pgErr) {
		switch pgErr.Code {
		case "40001", "40P01": // serialization_failure, deadlock_detected
			return true
		case "57P03": // cannot_connect_now: the server is starting
			return true
		}
	}
	var connectErr *pgconn.ConnectError
	if pgconn.SafeToRetry(err) || errors.As(err, &connectErr) {
		return true
	}
	return idempotent && pgConnLost(err)
}

// pgConnLost reports whether err says the connection to the server failed,
// rather than the server refusing the statement.
func pgConnLost(err error) bool {
	if errors.Is(err, context.Canceled) || errors.Is(err, context.DeadlineExceeded) {
		return false
	}
	var pgErr *pgconn.PgError
	if errors.As(err, &pgErr) {
		// connection_exception, and the server shutting down or restarting.
		return pgErr.Code[:2] == "08" || pgErr.Code == "57P01" || pgErr.Code == "57P02" || pgErr.Code == "57P03"
	}
	var connectErr *pgconn.ConnectError
	var netErr net.Error
	return errors.As(err, &connectErr) || errors.As(err, &netErr) ||
		errors.Is(err, io.EOF) || errors.Is(err, io.ErrUnexpectedEOF) || errors.Is(err, net.ErrClosed) ||
		pgconn.SafeToRetry(err)
}

// pgKind adds the errdefs kind a driver error stands for.
func pgKind(err error) error {
	if err == nil {
		return nil
	}
	var pgErr *pgconn.PgError
	switch {
	case pgConnLost(err):
		return fmt.Errorf("%w: %w", errdefs.ErrUnavailable, err)
	case errors.As(err, &pgErr) && pgErr.Code == "23505": // unique_violation
		return fmt.Errorf("%w: %w", errdefs.ErrAlreadyExists, err)
	}
	return err
}

func pgUnique(err error) bool {
	var pgErr *pgconn.PgError
	return errors.As(err, &pgErr) && pgErr.Code == "23505"
}

func nonNil(l []string) []string {
	if l == nil {
		return []string{}
	}
	return l
}

// tsArg is t as a nullable timestamptz argument.
func tsArg(t time.Time) any {
	if t.IsZero() {
		return nil
	}
	return t
}

func tsOf(t *time.Time) time.Time {
	if t == nil {
		return time.Time{}
	}
	return *t
}

// --- idempotency and reservations

const pgReservationCols = `key, request_hash, owner, placements, state, ids, created, updated, nonce`

func scanPGReservation(row pgx.Row, extra ...any) (CreateReservation, error) {
	var r CreateReservation
	dst := append(extra, &r.Key, &r.RequestHash, &r.Owner, &r.Placements, &r.State, &r.IDs, &r.Created, &r.Updated, &r.Nonce)
	if err := row.Scan(dst...); err != nil {
		return CreateReservation{}, err
	}
	r.Placements, r.IDs = nilIfEmpty(r.Placements), nilIfEmpty(r.IDs)
	return r, nil
}

func (s *pgStore) GetIdempotency(ctx context.Context, key string) (Idempotency, error) {
	var r CreateReservation
	err := s.retry(ctx, true, func(ctx context.Context) error {
		var err error
		r, err = scanPGReservation(s.pool.QueryRow(ctx,
			`SELECT `+pgReservationCols+` FROM idempotency WHERE key = $1 AND state = 'done'`, key))
		return err
	})
	if errors.Is(err, pgx.ErrNoRows) {
		return Idempotency{}, fmt.Errorf("idempotency key %q: %w", key, errdefs.ErrNotFound)
	}
	if err != nil {
		return Idempotency{}, fmt.Errorf("read idempotency key %q: %w", key, pgKind(err))
	}
	return Idempotency{Key: r.Key, RequestHash: r.RequestHash, IDs: r.IDs, Created: r.Created}, nil
}

func (s *pgStore) PutIdempotency(ctx context.Context, rec Idempotency) error {
	created := nowOr(rec.Created)
	err := s.retry(ctx, true, func(ctx context.Context) error {
		_, err := s.pool.Exec(ctx, `INSERT INTO idempotency (`+pgReservationCols+`)
			VALUES ($1, $2, '', '{}', 'done', $3, $4, $4, '')
			ON CONFLICT (key) DO UPDATE SET request_hash = EXCLUDED.request_hash, owner = '', placements = '{}',
				state = 'done', ids = EXCLUDED.ids, created = EXCLUDED.created, updated = EXCLUDED.updated, nonce = ''`,
			rec.Key, rec.RequestHash, nonNil(rec.IDs), created)
		return err
	})
	if err != nil {
		return fmt.Errorf("write idempotency key %q: %w", rec.Key, pgKind(err))
	}
	return nil
}

func (s *pgStore) ExpireIdempotency(ctx context.Context, olderThan time.Time) (int, error) {
	var n int64
	err := s.retry(ctx, false, func(ctx context.Context) error {
		tag, err := s.pool.Exec(ctx, `DELETE FROM idempotency WHERE state = 'done' AND created < $1`, olderThan)
		n = tag.RowsAffected()
		return err
	})
	if err != nil {
		return 0, fmt.Errorf("expire idempotency records: %w", pgKind(err))
	}
	return int(n), nil
}

// pgReserveSQL inserts a pending reservation or, when the key exists,
// returns the existing row. When the row was committed by another replica
// after this statement's snapshot was taken, the insert waits for it and
// skips, but the second SELECT cannot see it: no row comes back and the
// caller asks again.
const pgReserveSQL = `
WITH ins AS (
	INSERT INTO idempotency (` + pgReservationCols + `)
	VALUES ($1, $2, $3, $4, 'pending', '{}', $5, $5, $6)
	ON CONFLICT (key) DO NOTHING
	RETURNING ` + pgReservationCols + `)
SELECT true, * FROM ins
UNION ALL
SELECT false, ` + pgReservationCols + ` FROM idempotency WHERE key = $1 AND NOT EXISTS (SELECT 1 FROM ins)`

func (s *pgStore) ReserveCreate(ctx context.Context, r CreateReservation) (CreateReservation, bool, error) {
	r, err := newReservation(r)
	if err != nil {
		return CreateReservation{}, false, err
	}
	if r.Charge != nil {
		return s.reserveCharged(ctx, r)
	}
	var got CreateReservation
	var reserved bool
	err = s.retry(ctx, false, func(ctx context.Context) error {
		for range 10 {
			err := s.reserve.queryRow(ctx, pgReserveSQL,
				[]any{r.Key, r.RequestHash, r.Owner, nonNil(r.Placements), r.Created, r.Nonce},
				func(row pgx.Row) (err error) {
					got, err = scanPGReservation(row, &reserved)
					return err
				})
			if !errors.Is(err, pgx.ErrNoRows) {
				return err
			}
		}
		return fmt.Errorf("the key is reserved and released over and over: %w", errdefs.ErrUnavailable)
	})
	if err != nil {
		return CreateReservation{}, false, wrap(fmt.Sprintf("reserve idempotency key %q", r.Key), pgKind(err))
	}
	if !reserved && got.RequestHash != r.RequestHash {
		return CreateReservation{}, false, differentRequest(r.Key)
	}
	return got, reserved, nil
}

// pgCompleteSQL marks a pending reservation done and inserts its sandbox
// rows in one statement: a duplicate sandbox ID fails the whole of it. It
// returns how many reservations it marked (0 or 1) and rows it inserted.
const pgCompleteSQL = `
WITH done AS (
	UPDATE idempotency SET state = 'done', ids = $2, updated = $3
	WHERE key = $1 AND state = 'pending' AND nonce = $6
	RETURNING 1),
ins AS (
	INSERT INTO sandboxes (id, node, idempotency_key, created)
	SELECT s.id, s.node, $1, s.created FROM unnest($2::text[], $4::text[], $5::timestamptz[]) AS s (id, node, created)
	WHERE EXISTS (SELECT 1 FROM done)
	RETURNING 1)
SELECT (SELECT count(*) FROM done), (SELECT count(*) FROM ins)`

func (s *pgStore) CompleteCreate(ctx context.Context, key, nonce string, sbs []SandboxRow) error {
	rows, ids, err := completeRows(key, sbs)
	if err != nil {
		return err
	}
	nodes := make([]string, len(rows))
	created := make([]time.Time, len(rows))
	for i, sb := range rows {
		nodes[i], created[i] = sb.Node, sb.Created
	}
	// Completing is idempotent (a second run finds the key done with the
	// same IDs), so a lost connection is retried.
	err = s.retry(ctx, true, func(ctx context.Context) error {
		var marked, inserted int64
		err := s.complete.queryRow(ctx, pgCompleteSQL, []any{key, nonNil(ids), ms(time.Now()), nodes, created, nonce},
			func(row pgx.Row) error { return row.Scan(&marked, &inserted) })
		if pgUnique(err) {
			return fmt.Errorf("a sandbox ID is already recorded: %w: %w", errdefs.ErrAlreadyExists, err)
		}
		if err != nil || marked == 1 {
			return err
		}
		var state string
		var have []string
		err = s.pool.QueryRow(ctx, `SELECT state, ids FROM idempotency WHERE key = $1`, key).Scan(&state, &have)
		switch {
		case errors.Is(err, pgx.ErrNoRows):
			return fmt.Errorf("no reservation: %w", errdefs.ErrNotFound)
		case err != nil:
			return err
		case state == StateDone && !slices.Equal(have, ids):
			return fmt.Errorf("the key is already done with other sandboxes: %w", errdefs.ErrAlreadyExists)
		case state == StateDone:
			return nil
		}
		return reservedAgain()
	})
	if err != nil {
		return fmt.Errorf("complete create %q: %w", key, pgKind(err))
	}
	return nil
}

func (s *pgStore) ReleaseCreate(ctx context.Context, key string) error {
	err := s.retry(ctx, true, func(ctx context.Context) error {
		tag, err := s.pool.Exec(ctx, `DELETE FROM idempotency WHERE key = $1 AND state = 'pending'`, key)
		if err != nil || tag.RowsAffected() == 1 {
			return err
		}
		var state string
		err = s.pool.QueryRow(ctx, `SELECT state FROM idempotency WHERE key = $1`, key).Scan(&state)
		if errors.Is(err, pgx.ErrNoRows) {
			return nil
		}
		if err == nil && state == StateDone {
			return releaseDone(key)
		}
		return err
	})
	if errors.Is(err, errdefs.ErrFailedPrecondition) {
		return err
	}
	if err != nil {
		return fmt.Errorf("release idempotency key %q: %w", key, pgKind(err))
	}
	return nil
}

func (s *pgStore) Reservation(ctx context.Context, key string) (CreateReservation, error) {
	var r CreateReservation
	err := s.retry(ctx, true, func(ctx context.Context) error {
		var err error
		r, err = scanPGReservation(s.pool.QueryRow(ctx, `SELECT `+pgReservationCols+` FROM idempotency WHERE key = $1`, key))
		return err
	})
	if errors.Is(err, pgx.ErrNoRows) {
		return CreateReservation{}, fmt.Errorf("reservation %q: %w", key, errdefs.ErrNotFound)
	}
	if err != nil {
		return CreateReservation{}, fmt.Errorf("read reservation %q: %w", key, pgKind(err))
	}
	return r, nil
}

func (s *pgStore) TouchCreate(ctx context.Context, key, nonce string) error {
	now := ms(time.Now())
	var n int64
	err := s.retry(ctx, true, func(ctx context.Context) error {
		tag, err := s.pool.Exec(ctx, `UPDATE idempotency SET updated = GREATEST(updated, $3)
			WHERE key = $1 AND nonce = $2 AND state = 'pending'`, key, nonce, now)
		n = tag.RowsAffected()
		return err
	})
	if err != nil {
		return fmt.Errorf("touch reservation %q: %w", key, pgKind(err))
	}
	if n == 0 {
		return noPendingReservation(key)
	}
	return nil
}

func (s *pgStore) StaleCreates(ctx context.Context, before time.Time, limit int) ([]CreateReservation, error) {
	var out []CreateReservation
	err := s.retry(ctx, true, func(ctx context.Context) error {
		rows, err := s.pool.Query(ctx, `SELECT `+pgReservationCols+` FROM idempotency
			WHERE state = 'pending' AND updated < $1 ORDER BY updated, key LIMIT $2`, before, limit)
		if err != nil {
			return err
		}
		out, err = pgx.CollectRows(rows, func(row pgx.CollectableRow) (CreateReservation, error) { return scanPGReservation(row) })
		return err
	})
	if err != nil {
		return nil, fmt.Errorf("list stale reservations: %w", pgKind(err))
	}
	if len(out) == 0 {
		return nil, nil
	}
	return out, nil
}

// pgAbandonSQL removes a pending reservation untouched since $3 and, only
// if it did, records the doubts, in one statement. It returns how many
// reservations it removed (0 or 1).
const pgAbandonSQL = `
WITH gone AS (
	DELETE FROM idempotency WHERE key = $1 AND nonce = $2 AND state = 'pending' AND updated < $3
	RETURNING 1),
ins AS (
	INSERT INTO create_doubts (node, token, prefix, idempotency_key, created)
	SELECT d.node, d.token, d.prefix, d.key, d.created
	FROM unnest($4::text[], $5::text[], $6::boolean[], $7::text[], $8::timestamptz[]) AS d (node, token, prefix, key, created)
	WHERE EXISTS (SELECT 1 FROM gone)
	ON CONFLICT (node, token) DO NOTHING
	RETURNING 1)
SELECT (SELECT count(*) FROM gone), (SELECT count(*) FROM ins)`

func (s *pgStore) AbandonCreate(ctx context.Context, key, nonce string, before time.Time, doubts []Doubt) (bool, error) {
	ds, err := checkDoubts(doubts)
	if err != nil {
		return false, err
	}
	a := pgDoubtArrays(ds)
	var removed, inserted int64
	err = s.retry(ctx, false, func(ctx context.Context) error {
		return s.pool.QueryRow(ctx, pgAbandonSQL, key, nonce, before, a.nodes, a.tokens, a.prefixes, a.keys, a.created).
			Scan(&removed, &inserted)
	})
	if err != nil {
		return false, fmt.Errorf("abandon reservation %q: %w", key, pgKind(err))
	}
	return removed == 1, nil
}

func (s *pgStore) SandboxRows(ctx context.Context, key string) ([]SandboxRow, error) {
	out, err := s.sandboxRows(ctx, `idempotency_key`, key)
	if err != nil {
		return nil, fmt.Errorf("list sandbox rows of %q: %w", key, pgKind(err))
	}
	return out, nil
}

func (s *pgStore) NodeSandboxRows(ctx context.Context, node string) ([]SandboxRow, error) {
	out, err := s.sandboxRows(ctx, `node`, node)
	if err != nil {
		return nil, fmt.Errorf("list sandbox rows of node %s: %w", node, pgKind(err))
	}
	return out, nil
}

// sandboxRows lists the rows whose column col (a constant) is v, by ID.
func (s *pgStore) sandboxRows(ctx context.Context, col, v string) ([]SandboxRow, error) {
	var out []SandboxRow
	err := s.retry(ctx, true, func(ctx context.Context) error {
		rows, err := s.pool.Query(ctx,
			`SELECT id, node, idempotency_key, created FROM sandboxes WHERE `+col+` = $1 ORDER BY id`, v)
		if err != nil {
			return err
		}
		out, err = pgx.CollectRows(rows, func(row pgx.CollectableRow) (SandboxRow, error) {
			var sb SandboxRow
			err := row.Scan(&sb.ID, &sb.Node, &sb.Key, &sb.Created)
			return sb, err
		})
		return err
	})
	if len(out) == 0 {
		return nil, err
	}
	return out, err
}

func (s *pgStore) DeleteSandboxRows(ctx context.Context, ids []string) error {
	if len(ids) == 0 {
		return nil
	}
	err := s.retry(ctx, true, func(ctx context.Context) error {
		_, err := s.pool.Exec(ctx, `DELETE FROM sandboxes WHERE id = ANY($1)`, ids)
		return err
	})
	if err != nil {
		return fmt.Errorf("delete %d sandbox rows: %w", len(ids), pgKind(err))
	}
	return nil
}

// --- doubts

type pgDoubts struct {
	nodes, tokens, keys []string
	prefixes            []bool
	created             []time.Time
}

func pgDoubtArrays(ds []Doubt) pgDoubts {
	a := pgDoubts{nodes: []string{}, tokens: []string{}, keys: []string{}, prefixes: []bool{}, created: []time.Time{}}
	for _, d := range ds {
		a.nodes, a.tokens, a.keys = append(a.nodes, d.Node), append(a.tokens, d.Token), append(a.keys, d.Key)
		a.prefixes, a.created = append(a.prefixes, d.Prefix), append(a.created, d.Created)
	}
	return a
}

func (s *pgStore) AddDoubts(ctx context.Context, doubts []Doubt) error {
	ds, err := checkDoubts(doubts)
	if err != nil || len(ds) == 0 {
		return err
	}
	a := pgDoubtArrays(ds)
	err = s.retry(ctx, true, func(ctx context.Context) error {
		_, err := s.pool.Exec(ctx, `INSERT INTO create_doubts (node, token, prefix, idempotency_key, created)
			SELECT * FROM unnest($1::text[], $2::text[], $3::boolean[], $4::text[], $5::timestamptz[])
			ON CONFLICT (node, token) DO NOTHING`, a.nodes, a.tokens, a.prefixes, a.keys, a.created)
		return err
	})
	if err != nil {
		return fmt.Errorf("record %d doubts: %w", len(ds), pgKind(err))
	}
	return nil
}

func (s *pgStore) Doubts(ctx context.Context) ([]Doubt, error) {
	var out []Doubt
	err := s.retry(ctx, true, func(ctx context.Context) error {
		rows, err := s.pool.Query(ctx, `SELECT node, token, prefix, idempotency_key, created FROM create_doubts
			ORDER BY node, created, token`)
		if err != nil {
			return err
		}
		out, err = pgx.CollectRows(rows, func(row pgx.CollectableRow) (Doubt, error) {
			var d Doubt
			err := row.Scan(&d.Node, &d.Token, &d.Prefix, &d.Key, &d.Created)
			return d, err
		})
		return err
	})
	if err != nil {
		return nil, fmt.Errorf("list doubts: %w", pgKind(err))
	}
	if len(out) == 0 {
		return nil, nil
	}
	return out, nil
}

func (s *pgStore) ClearDoubts(ctx context.Context, doubts []Doubt) error {
	if len(doubts) == 0 {
		return nil
	}
	a := pgDoubtArrays(doubts)
	err := s.retry(ctx, true, func(ctx context.Context) error {
		_, err := s.pool.Exec(ctx, `DELETE FROM create_doubts
			WHERE (node, token) IN (SELECT * FROM unnest($1::text[], $2::text[]))`, a.nodes, a.tokens)
		return err
	})
	if err != nil {
		return fmt.Errorf("clear %d doubts: %w", len(doubts), pgKind(err))
	}
	return nil
}

// --- node registry

const pgNodeCols = `name, slot, generation, addr, backends, max_sandboxes, cpus, memory_mb, identity, registered, last_seen`

func scanPGNode(row pgx.Row) (Node, error) {
	var n Node
	err := row.Scan(&n.Name, &n.Slot, &n.Generation, &n.Addr, &n.Backends, &n.MaxSandboxes, &n.CPUs, &n.MemoryMB,
		&n.Identity, &n.Registered, &n.LastSeen)
	n.Backends = nilIfEmpty(n.Backends)
	return n, err
}

type pgRegistry struct{ tx pgx.Tx }

func (r pgRegistry) node(ctx context.Context, name string) (Node, bool, error) {
	n, err := scanPGNode(r.tx.QueryRow(ctx, `SELECT `+pgNodeCols+` FROM nodes WHERE name = $1`, name))
	if errors.Is(err, pgx.ErrNoRows) {
		return Node{}, false, nil
	}
	return n, err == nil, err
}

func (r pgRegistry) freeSlot(ctx context.Context) (int, bool, error) {
	var slot int
	err := r.tx.QueryRow(ctx, freeSlotSQL).Scan(&slot)
	if errors.Is(err, pgx.ErrNoRows) {
		return 0, false, nil
	}
	return slot, err == nil, err
}

func (r pgRegistry) nextGeneration(ctx context.Context, slot int) (int64, error) {
	var gen int64
	err := r.tx.QueryRow(ctx, `INSERT INTO node_slots (slot, generation) VALUES ($1, 1)
		ON CONFLICT (slot) DO UPDATE SET generation = node_slots.generation + 1 RETURNING generation`, slot).Scan(&gen)
	return gen, err
}

func (r pgRegistry) insertNode(ctx context.Context, n Node) error {
	_, err := r.tx.Exec(ctx, `INSERT INTO nodes (`+pgNodeCols+`) VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11)`,
		n.Name, n.Slot, n.Generation, n.Addr, nonNil(n.Backends), n.MaxSandboxes, n.CPUs, n.MemoryMB, n.Identity,
		n.Registered, n.LastSeen)
	return err
}

func (r pgRegistry) updateNode(ctx context.Context, n Node) error {
	_, err := r.tx.Exec(ctx, `UPDATE nodes SET slot = $2, generation = $3, addr = $4, backends = $5, max_sandboxes = $6,
		cpus = $7, memory_mb = $8, identity = $9, registered = $10, last_seen = $11 WHERE name = $1`,
		n.Name, n.Slot, n.Generation, n.Addr, nonNil(n.Backends), n.MaxSandboxes, n.CPUs, n.MemoryMB, n.Identity,
		n.Registered, n.LastSeen)
	return err
}

func (s *pgStore) RegisterNode(ctx context.Context, n Node, liveWindow time.Duration) (Node, error) {
	if err := checkNode(n, liveWindow); err != nil {
		return Node{}, err
	}
	n.LastSeen = nowOr(n.LastSeen) // fixed before a retry, so a retry is the same registration
	var out Node
	// Registering again is idempotent: a retry after a commit whose answer
	// was lost finds the node with this identity and keeps it as it is.
	err := s.retry(ctx, true, func(ctx context.Context) error {
		return pgx.BeginFunc(ctx, s.pool, func(tx pgx.Tx) error {
			if _, err := tx.Exec(ctx, `SELECT pg_advisory_xact_lock($1)`, int64(registryLockID)); err != nil {
				return err
			}
			var err error
			out, err = registerNode(ctx, pgRegistry{tx}, n, liveWindow)
			return err
		})
	})
	if err != nil {
		if errors.Is(err, errdefs.ErrAlreadyExists) || errors.Is(err, errdefs.ErrResourceExhausted) {
			return Node{}, err
		}
		return Node{}, fmt.Errorf("register node %s: %w", n.Name, pgKind(err))
	}
	return out, nil
}

func (s *pgStore) Heartbeat(ctx context.Context, name string, generation int64, at time.Time) error {
	at = nowOr(at)
	var current int64
	err := s.retry(ctx, true, func(ctx context.Context) error {
		tag, err := s.pool.Exec(ctx, `UPDATE nodes SET last_seen = GREATEST(last_seen, $3) WHERE name = $1 AND generation = $2`,
			name, generation, at)
		if err != nil || tag.RowsAffected() == 1 {
			return err
		}
		return s.pool.QueryRow(ctx, `SELECT generation FROM nodes WHERE name = $1`, name).Scan(&current)
	})
	switch {
	case errors.Is(err, pgx.ErrNoRows):
		return fmt.Errorf("heartbeat from node %s: the node is not registered: %w", name, errdefs.ErrNotFound)
	case err != nil:
		return fmt.Errorf("heartbeat from node %s: %w", name, pgKind(err))
	case current != 0:
		return staleGeneration(name, generation, current)
	}
	return nil
}

func (s *pgStore) Nodes(ctx context.Context) ([]Node, error) {
	var out []Node
	err := s.retry(ctx, true, func(ctx context.Context) error {
		rows, err := s.pool.Query(ctx, `SELECT `+pgNodeCols+` FROM nodes ORDER BY slot`)
		if err != nil {
			return err
		}
		out, err = pgx.CollectRows(rows, func(row pgx.CollectableRow) (Node, error) { return scanPGNode(row) })
		return err
	})
	if err != nil {
		return nil, fmt.Errorf("list nodes: %w", pgKind(err))
	}
	if len(out) == 0 {
		return nil, nil
	}
	return out, nil
}

func (s *pgStore) NodeBySlot(ctx context.Context, slot int) (Node, error) {
	var n Node
	err := s.retry(ctx, true, func(ctx context.Context) error {
		var err error
		n, err = scanPGNode(s.pool.QueryRow(ctx, `SELECT `+pgNodeCols+` FROM nodes WHERE slot = $1`, slot))
		return err
	})
	if errors.Is(err, pgx.ErrNoRows) {
		return Node{}, fmt.Errorf("node slot %d: no node holds it: %w", slot, errdefs.ErrNotFound)
	}
	if err != nil {
		return Node{}, fmt.Errorf("read node slot %d: %w", slot, pgKind(err))
	}
	return n, nil
}

func (s *pgStore) RemoveNode(ctx context.Context, name string) error {
	var n int64
	err := s.retry(ctx, false, func(ctx context.Context) error {
		tag, err := s.pool.Exec(ctx, `DELETE FROM nodes WHERE name = $1`, name)
		n = tag.RowsAffected()
		return err
	})
	if err != nil {
		return fmt.Errorf("remove node %s: %w", name, pgKind(err))
	}
	if n == 0 {
		return fmt.Errorf("remove node %s: %w", name, errdefs.ErrNotFound)
	}
	return nil
}

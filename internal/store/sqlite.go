package store

import (
	"context"
	"database/sql"
	"encoding/json"
	"errors"
	"fmt"
	"slices"
	"time"

	"modernc.org/sqlite" // also registers the database/sql driver "sqlite"
	sqlite3 "modernc.org/sqlite/lib"

	"dsec.dev/dsec/internal/errdefs"
)

// sqliteStore is the Store in one SQLite file. Write transactions begin
// IMMEDIATE, so they take the file's write lock up front and serialise
// across every handle on the file instead of failing on upgrade.
type sqliteStore struct {
	*sqlDB
	db   *sql.DB
	path string
}

func openSQLite(ctx context.Context, path string) (Store, error) {
	db, err := sql.Open("sqlite", "file:"+path+
		"?_pragma=busy_timeout(10000)&_pragma=journal_mode(WAL)&_pragma=synchronous(NORMAL)&_pragma=foreign_keys(1)&_txlock=immediate")
	if err != nil {
		return nil, fmt.Errorf("open metadata store %s: %w", path, err)
	}
	db.SetMaxOpenConns(4)
	if err := migrate(ctx, db, dialectSQLite); err != nil {
		db.Close()
		return nil, fmt.Errorf("open metadata store %s: %w", path, sqliteKind(err))
	}
	iam := &sqlDB{db: db, dialect: dialectSQLite, kind: sqliteKind,
		retry: func(ctx context.Context, _ bool, op func(context.Context) error) error { return op(ctx) }}
	return &sqliteStore{sqlDB: iam, db: db, path: path}, nil
}

func (s *sqliteStore) Close() error { return s.db.Close() }

// sqliteKind adds the errdefs kind a SQLite error stands for.
func sqliteKind(err error) error {
	var e *sqlite.Error
	if !errors.As(err, &e) {
		return err
	}
	switch e.Code() & 0xff {
	case sqlite3.SQLITE_BUSY, sqlite3.SQLITE_LOCKED:
		return fmt.Errorf("%w: %w", errdefs.ErrUnavailable, err)
	}
	return err
}

func sqliteUnique(err error) bool {
	var e *sqlite.Error
	return errors.As(err, &e) &&
		(e.Code() == sqlite3.SQLITE_CONSTRAINT_UNIQUE || e.Code() == sqlite3.SQLITE_CONSTRAINT_PRIMARYKEY)
}

// inTx runs fn in a write transaction and commits it if fn returns nil.
func (s *sqliteStore) inTx(ctx context.Context, fn func(tx *sql.Tx) error) error {
	tx, err := s.db.BeginTx(ctx, nil)
	if err != nil {
		return sqliteKind(err)
	}
	if err := fn(tx); err != nil {
		tx.Rollback()
		return err
	}
	return sqliteKind(tx.Commit())
}

func encodeList(l []string) string {
	if len(l) == 0 {
		return "[]"
	}
	b, _ := json.Marshal(l)
	return string(b)
}

func decodeList(s string) ([]string, error) {
	var l []string
	if err := json.Unmarshal([]byte(s), &l); err != nil {
		return nil, fmt.Errorf("decode list %q: %w", s, err)
	}
	if len(l) == 0 {
		return nil, nil
	}
	return l, nil
}

func msTime(v int64) time.Time { return time.UnixMilli(v) }

func nullMs(v sql.NullInt64) time.Time {
	if !v.Valid {
		return time.Time{}
	}
	return time.UnixMilli(v.Int64)
}

func msNull(t time.Time) sql.NullInt64 {
	if t.IsZero() {
		return sql.NullInt64{}
	}
	return sql.NullInt64{Int64: t.UnixMilli(), Valid: true}
}

// --- idempotency and reservations

const sqliteReservationCols = `key, request_hash, owner, placements, state, ids, created_ms, updated_ms, nonce`

func scanSQLiteReservation(row interface{ Scan(...any) error }) (CreateReservation, error) {
	var r CreateReservation
	var placements, ids string
	var created, updated int64
	if err := row.Scan(&r.Key, &r.RequestHash, &r.Owner, &placements, &r.State, &ids, &created, &updated, &r.Nonce); err != nil {
		return CreateReservation{}, err
	}
	var err error
	if r.Placements, err = decodeList(placements); err != nil {
		return CreateReservation{}, err
	}
	if r.IDs, err = decodeList(ids); err != nil {
		return CreateReservation{}, err
	}
	r.Created, r.Updated = msTime(created), msTime(updated)
	return r, nil
}

func (s *sqliteStore) GetIdempotency(ctx context.Context, key string) (Idempotency, error) {
	r, err := scanSQLiteReservation(s.db.QueryRowContext(ctx,
		`SELECT `+sqliteReservationCols+` FROM idempotency WHERE key = ? AND state = 'done'`, key))
	if errors.Is(err, sql.ErrNoRows) {
		return Idempotency{}, fmt.Errorf("idempotency key %q: %w", key, errdefs.ErrNotFound)
	}
	if err != nil {
		return Idempotency{}, fmt.Errorf("read idempotency key %q: %w", key, sqliteKind(err))
	}
	return Idempotency{Key: r.Key, RequestHash: r.RequestHash, IDs: r.IDs, Created: r.Created}, nil
}

func (s *sqliteStore) PutIdempotency(ctx context.Context, rec Idempotency) error {
	created := nowOr(rec.Created)
	_, err := s.db.ExecContext(ctx,
		`INSERT OR REPLACE INTO idempotency (`+sqliteReservationCols+`) VALUES (?, ?, '', '[]', 'done', ?, ?, ?, '')`,
		rec.Key, rec.RequestHash, encodeList(rec.IDs), created.UnixMilli(), created.UnixMilli())
	if err != nil {
		return fmt.Errorf("write idempotency key %q: %w", rec.Key, sqliteKind(err))
	}
	return nil
}

func (s *sqliteStore) ExpireIdempotency(ctx context.Context, olderThan time.Time) (int, error) {
	res, err := s.db.ExecContext(ctx, `DELETE FROM idempotency WHERE state = 'done' AND created_ms < ?`, olderThan.UnixMilli())
	if err != nil {
		return 0, fmt.Errorf("expire idempotency records: %w", sqliteKind(err))
	}
	n, _ := res.RowsAffected()
	return int(n), nil
}

func (s *sqliteStore) ReserveCreate(ctx context.Context, r CreateReservation) (CreateReservation, bool, error) {
	r, err := newReservation(r)
	if err != nil {
		return CreateReservation{}, false, err
	}
	var got CreateReservation
	reserved := false
	err = s.inTx(ctx, func(tx *sql.Tx) error {
		old, err := scanSQLiteReservation(tx.QueryRowContext(ctx,
			`SELECT `+sqliteReservationCols+` FROM idempotency WHERE key = ?`, r.Key))
		if err == nil {
			got = old
			return nil
		}
		if !errors.Is(err, sql.ErrNoRows) {
			return sqliteKind(err)
		}
		_, err = tx.ExecContext(ctx, `INSERT INTO idempotency (`+sqliteReservationCols+`) VALUES (?, ?, ?, ?, 'pending', '[]', ?, ?, ?)`,
			r.Key, r.RequestHash, r.Owner, encodeList(r.Placements), r.Created.UnixMilli(), r.Updated.UnixMilli(), r.Nonce)
		if err != nil {
			return sqliteKind(err)
		}
		if err := s.chargeReservation(ctx, tx, r); err != nil {
			return err
		}
		got, reserved = r, true
		return nil
	})
	if err != nil {
		return CreateReservation{}, false, wrap(fmt.Sprintf("reserve idempotency key %q", r.Key), err)
	}
	if !reserved && got.RequestHash != r.RequestHash {
		return CreateReservation{}, false, differentRequest(r.Key)
	}
	return got, reserved, nil
}

func (s *sqliteStore) CompleteCreate(ctx context.Context, key, nonce string, sbs []SandboxRow) error {
	rows, ids, err := completeRows(key, sbs)
	if err != nil {
		return err
	}
	return s.inTx(ctx, func(tx *sql.Tx) error {
		var state, done, current string
		err := tx.QueryRowContext(ctx, `SELECT state, ids, nonce FROM idempotency WHERE key = ?`, key).Scan(&state, &done, &current)
		if errors.Is(err, sql.ErrNoRows) {
			return fmt.Errorf("complete create %q: no reservation: %w", key, errdefs.ErrNotFound)
		}
		if err != nil {
			return fmt.Errorf("complete create %q: %w", key, sqliteKind(err))
		}
		if state == StateDone {
			have, err := decodeList(done)
			if err != nil {
				return fmt.Errorf("complete create %q: %w", key, err)
			}
			if !slices.Equal(have, ids) {
				return otherIDs(key)
			}
			return nil
		}
		if current != nonce {
			return fmt.Errorf("complete create %q: %w", key, reservedAgain())
		}
		ins, err := tx.PrepareContext(ctx, `INSERT INTO sandboxes (id, node, idempotency_key, created_ms) VALUES (?, ?, ?, ?)`)
		if err != nil {
			return fmt.Errorf("complete create %q: %w", key, sqliteKind(err))
		}
		defer ins.Close()
		for _, sb := range rows {
			if _, err := ins.ExecContext(ctx, sb.ID, sb.Node, sb.Key, sb.Created.UnixMilli()); err != nil {
				if sqliteUnique(err) {
					return fmt.Errorf("complete create %q: sandbox %s is already recorded: %w", key, sb.ID, errdefs.ErrAlreadyExists)
				}
				return fmt.Errorf("complete create %q: record sandbox %s: %w", key, sb.ID, sqliteKind(err))
			}
		}
		_, err = tx.ExecContext(ctx, `UPDATE idempotency SET state = 'done', ids = ?, updated_ms = ? WHERE key = ?`,
			encodeList(ids), time.Now().UnixMilli(), key)
		if err != nil {
			return fmt.Errorf("complete create %q: %w", key, sqliteKind(err))
		}
		return nil
	})
}

func (s *sqliteStore) ReleaseCreate(ctx context.Context, key string) error {
	return s.inTx(ctx, func(tx *sql.Tx) error {
		var state string
		err := tx.QueryRowContext(ctx, `SELECT state FROM idempotency WHERE key = ?`, key).Scan(&state)
		if errors.Is(err, sql.ErrNoRows) {
			return nil
		}
		if err != nil {
			return fmt.Errorf("release idempotency key %q: %w", key, sqliteKind(err))
		}
		if state == StateDone {
			return releaseDone(key)
		}
		if _, err := tx.ExecContext(ctx, `DELETE FROM idempotency WHERE key = ? AND state = 'pending'`, key); err != nil {
			return fmt.Errorf("release idempotency key %q: %w", key, sqliteKind(err))
		}
		return nil
	})
}

func releaseDone(key string) error {
	return fmt.Errorf("release idempotency key %q: its create is done: %w", key, errdefs.ErrFailedPrecondition)
}

func (s *sqliteStore) Reservation(ctx context.Context, key string) (CreateReservation, error) {
	r, err := scanSQLiteReservation(s.db.QueryRowContext(ctx,
		`SELECT `+sqliteReservationCols+` FROM idempotency WHERE key = ?`, key))
	if errors.Is(err, sql.ErrNoRows) {
		return CreateReservation{}, fmt.Errorf("reservation %q: %w", key, errdefs.ErrNotFound)
	}
	if err != nil {
		return CreateReservation{}, fmt.Errorf("read reservation %q: %w", key, sqliteKind(err))
	}
	return r, nil
}

func (s *sqliteStore) TouchCreate(ctx context.Context, key, nonce string) error {
	res, err := s.db.ExecContext(ctx, `UPDATE idempotency SET updated_ms = max(updated_ms, ?)
		WHERE key = ? AND nonce = ? AND state = 'pending'`, time.Now().UnixMilli(), key, nonce)
	if err != nil {
		return fmt.Errorf("touch reservation %q: %w", key, sqliteKind(err))
	}
	if n, _ := res.RowsAffected(); n == 0 {
		return noPendingReservation(key)
	}
	return nil
}

func (s *sqliteStore) StaleCreates(ctx context.Context, before time.Time, limit int) ([]CreateReservation, error) {
	rows, err := s.db.QueryContext(ctx, `SELECT `+sqliteReservationCols+` FROM idempotency
		WHERE state = 'pending' AND updated_ms < ? ORDER BY updated_ms, key LIMIT ?`, before.UnixMilli(), limit)
	if err != nil {
		return nil, fmt.Errorf("list stale reservations: %w", sqliteKind(err))
	}
	defer rows.Close()
	var out []CreateReservation
	for rows.Next() {
		r, err := scanSQLiteReservation(rows)
		if err != nil {
			return nil, fmt.Errorf("list stale reservations: %w", err)
		}
		out = append(out, r)
	}
	if err := rows.Err(); err != nil {
		return nil, fmt.Errorf("list stale reservations: %w", sqliteKind(err))
	}
	return out, nil
}

func (s *sqliteStore) AbandonCreate(ctx context.Context, key, nonce string, before time.Time, doubts []Doubt) (bool, error) {
	ds, err := checkDoubts(doubts)
	if err != nil {
		return false, err
	}
	removed := false
	err = s.inTx(ctx, func(tx *sql.Tx) error {
		res, err := tx.ExecContext(ctx, `DELETE FROM idempotency WHERE key = ? AND nonce = ? AND state = 'pending' AND updated_ms < ?`,
			key, nonce, before.UnixMilli())
		if err != nil {
			return sqliteKind(err)
		}
		if n, _ := res.RowsAffected(); n == 0 {
			return nil
		}
		removed = true
		return insertDoubts(ctx, tx, ds)
	})
	if err != nil {
		return false, fmt.Errorf("abandon reservation %q: %w", key, err)
	}
	return removed, nil
}

func (s *sqliteStore) SandboxRows(ctx context.Context, key string) ([]SandboxRow, error) {
	out, err := s.sandboxRows(ctx, `idempotency_key`, key)
	if err != nil {
		return nil, fmt.Errorf("list sandbox rows of %q: %w", key, err)
	}
	return out, nil
}

func (s *sqliteStore) NodeSandboxRows(ctx context.Context, node string) ([]SandboxRow, error) {
	out, err := s.sandboxRows(ctx, `node`, node)
	if err != nil {
		return nil, fmt.Errorf("list sandbox rows of node %s: %w", node, err)
	}
	return out, nil
}

// sandboxRows lists the rows whose column col (a constant) is v, by ID.
func (s *sqliteStore) sandboxRows(ctx context.Context, col, v string) ([]SandboxRow, error) {
	rows, err := s.db.QueryContext(ctx,
		`SELECT id, node, idempotency_key, created_ms FROM sandboxes WHERE `+col+` = ? ORDER BY id`, v)
	if err != nil {
		return nil, sqliteKind(err)
	}
	defer rows.Close()
	var out []SandboxRow
	for rows.Next() {
		var sb SandboxRow
		var created int64
		if err := rows.Scan(&sb.ID, &sb.Node, &sb.Key, &created); err != nil {
			return nil, err
		}
		sb.Created = msTime(created)
		out = append(out, sb)
	}
	return out, sqliteKind(rows.Err())
}

func (s *sqliteStore) DeleteSandboxRows(ctx context.Context, ids []string) error {
	if len(ids) == 0 {
		return nil
	}
	_, err := s.db.ExecContext(ctx, `DELETE FROM sandboxes WHERE id IN (SELECT value FROM json_each(?))`, encodeList(ids))
	if err != nil {
		return fmt.Errorf("delete %d sandbox rows: %w", len(ids), sqliteKind(err))
	}
	return nil
}

// --- doubts

// insertDoubts records doubts in tx, keeping any already recorded.
func insertDoubts(ctx context.Context, tx *sql.Tx, ds []Doubt) error {
	if len(ds) == 0 {
		return nil
	}
	ins, err := tx.PrepareContext(ctx, `INSERT INTO create_doubts (node, token, prefix, idempotency_key, created_ms)
		VALUES (?, ?, ?, ?, ?) ON CONFLICT (node, token) DO NOTHING`)
	if err != nil {
		return sqliteKind(err)
	}
	defer ins.Close()
	for _, d := range ds {
		if _, err := ins.ExecContext(ctx, d.Node, d.Token, d.Prefix, d.Key, d.Created.UnixMilli()); err != nil {
			return sqliteKind(err)
		}
	}
	return nil
}

func (s *sqliteStore) AddDoubts(ctx context.Context, doubts []Doubt) error {
	ds, err := checkDoubts(doubts)
	if err != nil || len(ds) == 0 {
		return err
	}
	if err := s.inTx(ctx, func(tx *sql.Tx) error { return insertDoubts(ctx, tx, ds) }); err != nil {
		return fmt.Errorf("record %d doubts: %w", len(ds), err)
	}
	return nil
}

func (s *sqliteStore) Doubts(ctx context.Context) ([]Doubt, error) {
	rows, err := s.db.QueryContext(ctx, `SELECT node, token, prefix, idempotency_key, created_ms FROM create_doubts
		ORDER BY node, created_ms, token`)
	if err != nil {
		return nil, fmt.Errorf("list doubts: %w", sqliteKind(err))
	}
	defer rows.Close()
	var out []Doubt
	for rows.Next() {
		var d Doubt
		var created int64
		if err := rows.Scan(&d.Node, &d.Token, &d.Prefix, &d.Key, &created); err != nil {
			return nil, fmt.Errorf("list doubts: %w", err)
		}
		d.Created = msTime(created)
		out = append(out, d)
	}
	if err := rows.Err(); err != nil {
		return nil, fmt.Errorf("list doubts: %w", sqliteKind(err))
	}
	return out, nil
}

func (s *sqliteStore) ClearDoubts(ctx context.Context, doubts []Doubt) error {
	if len(doubts) == 0 {
		return nil
	}
	err := s.inTx(ctx, func(tx *sql.Tx) error {
		del, err := tx.PrepareContext(ctx, `DELETE FROM create_doubts WHERE node = ? AND token = ?`)
		if err != nil {
			return sqliteKind(err)
		}
		defer del.Close()
		for _, d := range doubts {
			if _, err := del.ExecContext(ctx, d.Node, d.Token); err != nil {
				return sqliteKind(err)
			}
		}
		return nil
	})
	if err != nil {
		return fmt.Errorf("clear %d doubts: %w", len(doubts), err)
	}
	return nil
}

// --- node registry

const sqliteNodeCols = `name, slot, generation, addr, backends, max_sandboxes, cpus, memory_mb, identity, registered_ms, last_seen_ms`

func scanSQLiteNode(row interface{ Scan(...any) error }) (Node, error) {
	var n Node
	var backends string
	var registered, seen int64
	err := row.Scan(&n.Name, &n.Slot, &n.Generation, &n.Addr, &backends, &n.MaxSandboxes, &n.CPUs, &n.MemoryMB,
		&n.Identity, &registered, &seen)
	if err != nil {
		return Node{}, err
	}
	if n.Backends, err = decodeList(backends); err != nil {
		return Node{}, err
	}
	n.Registered, n.LastSeen = msTime(registered), msTime(seen)
	return n, nil
}

type sqliteRegistry struct{ tx *sql.Tx }

func (r sqliteRegistry) node(ctx context.Context, name string) (Node, bool, error) {
	n, err := scanSQLiteNode(r.tx.QueryRowContext(ctx, `SELECT `+sqliteNodeCols+` FROM nodes WHERE name = ?`, name))
	if errors.Is(err, sql.ErrNoRows) {
		return Node{}, false, nil
	}
	if err != nil {
		return Node{}, false, sqliteKind(err)
	}
	return n, true, nil
}

func (r sqliteRegistry) freeSlot(ctx context.Context) (int, bool, error) {
	var slot int
	err := r.tx.QueryRowContext(ctx, freeSlotSQL).Scan(&slot)
	if errors.Is(err, sql.ErrNoRows) {
		return 0, false, nil
	}
	if err != nil {
		return 0, false, sqliteKind(err)
	}
	return slot, true, nil
}

func (r sqliteRegistry) nextGeneration(ctx context.Context, slot int) (int64, error) {
	var gen int64
	err := r.tx.QueryRowContext(ctx, `INSERT INTO node_slots (slot, generation) VALUES (?, 1)
		ON CONFLICT (slot) DO UPDATE SET generation = generation + 1 RETURNING generation`, slot).Scan(&gen)
	return gen, sqliteKind(err)
}

func (r sqliteRegistry) insertNode(ctx context.Context, n Node) error {
	_, err := r.tx.ExecContext(ctx, `INSERT INTO nodes (`+sqliteNodeCols+`) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)`,
		n.Name, n.Slot, n.Generation, n.Addr, encodeList(n.Backends), n.MaxSandboxes, n.CPUs, n.MemoryMB, n.Identity,
		n.Registered.UnixMilli(), n.LastSeen.UnixMilli())
	return sqliteKind(err)
}

func (r sqliteRegistry) updateNode(ctx context.Context, n Node) error {
	_, err := r.tx.ExecContext(ctx, `UPDATE nodes SET slot = ?, generation = ?, addr = ?, backends = ?, max_sandboxes = ?,
		cpus = ?, memory_mb = ?, identity = ?, registered_ms = ?, last_seen_ms = ? WHERE name = ?`,
		n.Slot, n.Generation, n.Addr, encodeList(n.Backends), n.MaxSandboxes, n.CPUs, n.MemoryMB, n.Identity,
		n.Registered.UnixMilli(), n.LastSeen.UnixMilli(), n.Name)
	return sqliteKind(err)
}

func (s *sqliteStore) RegisterNode(ctx context.Context, n Node, liveWindow time.Duration) (Node, error) {
	if err := checkNode(n, liveWindow); err != nil {
		return Node{}, err
	}
	var out Node
	err := s.inTx(ctx, func(tx *sql.Tx) error {
		var err error
		out, err = registerNode(ctx, sqliteRegistry{tx}, n, liveWindow)
		return err
	})
	if err != nil {
		if errors.Is(err, errdefs.ErrAlreadyExists) || errors.Is(err, errdefs.ErrResourceExhausted) {
			return Node{}, err
		}
		return Node{}, fmt.Errorf("register node %s: %w", n.Name, err)
	}
	return out, nil
}

func (s *sqliteStore) Heartbeat(ctx context.Context, name string, generation int64, at time.Time) error {
	res, err := s.db.ExecContext(ctx, `UPDATE nodes SET last_seen_ms = max(last_seen_ms, ?) WHERE name = ? AND generation = ?`,
		nowOr(at).UnixMilli(), name, generation)
	if err != nil {
		return fmt.Errorf("heartbeat from node %s: %w", name, sqliteKind(err))
	}
	if n, _ := res.RowsAffected(); n == 1 {
		return nil
	}
	var current int64
	err = s.db.QueryRowContext(ctx, `SELECT generation FROM nodes WHERE name = ?`, name).Scan(&current)
	if errors.Is(err, sql.ErrNoRows) {
		return fmt.Errorf("heartbeat from node %s: the node is not registered: %w", name, errdefs.ErrNotFound)
	}
	if err != nil {
		return fmt.Errorf("heartbeat from node %s: %w", name, sqliteKind(err))
	}
	return staleGeneration(name, generation, current)
}

func (s *sqliteStore) Nodes(ctx context.Context) ([]Node, error) {
	rows, err := s.db.QueryContext(ctx, `SELECT `+sqliteNodeCols+` FROM nodes ORDER BY slot`)
	if err != nil {
		return nil, fmt.Errorf("list nodes: %w", sqliteKind(err))
	}
	defer rows.Close()
	var out []Node
	for rows.Next() {
		n, err := scanSQLiteNode(rows)
		if err != nil {
			return nil, fmt.Errorf("list nodes: %w", err)
		}
		out = append(out, n)
	}
	if err := rows.Err(); err != nil {
		return nil, fmt.Errorf("list nodes: %w", sqliteKind(err))
	}
	return out, nil
}

func (s *sqliteStore) NodeBySlot(ctx context.Context, slot int) (Node, error) {
	n, err := scanSQLiteNode(s.db.QueryRowContext(ctx, `SELECT `+sqliteNodeCols+` FROM nodes WHERE slot = ?`, slot))
	if errors.Is(err, sql.ErrNoRows) {
		return Node{}, fmt.Errorf("node slot %d: no node holds it: %w", slot, errdefs.ErrNotFound)
	}
	if err != nil {
		return Node{}, fmt.Errorf("read node slot %d: %w", slot, sqliteKind(err))
	}
	return n, nil
}

func (s *sqliteStore) RemoveNode(ctx context.Context, name string) error {
	res, err := s.db.ExecContext(ctx, `DELETE FROM nodes WHERE name = ?`, name)
	if err != nil {
		return fmt.Errorf("remove node %s: %w", name, sqliteKind(err))
	}
	if n, _ := res.RowsAffected(); n == 0 {
		return fmt.Errorf("remove node %s: %w", name, errdefs.ErrNotFound)
	}
	return nil
}

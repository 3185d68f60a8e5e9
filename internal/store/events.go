package store

import (
	"context"
	"database/sql"
	"fmt"
	"strings"
	"time"

	"dsec.dev/dsec/internal/errdefs"
	"dsec.dev/dsec/internal/iam"
)

// Events is the durable stream of sandbox lifecycle events: what the edges
// reported (created, paused, resumed, deleted, expired, failed…), each
// stored once under its key however often it is appended, read by cursor.
type Events interface {
	// AppendEvents stores the events whose keys it has not stored yet, in
	// order, and returns how many it stored; an event whose key is stored
	// already is skipped (appending the same events again is a no-op). ID
	// is set by the store: it grows with each stored event, and a reader
	// at a cursor never misses an event stored after it read (ids commit
	// in order).
	AppendEvents(ctx context.Context, evs ...Event) (int, error)
	// ListEvents returns the events q selects, in ID order.
	ListEvents(ctx context.Context, q EventQuery) ([]Event, error)
	// ExpireEvents forgets the events older than olderThan (by At) and
	// returns how many it removed.
	ExpireEvents(ctx context.Context, olderThan time.Time) (int, error)
	// LastEventID is the ID of the last event stored (0: none): the
	// stream's end now.
	LastEventID(ctx context.Context) (int64, error)
}

// Event is one lifecycle event of a sandbox.
type Event struct {
	ID int64 `json:"id"`
	// Key names the event wherever it is reported from (the edge's
	// NODE/EPOCH/SEQ): the same key is stored once.
	Key       string    `json:"key"`
	At        time.Time `json:"at"`
	Project   string    `json:"project"` // path, "" for the root
	SandboxID string    `json:"sandbox_id"`
	Kind      string    `json:"kind"`
	Node      string    `json:"node,omitempty"`
	Reason    string    `json:"reason,omitempty"`
	Message   string    `json:"message,omitempty"`
}

// EventQuery selects events. Zero fields select everything.
type EventQuery struct {
	// Projects are paths, each selecting the project and everything under
	// it; none, or the root (""), selects every project.
	Projects []string
	After    int64 // IDs above this
	Since    time.Time
	// SandboxID, when set, selects that sandbox's events only; Kinds, when
	// set, those kinds only.
	SandboxID string
	Kinds     []string
	// Before, when set, selects IDs below it; NewestFirst returns the
	// last Limit selected, by ID descending (a console's newest first).
	Before      int64
	NewestFirst bool
	// Limit bounds how many events come back (the first by ID); 0 is
	// DefaultEventLimit.
	Limit int
}

// DefaultEventLimit is how many events ListEvents returns when no limit
// is given.
const DefaultEventLimit = 1000

// eventBatch is how many events one INSERT takes (9 parameters each).
const eventBatch = 100

// eventLockID is the advisory lock a PostgreSQL append holds, so appends
// commit one at a time and ids become visible in order.
const eventLockID = 0x6473656365766e74

func checkEvents(evs []Event) error {
	for _, ev := range evs {
		if ev.Key == "" || ev.Kind == "" {
			return fmt.Errorf("append event of sandbox %s: key and kind are required: %w", ev.SandboxID, errdefs.ErrInvalidArgument)
		}
	}
	return nil
}

func (d *sqlDB) AppendEvents(ctx context.Context, evs ...Event) (int, error) {
	if len(evs) == 0 {
		return 0, nil
	}
	if err := checkEvents(evs); err != nil {
		return 0, err
	}
	var added int
	err := d.inTx(ctx, func(tx *sql.Tx) error {
		var err error
		added, err = d.appendEvents(ctx, tx, evs)
		return err
	})
	if err != nil {
		return 0, d.fail(fmt.Sprintf("append %d events", len(evs)), err)
	}
	return added, nil
}

// appendEvents inserts evs in tx (each key once) and returns how many it
// stored. On PostgreSQL it first takes the append's advisory lock, held
// until tx ends.
func (d *sqlDB) appendEvents(ctx context.Context, tx *sql.Tx, evs []Event) (int, error) {
	return d.insertEvents(ctx, tx, evs, true)
}

// insertEvents is appendEvents, lock says whether to take the advisory
// lock (false: the caller holds it).
func (d *sqlDB) insertEvents(ctx context.Context, tx *sql.Tx, evs []Event, lock bool) (int, error) {
	added := 0
	if lock && d.dialect == dialectPostgres {
		if _, err := tx.ExecContext(ctx, `SELECT pg_advisory_xact_lock($1)`, int64(eventLockID)); err != nil {
			return 0, err
		}
	}
	for rest := evs; len(rest) > 0; {
		n := min(len(rest), eventBatch)
		batch := rest[:n]
		rest = rest[n:]
		var sb strings.Builder
		sb.WriteString(`INSERT INTO events (key, at{ms}, project, sandbox_id, kind, node, reason, message) VALUES `)
		args := make([]any, 0, 8*n)
		for i, ev := range batch {
			if i > 0 {
				sb.WriteString(", ")
			}
			sb.WriteString("(?, ?, ?, ?, ?, ?, ?, ?)")
			args = append(args, ev.Key, d.ts(nowOr(ev.At)), ev.Project, ev.SandboxID, ev.Kind, ev.Node, ev.Reason, clip(ev.Message, 1000))
		}
		sb.WriteString(` ON CONFLICT (key) DO NOTHING`)
		res, err := tx.ExecContext(ctx, d.q(sb.String()), args...)
		if err != nil {
			return 0, err
		}
		k, _ := res.RowsAffected()
		added += int(k)
	}
	return added, nil
}

func clip(s string, n int) string {
	if len(s) > n {
		return s[:n]
	}
	return s
}

func (d *sqlDB) ListEvents(ctx context.Context, q EventQuery) ([]Event, error) {
	cond, args := `id > ?`, []any{q.After}
	var subtrees []string
	all := len(q.Projects) == 0
	for _, p := range q.Projects {
		path, err := iam.CleanPath(p)
		if err != nil {
			return nil, err
		}
		if path == "" {
			all = true
			break
		}
		// The project itself, or a path between "p/" and "p0" ('0'
		// follows '/').
		subtrees = append(subtrees, `(project = ? OR (project >= ? AND project < ?))`)
		args = append(args, path, path+"/", path+"0")
	}
	if !all {
		cond += ` AND (` + strings.Join(subtrees, " OR ") + `)`
	} else {
		args = args[:1]
	}
	if !q.Since.IsZero() {
		cond += ` AND at{ms} >= ?`
		args = append(args, d.ts(q.Since))
	}
	if q.SandboxID != "" {
		cond += ` AND sandbox_id = ?`
		args = append(args, q.SandboxID)
	}
	if len(q.Kinds) > 0 {
		cond += ` AND kind IN (` + placeholders(len(q.Kinds)) + `)`
		for _, k := range q.Kinds {
			args = append(args, k)
		}
	}
	if q.Before > 0 {
		cond += ` AND id < ?`
		args = append(args, q.Before)
	}
	order := "id"
	if q.NewestFirst {
		order = "id DESC"
	}
	limit := q.Limit
	if limit <= 0 {
		limit = DefaultEventLimit
	}
	args = append(args, limit)
	var out []Event
	err := d.retry(ctx, true, func(ctx context.Context) error {
		out = nil
		rows, err := d.db.QueryContext(ctx, d.q(`SELECT id, key, at{ms}, project, sandbox_id, kind, node, reason, message
			FROM events WHERE `+cond+` ORDER BY `+order+` LIMIT ?`), args...)
		if err != nil {
			return err
		}
		defer rows.Close()
		for rows.Next() {
			var e Event
			if err := rows.Scan(&e.ID, &e.Key, timeCol{&e.At}, &e.Project, &e.SandboxID, &e.Kind, &e.Node, &e.Reason, &e.Message); err != nil {
				return err
			}
			out = append(out, e)
		}
		return rows.Err()
	})
	if err != nil {
		return nil, d.fail("list events", err)
	}
	return out, nil
}

func (d *sqlDB) ExpireEvents(ctx context.Context, olderThan time.Time) (int, error) {
	var n int64
	err := d.retry(ctx, true, func(ctx context.Context) error {
		res, err := d.db.ExecContext(ctx, d.q(`DELETE FROM events WHERE at{ms} < ?`), d.ts(olderThan))
		if err != nil {
			return err
		}
		n, _ = res.RowsAffected()
		return nil
	})
	if err != nil {
		return 0, d.fail("expire events", err)
	}
	return int(n), nil
}

func (d *sqlDB) LastEventID(ctx context.Context) (int64, error) {
	var id int64
	err := d.retry(ctx, true, func(ctx context.Context) error {
		return d.db.QueryRowContext(ctx, `SELECT COALESCE(MAX(id), 0) FROM events`).Scan(&id)
	})
	if err != nil {
		return 0, d.fail("read the last event's ID", err)
	}
	return id, nil
}

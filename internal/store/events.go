package store

import (
	"context"
	"database/sql"
	"fmt"
	"slices"
	"strings"
	"time"

	"dsec.dev/dsec/internal/errdefs"
	"dsec.dev/dsec/internal/iam"
)

// Events is the durable stream of sandbox lifecycle events: what the edges
// reported (created, paused, resumed, deleted, expired, failed…), read by
// cursor.
type Events interface {
	// AppendEvents stores evs, in order, as one pull from no node
	// (PullEvents without a cursor), and returns how many it stored. IDs
	// are set by the store: they grow with each stored event, and a
	// reader at a cursor never misses an event stored after it read (ids
	// commit in order).
	AppendEvents(ctx context.Context, evs ...Event) (int, error)
	// ListEvents returns the events q selects, in ID order.
	ListEvents(ctx context.Context, q EventQuery) ([]Event, error)
	// ExpireEvents forgets the events older than olderThan (by At) and
	// returns how many it removed. Events are stored in packs of one
	// pull's (docs/events.md), and a pack goes when its newest event is
	// older than olderThan.
	ExpireEvents(ctx context.Context, olderThan time.Time) (int, error)
	// LastEventID is the ID of the last event stored (0: none): the
	// stream's end now.
	LastEventID(ctx context.Context) (int64, error)
}

// Event is one lifecycle event of a sandbox.
type Event struct {
	ID int64 `json:"id"`
	// Key names the event wherever it is reported from (the edge's
	// NODE/EPOCH/SEQ): a reader that must see each event once whatever
	// happens keys on it (docs/events.md "Once").
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

// packsARead is how many packs one query of ListEvents reads; it reads
// more while it has fewer events than its limit and packs are left.
const packsARead = 32

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
	packs := packEvents(evs)
	err := d.inTx(ctx, func(tx *sql.Tx) error { return d.insertPacks(ctx, tx, packs) })
	if err != nil {
		return 0, d.fail(fmt.Sprintf("append %d events", len(evs)), err)
	}
	return len(evs), nil
}

// insertPack stores a pack: its last and first ID, project, first and last
// time, and events encoded.
const insertPack = `INSERT INTO event_packs (last_id, first_id, project, first_at{ms}, last_at{ms}, events) VALUES (?, ?, ?, ?, ?, ?)`

// insertPacks stores packs in tx: it takes as many IDs as they hold
// events from the event_ids counter, whose row stays locked until tx
// ends, so the packs of two writers commit in the order of their IDs, and
// gives each pack its range in turn.
func (d *sqlDB) insertPacks(ctx context.Context, tx *sql.Tx, packs []eventPack) error {
	n := eventsIn(packs)
	var last int64
	if err := tx.QueryRowContext(ctx, d.q(`UPDATE event_ids SET last_id = last_id + ? WHERE one = 1 RETURNING last_id`), n).Scan(&last); err != nil {
		return fmt.Errorf("take %d event IDs: %w", n, err)
	}
	next := last - int64(n) + 1
	for _, p := range packs {
		first := next
		next += int64(len(p.events))
		if _, err := tx.ExecContext(ctx, d.q(insertPack), next-1, first, p.project, d.ts(p.firstAt), d.ts(p.last), encodePack(p.events)); err != nil {
			return err
		}
	}
	return nil
}

func clip(s string, n int) string {
	if len(s) > n {
		return s[:n]
	}
	return s
}

// eventFilter is what ListEvents checks of each event of a pack its query
// selected (the pack's project and times the query itself checks).
type eventFilter struct {
	after, before int64
	since         time.Time
	sandbox       string
	kinds         []string
}

func (f eventFilter) keep(e Event) bool {
	return e.ID > f.after && (f.before <= 0 || e.ID < f.before) && (f.since.IsZero() || !e.At.Before(f.since)) &&
		(f.sandbox == "" || e.SandboxID == f.sandbox) && (len(f.kinds) == 0 || slices.Contains(f.kinds, e.Kind))
}

func (d *sqlDB) ListEvents(ctx context.Context, q EventQuery) ([]Event, error) {
	var cond []string
	var args []any
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
	if all {
		args = nil
	} else {
		cond = append(cond, `(`+strings.Join(subtrees, " OR ")+`)`)
	}
	if !q.Since.IsZero() {
		cond = append(cond, `last_at{ms} >= ?`)
		args = append(args, d.ts(q.Since))
	}
	if q.SandboxID != "" {
		// Only the packs whose bytes hold the sandbox's ID: the server
		// searches them, the reader decodes only those (a sandbox's
		// events are a few of its project's many).
		search := `instr(events, ?) > 0`
		if d.dialect == dialectPostgres {
			search = `position(? in events) > 0`
		}
		cond = append(cond, search)
		args = append(args, []byte(q.SandboxID))
	}
	limit := q.Limit
	if limit <= 0 {
		limit = DefaultEventLimit
	}
	f := eventFilter{after: q.After, before: q.Before, since: q.Since, sandbox: q.SandboxID, kinds: q.Kinds}
	var out []Event
	err := d.retry(ctx, true, func(ctx context.Context) error {
		out = nil
		// The packs holding IDs in (lo, hi): lo moves up a read at a time
		// in ID order, hi down newest first. A pack's range is at most
		// packMax, so "first_id < hi" is "last_id < hi + packMax" on
		// the index, checked exactly after.
		lo, hi := q.After, q.Before
		for len(out) < limit {
			c, a := slices.Clone(cond), slices.Clone(args)
			c = append(c, `last_id > ?`)
			a = append(a, lo)
			if hi > 0 {
				c = append(c, `last_id < ?`, `first_id < ?`)
				a = append(a, hi+packMax, hi)
			}
			order := "last_id"
			if q.NewestFirst {
				order = "last_id DESC"
			}
			a = append(a, packsARead)
			rows, err := d.db.QueryContext(ctx, d.q(`SELECT `+packColumns+` FROM event_packs
				WHERE `+strings.Join(c, " AND ")+` ORDER BY `+order+` LIMIT ?`), a...)
			if err != nil {
				return err
			}
			packs := 0
			for rows.Next() && len(out) < limit {
				packs++
				p, err := scanPack(rows)
				if err != nil {
					rows.Close()
					return err
				}
				if q.NewestFirst {
					hi = p.first
					var evs []Event
					if err := p.decode(func(e Event) bool {
						if f.keep(e) {
							evs = append(evs, e)
						}
						return true
					}); err != nil {
						rows.Close()
						return err
					}
					for i := len(evs) - 1; i >= 0 && len(out) < limit; i-- {
						out = append(out, evs[i])
					}
					continue
				}
				lo = p.last
				if err := p.decode(func(e Event) bool {
					if f.keep(e) {
						out = append(out, e)
					}
					return len(out) < limit
				}); err != nil {
					rows.Close()
					return err
				}
			}
			rows.Close()
			if err := rows.Err(); err != nil {
				return err
			}
			if packs < packsARead {
				break
			}
		}
		return nil
	})
	if err != nil {
		return nil, d.fail("list events", err)
	}
	return out, nil
}

func (d *sqlDB) ExpireEvents(ctx context.Context, olderThan time.Time) (int, error) {
	var n int64
	err := d.retry(ctx, true, func(ctx context.Context) error {
		var err error
		n, err = d.deleteCounted(ctx, `DELETE FROM event_packs WHERE last_at{ms} < ? RETURNING last_id - first_id + 1`, d.ts(olderThan))
		return err
	})
	if err != nil {
		return 0, d.fail("expire events", err)
	}
	return int(n), nil
}

// deleteCounted runs query, a DELETE of packs returning how many items
// each held, and returns their sum.
func (d *sqlDB) deleteCounted(ctx context.Context, query string, args ...any) (int64, error) {
	rows, err := d.db.QueryContext(ctx, d.q(query), args...)
	if err != nil {
		return 0, err
	}
	defer rows.Close()
	var n int64
	for rows.Next() {
		var k int64
		if err := rows.Scan(&k); err != nil {
			return 0, err
		}
		n += k
	}
	return n, rows.Err()
}

func (d *sqlDB) LastEventID(ctx context.Context) (int64, error) {
	var id int64
	err := d.retry(ctx, true, func(ctx context.Context) error {
		return d.db.QueryRowContext(ctx, `SELECT last_id FROM event_ids WHERE one = 1`).Scan(&id)
	})
	if err != nil {
		return 0, d.fail("read the last event's ID", err)
	}
	return id, nil
}

package store

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"time"

	"dsec.dev/dsec/internal/errdefs"
)

// EventPulls says which apiserver pulls each node's events and how far it
// got. One apiserver at a time holds a node's lease (ClaimEventPulls,
// renewed while it can reach the node, lapsing when it dies) and only the
// holder stores what it pulled (PullEvents), in one transaction with the
// node's cursor: a node's events are offered to the store once, and the
// next holder resumes exactly after the last stored, so an apiserver
// killed mid-pull loses and doubles nothing.
type EventPulls interface {
	// ClaimEventPulls takes, until until, the lease of each of nodes that
	// is free, lapsed or owner's own (renewed), gives up owner's leases of
	// the nodes not named (it cannot reach them now), and returns the
	// nodes owner holds with their cursors.
	ClaimEventPulls(ctx context.Context, owner string, nodes []string, now, until time.Time) ([]EventPull, error)
	// PullEvents stores evs (each key once, as AppendEvents) and moves
	// the cursor of each node in to (Node, Epoch, Seq) in one transaction
	// (an apiserver's pulls of all its nodes in one tick: one write), and
	// returns how many events it stored. It returns
	// errdefs.ErrFailedPrecondition, storing nothing, when owner no longer
	// holds the lease of one of them.
	PullEvents(ctx context.Context, owner string, to []EventPull, evs ...Event) (int, error)
	// ReleaseEventPulls gives up owner's leases (an apiserver stopping),
	// so another apiserver takes them at once rather than when they lapse.
	ReleaseEventPulls(ctx context.Context, owner string) error
}

// EventPull is a node's pull: its lease and its cursor, the epoch of the
// node's event log and the last sequence number stored.
type EventPull struct {
	Node  string
	Owner string
	Until time.Time
	Epoch string
	Seq   uint64
}

var errNotHolder = errors.New("not the lease's holder")

func (d *sqlDB) ClaimEventPulls(ctx context.Context, owner string, nodes []string, now, until time.Time) ([]EventPull, error) {
	if owner == "" {
		return nil, fmt.Errorf("claim event pulls: no owner: %w", errdefs.ErrInvalidArgument)
	}
	var out []EventPull
	err := d.inTx(ctx, func(tx *sql.Tx) error {
		out = nil
		in := `''`
		if len(nodes) > 0 {
			in = placeholders(len(nodes))
			ins := `INSERT INTO event_pulls (node) VALUES ` + repeatJoin("(?)", len(nodes)) + ` ON CONFLICT (node) DO NOTHING`
			if _, err := tx.ExecContext(ctx, d.q(ins), anys(nodes)...); err != nil {
				return err
			}
			args := append([]any{owner, d.ts(until)}, anys(nodes)...)
			args = append(args, owner, d.ts(now))
			if _, err := tx.ExecContext(ctx, d.q(`UPDATE event_pulls SET owner = ?, lease{ms} = ?
				WHERE node IN (`+in+`) AND (owner = ? OR owner = '' OR lease{ms} IS NULL OR lease{ms} < ?)`), args...); err != nil {
				return err
			}
		}
		if _, err := tx.ExecContext(ctx, d.q(`UPDATE event_pulls SET owner = '', lease{ms} = NULL WHERE owner = ? AND node NOT IN (`+in+`)`),
			append([]any{owner}, anys(nodes)...)...); err != nil {
			return err
		}
		rows, err := tx.QueryContext(ctx, d.q(`SELECT node, owner, lease{ms}, epoch, seq FROM event_pulls WHERE owner = ? ORDER BY node`), owner)
		if err != nil {
			return err
		}
		defer rows.Close()
		for rows.Next() {
			var p EventPull
			var seq int64
			if err := rows.Scan(&p.Node, &p.Owner, timeCol{&p.Until}, &p.Epoch, &seq); err != nil {
				return err
			}
			p.Seq = uint64(seq)
			out = append(out, p)
		}
		return rows.Err()
	})
	if err != nil {
		return nil, d.fail("claim event pulls", err)
	}
	return out, nil
}

func repeatJoin(s string, n int) string {
	b := make([]byte, 0, n*(len(s)+2))
	for i := range n {
		if i > 0 {
			b = append(b, ", "...)
		}
		b = append(b, s...)
	}
	return string(b)
}

func (d *sqlDB) PullEvents(ctx context.Context, owner string, to []EventPull, evs ...Event) (int, error) {
	if len(to) == 0 {
		return 0, fmt.Errorf("pull events: no node's cursor: %w", errdefs.ErrInvalidArgument)
	}
	if err := checkEvents(evs); err != nil {
		return 0, err
	}
	var added int
	var lost string
	err := d.inTx(ctx, func(tx *sql.Tx) error {
		// On PostgreSQL the append's advisory lock is taken with the first
		// cursor's update (one round trip less); it is held until the
		// commit.
		for i, c := range to {
			q, args := `UPDATE event_pulls SET epoch = ?, seq = ? WHERE node = ? AND owner = ?`, []any{c.Epoch, int64(c.Seq), c.Node, owner}
			if i == 0 && d.dialect == dialectPostgres {
				q = `WITH l AS (SELECT pg_advisory_xact_lock(?)) UPDATE event_pulls SET epoch = ?, seq = ? FROM l WHERE node = ? AND owner = ?`
				args = append([]any{int64(eventLockID)}, args...)
			}
			res, err := tx.ExecContext(ctx, d.q(q), args...)
			if err != nil {
				return err
			}
			if n, _ := res.RowsAffected(); n == 0 {
				lost = c.Node
				return errNotHolder
			}
		}
		var err error
		if len(evs) > 0 {
			added, err = d.insertEvents(ctx, tx, evs, false)
		}
		return err
	})
	if errors.Is(err, errNotHolder) {
		return 0, fmt.Errorf("pull events of node %s: its lease is not %s's: %w", lost, owner, errdefs.ErrFailedPrecondition)
	}
	if err != nil {
		return 0, d.fail(fmt.Sprintf("store %d events pulled from %d nodes", len(evs), len(to)), err)
	}
	return added, nil
}

func (d *sqlDB) ReleaseEventPulls(ctx context.Context, owner string) error {
	err := d.retry(ctx, true, func(ctx context.Context) error {
		_, err := d.db.ExecContext(ctx, d.q(`UPDATE event_pulls SET owner = '', lease{ms} = NULL WHERE owner = ?`), owner)
		return err
	})
	if err != nil {
		return d.fail("release event pulls", err)
	}
	return nil
}

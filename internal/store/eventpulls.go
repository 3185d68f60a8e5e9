package store

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"slices"
	"time"

	"dsec.dev/dsec/internal/errdefs"
)

// EventPulls says which apiserver pulls each node's events and how far it
// got. One apiserver at a time holds a node's lease (ClaimEventPulls,
// renewed while it can reach the node, lapsing when it dies; each
// apiserver holds about its share of the nodes) and only the
// holder stores what it pulled (PullEvents), in one transaction with the
// node's cursor: a node's events are offered to the store once, and the
// next holder resumes exactly after the last stored, so an apiserver
// killed mid-pull loses and doubles nothing.
type EventPulls interface {
	// ClaimEventPulls renews, until until, owner's place among the live
	// pullers and its leases of nodes, gives up its leases of the nodes
	// not named (it cannot reach them now), takes free or lapsed ones up
	// to its share (nodes over the live pullers, rounded up) or gives back
	// those over it while another puller holds fewer, and returns the
	// nodes owner holds with their cursors. Owners call it between their
	// pulls, never during one.
	ClaimEventPulls(ctx context.Context, owner string, nodes []string, now, until time.Time) ([]EventPull, error)
	// PullEvents stores evs (in packs, as AppendEvents) and each node's
	// ledger records in to (Usage, as PutUsage), and moves the cursors of
	// each node in to (Node, Epoch, Seq, UsageEpoch, UsageSeq), in one
	// transaction (an apiserver's pulls of all its nodes in one tick: one
	// write), and returns how many events it stored. The cursors are what
	// keep an event or a ledger record from being stored twice: a holder
	// pulls after them. It returns errdefs.ErrFailedPrecondition, storing
	// nothing, when owner no longer holds the lease of one of them.
	PullEvents(ctx context.Context, owner string, to []EventPull, evs ...Event) (int, error)
	// ReleaseEventPulls gives up owner's leases (an apiserver stopping),
	// so another apiserver takes them at once rather than when they lapse.
	ReleaseEventPulls(ctx context.Context, owner string) error
	// ForgetEventPulls deletes the pulls of the nodes not in keep (the
	// fleet as the caller sees it: every registered node, reachable or
	// not) that no apiserver has held since before (their lease ended, or
	// they were given up, before it): the nodes that left the cluster,
	// whose rows would stay forever. A node that restarts stays
	// registered, so its cursor is kept however long it is down; one that
	// is registered again after its row went is pulled from its start, as
	// a new node is (the events it still keeps are stored once each). It
	// returns how many it deleted.
	ForgetEventPulls(ctx context.Context, keep []string, before time.Time) (int, error)
}

// EventPull is a node's pull: its lease and its cursors, the epoch of the
// node's event log and the last sequence number stored, the epoch of its
// ledger and the last version stored. Given to PullEvents, Usage are the
// ledger records the pull brought, stored with the cursors.
type EventPull struct {
	Node       string
	Owner      string
	Until      time.Time
	Epoch      string
	Seq        uint64
	UsageEpoch string
	UsageSeq   uint64
	Usage      []UsageRow
}

var errNotHolder = errors.New("not the lease's holder")

// checkPull says what is wrong with a pull of evs to cursors to.
func checkPull(to []EventPull, evs []Event) error {
	if len(to) == 0 {
		return fmt.Errorf("pull events: no node's cursor: %w", errdefs.ErrInvalidArgument)
	}
	for _, c := range to {
		if err := checkUsageRows(c.Usage); err != nil {
			return fmt.Errorf("pull events: the ledger records of node %s: %w", c.Node, err)
		}
	}
	return checkEvents(evs)
}

// pulledUsage splits the ledger records of the pulls to as PutUsage
// does: the sole ends to append, the rest to merge into ledger.
func pulledUsage(to []EventPull) (ends, rest []UsageRow) {
	var all []UsageRow
	for _, c := range to {
		if all == nil {
			all = slices.Clip(c.Usage) // a pull of one node's ledger: no copy
			continue
		}
		all = append(all, c.Usage...)
	}
	return splitAppended(all)
}

func (d *sqlDB) ClaimEventPulls(ctx context.Context, owner string, nodes []string, now, until time.Time) ([]EventPull, error) {
	if owner == "" {
		return nil, fmt.Errorf("claim event pulls: no owner: %w", errdefs.ErrInvalidArgument)
	}
	if !until.After(now) {
		return nil, fmt.Errorf("claim event pulls: lease until %s is not after now %s: %w", until, now, errdefs.ErrInvalidArgument)
	}
	var out []EventPull
	err := d.inTx(ctx, func(tx *sql.Tx) error {
		out = nil
		exec := func(q string, args ...any) error {
			_, err := tx.ExecContext(ctx, d.q(q), args...)
			return err
		}
		// owner is alive (as long as its leases), and those whose rows
		// lapsed are gone.
		if err := exec(`INSERT INTO event_pullers (owner, lease{ms}) VALUES (?, ?)
			ON CONFLICT (owner) DO UPDATE SET lease{ms} = excluded.lease{ms}`, owner, d.ts(until)); err != nil {
			return err
		}
		if err := exec(`DELETE FROM event_pullers WHERE lease{ms} < ?`, d.ts(now)); err != nil {
			return err
		}
		in := `''`
		if len(nodes) > 0 {
			in = placeholders(len(nodes))
			// A new node is free from now (its lease column says since when
			// a free node has been free).
			var args []any
			for _, n := range nodes {
				args = append(args, n, d.ts(now))
			}
			if err := exec(`INSERT INTO event_pulls (node, lease{ms}) VALUES `+repeatJoin("(?, ?)", len(nodes))+` ON CONFLICT (node) DO NOTHING`, args...); err != nil {
				return err
			}
			if err := exec(`UPDATE event_pulls SET lease{ms} = ? WHERE owner = ? AND node IN (`+in+`)`,
				append([]any{d.ts(until), owner}, anys(nodes)...)...); err != nil {
				return err
			}
		}
		if err := exec(`UPDATE event_pulls SET owner = '', lease{ms} = ? WHERE owner = ? AND node NOT IN (`+in+`)`,
			append([]any{d.ts(now), owner}, anys(nodes)...)...); err != nil {
			return err
		}
		if len(nodes) > 0 {
			if err := d.balanceEventPulls(ctx, tx, owner, nodes, now, until); err != nil {
				return err
			}
		}
		rows, err := tx.QueryContext(ctx, d.q(`SELECT node, owner, lease{ms}, epoch, seq, usage_epoch, usage_seq FROM event_pulls WHERE owner = ? ORDER BY node`), owner)
		if err != nil {
			return err
		}
		defer rows.Close()
		for rows.Next() {
			var p EventPull
			var seq, useq int64
			if err := rows.Scan(&p.Node, &p.Owner, timeCol{&p.Until}, &p.Epoch, &seq, &p.UsageEpoch, &useq); err != nil {
				return err
			}
			p.Seq, p.UsageSeq = uint64(seq), uint64(useq)
			out = append(out, p)
		}
		return rows.Err()
	})
	if err != nil {
		return nil, d.fail("claim event pulls", err)
	}
	return out, nil
}

// balanceEventPulls brings owner's share of nodes towards its target, the
// nodes over the live apiservers (rounded up): it takes free or lapsed
// nodes up to the target, and, over it while another live apiserver holds
// fewer than the target, gives back the extra ones, which that one takes
// at its next claim. A node given back was stored up to its cursor by the
// giver's last pull (a pull and a claim never overlap in one apiserver,
// and the giver can no longer store a pull of it), so the taker resumes
// there: no event is lost or stored twice. A node free for a whole lease
// that no apiserver under its target took (none of them reaches it) is
// taken over the target.
func (d *sqlDB) balanceEventPulls(ctx context.Context, tx *sql.Tx, owner string, nodes []string, now, until time.Time) error {
	rows, err := tx.QueryContext(ctx, d.q(`SELECT p.owner, (SELECT COUNT(*) FROM event_pulls e WHERE e.owner = p.owner AND e.lease{ms} >= ?)
		FROM event_pullers p WHERE p.lease{ms} >= ?`), d.ts(now), d.ts(now))
	if err != nil {
		return err
	}
	live, mine, starved := 0, 0, false
	held := map[string]int{}
	for rows.Next() {
		var o string
		var n int
		if err := rows.Scan(&o, &n); err != nil {
			rows.Close()
			return err
		}
		live++
		held[o] = n
	}
	rows.Close()
	if err := rows.Err(); err != nil {
		return err
	}
	live = max(live, 1)
	target := (len(nodes) + live - 1) / live
	for o, n := range held {
		if o == owner {
			mine = n
		} else if n < target {
			starved = true
		}
	}

	if mine > target && starved {
		rows, err := tx.QueryContext(ctx, d.q(`SELECT node FROM event_pulls WHERE owner = ? ORDER BY node DESC LIMIT ?`), owner, mine-target)
		if err != nil {
			return err
		}
		var extra []string
		for rows.Next() {
			var n string
			if err := rows.Scan(&n); err != nil {
				rows.Close()
				return err
			}
			extra = append(extra, n)
		}
		rows.Close()
		if err := rows.Err(); err != nil || len(extra) == 0 {
			return err
		}
		_, err = tx.ExecContext(ctx, d.q(`UPDATE event_pulls SET owner = '', lease{ms} = ? WHERE owner = ? AND node IN (`+placeholders(len(extra))+`)`),
			append([]any{d.ts(now), owner}, anys(extra)...)...)
		return err
	}

	free := `(owner = '' OR lease{ms} IS NULL OR lease{ms} < ?)`
	rows, err = tx.QueryContext(ctx, d.q(`SELECT node, lease{ms} IS NULL OR lease{ms} < ? FROM event_pulls WHERE node IN (`+placeholders(len(nodes))+`) AND `+free+` ORDER BY node`),
		append(append([]any{d.ts(now.Add(-until.Sub(now)))}, anys(nodes)...), d.ts(now))...)
	if err != nil {
		return err
	}
	var take []string
	for rows.Next() {
		var n string
		var long bool
		if err := rows.Scan(&n, &long); err != nil {
			rows.Close()
			return err
		}
		if mine+len(take) < target || long {
			take = append(take, n)
		}
	}
	rows.Close()
	if err := rows.Err(); err != nil || len(take) == 0 {
		return err
	}
	_, err = tx.ExecContext(ctx, d.q(`UPDATE event_pulls SET owner = ?, lease{ms} = ? WHERE node IN (`+placeholders(len(take))+`) AND `+free),
		append(append([]any{owner, d.ts(until)}, anys(take)...), d.ts(now))...)
	return err
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
	if err := checkPull(to, evs); err != nil {
		return 0, err
	}
	packs := packEvents(evs)
	ends, rest := pulledUsage(to)
	var lost string
	err := d.inTx(ctx, func(tx *sql.Tx) error {
		for _, c := range to {
			res, err := tx.ExecContext(ctx, d.q(`UPDATE event_pulls SET epoch = ?, seq = ?, usage_epoch = ?, usage_seq = ? WHERE node = ? AND owner = ?`),
				c.Epoch, int64(c.Seq), c.UsageEpoch, int64(c.UsageSeq), c.Node, owner)
			if err != nil {
				return err
			}
			if n, _ := res.RowsAffected(); n == 0 {
				lost = c.Node
				return errNotHolder
			}
		}
		if err := d.putUsage(ctx, tx, ends, rest); err != nil {
			return err
		}
		if len(packs) == 0 {
			return nil
		}
		return d.insertPacks(ctx, tx, packs)
	})
	if err != nil {
		return 0, d.pullFailed(err, lost, owner, to, evs)
	}
	return len(evs), nil
}

// pullFailed is the error PullEvents returns for err, its transaction's:
// ErrFailedPrecondition when owner lost node lost's lease.
func (d *sqlDB) pullFailed(err error, lost, owner string, to []EventPull, evs []Event) error {
	if errors.Is(err, errNotHolder) {
		return fmt.Errorf("pull events of node %s: its lease is not %s's: %w", lost, owner, errdefs.ErrFailedPrecondition)
	}
	return d.fail(fmt.Sprintf("store %d events pulled from %d nodes", len(evs), len(to)), err)
}

func (d *sqlDB) ForgetEventPulls(ctx context.Context, keep []string, before time.Time) (int, error) {
	in := `''`
	if len(keep) > 0 {
		in = placeholders(len(keep))
	}
	var n int64
	err := d.retry(ctx, true, func(ctx context.Context) error {
		// A held row's lease is until when it is held; a free row's, since
		// when it has been free: either way, older than before is a node
		// no apiserver has pulled since.
		res, err := d.db.ExecContext(ctx, d.q(`DELETE FROM event_pulls WHERE (lease{ms} IS NULL OR lease{ms} < ?) AND node NOT IN (`+in+`)`),
			append([]any{d.ts(before)}, anys(keep)...)...)
		if err != nil {
			return err
		}
		n, _ = res.RowsAffected()
		return nil
	})
	if err != nil {
		return 0, d.fail(fmt.Sprintf("forget the event pulls of nodes gone since %s", before.Format(time.RFC3339)), err)
	}
	return int(n), nil
}

func (d *sqlDB) ForgetDoubts(ctx context.Context, keep []string, before time.Time) (int, error) {
	in := `''`
	if len(keep) > 0 {
		in = placeholders(len(keep))
	}
	var n int64
	err := d.retry(ctx, true, func(ctx context.Context) error {
		res, err := d.db.ExecContext(ctx, d.q(`DELETE FROM create_doubts WHERE created{ms} < ? AND node NOT IN (`+in+`)`),
			append([]any{d.ts(before)}, anys(keep)...)...)
		if err != nil {
			return err
		}
		n, _ = res.RowsAffected()
		return nil
	})
	if err != nil {
		return 0, d.fail(fmt.Sprintf("forget the doubts of nodes gone recorded before %s", before.Format(time.RFC3339)), err)
	}
	return int(n), nil
}

func (d *sqlDB) ReleaseEventPulls(ctx context.Context, owner string) error {
	err := d.retry(ctx, true, func(ctx context.Context) error {
		now := d.ts(time.Now())
		if _, err := d.db.ExecContext(ctx, d.q(`UPDATE event_pulls SET owner = '', lease{ms} = ? WHERE owner = ?`), now, owner); err != nil {
			return err
		}
		_, err := d.db.ExecContext(ctx, d.q(`DELETE FROM event_pullers WHERE owner = ?`), owner)
		return err
	})
	if err != nil {
		return d.fail("release event pulls", err)
	}
	return nil
}

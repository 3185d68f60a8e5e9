package store

import (
	"context"
	"errors"
	"fmt"

	"github.com/jackc/pgx/v5"

	"dsec.dev/dsec/internal/errdefs"
)

// eventColumns are the columns a pull writes of each event, in the order
// copyEvents gives them.
var eventColumns = []string{"key", "at", "project", "sandbox_id", "kind", "node", "reason", "message"}

// PullEvents on PostgreSQL is sqlDB's with the events written by COPY
// (pgx's CopyFrom) rather than INSERTs of 100 rows each: the server
// parses no statement per batch and inserts the rows together, and the
// apiserver builds no argument list of 8 values a row. The nodes' cursors
// move in the same transaction, under the events' advisory lock, as
// before. COPY has no ON CONFLICT: a key already stored fails the whole
// transaction (unique_violation, nothing written), and the pull is then
// stored again by sqlDB's INSERTs, which skip the keys stored. That
// happens only when a node's events come again from its start (its pull
// forgotten while it kept running, then registered again): a holder pulls
// from its cursor, which moves in the transaction that stores the events.
func (s *pgStore) PullEvents(ctx context.Context, owner string, to []EventPull, evs ...Event) (int, error) {
	if len(to) == 0 {
		return 0, fmt.Errorf("pull events: no node's cursor: %w", errdefs.ErrInvalidArgument)
	}
	if err := checkEvents(evs); err != nil {
		return 0, err
	}
	var lost string
	err := s.retry(ctx, false, func(ctx context.Context) error {
		var err error
		lost, err = s.copyEvents(ctx, owner, to, evs)
		return err
	})
	switch {
	case errors.Is(err, errNotHolder):
		return 0, fmt.Errorf("pull events of node %s: its lease is not %s's: %w", lost, owner, errdefs.ErrFailedPrecondition)
	case pgUnique(err):
		return s.sqlDB.PullEvents(ctx, owner, to, evs...)
	case err != nil:
		return 0, s.fail(fmt.Sprintf("store %d events pulled from %d nodes", len(evs), len(to)), err)
	}
	return len(evs), nil
}

// copyEvents is one try of PullEvents: in a transaction, the advisory
// lock, the cursors' updates (one round trip for all), then the events by
// COPY. It returns the node whose lease owner lost with errNotHolder.
func (s *pgStore) copyEvents(ctx context.Context, owner string, to []EventPull, evs []Event) (string, error) {
	tx, err := s.pool.Begin(ctx)
	if err != nil {
		return "", err
	}
	defer tx.Rollback(context.WithoutCancel(ctx))
	b := &pgx.Batch{}
	b.Queue(`SELECT pg_advisory_xact_lock($1)`, int64(eventLockID))
	for _, c := range to {
		b.Queue(`UPDATE event_pulls SET epoch = $1, seq = $2 WHERE node = $3 AND owner = $4`, c.Epoch, int64(c.Seq), c.Node, owner)
	}
	br := tx.SendBatch(ctx, b)
	if _, err := br.Exec(); err != nil {
		br.Close()
		return "", err
	}
	for _, c := range to {
		tag, err := br.Exec()
		if err != nil {
			br.Close()
			return "", err
		}
		if tag.RowsAffected() == 0 {
			br.Close()
			return c.Node, errNotHolder
		}
	}
	if err := br.Close(); err != nil {
		return "", err
	}
	if len(evs) > 0 {
		rows := pgx.CopyFromSlice(len(evs), func(i int) ([]any, error) {
			ev := evs[i]
			return []any{ev.Key, nowOr(ev.At), ev.Project, ev.SandboxID, ev.Kind, ev.Node, ev.Reason, clip(ev.Message, 1000)}, nil
		})
		if _, err := tx.CopyFrom(ctx, pgx.Identifier{"events"}, eventColumns, rows); err != nil {
			return "", err
		}
	}
	return "", tx.Commit(ctx)
}

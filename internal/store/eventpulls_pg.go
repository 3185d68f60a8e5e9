package store

import (
	"context"

	"github.com/jackc/pgx/v5"
)

// PullEvents on PostgreSQL is sqlDB's in one round trip: the nodes'
// cursors, the event IDs taken from the counter and the packs go as one
// pgx batch, each pack's range computed by the server from the counter's
// new value (its row locked until the commit, so the packs of two pulls
// commit in the order of their IDs).
func (s *pgStore) PullEvents(ctx context.Context, owner string, to []EventPull, evs ...Event) (int, error) {
	if err := checkPull(to, evs); err != nil {
		return 0, err
	}
	packs := packEvents(evs)
	var lost string
	err := s.retry(ctx, false, func(ctx context.Context) error {
		var err error
		lost, err = s.pullEvents(ctx, owner, to, packs)
		return err
	})
	if err != nil {
		return 0, s.pullFailed(err, lost, owner, to, evs)
	}
	return len(evs), nil
}

// pullEvents is one try of PullEvents. It returns the node whose lease
// owner lost with errNotHolder.
func (s *pgStore) pullEvents(ctx context.Context, owner string, to []EventPull, packs []eventPack) (string, error) {
	tx, err := s.pool.Begin(ctx)
	if err != nil {
		return "", err
	}
	defer tx.Rollback(context.WithoutCancel(ctx))
	b := &pgx.Batch{}
	for _, c := range to {
		b.Queue(`UPDATE event_pulls SET epoch = $1, seq = $2 WHERE node = $3 AND owner = $4`, c.Epoch, int64(c.Seq), c.Node, owner)
	}
	if n := eventsIn(packs); n > 0 {
		b.Queue(`UPDATE event_ids SET last_id = last_id + $1 WHERE one = 1`, int64(n))
		// The counter now ends at the last ID taken: a pack of events
		// off to off+k-1 of the n is last_id-n+off+1 to last_id-n+off+k.
		off := 0
		for _, p := range packs {
			k := len(p.events)
			b.Queue(`INSERT INTO event_packs (last_id, first_id, project, first_at, last_at, events)
				SELECT last_id - $1, last_id - $2, $3, $4, $5, $6 FROM event_ids WHERE one = 1`,
				int64(n-off-k), int64(n-off-1), p.project, p.firstAt, p.last, encodePack(p.events))
			off += k
		}
	}
	br := tx.SendBatch(ctx, b)
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
	return "", tx.Commit(ctx)
}

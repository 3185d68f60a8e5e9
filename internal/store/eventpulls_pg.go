package store

import (
	"cmp"
	"context"
	"slices"

	"github.com/jackc/pgx/v5"
)

// PullEvents on PostgreSQL is sqlDB's in one round trip: the nodes'
// cursors, the ledger's upsert (putUsagePG) and packs of sole ends
// (insertEndPackPG), as PutUsage writes them, the event IDs taken from the
// counter and the event packs go as one pgx batch, each event pack's range
// computed by the server from the counter's new value (its row locked
// until the commit, so the packs of two pulls commit in the order of their
// IDs).
//
// A pull commits without waiting for its WAL to reach the disk
// (synchronous_commit off): waiting had the creates' commits wait behind
// the packs' bytes, 4 % of bench cluster's create rate (BenchmarkClusterOps,
// events alone: 0.955–0.963 the rate of events off; 0.993–0.996 so). A
// crash of PostgreSQL can take back the last such commits (up to three
// wal_writer_delay, 0.6 s by default): the cursors with the packs, so the
// next pull reads those events from the edges again, and nothing is lost.
// What a reader was given must not be taken back, though (its IDs would
// be given again, to other events, behind its cursor): ListEvents makes
// what it read durable before it returns it (flushEvents).
func (s *pgStore) PullEvents(ctx context.Context, owner string, to []EventPull, evs ...Event) (int, error) {
	if err := checkPull(to, evs); err != nil {
		return 0, err
	}
	packs := packEvents(evs)
	usage := newLedgerWrite(pulledUsage(to))
	var lost string
	err := s.retry(ctx, false, func(ctx context.Context) error {
		var err error
		lost, err = s.pullEvents(ctx, owner, to, packs, usage)
		return err
	})
	if err != nil {
		return 0, s.pullFailed(err, lost, owner, to, evs)
	}
	return len(evs), nil
}

// pullEvents is one try of PullEvents. It returns the node whose lease
// owner lost with errNotHolder.
func (s *pgStore) pullEvents(ctx context.Context, owner string, to []EventPull, packs []eventPack, usage ledgerWrite) (string, error) {
	tx, err := s.pool.Begin(ctx)
	if err != nil {
		return "", err
	}
	defer tx.Rollback(context.WithoutCancel(ctx))
	b := &pgx.Batch{}
	b.Queue(`SET LOCAL synchronous_commit TO off`)
	for _, c := range to {
		b.Queue(`UPDATE event_pulls SET epoch = $1, seq = $2, usage_epoch = $3, usage_seq = $4 WHERE node = $5 AND owner = $6`,
			c.Epoch, int64(c.Seq), c.UsageEpoch, int64(c.UsageSeq), c.Node, owner)
	}
	usage.queue(b)
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
	return "", tx.Commit(ctx)
}

// ListEvents on PostgreSQL is sqlDB's, made durable before it returns: a
// pull's commit does not wait for the disk (PullEvents), so the events
// read may not be on it yet. A transaction that writes commits with a
// record in the WAL after every commit the read could see, and waits until
// the WAL is on the disk up to it: once per new events this process reads
// (flushed), not per reader.
func (s *pgStore) ListEvents(ctx context.Context, q EventQuery) ([]Event, error) {
	evs, err := s.sqlDB.ListEvents(ctx, q)
	if err != nil || len(evs) == 0 {
		return evs, err
	}
	newest := slices.MaxFunc(evs, func(a, b Event) int { return cmp.Compare(a.ID, b.ID) }).ID
	if newest <= s.flushed.Load() {
		return evs, nil
	}
	if err := s.flushEvents(ctx); err != nil {
		return nil, s.fail("make the events read durable", err)
	}
	for {
		cur := s.flushed.Load()
		if newest <= cur || s.flushed.CompareAndSwap(cur, newest) {
			return evs, nil
		}
	}
}

// flushEvents waits until every commit made before it is on the disk. A
// transaction that wrote nothing would commit without waiting, so it
// writes the counter's row unchanged (a pull waits for that row the few
// milliseconds it takes).
func (s *pgStore) flushEvents(ctx context.Context) error {
	b := &pgx.Batch{}
	b.Queue(`SET LOCAL synchronous_commit TO on`)
	b.Queue(`UPDATE event_ids SET last_id = last_id WHERE one = 1`)
	return pgx.BeginFunc(ctx, s.pool, func(tx pgx.Tx) error {
		return tx.SendBatch(ctx, b).Close()
	})
}

package store

import (
	"context"
	"errors"
	"sync"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
)

// A combiner runs the one-row statements of concurrent calls together:
// what arrives while a flush is under way waits for the next, which sends
// all of it as one pgx.Batch. PostgreSQL runs a batch's statements in one
// implicit transaction, so a flush of n statements costs one round trip and
// one durable commit instead of n of each: under load (a burst of creates,
// each reserving and then completing its key) most of PostgreSQL's work per
// create was the commit's WAL write and flush, and most of the apiserver's
// the round trips. A call alone waits for nothing: with no flush under way
// it is sent at once, as a plain statement.
//
// Every statement still succeeds or fails on its own: a batch's outcome is
// delivered only once it has committed, and when it fails (one statement's
// constraint, a deadlock between two replicas' batches) none of it is
// stored and each statement is run again alone, so that each call gets its
// own answer. A connection lost during a flush fails every call in it with
// that error, as it would have failed each alone.
type combiner struct {
	pool    *pgxpool.Pool
	maxRows int // statements per flush
	flushes int // flushes under way at once

	mu      sync.Mutex
	queue   []*combined
	running int

	// batched counts the statements sent in batches of two or more, and
	// rerun those of them run again alone after their batch failed.
	batched, rerun atomic.Int64
}

// combined is one call's statement. scan reads its one row; it may run
// more than once (a failed batch, then alone), and only its last run counts.
type combined struct {
	ctx  context.Context
	sql  string
	args []any
	scan func(pgx.Row) error
	err  error
	done chan struct{}
}

// flushTimeout bounds one flush: it serves many callers, so none of their
// contexts bounds it.
const flushTimeout = 30 * time.Second

func newCombiner(pool *pgxpool.Pool) *combiner {
	return &combiner{pool: pool, maxRows: 64, flushes: 2}
}

// queryRow runs sql with args, alone or in a batch with other calls', and
// hands its one row to scan; it returns what running it alone would return.
// When ctx ends while the statement waits for a flush it is dropped with
// ctx's error; once sent, it runs to its end.
func (c *combiner) queryRow(ctx context.Context, sql string, args []any, scan func(pgx.Row) error) error {
	q := &combined{ctx: ctx, sql: sql, args: args, scan: scan, done: make(chan struct{})}
	c.mu.Lock()
	c.queue = append(c.queue, q)
	if c.running < c.flushes {
		c.running++
		go c.flushAll()
	}
	c.mu.Unlock()
	select {
	case <-q.done:
		return q.err
	case <-ctx.Done():
	}
	// Still queued: leave (a flush finds it done and skips it). Already
	// sent: its outcome is on the way.
	c.mu.Lock()
	for i, w := range c.queue {
		if w == q {
			c.queue = append(c.queue[:i], c.queue[i+1:]...)
			c.mu.Unlock()
			return ctx.Err()
		}
	}
	c.mu.Unlock()
	<-q.done
	return q.err
}

// flushAll flushes the queue until it is empty; its starter counted it in
// running.
func (c *combiner) flushAll() {
	for {
		c.mu.Lock()
		n := min(len(c.queue), c.maxRows)
		if n == 0 {
			c.running--
			c.mu.Unlock()
			return
		}
		batch := make([]*combined, n)
		copy(batch, c.queue)
		c.queue = append(c.queue[:0], c.queue[n:]...)
		c.mu.Unlock()
		c.flush(batch)
	}
}

func (c *combiner) flush(qs []*combined) {
	ctx, cancel := context.WithTimeout(context.Background(), flushTimeout)
	defer cancel()
	if len(qs) == 1 {
		q := qs[0]
		q.err = q.scan(c.pool.QueryRow(ctx, q.sql, q.args...))
		close(q.done)
		return
	}
	b := &pgx.Batch{}
	for _, q := range qs {
		b.Queue(q.sql, q.args...).QueryRow(q.scan)
	}
	err := c.pool.SendBatch(ctx, b).Close()
	c.batched.Add(int64(len(qs)))
	var pgErr *pgconn.PgError
	switch {
	case err == nil:
	case errors.As(err, &pgErr):
		// A statement failed and took the batch with it: nothing was
		// stored, so each runs again alone for its own answer.
		c.rerun.Add(int64(len(qs)))
		for _, q := range qs {
			q.err = q.scan(c.pool.QueryRow(ctx, q.sql, q.args...))
			close(q.done)
		}
		return
	default:
		for _, q := range qs {
			q.err = err
		}
	}
	for _, q := range qs {
		close(q.done)
	}
}

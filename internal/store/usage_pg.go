package store

import (
	"context"
	"fmt"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgtype"
)

// putUsagePG is PutUsage's statement on PostgreSQL: every row of a call at
// once, as one array per column, so the statement's text is one (prepared
// once per connection) whatever the number of rows. sqlDB's multi-row
// VALUES, 15 parameters a row through database/sql, cost the apiserver a
// tenth of its CPU when a cluster ends 10,000 sandboxes a second, and
// PostgreSQL a plan per shape (BenchmarkClusterOps with a TTL).
var putUsagePG = strings.ReplaceAll(`INSERT INTO ledger (key, sandbox_id, project, labels, node, started, ended, updated, cpu_usec, memory_gib_s,
	disk_gib_h, disk_peak_bytes, snapshot_bytes, egress_bytes, fncall_calls)
	SELECT * FROM unnest($1::text[], $2::text[], $3::text[], $4::text[], $5::text[], $6::timestamptz[], $7::timestamptz[],
		$8::timestamptz[], $9::bigint[], $10::float8[], $11::float8[], $12::bigint[], $13::bigint[], $14::bigint[], $15::bigint[])`+
	usageOnConflict("GREATEST", "LEAST"), "{ms}", "")

// insertEndPackPG stores one pack of sole ends (endpack.go).
const insertEndPackPG = `INSERT INTO ledger_end_packs (project, started, ended, n, records) VALUES ($1, $2, $3, $4, $5)`

// PutUsage on PostgreSQL upserts the rows in one statement (putUsagePG)
// and stores the sandboxes' sole reports in packs (insertEndPackPG), in
// one batch: one round trip, one implicit transaction. One statement
// cannot change a row twice, so rows of one key are merged first, as the
// store would merge them one after the other.
func (s *pgStore) PutUsage(ctx context.Context, rows ...UsageRow) error {
	if err := checkUsageRows(rows); err != nil || len(rows) == 0 {
		return err
	}
	w := newLedgerWrite(splitAppended(rows))
	err := s.retry(ctx, true, func(ctx context.Context) error {
		// A batch is one implicit transaction: all of it or nothing.
		b := &pgx.Batch{}
		w.queue(b)
		return s.pool.SendBatch(ctx, b).Close()
	})
	if err != nil {
		return s.fail(fmt.Sprintf("put %d usage rows", len(rows)), err)
	}
	return nil
}

// ledgerWrite is usage rows as PostgreSQL is given them: the upsert's
// arguments (putUsagePG) of the rows merged into ledger, nil when there is
// none, and the packs of the sole ends.
type ledgerWrite struct {
	upsert []any
	ends   []endPack
}

// newLedgerWrite is the write of ends and rest, as splitAppended parts
// rows.
func newLedgerWrite(ends, rest []UsageRow) ledgerWrite {
	var w ledgerWrite
	if len(rest) > 0 {
		w.upsert = upsertArgs(mergeUsageRows(rest))
	}
	w.ends = packEnds(ends)
	return w
}

// queue adds w's statements to b.
func (w ledgerWrite) queue(b *pgx.Batch) {
	if w.upsert != nil {
		b.Queue(putUsagePG, w.upsert...)
	}
	for _, p := range w.ends {
		b.Queue(insertEndPackPG, p.project, p.started, p.ended, p.n, p.records)
	}
}

// upsertArgs are putUsagePG's arguments for rows: a column's values each.
func upsertArgs(rows []UsageRow) []any {
	n := len(rows)
	var (
		keys, ids, projects, labels, nodes = make([]string, n), make([]string, n), make([]string, n), make([]string, n), make([]string, n)
		started, ended, updated            = make([]pgtype.Timestamptz, n), make([]pgtype.Timestamptz, n), make([]pgtype.Timestamptz, n)
		cpu, peak, snaps, egress, calls    = make([]int64, n), make([]int64, n), make([]int64, n), make([]int64, n), make([]int64, n)
		mem, disk                          = make([]float64, n), make([]float64, n)
	)
	stamp := func(t time.Time) pgtype.Timestamptz { return pgtype.Timestamptz{Time: t, Valid: !t.IsZero()} }
	for i, r := range rows {
		keys[i], ids[i], projects[i], labels[i], nodes[i] = r.Key, r.SandboxID, r.Project, string(appendLabelsJSON(nil, r.Labels)), r.Node
		started[i], ended[i], updated[i] = stamp(nowOr(r.Started)), stamp(ms(r.Ended)), stamp(nowOr(r.Updated))
		cpu[i], mem[i], disk[i], peak[i], snaps[i], egress[i], calls[i] = r.CPUUsec, r.MemoryGiBSec, r.DiskGiBHours, r.DiskPeakBytes,
			r.SnapshotBytes, r.EgressBytes, r.FnCallCalls
	}
	return []any{keys, ids, projects, labels, nodes, started, ended, updated, cpu, mem, disk, peak, snaps, egress, calls}
}

// mergeUsageRows merges the rows of one key into one, as storing them one
// after the other would (the earliest start, the latest end and update,
// each figure's largest, the last row's names); rows whose keys are all
// different come back as they are.
func mergeUsageRows(rows []UsageRow) []UsageRow {
	at := make(map[string]int, len(rows))
	var out []UsageRow
	for i, r := range rows {
		j, dup := at[r.Key]
		if !dup {
			at[r.Key] = len(at)
			if out != nil {
				out = append(out, r)
			}
			continue
		}
		if out == nil {
			out = append(make([]UsageRow, 0, len(rows)), rows[:i]...)
		}
		m := &out[j]
		if r.Started.IsZero() || !m.Started.IsZero() && m.Started.Before(r.Started) {
			r.Started = m.Started
		}
		if m.Ended.After(r.Ended) {
			r.Ended = m.Ended
		}
		if m.Updated.After(r.Updated) {
			r.Updated = m.Updated
		}
		r.Usage.raise(m.Usage)
		*m = r
	}
	if out == nil {
		return rows
	}
	return out
}

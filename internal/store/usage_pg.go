package store

import (
	"bytes"
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

// copyEndsPG copies rows into ledger_ends, their columns in the order
// copyEnds writes them.
const copyEndsPG = `COPY ledger_ends (key, sandbox_id, project, labels, node, started, ended, updated, cpu_usec, memory_gib_s,
	disk_gib_h, disk_peak_bytes, snapshot_bytes, egress_bytes, fncall_calls) FROM STDIN (FORMAT binary)`

// PutUsage on PostgreSQL upserts the rows in one statement (putUsagePG)
// and copies the sandboxes' sole reports into ledger_ends (COPY), in one
// transaction. One statement cannot change a row twice, so rows of one key
// are merged first, as the store would merge them one after the other.
func (s *pgStore) PutUsage(ctx context.Context, rows ...UsageRow) error {
	if err := checkUsageRows(rows); err != nil || len(rows) == 0 {
		return err
	}
	w := newLedgerWrite(splitAppended(rows))
	err := s.retry(ctx, true, func(ctx context.Context) error {
		if w.ends == nil {
			_, err := s.pool.Exec(ctx, putUsagePG, w.upsert...)
			return err
		}
		return pgx.BeginFunc(ctx, s.pool, func(tx pgx.Tx) error {
			if w.upsert != nil {
				if _, err := tx.Exec(ctx, putUsagePG, w.upsert...); err != nil {
					return err
				}
			}
			_, err := tx.Conn().PgConn().CopyFrom(ctx, bytes.NewReader(w.ends), copyEndsPG)
			return err
		})
	})
	if err != nil {
		return s.fail(fmt.Sprintf("put %d usage rows", len(rows)), err)
	}
	return nil
}

// ledgerWrite is usage rows as PostgreSQL is given them: the upsert's
// arguments (putUsagePG) of the rows merged into ledger, the COPY data
// (copyEndsPG) of the sole ends appended to ledger_ends, each nil when
// there is none.
type ledgerWrite struct {
	upsert []any
	ends   []byte
}

// newLedgerWrite is the write of ends and rest, as splitAppended parts
// rows.
func newLedgerWrite(ends, rest []UsageRow) ledgerWrite {
	var w ledgerWrite
	if len(rest) > 0 {
		w.upsert = upsertArgs(mergeUsageRows(rest))
	}
	if len(ends) > 0 {
		w.ends = copyEnds(ends)
	}
	return w
}

// copyEnds is the binary COPY data of rows in ledger_ends' columns
// (copyEndsPG).
func copyEnds(rows []UsageRow) []byte {
	// A row's fixed part (15 fields' lengths, 10 of them 8 bytes of
	// value) and its strings at their usual lengths.
	c := newCopyRows(len(rows), 2+15*4+10*8+160)
	for i := range rows {
		r := &rows[i]
		c.row(15)
		c.text(r.Key)
		c.text(r.SandboxID)
		c.text(r.Project)
		c.labelsJSON(r.Labels)
		c.text(r.Node)
		c.timestamptz(nowOr(r.Started))
		c.timestamptz(ms(r.Ended))
		c.timestamptz(nowOr(r.Updated))
		c.int8(r.CPUUsec)
		c.float8(r.MemoryGiBSec)
		c.float8(r.DiskGiBHours)
		c.int8(r.DiskPeakBytes)
		c.int8(r.SnapshotBytes)
		c.int8(r.EgressBytes)
		c.int8(r.FnCallCalls)
	}
	return c.data()
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

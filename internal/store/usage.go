package store

import (
	"context"
	"database/sql"
	"encoding/json"
	"fmt"
	"slices"
	"sort"
	"strings"
	"time"

	"dsec.dev/dsec/internal/errdefs"
	"dsec.dev/dsec/internal/iam"
)

// Ledger is the cost ledger: what each sandbox used (CPU, memory, disk,
// snapshots, egress) and the FnCall calls each project made, by project
// and labels, kept after the sandbox is gone until the retention expires
// it (docs/usage.md).
type Ledger interface {
	// PutUsage stores usage rows in one transaction. The figures of a row
	// are cumulative: a row whose key is stored already keeps, for each
	// figure, the larger of the two (and the earlier start, the later
	// end), so a report stored twice, or an older one stored after a newer
	// one, changes nothing. Project, labels and node are the last put's.
	// A sandbox's sole report (UsageRow.Sole) is appended rather than
	// merged into a row of its key: SumUsage merges a key's rows as
	// PutUsage would have.
	PutUsage(ctx context.Context, rows ...UsageRow) error
	// SumUsage adds up the rows q selects by group (UsageBy), in key order,
	// with q.Live's rows in place of the stored ones of their keys.
	SumUsage(ctx context.Context, q UsageQuery) ([]UsageSum, error)
	// ExpireUsage forgets the rows of sandboxes that ended before
	// olderThan (and counters not updated since), returning how many.
	ExpireUsage(ctx context.Context, olderThan time.Time) (int, error)
}

// UsageRow is what one sandbox used over its life so far, or (Key
// "fncall/...", no SandboxID) the FnCall calls one apiserver ran for a
// project.
type UsageRow struct {
	Key       string            `json:"key"`
	SandboxID string            `json:"sandbox_id,omitempty"`
	Project   string            `json:"project"`
	Labels    map[string]string `json:"labels,omitempty"`
	Node      string            `json:"node,omitempty"`
	Started   time.Time         `json:"started"`
	Ended     time.Time         `json:"ended"` // zero while it lives
	Updated   time.Time         `json:"updated"`
	// Sole says the row is its sandbox's end and the first report of it
	// its node offered (no checkpoint, no snapshot before it): no row of
	// the key can be stored but this one put before, so the store appends
	// it, in a pack of ends (ledger_end_packs), instead of upserting it,
	// a fraction of the cost. Ignored on a row without an end.
	Sole bool `json:"sole,omitempty"`
	Usage
}

// appended says whether PutUsage appends r to a pack of ends (a
// sandbox's sole report) rather than upserting it into ledger.
func appended(r *UsageRow) bool { return r.Sole && r.SandboxID != "" && !r.Ended.IsZero() }

// splitAppended parts rows into those PutUsage appends and the rest.
func splitAppended(rows []UsageRow) (ends, rest []UsageRow) {
	n := 0
	for i := range rows {
		if appended(&rows[i]) {
			n++
		}
	}
	switch n {
	case 0:
		return nil, rows
	case len(rows):
		return rows, nil
	}
	ends, rest = make([]UsageRow, 0, n), make([]UsageRow, 0, len(rows)-n)
	for i := range rows {
		if appended(&rows[i]) {
			ends = append(ends, rows[i])
		} else {
			rest = append(rest, rows[i])
		}
	}
	return ends, rest
}

// Usage is the ledger's figures.
type Usage struct {
	CPUUsec       int64   `json:"cpu_usec"`
	MemoryGiBSec  float64 `json:"memory_gib_seconds"`
	DiskGiBHours  float64 `json:"disk_gib_hours"`
	DiskPeakBytes int64   `json:"disk_peak_bytes"` // the writable layer's largest size seen
	SnapshotBytes int64   `json:"snapshot_bytes"`
	EgressBytes   int64   `json:"egress_bytes"`
	FnCallCalls   int64   `json:"fncall_calls"`
	Sandboxes     int64   `json:"sandboxes"`
}

// Add adds o's figures to u (DiskPeakBytes: the larger).
func (u *Usage) Add(o Usage) {
	u.CPUUsec += o.CPUUsec
	u.MemoryGiBSec += o.MemoryGiBSec
	u.DiskGiBHours += o.DiskGiBHours
	u.DiskPeakBytes = max(u.DiskPeakBytes, o.DiskPeakBytes)
	u.SnapshotBytes += o.SnapshotBytes
	u.EgressBytes += o.EgressBytes
	u.FnCallCalls += o.FnCallCalls
	u.Sandboxes += o.Sandboxes
}

// raise sets each of u's figures to the larger of it and o's.
func (u *Usage) raise(o Usage) {
	u.CPUUsec = max(u.CPUUsec, o.CPUUsec)
	u.MemoryGiBSec = max(u.MemoryGiBSec, o.MemoryGiBSec)
	u.DiskGiBHours = max(u.DiskGiBHours, o.DiskGiBHours)
	u.DiskPeakBytes = max(u.DiskPeakBytes, o.DiskPeakBytes)
	u.SnapshotBytes = max(u.SnapshotBytes, o.SnapshotBytes)
	u.EgressBytes = max(u.EgressBytes, o.EgressBytes)
	u.FnCallCalls = max(u.FnCallCalls, o.FnCallCalls)
}

// UsageQuery selects ledger rows and how to group them.
type UsageQuery struct {
	// Projects are paths, each selecting the project and everything under
	// it; none, or the root (""), selects every project.
	Projects []string
	// Since and Until select the rows whose life overlaps [Since, Until)
	// (a zero bound is open): a sandbox alive in the window counts whole.
	Since, Until time.Time
	// By groups the sums: "project" (the default), "sandbox", "node" or
	// "label:KEY" (rows without the label sum under "").
	By string
	// Live are rows as the nodes hold them now (their live sandboxes',
	// read at query time, which the store has at their last checkpoint or
	// not at all): each is summed in place of the stored row of its key,
	// figure by figure the larger of the two (as PutUsage would store
	// it), or alone, when Projects, Since and Until select it.
	Live []UsageRow
}

// UsageSum is the figures of one group.
type UsageSum struct {
	Key string `json:"key"`
	Usage
}

// CheckUsageBy refuses a grouping SumUsage does not know.
func CheckUsageBy(by string) error {
	switch {
	case by == "", by == "project", by == "sandbox", by == "node":
		return nil
	case strings.HasPrefix(by, "label:") && len(by) > len("label:"):
		return nil
	}
	return fmt.Errorf("group usage by %q: want project, sandbox, node or label:KEY: %w", by, errdefs.ErrInvalidArgument)
}

// usageBatch is how many rows one INSERT takes (15 parameters each).
const usageBatch = 50

// checkUsageRows refuses a row without a key.
func checkUsageRows(rows []UsageRow) error {
	for _, r := range rows {
		if r.Key == "" {
			return fmt.Errorf("put usage of sandbox %s: a key is required: %w", r.SandboxID, errdefs.ErrInvalidArgument)
		}
	}
	return nil
}

// usageOnConflict is PutUsage's ON CONFLICT clause, with the dialect's
// greatest and least and {ms} in the time columns' names: a report only
// ever raises a row's figures, and an end stays once set (the later of
// two ends wins).
func usageOnConflict(greatest, least string) string {
	endExpr := `CASE WHEN ledger.ended{ms} IS NULL THEN excluded.ended{ms} WHEN excluded.ended{ms} IS NULL THEN ledger.ended{ms} ELSE ` + greatest + `(ledger.ended{ms}, excluded.ended{ms}) END`
	set := []string{
		"sandbox_id = excluded.sandbox_id", "project = excluded.project", "labels = excluded.labels", "node = excluded.node",
		"started{ms} = " + least + "(ledger.started{ms}, excluded.started{ms})",
		"ended{ms} = " + endExpr,
		"updated{ms} = " + greatest + "(ledger.updated{ms}, excluded.updated{ms})",
	}
	for _, c := range []string{"cpu_usec", "memory_gib_s", "disk_gib_h", "disk_peak_bytes", "snapshot_bytes", "egress_bytes", "fncall_calls"} {
		set = append(set, c+" = "+greatest+"(ledger."+c+", excluded."+c+")")
	}
	return ` ON CONFLICT (key) DO UPDATE SET ` + strings.Join(set, ", ")
}

func (d *sqlDB) PutUsage(ctx context.Context, rows ...UsageRow) error {
	if err := checkUsageRows(rows); err != nil || len(rows) == 0 {
		return err
	}
	ends, rest := splitAppended(rows)
	err := d.inTx(ctx, func(tx *sql.Tx) error { return d.putUsage(ctx, tx, ends, rest) })
	if err != nil {
		return d.fail(fmt.Sprintf("put %d usage rows", len(rows)), err)
	}
	return nil
}

// putUsage is PutUsage's writes in tx: ends appended to ledger_end_packs,
// in packs, rest merged into ledger.
func (d *sqlDB) putUsage(ctx context.Context, tx *sql.Tx, ends, rest []UsageRow) error {
	greatest, least := "GREATEST", "LEAST"
	if d.dialect == dialectSQLite {
		greatest, least = "max", "min"
	}
	if err := d.insertUsage(ctx, tx, "ledger", rest, usageOnConflict(greatest, least)); err != nil {
		return err
	}
	for _, p := range packEnds(ends) {
		if _, err := tx.ExecContext(ctx, d.q(`INSERT INTO ledger_end_packs (project, started{ms}, ended{ms}, n, records) VALUES (?, ?, ?, ?, ?)`),
			p.project, d.ts(p.started), d.ts(p.ended), p.n, p.records); err != nil {
			return err
		}
	}
	return nil
}

// insertUsage inserts rows into table, usageBatch at a time, each INSERT
// ending with tail.
func (d *sqlDB) insertUsage(ctx context.Context, tx *sql.Tx, table string, rows []UsageRow, tail string) error {
	for rest := rows; len(rest) > 0; {
		n := min(len(rest), usageBatch)
		batch := rest[:n]
		rest = rest[n:]
		var sb strings.Builder
		sb.WriteString(`INSERT INTO ` + table + ` (key, sandbox_id, project, labels, node, started{ms}, ended{ms}, updated{ms}, cpu_usec, memory_gib_s,
			disk_gib_h, disk_peak_bytes, snapshot_bytes, egress_bytes, fncall_calls) VALUES `)
		args := make([]any, 0, 15*n)
		for i, r := range batch {
			if i > 0 {
				sb.WriteString(", ")
			}
			sb.WriteString("(?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)")
			args = append(args, r.Key, r.SandboxID, r.Project, string(appendLabelsJSON(nil, r.Labels)), r.Node, d.ts(nowOr(r.Started)), d.ts(r.Ended), d.ts(nowOr(r.Updated)),
				r.CPUUsec, r.MemoryGiBSec, r.DiskGiBHours, r.DiskPeakBytes, r.SnapshotBytes, r.EgressBytes, r.FnCallCalls)
		}
		sb.WriteString(tail)
		if _, err := tx.ExecContext(ctx, d.q(sb.String()), args...); err != nil {
			return err
		}
	}
	return nil
}

func (d *sqlDB) SumUsage(ctx context.Context, q UsageQuery) ([]UsageSum, error) {
	if err := CheckUsageBy(q.By); err != nil {
		return nil, err
	}
	var conds []string
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
		subtrees = append(subtrees, `(project = ? OR (project >= ? AND project < ?))`)
		args = append(args, path, path+"/", path+"0")
	}
	if all {
		subtrees, args = nil, nil
	} else {
		conds = append(conds, `(`+strings.Join(subtrees, " OR ")+`)`)
	}
	if !q.Since.IsZero() {
		conds = append(conds, `(ended{ms} IS NULL OR ended{ms} >= ?)`)
		args = append(args, d.ts(q.Since))
	}
	if !q.Until.IsZero() {
		conds = append(conds, `started{ms} < ?`)
		args = append(args, d.ts(q.Until))
	}
	where := ""
	if len(conds) > 0 {
		where = ` WHERE ` + strings.Join(conds, " AND ")
	}
	label, byLabel := strings.CutPrefix(q.By, "label:")
	var sums map[string]*UsageSum
	add := func(sbID, project string, labels map[string]string, node string, u Usage) {
		if sbID != "" {
			u.Sandboxes = 1
		}
		var key string
		switch {
		case byLabel:
			key = labels[label]
		case q.By == "sandbox":
			key = sbID
		case q.By == "node":
			key = node
		default:
			key = project
		}
		s := sums[key]
		if s == nil {
			s = &UsageSum{Key: key}
			sums[key] = s
		}
		s.Add(u)
	}
	err := d.retry(ctx, true, func(ctx context.Context) error {
		sums = map[string]*UsageSum{}
		live := make(map[string]*UsageRow, len(q.Live))
		for i := range q.Live {
			live[q.Live[i].Key] = &q.Live[i]
		}
		packed, err := d.packedEnds(ctx, q, where, args)
		if err != nil {
			return err
		}
		// stored sums a key's stored figures, the node's live record in
		// their place when it has one.
		stored := func(key, sbID, project, labels, node string, u Usage) error {
			if r, ok := live[key]; ok {
				// The node's record as it stands: newer than the stored.
				delete(live, key)
				u.raise(r.Usage)
				add(r.SandboxID, r.Project, r.Labels, r.Node, u)
				return nil
			}
			var m map[string]string
			if byLabel && labels != "" && labels != "null" {
				if err := json.Unmarshal([]byte(labels), &m); err != nil {
					return fmt.Errorf("labels of sandbox %s: %w", sbID, err)
				}
			}
			add(sbID, project, m, node, u)
			return nil
		}
		rows, err := d.db.QueryContext(ctx, d.q(sumUsageQuery(where)), append(slices.Clip(args), args...)...)
		if err != nil {
			return err
		}
		defer rows.Close()
		for rows.Next() {
			var key, sbID, project, labels, node string
			var u Usage
			if err := rows.Scan(&key, &sbID, &project, &labels, &node, &u.CPUUsec, &u.MemoryGiBSec, &u.DiskGiBHours, &u.DiskPeakBytes,
				&u.SnapshotBytes, &u.EgressBytes, &u.FnCallCalls); err != nil {
				return err
			}
			if p, ok := packed[key]; ok {
				// Its end in a pack too (put twice, or by an older
				// dsec in ledger_ends): merged as the query merges rows.
				delete(packed, key)
				u.raise(p.Usage)
				labels = max(labels, p.labels)
			}
			if err := stored(key, sbID, project, labels, node, u); err != nil {
				return err
			}
		}
		if err := rows.Err(); err != nil {
			return err
		}
		for key, p := range packed {
			if err := stored(key, p.SandboxID, p.Project, p.labels, p.Node, p.Usage); err != nil {
				return err
			}
		}
		// The live rows the store has none of yet, as the query selects.
		for _, r := range live {
			if q.selects(*r) {
				u := r.Usage
				u.Sandboxes = 0
				add(r.SandboxID, r.Project, r.Labels, r.Node, u)
			}
		}
		return nil
	})
	if err != nil {
		return nil, d.fail("sum usage", err)
	}
	out := make([]UsageSum, 0, len(sums))
	for _, s := range sums {
		out = append(out, *s)
	}
	sort.Slice(out, func(i, j int) bool { return out[i].Key < out[j].Key })
	return out, nil
}

// packedEnd is a sole end read from a pack, its labels as JSON.
type packedEnd struct {
	UsageRow
	labels string
}

// packedEnds reads the records of the packs of ends that where (with
// args) selects, keeps those q selects, and merges a key's records as
// sumUsageQuery merges rows: each figure's largest (a pull stored twice
// packs an end twice).
func (d *sqlDB) packedEnds(ctx context.Context, q UsageQuery, where string, args []any) (map[string]*packedEnd, error) {
	rows, err := d.db.QueryContext(ctx, d.q(`SELECT project, records FROM ledger_end_packs`+where), args...)
	if err != nil {
		return nil, err
	}
	defer rows.Close()
	out := map[string]*packedEnd{}
	for rows.Next() {
		var project string
		var records []byte
		if err := rows.Scan(&project, &records); err != nil {
			return nil, err
		}
		err := decodeEnds(project, records, func(r *UsageRow, labels string) {
			if !q.selects(*r) {
				return
			}
			if p, ok := out[r.Key]; ok {
				p.Usage.raise(r.Usage)
				p.labels = max(p.labels, labels)
				return
			}
			out[r.Key] = &packedEnd{UsageRow: *r, labels: labels}
		})
		if err != nil {
			return nil, err
		}
	}
	return out, rows.Err()
}

// sumUsageQuery reads the rows of ledger and ledger_ends that where
// selects (its arguments given twice), a key's rows merged as PutUsage
// merges reports: each figure's largest. A key's rows name one sandbox
// (its project and node never change; of labels changed in its life, the
// larger as text is read).
func sumUsageQuery(where string) string {
	const cols = `key, sandbox_id, project, labels, node, cpu_usec, memory_gib_s, disk_gib_h, disk_peak_bytes, snapshot_bytes, egress_bytes, fncall_calls`
	return `SELECT key, max(sandbox_id), max(project), max(labels), max(node), max(cpu_usec), max(memory_gib_s), max(disk_gib_h),
		max(disk_peak_bytes), max(snapshot_bytes), max(egress_bytes), max(fncall_calls)
		FROM (SELECT ` + cols + ` FROM ledger` + where + ` UNION ALL SELECT ` + cols + ` FROM ledger_ends` + where + `) u GROUP BY key`
}

// selects says whether q selects row r, as SumUsage's query does the
// stored rows.
func (q UsageQuery) selects(r UsageRow) bool {
	if !q.Since.IsZero() && !r.Ended.IsZero() && r.Ended.Before(q.Since) {
		return false
	}
	if !q.Until.IsZero() && !r.Started.Before(q.Until) {
		return false
	}
	if len(q.Projects) == 0 {
		return true
	}
	for _, p := range q.Projects {
		path, err := iam.CleanPath(p)
		if err == nil && (path == "" || r.Project == path || strings.HasPrefix(r.Project, path+"/")) {
			return true
		}
	}
	return false
}

func (d *sqlDB) ExpireUsage(ctx context.Context, olderThan time.Time) (int, error) {
	var n int64
	err := d.retry(ctx, true, func(ctx context.Context) error {
		res, err := d.db.ExecContext(ctx, d.q(`DELETE FROM ledger WHERE (ended{ms} IS NOT NULL AND ended{ms} < ?) OR (sandbox_id = '' AND updated{ms} < ?)`),
			d.ts(olderThan), d.ts(olderThan))
		if err != nil {
			return err
		}
		n, _ = res.RowsAffected()
		res, err = d.db.ExecContext(ctx, d.q(`DELETE FROM ledger_ends WHERE ended{ms} < ?`), d.ts(olderThan))
		if err != nil {
			return err
		}
		ends, _ := res.RowsAffected()
		n += ends
		// A pack goes whole, once its latest end is past the cut: its
		// records ended within a pull of one another.
		packed, err := d.deleteCounted(ctx, `DELETE FROM ledger_end_packs WHERE ended{ms} < ? RETURNING n`, d.ts(olderThan))
		n += packed
		return err
	})
	if err != nil {
		return 0, d.fail("expire usage", err)
	}
	return int(n), nil
}

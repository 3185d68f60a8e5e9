package store

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"strings"
	"time"

	"dsec.dev/dsec/internal/iam"
)

// AuditRecord is one management call, as the apiserver saw it.
type AuditRecord struct {
	ID        int64     `json:"id"`
	At        time.Time `json:"at"`
	Principal string    `json:"principal"`
	TokenID   string    `json:"token_id,omitempty"`
	Project   string    `json:"project"` // path, "" for the root
	Operation string    `json:"operation"`
	Object    string    `json:"object,omitempty"`
	// Code is the call's result: "ok", or its error's code (permission_denied…).
	Code    string `json:"code"`
	Peer    string `json:"peer,omitempty"`
	Message string `json:"message,omitempty"`
}

// AuditQuery selects audit records. Zero fields select everything.
type AuditQuery struct {
	Project   string // a path: the project and everything under it
	Since     time.Time
	Until     time.Time // exclusive
	Principal string
	// Limit bounds how many records come back (the oldest first); 0 is
	// DefaultAuditLimit.
	Limit int
}

// DefaultAuditLimit is how many records QueryAudit returns when no limit
// is given.
const DefaultAuditLimit = 1000

func (d *sqlDB) AppendAudit(ctx context.Context, recs ...AuditRecord) error {
	// One statement per auditBatch records: a writer appending many at once
	// pays one round trip for them.
	for len(recs) > 0 {
		n := min(len(recs), auditBatch)
		batch := recs[:n]
		recs = recs[n:]
		var sb strings.Builder
		sb.WriteString(`INSERT INTO audit (at{ms}, principal, token_id, project, operation, object, code, peer, message) VALUES `)
		args := make([]any, 0, 9*n)
		for i, rec := range batch {
			if i > 0 {
				sb.WriteString(", ")
			}
			sb.WriteString("(?, ?, ?, ?, ?, ?, ?, ?, ?)")
			args = append(args, d.ts(nowOr(rec.At)), rec.Principal, rec.TokenID, rec.Project, rec.Operation, rec.Object, rec.Code, rec.Peer, rec.Message)
		}
		q := d.q(sb.String())
		err := d.retry(ctx, false, func(ctx context.Context) error {
			_, err := d.db.ExecContext(ctx, q, args...)
			return err
		})
		if err != nil {
			return d.fail(fmt.Sprintf("append %d audit records", n), err)
		}
	}
	return nil
}

// auditBatch is how many audit records one INSERT takes (9 parameters
// each: well under SQLite's and PostgreSQL's limits).
const auditBatch = 100

func (d *sqlDB) QueryAudit(ctx context.Context, q AuditQuery) ([]AuditRecord, error) {
	path, err := iam.CleanPath(q.Project)
	if err != nil {
		return nil, err
	}
	cond, args := `1 = 1`, []any{}
	if path != "" {
		// The project itself, or a path between "p/" and "p0" ('0' follows
		// '/'): a range the (project, at) index serves.
		cond += ` AND (project = ? OR (project >= ? AND project < ?))`
		args = append(args, path, path+"/", path+"0")
	}
	if !q.Since.IsZero() {
		cond += ` AND at{ms} >= ?`
		args = append(args, d.ts(q.Since))
	}
	if !q.Until.IsZero() {
		cond += ` AND at{ms} < ?`
		args = append(args, d.ts(q.Until))
	}
	if q.Principal != "" {
		cond += ` AND principal = ?`
		args = append(args, q.Principal)
	}
	limit := q.Limit
	if limit <= 0 {
		limit = DefaultAuditLimit
	}
	args = append(args, limit)
	var out []AuditRecord
	err = d.retry(ctx, true, func(ctx context.Context) error {
		out = nil
		rows, err := d.db.QueryContext(ctx, d.q(`SELECT id, at{ms}, principal, token_id, project, operation, object, code, peer, message
			FROM audit WHERE `+cond+` ORDER BY at{ms}, id LIMIT ?`), args...)
		if err != nil {
			return err
		}
		defer rows.Close()
		for rows.Next() {
			var r AuditRecord
			if err := rows.Scan(&r.ID, timeCol{&r.At}, &r.Principal, &r.TokenID, &r.Project, &r.Operation, &r.Object,
				&r.Code, &r.Peer, &r.Message); err != nil {
				return err
			}
			out = append(out, r)
		}
		return rows.Err()
	})
	if err != nil {
		return nil, d.fail("query the audit log", err)
	}
	return out, nil
}

func (d *sqlDB) ExpireAudit(ctx context.Context, olderThan time.Time) (int, error) {
	var n int64
	err := d.retry(ctx, true, func(ctx context.Context) error {
		res, err := d.db.ExecContext(ctx, d.q(`DELETE FROM audit WHERE at{ms} < ?`), d.ts(olderThan))
		if err != nil {
			return err
		}
		n, _ = res.RowsAffected()
		return nil
	})
	if err != nil {
		return 0, d.fail("expire audit records", err)
	}
	return int(n), nil
}

// WriteAuditJSON writes records as JSON lines, one object a line, times
// in RFC 3339 UTC.
func WriteAuditJSON(w io.Writer, recs []AuditRecord) error {
	enc := json.NewEncoder(w)
	for _, r := range recs {
		r.At = r.At.UTC()
		if err := enc.Encode(r); err != nil {
			return fmt.Errorf("write audit record %d: %w", r.ID, err)
		}
	}
	return nil
}

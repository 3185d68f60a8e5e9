// Package store is the metadata store of the control plane. Today it holds
// idempotency records for Create, so a retried request never makes a second
// batch of sandboxes; the IAM and catalogue tables join it later. It is an
// embedded SQLite database by default (one file under the daemon's root).
package store

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"strings"
	"time"

	_ "modernc.org/sqlite" // the database/sql driver "sqlite"

	"dsec.dev/dsec/internal/errdefs"
)

// Store is safe for concurrent use. Close it when the daemon exits.
type Store struct {
	db *sql.DB
}

// Open opens (creating if needed) the SQLite database at path.
func Open(ctx context.Context, path string) (*Store, error) {
	db, err := sql.Open("sqlite", "file:"+path+"?_pragma=busy_timeout(5000)&_pragma=journal_mode(WAL)&_pragma=synchronous(NORMAL)")
	if err != nil {
		return nil, fmt.Errorf("open metadata store %s: %w", path, err)
	}
	db.SetMaxOpenConns(4)
	const schema = `
CREATE TABLE IF NOT EXISTS idempotency (
	key          TEXT PRIMARY KEY,
	request_hash TEXT NOT NULL,
	ids          TEXT NOT NULL,
	created_ms   INTEGER NOT NULL
);`
	if _, err := db.ExecContext(ctx, schema); err != nil {
		db.Close()
		return nil, fmt.Errorf("create metadata schema in %s: %w", path, err)
	}
	return &Store{db: db}, nil
}

// Close closes the database.
func (s *Store) Close() error { return s.db.Close() }

// Idempotency is the outcome recorded for one idempotency key.
type Idempotency struct {
	Key         string
	RequestHash string
	IDs         []string
	Created     time.Time
}

// GetIdempotency returns the record for key, or errdefs.ErrNotFound.
func (s *Store) GetIdempotency(ctx context.Context, key string) (Idempotency, error) {
	var rec Idempotency
	var ids string
	var created int64
	err := s.db.QueryRowContext(ctx,
		`SELECT key, request_hash, ids, created_ms FROM idempotency WHERE key = ?`, key).
		Scan(&rec.Key, &rec.RequestHash, &ids, &created)
	if errors.Is(err, sql.ErrNoRows) {
		return Idempotency{}, fmt.Errorf("idempotency key %q: %w", key, errdefs.ErrNotFound)
	}
	if err != nil {
		return Idempotency{}, fmt.Errorf("read idempotency key %q: %w", key, err)
	}
	if ids != "" {
		rec.IDs = strings.Split(ids, ",")
	}
	rec.Created = time.UnixMilli(created)
	return rec, nil
}

// PutIdempotency records the sandboxes a request made under its key.
func (s *Store) PutIdempotency(ctx context.Context, rec Idempotency) error {
	_, err := s.db.ExecContext(ctx,
		`INSERT OR REPLACE INTO idempotency (key, request_hash, ids, created_ms) VALUES (?, ?, ?, ?)`,
		rec.Key, rec.RequestHash, strings.Join(rec.IDs, ","), rec.Created.UnixMilli())
	if err != nil {
		return fmt.Errorf("write idempotency key %q: %w", rec.Key, err)
	}
	return nil
}

// ExpireIdempotency forgets records older than before.
func (s *Store) ExpireIdempotency(ctx context.Context, before time.Time) error {
	if _, err := s.db.ExecContext(ctx, `DELETE FROM idempotency WHERE created_ms < ?`, before.UnixMilli()); err != nil {
		return fmt.Errorf("expire idempotency records: %w", err)
	}
	return nil
}

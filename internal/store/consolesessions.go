package store

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"time"

	"dsec.dev/dsec/internal/errdefs"
)

// ConsoleSessions keeps the web console's sessions (package console), so
// that every apiserver on the store accepts a browser any of them signed
// in, and a restart signs no one out. A session is named by a hash of its
// cookie and holds its token sealed under a key derived from the cookie:
// the store alone gives neither a cookie nor a token.
type ConsoleSessions interface {
	// PutConsoleSession stores a new session; an ID stored already is
	// errdefs.ErrAlreadyExists. The metadata store keeps a token's newest
	// MaxConsoleSessionsPerToken, its oldest going in the same
	// transaction (the console's in-memory table bounds them all).
	PutConsoleSession(ctx context.Context, s ConsoleSession) error
	// ConsoleSession returns the session id names, or errdefs.ErrNotFound
	// when there is none or it ended before now.
	ConsoleSession(ctx context.Context, id string, now time.Time) (ConsoleSession, error)
	// DeleteConsoleSession ends a session (a sign-out, its token refused);
	// an unknown ID is no error.
	DeleteConsoleSession(ctx context.Context, id string) error
	// ExpireConsoleSessions forgets the sessions that ended before now and
	// returns how many.
	ExpireConsoleSessions(ctx context.Context, now time.Time) (int, error)
}

// MaxConsoleSessionsPerToken bounds the sessions one token holds: a
// browser signed in again, or a script signing in in a loop, ends the
// token's oldest, so a token cannot fill the store with rows that live a
// session's life.
const MaxConsoleSessionsPerToken = 64

// ConsoleSession is one signed-in browser. RevokeToken ends the sessions
// of the tokens it revokes.
type ConsoleSession struct {
	ID      string // the SHA-256 of the cookie's value, hex
	TokenID string // the token the browser signed in with ("" for one of no ID)
	Sealed  string // the token, sealed with a key only the cookie gives
	Created time.Time
	Expires time.Time
}

func (d *sqlDB) PutConsoleSession(ctx context.Context, s ConsoleSession) error {
	if s.ID == "" || s.Sealed == "" || s.Expires.IsZero() {
		return fmt.Errorf("put console session: ID, sealed token and expiry are needed: %w", errdefs.ErrInvalidArgument)
	}
	if s.Created.IsZero() {
		s.Created = time.Now()
	}
	err := d.inTx(ctx, func(tx *sql.Tx) error {
		if _, err := tx.ExecContext(ctx, d.q(`INSERT INTO console_sessions (id, token_id, sealed, created{ms}, expires{ms}) VALUES (?, ?, ?, ?, ?)`),
			s.ID, s.TokenID, s.Sealed, d.ts(s.Created), d.ts(s.Expires)); err != nil {
			return err
		}
		_, err := tx.ExecContext(ctx, d.q(`DELETE FROM console_sessions WHERE token_id = ? AND id NOT IN
			(SELECT id FROM console_sessions WHERE token_id = ? ORDER BY created{ms} DESC, id DESC LIMIT ?)`),
			s.TokenID, s.TokenID, MaxConsoleSessionsPerToken)
		return err
	})
	if err != nil && d.unique(err) {
		return fmt.Errorf("put console session: its ID is taken: %w", errdefs.ErrAlreadyExists)
	}
	if err != nil {
		return d.fail("put console session", err)
	}
	return nil
}

func (d *sqlDB) ConsoleSession(ctx context.Context, id string, now time.Time) (ConsoleSession, error) {
	var s ConsoleSession
	err := d.retry(ctx, true, func(ctx context.Context) error {
		return d.db.QueryRowContext(ctx, d.q(`SELECT id, token_id, sealed, created{ms}, expires{ms} FROM console_sessions WHERE id = ? AND expires{ms} > ?`),
			id, d.ts(now)).Scan(&s.ID, &s.TokenID, &s.Sealed, timeCol{&s.Created}, timeCol{&s.Expires})
	})
	if errors.Is(err, sql.ErrNoRows) {
		return ConsoleSession{}, fmt.Errorf("no such console session: %w", errdefs.ErrNotFound)
	}
	if err != nil {
		return ConsoleSession{}, d.fail("read console session", err)
	}
	return s, nil
}

func (d *sqlDB) DeleteConsoleSession(ctx context.Context, id string) error {
	err := d.retry(ctx, true, func(ctx context.Context) error {
		_, err := d.db.ExecContext(ctx, d.q(`DELETE FROM console_sessions WHERE id = ?`), id)
		return err
	})
	if err != nil {
		return d.fail("delete console session", err)
	}
	return nil
}

func (d *sqlDB) ExpireConsoleSessions(ctx context.Context, now time.Time) (int, error) {
	var n int64
	err := d.retry(ctx, true, func(ctx context.Context) error {
		res, err := d.db.ExecContext(ctx, d.q(`DELETE FROM console_sessions WHERE expires{ms} <= ?`), d.ts(now))
		if err != nil {
			return err
		}
		n, _ = res.RowsAffected()
		return nil
	})
	if err != nil {
		return 0, d.fail("expire console sessions", err)
	}
	return int(n), nil
}

// endConsoleSessions ends the console sessions of revoked tokens, in
// RevokeToken's transaction.
func endConsoleSessions(ctx context.Context, d *sqlDB, tx *sql.Tx) error {
	_, err := tx.ExecContext(ctx, d.q(`DELETE FROM console_sessions WHERE token_id IN
		(SELECT id FROM tokens WHERE revoked{ms} IS NOT NULL AND id IN (SELECT token_id FROM console_sessions))`))
	return err
}

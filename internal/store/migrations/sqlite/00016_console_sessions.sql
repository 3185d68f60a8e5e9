-- The web console's sessions, as migrations/postgres/00015_console_sessions.sql:
-- one row per signed-in browser, named by the SHA-256 of its cookie (the
-- cookie itself is never stored), the ID of the token it signed in with,
-- that token sealed under a key only the cookie gives, and when it ends.
-- Any apiserver on the store accepts the session; a restart keeps it.

-- +goose Up
CREATE TABLE console_sessions (
	id         TEXT PRIMARY KEY,
	token_id   TEXT NOT NULL,
	sealed     TEXT NOT NULL,
	created_ms INTEGER NOT NULL,
	expires_ms INTEGER NOT NULL
);
CREATE INDEX console_sessions_token ON console_sessions (token_id);
CREATE INDEX console_sessions_expires ON console_sessions (expires_ms);

-- +goose Down
DROP TABLE console_sessions;

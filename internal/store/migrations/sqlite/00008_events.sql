-- Lifecycle events, as migrations/postgres/00007_events.sql: one row per
-- event an edge reported (created, paused, deleted, expired…), keyed by the
-- edge's idempotent key so a report pulled twice (two apiservers, or one
-- restarted) is stored once; id is the cursor readers follow.

-- +goose Up
CREATE TABLE events (
	id         INTEGER PRIMARY KEY AUTOINCREMENT,
	key        TEXT NOT NULL UNIQUE,
	at_ms      INTEGER NOT NULL,
	project    TEXT NOT NULL,
	sandbox_id TEXT NOT NULL,
	kind       TEXT NOT NULL,
	node       TEXT NOT NULL,
	reason     TEXT NOT NULL,
	message    TEXT NOT NULL
);
CREATE INDEX events_project_id ON events (project, id);
CREATE INDEX events_at ON events (at_ms);

-- +goose Down
DROP TABLE events;

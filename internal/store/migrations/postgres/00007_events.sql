-- Lifecycle events, as migrations/sqlite/00008_events.sql: one row per
-- event an edge reported (created, paused, deleted, expired…), keyed by the
-- edge's idempotent key so a report pulled twice (two apiservers, or one
-- restarted) is stored once; id is the cursor readers follow (appends
-- take an advisory lock, so ids commit in order and a reader at a cursor
-- never skips a row committed later with a smaller id).

-- +goose Up
CREATE TABLE events (
	id         bigserial PRIMARY KEY,
	key        text NOT NULL UNIQUE,
	at         timestamptz NOT NULL,
	project    text NOT NULL,
	sandbox_id text NOT NULL,
	kind       text NOT NULL,
	node       text NOT NULL,
	reason     text NOT NULL,
	message    text NOT NULL
);
CREATE INDEX events_project_id ON events (project, id);
CREATE INDEX events_at ON events (at);

-- +goose Down
DROP TABLE events;

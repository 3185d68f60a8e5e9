-- Webhooks, as migrations/postgres/00008_webhooks.sql: an endpoint a
-- project registered for its events (and those of the projects under it),
-- the kinds it wants ('' all), its signing secret, how far its deliveries
-- got (delivered: the last event ID acknowledged), the apiserver holding
-- its lease and until when, and the last delivery's outcomes.

-- +goose Up
CREATE TABLE webhooks (
	id            TEXT PRIMARY KEY,
	project       TEXT NOT NULL,
	url           TEXT NOT NULL,
	kinds         TEXT NOT NULL,
	secret        TEXT NOT NULL,
	created_ms    INTEGER NOT NULL,
	delivered     INTEGER NOT NULL,
	lease_owner   TEXT NOT NULL DEFAULT '',
	lease_ms      INTEGER,
	ok_ms         INTEGER,
	failed_ms     INTEGER,
	failures      INTEGER NOT NULL DEFAULT 0,
	last_error    TEXT NOT NULL DEFAULT ''
);
CREATE INDEX webhooks_project ON webhooks (project);

-- +goose Down
DROP TABLE webhooks;

-- Webhooks, as migrations/sqlite/00009_webhooks.sql: an endpoint a
-- project registered for its events (and those of the projects under it),
-- the kinds it wants ('' all), its signing secret, how far its deliveries
-- got (delivered: the last event ID acknowledged), the apiserver holding
-- its lease and until when, and the last delivery's outcomes.

-- +goose Up
CREATE TABLE webhooks (
	id          text PRIMARY KEY,
	project     text NOT NULL,
	url         text NOT NULL,
	kinds       text NOT NULL,
	secret      text NOT NULL,
	created     timestamptz NOT NULL,
	delivered   bigint NOT NULL,
	lease_owner text NOT NULL DEFAULT '',
	lease       timestamptz,
	ok          timestamptz,
	failed      timestamptz,
	failures    bigint NOT NULL DEFAULT 0,
	last_error  text NOT NULL DEFAULT ''
);
CREATE INDEX webhooks_project ON webhooks (project);

-- +goose Down
DROP TABLE webhooks;

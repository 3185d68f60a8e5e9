-- The apiservers that pull events, as migrations/sqlite/00013_event_pullers.sql:
-- one row per apiserver, renewed with its leases of event_pulls, so each
-- knows how many are alive (holding nodes or not) and takes only its
-- share of the nodes. A row whose lease lapsed is an apiserver gone.

-- +goose Up
CREATE TABLE event_pullers (
	owner text PRIMARY KEY,
	lease timestamptz NOT NULL
);

-- +goose Down
DROP TABLE event_pullers;

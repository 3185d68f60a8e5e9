-- Who pulls each node's events, as migrations/postgres/00009_event_pulls.sql:
-- one row per node, the apiserver holding its lease and until when, and
-- the cursor (the node's log epoch and the last sequence number stored),
-- written in the transaction that stores the pulled events, so the next
-- holder resumes exactly after them.

-- +goose Up
CREATE TABLE event_pulls (
	node     TEXT PRIMARY KEY,
	owner    TEXT NOT NULL DEFAULT '',
	lease_ms INTEGER,
	epoch    TEXT NOT NULL DEFAULT '',
	seq      INTEGER NOT NULL DEFAULT 0
);

-- +goose Down
DROP TABLE event_pulls;

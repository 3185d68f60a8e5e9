-- Who pulls each node's events, as migrations/sqlite/00010_event_pulls.sql:
-- one row per node, the apiserver holding its lease and until when, and
-- the cursor (the node's log epoch and the last sequence number stored),
-- written in the transaction that stores the pulled events, so the next
-- holder resumes exactly after them.

-- +goose Up
CREATE TABLE event_pulls (
	node  text PRIMARY KEY,
	owner text NOT NULL DEFAULT '',
	lease timestamptz,
	epoch text NOT NULL DEFAULT '',
	seq   bigint NOT NULL DEFAULT 0
);

-- +goose Down
DROP TABLE event_pulls;

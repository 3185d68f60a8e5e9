-- Events in packs, as migrations/postgres/00017_event_packs.sql: a pull's
-- events of one project as one row (store/eventpack.go), whose event IDs
-- are the consecutive range first_id to last_id, taken from event_ids'
-- counter (its row locked by the pull that takes them, so packs commit in
-- the order of their IDs). The counter starts after the last ID the
-- events table gave, so readers' cursors go on; the next migration (Go,
-- store/eventmigrate.go) moves that table's rows into packs and drops it.

-- +goose Up
CREATE TABLE event_packs (
	last_id     INTEGER PRIMARY KEY,
	first_id    INTEGER NOT NULL,
	project     TEXT NOT NULL,
	first_at_ms INTEGER NOT NULL,
	last_at_ms  INTEGER NOT NULL,
	events      BLOB NOT NULL
);
CREATE INDEX event_packs_project ON event_packs (project, last_id);
CREATE INDEX event_packs_last_at ON event_packs (last_at_ms);
CREATE TABLE event_ids (
	one     INTEGER PRIMARY KEY CHECK (one = 1),
	last_id INTEGER NOT NULL
);
INSERT INTO event_ids (one, last_id) VALUES (1, MAX(
	COALESCE((SELECT seq FROM sqlite_sequence WHERE name = 'events'), 0),
	COALESCE((SELECT MAX(id) FROM events), 0)));

-- +goose Down
DROP TABLE event_ids;
DROP TABLE event_packs;

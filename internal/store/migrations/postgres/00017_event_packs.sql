-- Events in packs, as migrations/sqlite/00018_event_packs.sql: a pull's
-- events of one project as one row (store/eventpack.go), whose event IDs
-- are the consecutive range first_id to last_id, taken from event_ids'
-- counter (its row locked by the pull that takes them, so packs commit in
-- the order of their IDs). The counter starts after the last ID the
-- events table gave, so readers' cursors go on; the next migration (Go,
-- store/eventmigrate.go) moves that table's rows into packs and drops it.

-- +goose Up
CREATE TABLE event_packs (
	last_id  bigint PRIMARY KEY,
	first_id bigint NOT NULL,
	project  text NOT NULL,
	first_at timestamptz NOT NULL,
	last_at  timestamptz NOT NULL,
	events   bytea NOT NULL
);
CREATE INDEX event_packs_project ON event_packs (project, last_id);
CREATE INDEX event_packs_last_at ON event_packs (last_at);
CREATE TABLE event_ids (
	one     int PRIMARY KEY CHECK (one = 1),
	last_id bigint NOT NULL
);
INSERT INTO event_ids (one, last_id) SELECT 1, GREATEST(
	(SELECT CASE WHEN is_called THEN last_value ELSE 0 END FROM events_id_seq),
	(SELECT COALESCE(MAX(id), 0) FROM events));

-- +goose Down
DROP TABLE event_ids;
DROP TABLE event_packs;

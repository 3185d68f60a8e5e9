-- Create reservations, sandbox rows, the node registry, projects,
-- principals and tokens. Times are Unix milliseconds; lists are JSON arrays.

-- +goose Up
ALTER TABLE idempotency ADD COLUMN owner TEXT NOT NULL DEFAULT '';
ALTER TABLE idempotency ADD COLUMN placements TEXT NOT NULL DEFAULT '[]';
ALTER TABLE idempotency ADD COLUMN state TEXT NOT NULL DEFAULT 'done' CHECK (state IN ('pending', 'done'));
ALTER TABLE idempotency ADD COLUMN updated_ms INTEGER NOT NULL DEFAULT 0;
-- Older records kept their IDs comma-separated (sandbox IDs hold no commas
-- or quotes).
UPDATE idempotency SET
	updated_ms = created_ms,
	ids = CASE WHEN ids = '' THEN '[]' ELSE '["' || replace(ids, ',', '","') || '"]' END;
CREATE INDEX idempotency_done_created ON idempotency (created_ms) WHERE state = 'done';

CREATE TABLE sandboxes (
	id              TEXT PRIMARY KEY,
	node            TEXT NOT NULL,
	idempotency_key TEXT,
	created_ms      INTEGER NOT NULL
);
CREATE INDEX sandboxes_key ON sandboxes (idempotency_key);
CREATE INDEX sandboxes_node ON sandboxes (node);

CREATE TABLE node_slots (
	slot       INTEGER PRIMARY KEY CHECK (slot BETWEEN 1 AND 65535),
	generation INTEGER NOT NULL
);

CREATE TABLE nodes (
	name          TEXT PRIMARY KEY,
	slot          INTEGER NOT NULL UNIQUE REFERENCES node_slots (slot),
	generation    INTEGER NOT NULL,
	addr          TEXT NOT NULL,
	backends      TEXT NOT NULL,
	max_sandboxes INTEGER NOT NULL,
	cpus          REAL NOT NULL,
	memory_mb     INTEGER NOT NULL,
	identity      TEXT NOT NULL,
	registered_ms INTEGER NOT NULL,
	last_seen_ms  INTEGER NOT NULL
);

CREATE TABLE projects (
	id         TEXT PRIMARY KEY,
	parent_id  TEXT REFERENCES projects (id),
	name       TEXT NOT NULL,
	created_ms INTEGER NOT NULL
);
CREATE UNIQUE INDEX projects_parent_name ON projects (coalesce(parent_id, ''), name);
INSERT INTO projects (id, parent_id, name, created_ms)
	VALUES ('root', NULL, 'root', CAST((julianday('now') - 2440587.5) * 86400000 AS INTEGER));

CREATE TABLE principals (
	id         TEXT PRIMARY KEY,
	project_id TEXT NOT NULL REFERENCES projects (id),
	name       TEXT NOT NULL UNIQUE,
	created_ms INTEGER NOT NULL
);

CREATE TABLE tokens (
	id           TEXT PRIMARY KEY,
	principal_id TEXT NOT NULL REFERENCES principals (id) ON DELETE CASCADE,
	hash         BLOB NOT NULL UNIQUE CHECK (length(hash) = 32),
	created_ms   INTEGER NOT NULL,
	expires_ms   INTEGER,
	revoked_ms   INTEGER
);
CREATE INDEX tokens_principal ON tokens (principal_id);

-- +goose Down
DROP TABLE tokens;
DROP TABLE principals;
DROP TABLE projects;
DROP TABLE nodes;
DROP TABLE node_slots;
DROP TABLE sandboxes;
DROP INDEX idempotency_done_created;
UPDATE idempotency SET ids = coalesce((SELECT group_concat(value, ',') FROM json_each(idempotency.ids)), '');
ALTER TABLE idempotency DROP COLUMN updated_ms;
ALTER TABLE idempotency DROP COLUMN state;
ALTER TABLE idempotency DROP COLUMN placements;
ALTER TABLE idempotency DROP COLUMN owner;

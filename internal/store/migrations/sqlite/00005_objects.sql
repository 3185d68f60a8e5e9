-- Owned objects, as migrations/postgres/00004_objects.sql: every layer,
-- image, snapshot and warm pool the apiserver makes is recorded by the
-- name an environment gives it (name:tag, snap:NAME, pool:KEY) with the
-- path of the project it belongs to and the bytes charged for it; a share
-- lets another project (and what lies under it) read and use it. A name
-- without a row is the root's (made before this, or by the node).

-- +goose Up
CREATE TABLE objects (
	name       TEXT PRIMARY KEY,
	kind       TEXT NOT NULL CHECK (kind IN ('layer', 'image', 'snapshot', 'pool')),
	project    TEXT NOT NULL,
	bytes      INTEGER NOT NULL DEFAULT 0 CHECK (bytes >= 0),
	created_ms INTEGER NOT NULL
);
CREATE INDEX objects_project ON objects (project);

CREATE TABLE object_shares (
	name       TEXT NOT NULL REFERENCES objects (name) ON DELETE CASCADE,
	project    TEXT NOT NULL,
	created_ms INTEGER NOT NULL,
	PRIMARY KEY (name, project)
);

-- +goose Down
DROP TABLE object_shares;
DROP TABLE objects;

-- Owned objects, as migrations/sqlite/00005_objects.sql: every layer,
-- image, snapshot and warm pool the apiserver makes is recorded by the
-- name an environment gives it (name:tag, snap:NAME, pool:KEY) with the
-- path of the project it belongs to and the bytes charged for it; a share
-- lets another project (and what lies under it) read and use it. A name
-- without a row is the root's (made before this, or by the node).

-- +goose Up
CREATE TABLE objects (
	name    text PRIMARY KEY,
	kind    text NOT NULL CHECK (kind IN ('layer', 'image', 'snapshot', 'pool')),
	project text NOT NULL,
	bytes   bigint NOT NULL DEFAULT 0 CHECK (bytes >= 0),
	created timestamptz NOT NULL
);
CREATE INDEX objects_project ON objects (project);

CREATE TABLE object_shares (
	name    text NOT NULL REFERENCES objects (name) ON DELETE CASCADE,
	project text NOT NULL,
	created timestamptz NOT NULL,
	PRIMARY KEY (name, project)
);

-- +goose Down
DROP TABLE object_shares;
DROP TABLE objects;

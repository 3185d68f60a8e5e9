-- The blobs each object holds, as migrations/postgres/00005_object_blobs.sql:
-- a layer holds one, an image its layers', a snapshot its own. A project's
-- layer_bytes and snapshot_bytes are charged each blob once, however many
-- of its objects hold it (two images on one base layer pay for the base
-- once). An object recorded before this holds one blob of its own
-- (object:NAME), so what it was charged is given back as before.

-- +goose Up
CREATE TABLE object_blobs (
	name   TEXT NOT NULL REFERENCES objects (name) ON DELETE CASCADE,
	digest TEXT NOT NULL,
	bytes  INTEGER NOT NULL CHECK (bytes >= 0),
	PRIMARY KEY (name, digest)
);
CREATE INDEX object_blobs_digest ON object_blobs (digest);
-- Shares with projects deleted before this go: a project made again at the
-- path would see them. (An object of such a project keeps its path, seen
-- from the root only, which may remove it: made the root's, every project
-- would see it.)
DELETE FROM object_shares WHERE project NOT IN (SELECT path FROM projects);
INSERT INTO object_blobs (name, digest, bytes) SELECT name, 'object:' || name, bytes FROM objects WHERE bytes > 0;

-- +goose Down
DROP TABLE object_blobs;

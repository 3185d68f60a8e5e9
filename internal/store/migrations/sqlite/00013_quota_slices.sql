-- Quota slices, as migrations/postgres/00012_quota_slices.sql: headroom of
-- a limited project that one apiserver (owner) leased, charged to the
-- project's use and its ancestors' when taken (size), of which its creates
-- have spent used; the rest (size - used) is headroom, not use, and goes
-- back when the slice is returned, or expires with its apiserver. A hold
-- names the slice it was charged to.

-- +goose Up
CREATE TABLE quota_slices (
	id         TEXT NOT NULL,
	resource   TEXT NOT NULL,
	project_id TEXT NOT NULL REFERENCES projects (id) ON DELETE CASCADE,
	owner      TEXT NOT NULL,
	size       INTEGER NOT NULL CHECK (size >= 0),
	used       INTEGER NOT NULL DEFAULT 0,
	gen        INTEGER NOT NULL DEFAULT 0,
	expires_ms INTEGER NOT NULL,
	PRIMARY KEY (id, resource)
);
ALTER TABLE quota_holds ADD COLUMN slice TEXT;

-- +goose Down
ALTER TABLE quota_holds DROP COLUMN slice;
DROP TABLE quota_slices;

-- Quota slices, as migrations/sqlite/00013_quota_slices.sql: headroom of a
-- limited project that one apiserver (owner) leased, charged to the
-- project's use and its ancestors' when taken (size), of which its creates
-- have spent used; the rest (size - used) is headroom, not use, and goes
-- back when the slice is returned, or expires with its apiserver. A hold
-- names the slice it was charged to.

-- +goose Up
CREATE TABLE quota_slices (
	id         text NOT NULL,
	resource   text NOT NULL,
	project_id text NOT NULL REFERENCES projects (id) ON DELETE CASCADE,
	owner      text NOT NULL,
	size       bigint NOT NULL CHECK (size >= 0),
	used       bigint NOT NULL DEFAULT 0,
	gen        bigint NOT NULL DEFAULT 0,
	expires    timestamptz NOT NULL,
	PRIMARY KEY (id, resource)
);
ALTER TABLE quota_holds ADD COLUMN slice text;

-- dsec_slice_spent fails the statement that calls it, so that a charge to
-- a slice without room undoes the reservation made beside it in one
-- statement (store.ErrSliceSpent).
-- +goose StatementBegin
CREATE FUNCTION dsec_slice_spent() RETURNS boolean LANGUAGE plpgsql AS $$
BEGIN
	RAISE EXCEPTION 'quota slice spent' USING ERRCODE = 'DS001';
END $$;
-- +goose StatementEnd

-- +goose Down
DROP FUNCTION dsec_slice_spent();
ALTER TABLE quota_holds DROP COLUMN slice;
DROP TABLE quota_slices;

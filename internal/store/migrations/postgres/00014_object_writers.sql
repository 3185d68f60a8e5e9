-- One writer per object name, as migrations/sqlite/00015_object_writers.sql:
-- the call making an object, or making it again, holds its record's writer
-- (a token of its own) until writer_until, so that two calls never make
-- one name at once, whichever apiserver serves them. A writer past
-- writer_until is a call that died (its apiserver killed): a later call
-- may take the name over. '' is no writer.

-- +goose Up
ALTER TABLE objects ADD COLUMN writer text NOT NULL DEFAULT '';
ALTER TABLE objects ADD COLUMN writer_until timestamptz;

-- +goose Down
ALTER TABLE objects DROP COLUMN writer_until;
ALTER TABLE objects DROP COLUMN writer;

-- Each node's ledger cursor beside its events', as
-- migrations/postgres/00021_usage_cursors.sql.

-- +goose Up
ALTER TABLE event_pulls ADD COLUMN usage_epoch TEXT NOT NULL DEFAULT '';
ALTER TABLE event_pulls ADD COLUMN usage_seq INTEGER NOT NULL DEFAULT 0;

-- +goose Down
ALTER TABLE event_pulls DROP COLUMN usage_seq;
ALTER TABLE event_pulls DROP COLUMN usage_epoch;

-- Each node's ledger cursor beside its events' (as
-- migrations/sqlite/00021_usage_cursors.sql): the epoch of the node's
-- ledger and the last version stored, written in the transaction that
-- stores the records pulled with it. Kept in each apiserver's memory
-- before, so the apiserver that took a node's lease (another's lapsed or
-- was given back, or it restarted) pulled the node's whole ledger again,
-- and every sole end in it was appended to ledger_ends a second time.

-- +goose Up
ALTER TABLE event_pulls ADD COLUMN usage_epoch text NOT NULL DEFAULT '';
ALTER TABLE event_pulls ADD COLUMN usage_seq bigint NOT NULL DEFAULT 0;

-- +goose Down
ALTER TABLE event_pulls DROP COLUMN usage_seq;
ALTER TABLE event_pulls DROP COLUMN usage_epoch;

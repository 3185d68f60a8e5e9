-- Ended sandboxes' sole reports in packs, as
-- migrations/sqlite/00022_ledger_end_packs.sql: the sole ends of one
-- project that one pull (or PutUsage) stores, as one row (store/endpack.go),
-- selected by its project and by the earliest start and latest end of its
-- records. A row of ledger_ends each cost PostgreSQL more than the rest of
-- a hollow sandbox's end did; ledger_ends keeps the rows written before
-- and is still read and expired.

-- +goose Up
CREATE TABLE ledger_end_packs (
	id       bigserial PRIMARY KEY,
	project  text NOT NULL,
	started  timestamptz NOT NULL,
	ended    timestamptz NOT NULL,
	n        integer NOT NULL,
	records  bytea NOT NULL
);
CREATE INDEX ledger_end_packs_ended ON ledger_end_packs USING brin (ended);

-- +goose Down
DROP TABLE ledger_end_packs;

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
-- Compressed with LZ4 where the server has it, as event packs are
-- (00020): with pglz a pack of 2,000 ends cost the server 1.4 µs a
-- record, with LZ4 0.45 (BenchmarkPutUsagePG).
-- +goose StatementBegin
DO $$
BEGIN
	ALTER TABLE ledger_end_packs ALTER COLUMN records SET COMPRESSION lz4;
EXCEPTION WHEN feature_not_supported OR invalid_parameter_value THEN
	RAISE NOTICE 'this PostgreSQL has no LZ4: packs of ends are compressed with pglz';
END
$$;
-- +goose StatementEnd

-- +goose Down
DROP TABLE ledger_end_packs;

-- Ended sandboxes' sole reports in packs, as
-- migrations/postgres/00022_ledger_end_packs.sql (a plain index on the
-- latest end here, where PostgreSQL has a BRIN).

-- +goose Up
CREATE TABLE ledger_end_packs (
	id          INTEGER PRIMARY KEY,
	project     TEXT NOT NULL,
	started_ms  INTEGER NOT NULL,
	ended_ms    INTEGER NOT NULL,
	n           INTEGER NOT NULL,
	records     BLOB NOT NULL
);
CREATE INDEX ledger_end_packs_ended ON ledger_end_packs (ended_ms);

-- +goose Down
DROP TABLE ledger_end_packs;

-- Ended sandboxes' sole reports, as migrations/postgres/00019_ledger_ends.sql
-- (there appended by COPY, indexed by a BRIN on ended, which SQLite has
-- not: a plain index here). No key is unique: SumUsage merges a key's rows
-- with ledger's.

-- +goose Up
CREATE TABLE ledger_ends (
	key              TEXT NOT NULL,
	sandbox_id       TEXT NOT NULL,
	project          TEXT NOT NULL,
	labels           TEXT NOT NULL,
	node             TEXT NOT NULL,
	started_ms       INTEGER NOT NULL,
	ended_ms         INTEGER NOT NULL,
	updated_ms       INTEGER NOT NULL,
	cpu_usec         INTEGER NOT NULL,
	memory_gib_s     REAL NOT NULL,
	disk_gib_h       REAL NOT NULL,
	disk_peak_bytes  INTEGER NOT NULL,
	snapshot_bytes   INTEGER NOT NULL,
	egress_bytes     INTEGER NOT NULL,
	fncall_calls     INTEGER NOT NULL
);
CREATE INDEX ledger_ends_ended ON ledger_ends (ended_ms);

-- +goose Down
DROP TABLE ledger_ends;

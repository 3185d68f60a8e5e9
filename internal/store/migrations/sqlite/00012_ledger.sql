-- The cost ledger, as migrations/postgres/00011_ledger.sql: one row per
-- sandbox (or per apiserver's FnCall counter of a project), its figures
-- cumulative, so an edge's report pulled twice (two apiservers, or one
-- restarted) changes nothing: a report only ever raises them. Rows outlive
-- their sandboxes until the usage retention expires them.

-- +goose Up
CREATE TABLE ledger (
	key              TEXT PRIMARY KEY,
	sandbox_id       TEXT NOT NULL,
	project          TEXT NOT NULL,
	labels           TEXT NOT NULL,
	node             TEXT NOT NULL,
	started_ms       INTEGER NOT NULL,
	ended_ms         INTEGER,
	updated_ms       INTEGER NOT NULL,
	cpu_usec         INTEGER NOT NULL,
	memory_gib_s     REAL NOT NULL,
	disk_gib_h       REAL NOT NULL,
	disk_peak_bytes  INTEGER NOT NULL,
	snapshot_bytes   INTEGER NOT NULL,
	egress_bytes     INTEGER NOT NULL,
	fncall_calls     INTEGER NOT NULL
);
CREATE INDEX ledger_project ON ledger (project);
CREATE INDEX ledger_updated ON ledger (updated_ms);

-- +goose Down
DROP TABLE ledger;

-- The cost ledger, as migrations/sqlite/00012_ledger.sql: one row per
-- sandbox (or per apiserver's FnCall counter of a project), its figures
-- cumulative, so an edge's report pulled twice (two apiservers, or one
-- restarted) changes nothing: a report only ever raises them. Rows outlive
-- their sandboxes until the usage retention expires them.

-- +goose Up
CREATE TABLE ledger (
	key              text PRIMARY KEY,
	sandbox_id       text NOT NULL,
	project          text NOT NULL,
	labels           text NOT NULL,
	node             text NOT NULL,
	started          timestamptz NOT NULL,
	ended            timestamptz,
	updated          timestamptz NOT NULL,
	cpu_usec         bigint NOT NULL,
	memory_gib_s     double precision NOT NULL,
	disk_gib_h       double precision NOT NULL,
	disk_peak_bytes  bigint NOT NULL,
	snapshot_bytes   bigint NOT NULL,
	egress_bytes     bigint NOT NULL,
	fncall_calls     bigint NOT NULL
);
CREATE INDEX ledger_project ON ledger (project);
CREATE INDEX ledger_updated ON ledger (updated);

-- +goose Down
DROP TABLE ledger;

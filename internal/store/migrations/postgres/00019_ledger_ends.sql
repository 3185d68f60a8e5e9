-- Ended sandboxes' sole reports, as migrations/sqlite/00020_ledger_ends.sql:
-- a sandbox whose node offered nothing of it before its end (no
-- checkpoint, no snapshot: most sandboxes of a training loop, which live
-- seconds to minutes) has its end appended here, by COPY, where a row of
-- ledger would cost an upsert through its key's index (a quarter of the
-- PostgreSQL CPU, BenchmarkPutUsagePG). No key is unique here: a report
-- put twice (a node's whole ledger pulled again) is two rows, which
-- SumUsage merges by key with ledger's, as PutUsage would have. Ends
-- arrive in about the order they happened, so a BRIN index on ended
-- serves the windows and the expiry at next to no cost a row.

-- +goose Up
CREATE TABLE ledger_ends (
	key              text NOT NULL,
	sandbox_id       text NOT NULL,
	project          text NOT NULL,
	labels           text NOT NULL,
	node             text NOT NULL,
	started          timestamptz NOT NULL,
	ended            timestamptz NOT NULL,
	updated          timestamptz NOT NULL,
	cpu_usec         bigint NOT NULL,
	memory_gib_s     double precision NOT NULL,
	disk_gib_h       double precision NOT NULL,
	disk_peak_bytes  bigint NOT NULL,
	snapshot_bytes   bigint NOT NULL,
	egress_bytes     bigint NOT NULL,
	fncall_calls     bigint NOT NULL
);
CREATE INDEX ledger_ends_ended ON ledger_ends USING brin (ended);

-- +goose Down
DROP TABLE ledger_ends;

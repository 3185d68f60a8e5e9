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
-- ledger's columns (no key, no index of its own), an end always set.
CREATE TABLE ledger_ends (LIKE ledger);
ALTER TABLE ledger_ends ALTER COLUMN ended SET NOT NULL;
CREATE INDEX ledger_ends_ended ON ledger_ends USING brin (ended);

-- +goose Down
DROP TABLE ledger_ends;

-- The ledger's rows are updated in place with every sample a node reports:
-- no index names a column a sample changes, so an update writes no index
-- entry. As migrations/postgres/00013_ledger_hot.sql.

-- +goose Up
DROP INDEX ledger_updated;
CREATE INDEX ledger_ended ON ledger (ended_ms);

-- +goose Down
DROP INDEX ledger_ended;
CREATE INDEX ledger_updated ON ledger (updated_ms);

-- The ledger's rows are updated in place with every sample a node reports
-- (each live sandbox's, every ledger interval): no index names a column a
-- sample changes, and each page keeps room, so an update is a heap-only
-- tuple (HOT) that writes no index. updated was indexed for the expiry
-- of the FnCall counters' rows alone, which reads the table about once an
-- hour; ended, set once, serves the expiry of ended sandboxes' rows.
-- As migrations/sqlite/00014_ledger_hot.sql.

-- +goose Up
DROP INDEX ledger_updated;
CREATE INDEX ledger_ended ON ledger (ended);
ALTER TABLE ledger SET (fillfactor = 70);

-- +goose Down
ALTER TABLE ledger RESET (fillfactor);
DROP INDEX ledger_ended;
CREATE INDEX ledger_updated ON ledger (updated);

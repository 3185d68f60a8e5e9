-- A webhook's batch, as migrations/postgres/00016_webhook_batch.sql: the
-- most events one delivery carries; 0 (every webhook added before
-- batches) one event a delivery, the event itself as the body.

-- +goose Up
ALTER TABLE webhooks ADD COLUMN batch INTEGER NOT NULL DEFAULT 0;

-- +goose Down
ALTER TABLE webhooks DROP COLUMN batch;

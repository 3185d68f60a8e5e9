-- A webhook's previous signing secret, as
-- migrations/postgres/00010_webhook_rotation.sql: after a rotation it
-- signs deliveries beside the new secret until prev_until.

-- +goose Up
ALTER TABLE webhooks ADD COLUMN prev_secret TEXT NOT NULL DEFAULT '';
ALTER TABLE webhooks ADD COLUMN prev_until_ms INTEGER;

-- +goose Down
ALTER TABLE webhooks DROP COLUMN prev_until_ms;
ALTER TABLE webhooks DROP COLUMN prev_secret;

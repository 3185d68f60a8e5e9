-- A webhook's previous signing secret, as
-- migrations/sqlite/00011_webhook_rotation.sql: after a rotation it
-- signs deliveries beside the new secret until prev_until.

-- +goose Up
ALTER TABLE webhooks ADD COLUMN prev_secret text NOT NULL DEFAULT '';
ALTER TABLE webhooks ADD COLUMN prev_until timestamptz;

-- +goose Down
ALTER TABLE webhooks DROP COLUMN prev_until;
ALTER TABLE webhooks DROP COLUMN prev_secret;

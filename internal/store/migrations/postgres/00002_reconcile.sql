-- Reconciliation: a nonce per reservation (it names the reservation in its
-- sandboxes' create tokens), pending reservations found by their lease, and
-- doubts: creates sent to a node whose outcome nobody learned.

-- +goose Up
ALTER TABLE idempotency ADD COLUMN nonce text NOT NULL DEFAULT '';
CREATE INDEX idempotency_pending_updated ON idempotency (updated) WHERE state = 'pending';

CREATE TABLE create_doubts (
	node            text NOT NULL,
	token           text NOT NULL,
	prefix          boolean NOT NULL,
	idempotency_key text NOT NULL DEFAULT '',
	created         timestamptz NOT NULL,
	PRIMARY KEY (node, token)
);

-- +goose Down
DROP TABLE create_doubts;
DROP INDEX idempotency_pending_updated;
ALTER TABLE idempotency DROP COLUMN nonce;

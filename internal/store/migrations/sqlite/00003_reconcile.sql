-- Reconciliation: a nonce per reservation (it names the reservation in its
-- sandboxes' create tokens), pending reservations found by their lease, and
-- doubts: creates sent to a node whose outcome nobody learned.

-- +goose Up
ALTER TABLE idempotency ADD COLUMN nonce TEXT NOT NULL DEFAULT '';
CREATE INDEX idempotency_pending_updated ON idempotency (updated_ms) WHERE state = 'pending';

CREATE TABLE create_doubts (
	node            TEXT NOT NULL,
	token           TEXT NOT NULL,
	prefix          INTEGER NOT NULL CHECK (prefix IN (0, 1)),
	idempotency_key TEXT NOT NULL DEFAULT '',
	created_ms      INTEGER NOT NULL,
	PRIMARY KEY (node, token)
);

-- +goose Down
DROP TABLE create_doubts;
DROP INDEX idempotency_pending_updated;
ALTER TABLE idempotency DROP COLUMN nonce;

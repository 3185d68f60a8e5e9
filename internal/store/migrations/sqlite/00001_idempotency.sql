-- The schema dsecd created before migrations existed: a file made by an
-- older dsecd already has this table, and keeps its records.

-- +goose Up
CREATE TABLE IF NOT EXISTS idempotency (
	key          TEXT PRIMARY KEY,
	request_hash TEXT NOT NULL,
	ids          TEXT NOT NULL,
	created_ms   INTEGER NOT NULL
);

-- +goose Down
DROP TABLE idempotency;

-- The metadata schema: create reservations and idempotency records, sandbox
-- rows, the node registry, projects, principals and tokens.

-- +goose Up
CREATE TABLE projects (
	id        text PRIMARY KEY,
	parent_id text REFERENCES projects (id),
	name      text NOT NULL,
	created   timestamptz NOT NULL DEFAULT date_trunc('milliseconds', now())
);
CREATE UNIQUE INDEX projects_parent_name ON projects (coalesce(parent_id, ''), name);
INSERT INTO projects (id, parent_id, name) VALUES ('root', NULL, 'root');

CREATE TABLE principals (
	id         text PRIMARY KEY,
	project_id text NOT NULL REFERENCES projects (id),
	name       text NOT NULL UNIQUE,
	created    timestamptz NOT NULL
);

CREATE TABLE tokens (
	id           text PRIMARY KEY,
	principal_id text NOT NULL REFERENCES principals (id) ON DELETE CASCADE,
	hash         bytea NOT NULL UNIQUE CHECK (length(hash) = 32),
	created      timestamptz NOT NULL,
	expires      timestamptz,
	revoked      timestamptz
);
CREATE INDEX tokens_principal ON tokens (principal_id);

-- One row per idempotency key: a pending reservation, or a done create
-- with the IDs it made.
CREATE TABLE idempotency (
	key          text PRIMARY KEY,
	request_hash text NOT NULL,
	owner        text NOT NULL DEFAULT '',
	placements   text[] NOT NULL DEFAULT '{}',
	state        text NOT NULL CHECK (state IN ('pending', 'done')),
	ids          text[] NOT NULL DEFAULT '{}',
	created      timestamptz NOT NULL,
	updated      timestamptz NOT NULL
);
CREATE INDEX idempotency_done_created ON idempotency (created) WHERE state = 'done';

CREATE TABLE sandboxes (
	id              text PRIMARY KEY,
	node            text NOT NULL,
	idempotency_key text,
	created         timestamptz NOT NULL
);
CREATE INDEX sandboxes_key ON sandboxes (idempotency_key);
CREATE INDEX sandboxes_node ON sandboxes (node);

-- A slot's generation only grows, and outlives the node holding it.
CREATE TABLE node_slots (
	slot       integer PRIMARY KEY CHECK (slot BETWEEN 1 AND 65535),
	generation bigint NOT NULL
);

CREATE TABLE nodes (
	name          text PRIMARY KEY,
	slot          integer NOT NULL UNIQUE REFERENCES node_slots (slot),
	generation    bigint NOT NULL,
	addr          text NOT NULL,
	backends      text[] NOT NULL,
	max_sandboxes integer NOT NULL,
	cpus          double precision NOT NULL,
	memory_mb     bigint NOT NULL,
	identity      text NOT NULL,
	registered    timestamptz NOT NULL,
	last_seen     timestamptz NOT NULL
);

-- +goose Down
DROP TABLE nodes;
DROP TABLE node_slots;
DROP TABLE sandboxes;
DROP TABLE idempotency;
DROP TABLE tokens;
DROP TABLE principals;
DROP TABLE projects;

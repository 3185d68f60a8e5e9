-- IAM, as migrations/postgres/00003_iam.sql: projects nest, principals have
-- a kind, role bindings, tokens carry a project, a role and the token that
-- minted them, quotas, the audit trail and the authority generation. Every
-- principal and token made before this had all power: each principal keeps
-- it as an admin binding on the root, each token as role admin there.
-- SQLite adds no column with a foreign key and a default, so tokens is
-- made again.

-- +goose Up
ALTER TABLE projects ADD COLUMN path TEXT NOT NULL DEFAULT '';
ALTER TABLE projects ADD COLUMN depth INTEGER NOT NULL DEFAULT 0 CHECK (depth BETWEEN 0 AND 16);
CREATE UNIQUE INDEX projects_path ON projects (path);

ALTER TABLE principals ADD COLUMN kind TEXT NOT NULL DEFAULT 'user' CHECK (kind IN ('user', 'service'));

CREATE TABLE role_bindings (
	principal_id TEXT NOT NULL REFERENCES principals (id) ON DELETE CASCADE,
	project_id   TEXT NOT NULL REFERENCES projects (id) ON DELETE CASCADE,
	role         TEXT NOT NULL CHECK (role IN ('viewer', 'runner', 'builder', 'admin')),
	created_ms   INTEGER NOT NULL,
	PRIMARY KEY (principal_id, project_id)
);
CREATE INDEX role_bindings_project ON role_bindings (project_id);
INSERT INTO role_bindings (principal_id, project_id, role, created_ms)
	SELECT id, 'root', 'admin', created_ms FROM principals;

CREATE TABLE tokens_iam (
	id           TEXT PRIMARY KEY,
	principal_id TEXT NOT NULL REFERENCES principals (id) ON DELETE CASCADE,
	hash         BLOB NOT NULL UNIQUE CHECK (length(hash) = 32),
	created_ms   INTEGER NOT NULL,
	expires_ms   INTEGER,
	revoked_ms   INTEGER,
	project_id   TEXT NOT NULL REFERENCES projects (id) ON DELETE CASCADE,
	role         TEXT NOT NULL CHECK (role IN ('viewer', 'runner', 'builder', 'admin')),
	parent_id    TEXT REFERENCES tokens (id) ON DELETE CASCADE
);
INSERT INTO tokens_iam (id, principal_id, hash, created_ms, expires_ms, revoked_ms, project_id, role)
	SELECT id, principal_id, hash, created_ms, expires_ms, revoked_ms, 'root', 'admin' FROM tokens;
DROP TABLE tokens;
ALTER TABLE tokens_iam RENAME TO tokens;
CREATE INDEX tokens_principal ON tokens (principal_id);
CREATE INDEX tokens_parent ON tokens (parent_id);
CREATE INDEX tokens_project ON tokens (project_id);

CREATE TABLE iam_generation (
	id         INTEGER PRIMARY KEY CHECK (id = 1),
	generation INTEGER NOT NULL
);
INSERT INTO iam_generation VALUES (1, 1);

CREATE TABLE quotas (
	project_id  TEXT NOT NULL REFERENCES projects (id) ON DELETE CASCADE,
	resource    TEXT NOT NULL,
	lim         INTEGER CHECK (lim >= 0),
	used        INTEGER NOT NULL DEFAULT 0,
	level       REAL NOT NULL DEFAULT 0,
	refilled_ms INTEGER NOT NULL DEFAULT 0,
	PRIMARY KEY (project_id, resource)
);
INSERT INTO quotas (project_id, resource)
	SELECT 'root', value FROM json_each('["sandboxes", "vcpus", "memory_mb", "disk_mb", "snapshot_bytes",
		"layer_bytes", "fncall_inflight", "creates_per_second"]');

CREATE TABLE audit (
	id        INTEGER PRIMARY KEY AUTOINCREMENT,
	at_ms     INTEGER NOT NULL,
	principal TEXT NOT NULL,
	token_id  TEXT NOT NULL,
	project   TEXT NOT NULL,
	operation TEXT NOT NULL,
	object    TEXT NOT NULL,
	code      TEXT NOT NULL,
	peer      TEXT NOT NULL,
	message   TEXT NOT NULL
);
CREATE INDEX audit_at ON audit (at_ms);
CREATE INDEX audit_project_at ON audit (project, at_ms);

-- +goose Down
DROP TABLE audit;
DROP TABLE quotas;
DROP TABLE iam_generation;
CREATE TABLE tokens_old (
	id           TEXT PRIMARY KEY,
	principal_id TEXT NOT NULL REFERENCES principals (id) ON DELETE CASCADE,
	hash         BLOB NOT NULL UNIQUE CHECK (length(hash) = 32),
	created_ms   INTEGER NOT NULL,
	expires_ms   INTEGER,
	revoked_ms   INTEGER
);
INSERT INTO tokens_old SELECT id, principal_id, hash, created_ms, expires_ms, revoked_ms FROM tokens;
DROP TABLE tokens;
ALTER TABLE tokens_old RENAME TO tokens;
CREATE INDEX tokens_principal ON tokens (principal_id);
DROP TABLE role_bindings;
ALTER TABLE principals DROP COLUMN kind;
DROP INDEX projects_path;
ALTER TABLE projects DROP COLUMN depth;
ALTER TABLE projects DROP COLUMN path;

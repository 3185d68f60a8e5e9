-- IAM: projects nest (a path and depth per row), principals have a kind,
-- role bindings, tokens carry a project, a role and the token that minted
-- them, quotas with their use per project and resource, the audit trail,
-- and a generation that grows whenever authority is taken away (revoked
-- tokens, changed or removed bindings), which authentication caches read.
-- Every principal and token made before this had all power: each principal
-- keeps it as an admin binding on the root, each token as role admin there.

-- +goose Up
ALTER TABLE projects ADD COLUMN path text NOT NULL DEFAULT '';
ALTER TABLE projects ADD COLUMN depth integer NOT NULL DEFAULT 0 CHECK (depth BETWEEN 0 AND 16);
CREATE UNIQUE INDEX projects_path ON projects (path);

ALTER TABLE principals ADD COLUMN kind text NOT NULL DEFAULT 'user' CHECK (kind IN ('user', 'service'));

CREATE TABLE role_bindings (
	principal_id text NOT NULL REFERENCES principals (id) ON DELETE CASCADE,
	project_id   text NOT NULL REFERENCES projects (id) ON DELETE CASCADE,
	role         text NOT NULL CHECK (role IN ('viewer', 'runner', 'builder', 'admin')),
	created      timestamptz NOT NULL,
	PRIMARY KEY (principal_id, project_id)
);
CREATE INDEX role_bindings_project ON role_bindings (project_id);
INSERT INTO role_bindings (principal_id, project_id, role, created)
	SELECT id, 'root', 'admin', created FROM principals;

ALTER TABLE tokens ADD COLUMN project_id text NOT NULL DEFAULT 'root' REFERENCES projects (id) ON DELETE CASCADE;
ALTER TABLE tokens ADD COLUMN role text NOT NULL DEFAULT 'admin' CHECK (role IN ('viewer', 'runner', 'builder', 'admin'));
ALTER TABLE tokens ADD COLUMN parent_id text REFERENCES tokens (id) ON DELETE CASCADE;
CREATE INDEX tokens_parent ON tokens (parent_id);
CREATE INDEX tokens_project ON tokens (project_id);

CREATE TABLE iam_generation (
	id         integer PRIMARY KEY CHECK (id = 1),
	generation bigint NOT NULL
);
INSERT INTO iam_generation VALUES (1, 1);

-- One row per project and resource. lim NULL: no limit of its own. used
-- counts the project and everything under it. For creates_per_second,
-- level is the token bucket's content at refilled.
CREATE TABLE quotas (
	project_id text NOT NULL REFERENCES projects (id) ON DELETE CASCADE,
	resource   text NOT NULL,
	lim        bigint CHECK (lim >= 0),
	used       bigint NOT NULL DEFAULT 0,
	level      double precision NOT NULL DEFAULT 0,
	refilled   timestamptz NOT NULL DEFAULT date_trunc('milliseconds', now()),
	PRIMARY KEY (project_id, resource)
);
INSERT INTO quotas (project_id, resource)
	SELECT 'root', r FROM unnest(ARRAY['sandboxes', 'vcpus', 'memory_mb', 'disk_mb', 'snapshot_bytes',
		'layer_bytes', 'fncall_inflight', 'creates_per_second']) AS r;

CREATE TABLE audit (
	id        bigserial PRIMARY KEY,
	at        timestamptz NOT NULL,
	principal text NOT NULL,
	token_id  text NOT NULL,
	project   text NOT NULL,
	operation text NOT NULL,
	object    text NOT NULL,
	code      text NOT NULL,
	peer      text NOT NULL,
	message   text NOT NULL
);
CREATE INDEX audit_at ON audit (at);
CREATE INDEX audit_project_at ON audit (project, at);

-- +goose Down
DROP TABLE audit;
DROP TABLE quotas;
DROP TABLE iam_generation;
ALTER TABLE tokens DROP COLUMN parent_id;
ALTER TABLE tokens DROP COLUMN role;
ALTER TABLE tokens DROP COLUMN project_id;
DROP TABLE role_bindings;
ALTER TABLE principals DROP COLUMN kind;
DROP INDEX projects_path;
ALTER TABLE projects DROP COLUMN depth;
ALTER TABLE projects DROP COLUMN path;

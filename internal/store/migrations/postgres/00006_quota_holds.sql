-- Quotas that hold across apiservers and reconcile only what they can
-- prove: a generation per quota row that grows with every change of the
-- project's own use (a reconciler corrects a use only if it is as it read
-- it before listing the edges), holds (what a create or a FnCall call under
-- way holds of its charge, until it settles: use the edges cannot show
-- yet), and sandboxes released (a second release of one changes nothing).

-- +goose Up
ALTER TABLE quotas ADD COLUMN gen bigint NOT NULL DEFAULT 0;

CREATE TABLE quota_holds (
	id         text NOT NULL,
	resource   text NOT NULL,
	project_id text NOT NULL REFERENCES projects (id) ON DELETE CASCADE,
	amount     bigint NOT NULL CHECK (amount >= 0),
	expires    timestamptz NOT NULL,
	PRIMARY KEY (id, resource)
);
-- No index but the key: a hold lives as long as its create, so the table
-- holds the creates under way, and every index is written and cleaned
-- with every create charged.

CREATE TABLE quota_released (
	sandbox text PRIMARY KEY,
	at      timestamptz NOT NULL
);
CREATE INDEX quota_released_at ON quota_released (at);

-- +goose Down
DROP TABLE quota_released;
DROP TABLE quota_holds;
ALTER TABLE quotas DROP COLUMN gen;

-- Quotas that hold across apiservers and reconcile only what they can
-- prove: a generation per quota row that grows with every change of the
-- project's own use (a reconciler corrects a use only if it is as it read
-- it before listing the edges), holds (what a create or a FnCall call under
-- way holds of its charge, until it settles: use the edges cannot show
-- yet), and sandboxes released (a second release of one changes nothing).

-- +goose Up
ALTER TABLE quotas ADD COLUMN gen INTEGER NOT NULL DEFAULT 0;

CREATE TABLE quota_holds (
	id         TEXT NOT NULL,
	resource   TEXT NOT NULL,
	project_id TEXT NOT NULL REFERENCES projects (id) ON DELETE CASCADE,
	amount     INTEGER NOT NULL CHECK (amount >= 0),
	expires_ms INTEGER NOT NULL,
	PRIMARY KEY (id, resource)
);
-- No index but the key: a hold lives as long as its create, so the table
-- holds the creates under way, and every index is written and cleaned
-- with every create charged.

CREATE TABLE quota_released (
	sandbox TEXT PRIMARY KEY,
	at_ms   INTEGER NOT NULL
);
CREATE INDEX quota_released_at ON quota_released (at_ms);

-- +goose Down
DROP TABLE quota_released;
DROP TABLE quota_holds;
ALTER TABLE quotas DROP COLUMN gen;

package store

import (
	"context"
	"database/sql"
	"fmt"
	"math"
	"slices"
	"strings"
	"time"

	"dsec.dev/dsec/internal/errdefs"
	"dsec.dev/dsec/internal/iam"
)

// Resource is a quantity a project's quota bounds.
type Resource string

// The resources a quota bounds.
const (
	Sandboxes      Resource = "sandboxes"       // sandboxes existing
	VCPUs          Resource = "vcpus"           // milli-CPUs of those sandboxes
	MemoryMB       Resource = "memory_mb"       // MiB of memory of those sandboxes
	DiskMB         Resource = "disk_mb"         // MiB of disk of those sandboxes
	SnapshotBytes  Resource = "snapshot_bytes"  // bytes of snapshots kept
	LayerBytes     Resource = "layer_bytes"     // bytes of layers kept
	FnCallInflight Resource = "fncall_inflight" // FnCall calls running
	// CreatesPerSecond is a rate, not a count: a token bucket per project
	// holding up to a second's worth of creates, refilled at the limit per
	// second, computed from the time of the last charge (so it holds across
	// apiservers). It has no use to show or release.
	CreatesPerSecond Resource = "creates_per_second"
)

// Resources lists every resource, in the order quotas show them.
var Resources = []Resource{Sandboxes, VCPUs, MemoryMB, DiskMB, SnapshotBytes, LayerBytes, FnCallInflight, CreatesPerSecond}

// Unlimited is the limit of a project without one of its own: it draws on
// its ancestors' limits alone.
const Unlimited int64 = -1

// ParseResource reads a resource's name.
func ParseResource(s string) (Resource, error) {
	if slices.Contains(Resources, Resource(s)) {
		return Resource(s), nil
	}
	names := make([]string, len(Resources))
	for i, r := range Resources {
		names[i] = string(r)
	}
	return "", fmt.Errorf("resource %q: want one of %s: %w", s, strings.Join(names, ", "), errdefs.ErrInvalidArgument)
}

// unit is how an amount of r reads in a sentence ("64 sandboxes").
func (r Resource) unit() string {
	switch r {
	case VCPUs:
		return "milli-vCPUs"
	case MemoryMB:
		return "MiB of memory"
	case DiskMB:
		return "MiB of disk"
	case SnapshotBytes:
		return "bytes of snapshots"
	case LayerBytes:
		return "bytes of layers"
	case FnCallInflight:
		return "FnCall calls in flight"
	case CreatesPerSecond:
		return "creates per second"
	}
	return string(r)
}

func (r Resource) amount(n int64) string {
	if n == 1 {
		switch r {
		case Sandboxes:
			return "1 sandbox"
		case FnCallInflight:
			return "1 FnCall call in flight"
		}
	}
	return fmt.Sprintf("%d %s", n, r.unit())
}

// exhausted is the refusal of a charge of n of r at project path, which
// uses used of its limit lim: "quota of project ml: 64 of 64 sandboxes in
// use". A charge refused while some of the limit is left says how much it
// asked ("0 of 2 sandboxes in use, 3 asked"), without which a batch of 3 or
// a sandbox of 2 vCPUs refused at an unused limit reads as a contradiction.
func exhausted(path string, r Resource, used, n, lim int64) error {
	msg := fmt.Sprintf("quota of project %s: %d of %s", iam.Display(path), used, r.amount(lim))
	if r != FnCallInflight { // whose unit says "in flight" already
		msg += " in use"
	}
	if used < lim {
		msg += fmt.Sprintf(", %d asked", n)
	}
	return fmt.Errorf("%s: %w", msg, errdefs.ErrResourceExhausted)
}

// Amounts are quantities of resources to charge or release.
type Amounts map[Resource]int64

// ProjectQuota is a project's limits and use: Limits[r] is Unlimited when
// the project has no limit of its own on r; Used[r] counts the project and
// everything under it.
type ProjectQuota struct {
	Project string // path
	Limits  map[Resource]int64
	Used    map[Resource]int64
}

// quotaRow is one locked row of the quotas table.
type quotaRow struct {
	project  string // ID
	path     string
	depth    int
	resource Resource
	lim      sql.NullInt64
	used     int64
	level    float64
	refilled time.Time
}

// lockQuotas reads and, in PostgreSQL, locks the quota rows of resources
// on the projects at paths, from the root down and by resource within a
// project: every transaction that changes quota rows locks them in this
// one order, so two of them never wait on each other in a cycle.
func (d *sqlDB) lockQuotas(ctx context.Context, tx *sql.Tx, paths []string, resources []Resource) ([]quotaRow, error) {
	args := append(anys(paths), anys(resources)...)
	rows, err := tx.QueryContext(ctx, d.q(`SELECT j.id, j.path, j.depth, q.resource, q.lim, q.used, q.level, q.refilled{ms}
		FROM quotas q JOIN projects j ON j.id = q.project_id
		WHERE j.path IN (`+placeholders(len(paths))+`) AND q.resource IN (`+placeholders(len(resources))+`)
		ORDER BY j.depth, q.resource{lockq}`), args...)
	if err != nil {
		return nil, err
	}
	defer rows.Close()
	var out []quotaRow
	for rows.Next() {
		var r quotaRow
		var res string
		if err := rows.Scan(&r.project, &r.path, &r.depth, &res, &r.lim, &r.used, &r.level, timeCol{&r.refilled}); err != nil {
			return nil, err
		}
		r.resource = Resource(res)
		out = append(out, r)
	}
	return out, rows.Err()
}

// chargeOrder checks amounts and returns their resources sorted, as
// lockQuotas orders them.
func chargeOrder(amounts Amounts) ([]Resource, error) {
	var out []Resource
	for r, n := range amounts {
		if _, err := ParseResource(string(r)); err != nil {
			return nil, err
		}
		if n < 0 {
			return nil, fmt.Errorf("negative amount %d of %s: %w", n, r, errdefs.ErrInvalidArgument)
		}
		if n > 0 {
			out = append(out, r)
		}
	}
	slices.Sort(out)
	return out, nil
}

// ancestorsLocked locks the quota rows of path and its ancestors, and
// fails with errdefs.ErrNotFound when the project does not exist.
func (d *sqlDB) ancestorsLocked(ctx context.Context, tx *sql.Tx, path string, resources []Resource) ([]quotaRow, error) {
	anc := iam.Ancestors(path)
	rows, err := d.lockQuotas(ctx, tx, anc, resources)
	if err != nil {
		return nil, err
	}
	if len(rows) != len(anc)*len(resources) {
		return nil, fmt.Errorf("project %s does not exist: %w", iam.Display(path), errdefs.ErrNotFound)
	}
	return rows, nil
}

// refill is a creates_per_second bucket's level at now.
func refill(r quotaRow, now time.Time) float64 {
	lim := float64(r.lim.Int64)
	return math.Min(lim, r.level+lim*now.Sub(r.refilled).Seconds())
}

func (d *sqlDB) Charge(ctx context.Context, project string, amounts Amounts) error {
	return d.ChargeHeld(ctx, project, amounts, nil)
}

func (d *sqlDB) ChargeHeld(ctx context.Context, project string, amounts Amounts, holds []Hold) error {
	path, err := iam.CleanPath(project)
	if err != nil {
		return err
	}
	if _, err := chargeOrder(amounts); err != nil {
		return err
	}
	err = d.inTx(ctx, func(tx *sql.Tx) error { return d.chargeTx(ctx, tx, path, amounts, holds) })
	if err != nil {
		return d.fail("charge project "+iam.Display(path), err)
	}
	return nil
}

// chargeTx charges path amounts in tx and records holds, or refuses with
// errdefs.ErrResourceExhausted.
func (d *sqlDB) chargeTx(ctx context.Context, tx *sql.Tx, path string, amounts Amounts, holds []Hold) error {
	resources, err := chargeOrder(amounts)
	if err != nil || len(resources) == 0 {
		return err
	}
	anc := iam.Ancestors(path)
	now := ms(time.Now())
	// The holds are written before the quota rows are locked, so the
	// locks every create of the cluster queues on are held the shorter:
	// nothing sees them before the commit.
	if err := d.insertHolds(ctx, tx, path, holds, now); err != nil {
		return err
	}
	rows, err := d.ancestorsLocked(ctx, tx, path, resources)
	if err != nil {
		return err
	}
	// Rows come from the root down, so the first refusal names the
	// highest project that is full.
	for i, r := range rows {
		n := amounts[r.resource]
		if !r.lim.Valid {
			continue
		}
		if r.resource == CreatesPerSecond {
			level := refill(r, now)
			if level < float64(n) {
				return fmt.Errorf("quota of project %s: more than %s: %w", iam.Display(r.path), r.resource.amount(r.lim.Int64), errdefs.ErrResourceExhausted)
			}
			rows[i].level = level - float64(n)
			continue
		}
		if r.used+n > r.lim.Int64 {
			return exhausted(r.path, r.resource, r.used, n, r.lim.Int64)
		}
	}
	for _, r := range resources {
		if r == CreatesPerSecond {
			continue
		}
		if err := d.addUse(ctx, tx, path, anc, r, amounts[r]); err != nil {
			return err
		}
	}
	for _, r := range rows {
		if r.resource != CreatesPerSecond || !r.lim.Valid {
			continue
		}
		if _, err := tx.ExecContext(ctx, d.q(`UPDATE quotas SET level = ?, refilled{ms} = ?
			WHERE resource = ? AND project_id = (SELECT id FROM projects WHERE path = ?)`),
			r.level, d.ts(now), string(r.resource), r.path); err != nil {
			return err
		}
	}
	return nil
}

// addUse adds n (negative: takes off, never below zero) to the use of
// resource by path and its ancestors anc, and moves the generation of
// path's own row: its own use changed.
func (d *sqlDB) addUse(ctx context.Context, tx *sql.Tx, path string, anc []string, r Resource, n int64) error {
	_, err := tx.ExecContext(ctx, d.q(`UPDATE quotas SET used = CASE WHEN used + ? > 0 THEN used + ? ELSE 0 END,
			gen = gen + CASE WHEN project_id = (SELECT id FROM projects WHERE path = ?) THEN 1 ELSE 0 END
		WHERE resource = ? AND project_id IN (SELECT id FROM projects WHERE path IN (`+placeholders(len(anc))+`))`),
		append([]any{n, n, path, string(r)}, anys(anc)...)...)
	return err
}

func (d *sqlDB) Release(ctx context.Context, project string, amounts Amounts) error {
	path, err := iam.CleanPath(project)
	if err != nil {
		return err
	}
	what := "release quota of project " + iam.Display(path)
	resources, err := chargeOrder(amounts)
	if err != nil {
		return err
	}
	resources = slices.DeleteFunc(resources, func(r Resource) bool { return r == CreatesPerSecond })
	if len(resources) == 0 {
		return nil
	}
	anc := iam.Ancestors(path)
	err = d.inTx(ctx, func(tx *sql.Tx) error {
		if _, err := d.ancestorsLocked(ctx, tx, path, resources); err != nil {
			return err
		}
		// Never below zero: a release the store never saw charged (a
		// reconciliation got there first) leaves nothing negative.
		for _, r := range resources {
			if err := d.addUse(ctx, tx, path, anc, r, -amounts[r]); err != nil {
				return err
			}
		}
		return nil
	})
	if err != nil {
		return d.fail(what, err)
	}
	return nil
}

func (d *sqlDB) SetUse(ctx context.Context, project string, resource Resource, n int64) error {
	path, err := iam.CleanPath(project)
	if err != nil {
		return err
	}
	what := fmt.Sprintf("set the %s use of project %s", resource, iam.Display(path))
	if _, err := ParseResource(string(resource)); err != nil || resource == CreatesPerSecond || n < 0 {
		return fmt.Errorf("%s to %d: a count resource and a use of at least 0 are required: %w", what, n, errdefs.ErrInvalidArgument)
	}
	anc := iam.Ancestors(path)
	err = d.inTx(ctx, func(tx *sql.Tx) error {
		rows, err := d.ancestorsLocked(ctx, tx, path, []Resource{resource})
		if err != nil {
			return err
		}
		self := rows[len(rows)-1]
		// The children's rows: their use is theirs, not the project's own.
		// A child's charge locks this project's row first, so none
		// changes while it is held.
		var children int64
		if err := tx.QueryRowContext(ctx, d.q(`SELECT coalesce(sum(q.used), 0) FROM quotas q JOIN projects j ON j.id = q.project_id
			WHERE q.resource = ? AND j.parent_id = (SELECT id FROM projects WHERE path = ?)`), string(resource), path).Scan(&children); err != nil {
			return err
		}
		delta := n - (self.used - children)
		if delta == 0 {
			return nil
		}
		return d.addUse(ctx, tx, path, anc, resource, delta)
	})
	if err != nil {
		return d.fail(what, err)
	}
	return nil
}

func (d *sqlDB) SetLimit(ctx context.Context, actor iam.Authority, project string, resource Resource, limit int64) error {
	path, err := iam.CleanPath(project)
	if err != nil {
		return err
	}
	what := fmt.Sprintf("set the %s limit of project %s", resource, iam.Display(path))
	if _, err := ParseResource(string(resource)); err != nil {
		return err
	}
	if limit < Unlimited {
		return fmt.Errorf("%s to %d: %w", what, limit, errdefs.ErrInvalidArgument)
	}
	err = d.inTx(ctx, func(tx *sql.Tx) error {
		a, err := d.actorIn(ctx, tx, actor)
		if err != nil {
			return err
		}
		if err := iam.CheckQuota(a, path); err != nil {
			return err
		}
		rows, err := d.ancestorsLocked(ctx, tx, path, []Resource{resource})
		if err != nil {
			return err
		}
		self := rows[len(rows)-1]
		if limit != Unlimited && resource != CreatesPerSecond && self.used > limit {
			return fmt.Errorf("%s to %d: %s in use: %w", what, limit, resource.amount(self.used), errdefs.ErrFailedPrecondition)
		}
		// The nearest ancestor with a limit carves this one from its own.
		top := ""
		var holder *quotaRow
		for i := len(rows) - 2; i >= 0; i-- {
			if rows[i].lim.Valid {
				holder, top = &rows[i], rows[i].path
				break
			}
		}
		limits, err := d.limitsUnder(ctx, tx, top, resource)
		if err != nil {
			return err
		}
		delete(limits, path)
		if limit != Unlimited {
			if below := frontierSum(limits, path); below > limit {
				return fmt.Errorf("%s to %d: the projects under it hold %s: %w", what, limit, resource.amount(below), errdefs.ErrFailedPrecondition)
			}
			limits[path] = limit
		}
		if holder != nil {
			if handed := frontierSum(limits, holder.path); handed > holder.lim.Int64 {
				return fmt.Errorf("%s to %d: project %s holds %s and would hand down %d: %w",
					what, limit, iam.Display(holder.path), resource.amount(holder.lim.Int64), handed, errdefs.ErrResourceExhausted)
			}
		}
		var lim any
		if limit != Unlimited {
			lim = limit
		}
		_, err = tx.ExecContext(ctx, d.q(`UPDATE quotas SET lim = ?, level = ?, refilled{ms} = ?
			WHERE resource = ? AND project_id = (SELECT id FROM projects WHERE path = ?)`),
			lim, float64(max(limit, 0)), d.ts(time.Now()), string(resource), path)
		return err
	})
	if err != nil && strings.HasPrefix(err.Error(), what+" to ") {
		return err // a refusal above, which says what was set already
	}
	if err != nil {
		return d.fail(what, err)
	}
	return nil
}

// limitsUnder reads the limits on resource of the projects strictly under
// path, by path.
func (d *sqlDB) limitsUnder(ctx context.Context, tx *sql.Tx, path string, resource Resource) (map[string]int64, error) {
	cond, args := subtreeCond("j.path", path)
	rows, err := tx.QueryContext(ctx, d.q(`SELECT j.path, q.lim FROM quotas q JOIN projects j ON j.id = q.project_id
		WHERE q.resource = ? AND q.lim IS NOT NULL AND `+cond), append([]any{string(resource)}, args...)...)
	if err != nil {
		return nil, err
	}
	defer rows.Close()
	out := map[string]int64{}
	for rows.Next() {
		var p string
		var lim int64
		if err := rows.Scan(&p, &lim); err != nil {
			return nil, err
		}
		out[p] = lim
	}
	return out, rows.Err()
}

// frontierSum is what the project at path has handed down: the sum of the
// limits of the projects under it that have one and have no project with a
// limit between them and path (a project without a limit hands nothing
// down itself: its children's limits count against path).
func frontierSum(limits map[string]int64, path string) int64 {
	var sum int64
	for p, lim := range limits {
		if p == path || !iam.Within(p, path) {
			continue
		}
		covered := false
		for _, a := range iam.Ancestors(p) {
			if a != p && a != path && iam.Within(a, path) && len(a) > len(path) {
				if _, ok := limits[a]; ok {
					covered = true
					break
				}
			}
		}
		if !covered {
			sum += lim
		}
	}
	return sum
}

func (d *sqlDB) Quota(ctx context.Context, project string) ([]ProjectQuota, error) {
	path, err := iam.CleanPath(project)
	if err != nil {
		return nil, err
	}
	var out []ProjectQuota
	err = d.retry(ctx, true, func(ctx context.Context) error {
		out = nil
		p, err := d.projectIn(ctx, d.db, path, "")
		if err != nil {
			return err
		}
		rows, err := d.db.QueryContext(ctx, d.q(`SELECT j.path, q.resource, q.lim, q.used FROM quotas q JOIN projects j ON j.id = q.project_id
			WHERE j.id = ? OR j.parent_id = ? ORDER BY j.path`), p.ID, p.ID)
		if err != nil {
			return err
		}
		defer rows.Close()
		for rows.Next() {
			var pp, r string
			var lim sql.NullInt64
			var used int64
			if err := rows.Scan(&pp, &r, &lim, &used); err != nil {
				return err
			}
			if len(out) == 0 || out[len(out)-1].Project != pp {
				out = append(out, ProjectQuota{Project: pp, Limits: map[Resource]int64{}, Used: map[Resource]int64{}})
			}
			q := &out[len(out)-1]
			q.Limits[Resource(r)] = Unlimited
			if lim.Valid {
				q.Limits[Resource(r)] = lim.Int64
			}
			q.Used[Resource(r)] = used
		}
		return rows.Err()
	})
	if err != nil {
		return nil, d.fail("read quota of project "+iam.Display(path), err)
	}
	return out, nil
}

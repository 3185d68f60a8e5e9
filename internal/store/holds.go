package store

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"maps"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"

	"dsec.dev/dsec/internal/errdefs"
	"dsec.dev/dsec/internal/iam"
)

// Hold is what something under way holds of a charge until it settles: a
// create until its sandboxes exist (the edges then show them), a FnCall
// call until it ends. Reconciliation counts holds as use the edges cannot
// show yet, so a create charged while a sweep lists the edges is never
// corrected away.
type Hold struct {
	ID      string // unique among holds
	Amounts Amounts
	// Expires is when ExpireHolds may release the hold as one whose
	// apiserver died with it: once what holds it is surely over (a
	// create's deadline); zero is DefaultHoldExpiry from now.
	Expires time.Time
}

// DefaultHoldExpiry is how long a hold without an expiry of its own
// lasts.
const DefaultHoldExpiry = 10 * time.Minute

// QuotaCharge is a charge made in the transaction that reserves a create
// (CreateReservation.Charge), held under ReservationHold(key, nonce).
type QuotaCharge struct {
	Project string
	// Amounts are charged; Held, a part of them, is held until the create
	// settles, or Expires (Hold.Expires).
	Amounts, Held Amounts
	Expires       time.Time
	// Parts, when set, splits Held into that many equal holds,
	// under ReservationPart(key, nonce, i), each settled alone (a fork's
	// children, which a node makes or refuses one by one).
	Parts int
}

// holds are the holds of c, the charge of the reservation of key with
// nonce.
func (c *QuotaCharge) holds(key, nonce string) ([]Hold, error) {
	if c.Parts <= 0 {
		return []Hold{{ID: ReservationHold(key, nonce), Amounts: c.Held, Expires: c.Expires}}, nil
	}
	each := Amounts{}
	for r, n := range c.Held {
		if n%int64(c.Parts) != 0 {
			return nil, fmt.Errorf("hold %d %s in %d equal parts: %w", n, r, c.Parts, errdefs.ErrInvalidArgument)
		}
		each[r] = n / int64(c.Parts)
	}
	out := make([]Hold, c.Parts)
	for i := range out {
		out[i] = Hold{ID: ReservationPart(key, nonce, i), Amounts: each, Expires: c.Expires}
	}
	return out, nil
}

// ReleaseHold is the ID of the hold a delete of sandbox records before the
// sandbox goes (HoldRelease) until its release (ReleaseSandbox).
func ReleaseHold(sandbox string) string { return "release:" + sandbox }

func (d *sqlDB) HoldRelease(ctx context.Context, project, sandbox string, amounts Amounts, expires time.Time) error {
	path, err := iam.CleanPath(project)
	if err != nil {
		return err
	}
	if _, err := chargeOrder(amounts); err != nil {
		return err
	}
	holds := []Hold{{ID: ReleaseHold(sandbox), Amounts: amounts, Expires: expires}}
	err = d.inTx(ctx, func(tx *sql.Tx) error {
		return d.insertHoldsOr(ctx, tx, path, holds, time.Now(), ` ON CONFLICT (id, resource) DO NOTHING`)
	})
	if err != nil {
		return d.fail(fmt.Sprintf("hold the release of sandbox %s of project %s", sandbox, iam.Display(path)), err)
	}
	return nil
}

// ReservationHold is the ID of the hold of the reservation of key with
// nonce.
func ReservationHold(key, nonce string) string { return "key:" + key + "#" + nonce }

// ReservationPart is the ID of part i of the hold of the reservation of
// key with nonce (QuotaCharge.Parts).
func ReservationPart(key, nonce string, i int) string {
	return ReservationHold(key, nonce) + "/" + strconv.Itoa(i)
}

// Use is a project's own use of a resource (not its descendants'), with
// what its holds hold of it and the generation of its quota row, which
// moves with every change of its own use (a charge, a release, a hold
// released, a correction; a child's charge does not).
type Use struct {
	Project  string
	Resource Resource
	Own      int64
	Held     int64
	Gen      int64
}

// holdRowsPerInsert bounds the rows of one INSERT of holds (four
// parameters each).
const holdRowsPerInsert = 500

// insertHolds records holds of the project at path (a project that does
// not exist fails the charge's lock after it).
func (d *sqlDB) insertHolds(ctx context.Context, tx *sql.Tx, path string, holds []Hold, now time.Time) error {
	return d.insertHoldsOr(ctx, tx, path, holds, now, "")
}

// insertHoldsOr is insertHolds with an ON CONFLICT clause (or "").
func (d *sqlDB) insertHoldsOr(ctx context.Context, tx *sql.Tx, path string, holds []Hold, now time.Time, conflict string) error {
	var args []any
	for _, h := range holds {
		if h.ID == "" {
			return fmt.Errorf("a hold without an ID: %w", errdefs.ErrInvalidArgument)
		}
		expires := h.Expires
		if expires.IsZero() {
			expires = now.Add(DefaultHoldExpiry)
		}
		for r, n := range h.Amounts {
			if n > 0 && r != CreatesPerSecond {
				args = append(args, h.ID, string(r), n, d.ts(ms(expires)))
			}
		}
	}
	if len(args) == 0 {
		return nil
	}
	for len(args) > 0 {
		n := min(len(args)/4, holdRowsPerInsert)
		row := "(?, ?, ?, ?), "
		if d.dialect == dialectPostgres {
			row = "(?, ?, ?::bigint, ?::timestamptz), "
		}
		rows := strings.TrimSuffix(strings.Repeat(row, n), ", ")
		_, err := tx.ExecContext(ctx, d.q(`INSERT INTO quota_holds (id, resource, project_id, amount, expires{ms})
			SELECT v.column1, v.column2, p.id, v.column3, v.column4 FROM (VALUES `+rows+`) AS v, projects p WHERE p.path = ?`+conflict), append(args[:n*4:n*4], path)...)
		if err != nil {
			if d.unique(err) {
				return fmt.Errorf("a hold is held already: %w", errdefs.ErrAlreadyExists)
			}
			return err
		}
		args = args[n*4:]
	}
	return nil
}

// releasedKept is how long a sandbox's release is remembered: far longer
// than two deletes of it can race.
const releasedKept = time.Hour

// heldRow is one row of quota_holds.
type heldRow struct {
	id, path string
	resource Resource
	amount   int64
}

func (d *sqlDB) Settle(ctx context.Context, ids []string, release bool) error {
	if len(ids) == 0 {
		return nil
	}
	var err error
	if release {
		err = d.inTx(ctx, func(tx *sql.Tx) error {
			return d.settleTx(ctx, tx, `h.id IN (`+placeholders(len(ids))+`)`, anys(ids), release)
		})
	} else {
		err = d.retry(ctx, true, func(ctx context.Context) error { return d.keep(ctx, ids) })
	}
	if err != nil {
		return d.fail(fmt.Sprintf("settle %d quota holds", len(ids)), err)
	}
	return nil
}

// keep ends the holds of ids keeping what they held charged, in one
// statement: the use is as it was, so no quota row is locked nor its
// generation moved. A reconciler sees the holds go by what they hold
// (CorrectUse compares it with what it read): a hold can go uncharged
// only this way, and a charge that adds one moves the generation.
func (d *sqlDB) keep(ctx context.Context, ids []string) error {
	_, err := d.db.ExecContext(ctx, d.q(`DELETE FROM quota_holds WHERE id IN (`+placeholders(len(ids))+`)`), anys(ids)...)
	return err
}

// settleTx ends the holds cond selects: it locks their projects' quota rows
// (from the root down, as every change of quotas does), deletes the holds
// and, with release, takes what they held off the use. Every project whose
// holds change moves its own generation.
func (d *sqlDB) settleTx(ctx context.Context, tx *sql.Tx, cond string, args []any, release bool) error {
	rows, err := tx.QueryContext(ctx, d.q(`SELECT h.id, j.path, h.resource, h.amount FROM quota_holds h JOIN projects j ON j.id = h.project_id
		WHERE `+cond), args...)
	if err != nil {
		return err
	}
	var held []heldRow
	for rows.Next() {
		var h heldRow
		var r string
		if err := rows.Scan(&h.id, &h.path, &r, &h.amount); err != nil {
			rows.Close()
			return err
		}
		h.resource = Resource(r)
		held = append(held, h)
	}
	rows.Close()
	if err := rows.Err(); err != nil || len(held) == 0 {
		return err
	}
	// Each project's total by resource, locked in lockQuotas's order.
	type key struct {
		path     string
		resource Resource
	}
	sums := map[key]int64{}
	var paths []string
	var resources []Resource
	for _, h := range held {
		sums[key{h.path, h.resource}] += h.amount
		for _, a := range iam.Ancestors(h.path) {
			if !slices.Contains(paths, a) {
				paths = append(paths, a)
			}
		}
		if !slices.Contains(resources, h.resource) {
			resources = append(resources, h.resource)
		}
	}
	if _, err := d.lockQuotas(ctx, tx, paths, resources); err != nil {
		return err
	}
	// Deleted by ID and resource: a hold another settle took meanwhile
	// (PostgreSQL's READ COMMITTED) is not given back twice.
	for _, h := range held {
		res, err := tx.ExecContext(ctx, d.q(`DELETE FROM quota_holds WHERE id = ? AND resource = ?`), h.id, string(h.resource))
		if err != nil {
			return err
		}
		if n, _ := res.RowsAffected(); n == 0 {
			sums[key{h.path, h.resource}] -= h.amount
		}
	}
	for k, n := range sums {
		if !release {
			n = 0 // the use stays; the generation moves all the same
		}
		if err := d.addUse(ctx, tx, k.path, iam.Ancestors(k.path), k.resource, -n); err != nil {
			return err
		}
	}
	return nil
}

func (d *sqlDB) ReleaseSandbox(ctx context.Context, project, id string, amounts Amounts) (bool, error) {
	path, err := iam.CleanPath(project)
	if err != nil {
		return false, err
	}
	resources, err := chargeOrder(amounts)
	if err != nil {
		return false, err
	}
	resources = slices.DeleteFunc(resources, func(r Resource) bool { return r == CreatesPerSecond })
	released := false
	err = d.inTx(ctx, func(tx *sql.Tx) error {
		released = false
		if len(resources) > 0 {
			if _, err := d.ancestorsLocked(ctx, tx, path, resources); err != nil {
				return err
			}
		}
		if _, err := tx.ExecContext(ctx, d.q(`DELETE FROM quota_holds WHERE id = ?`), ReleaseHold(id)); err != nil {
			return err
		}
		res, err := tx.ExecContext(ctx, d.q(`INSERT INTO quota_released (sandbox, at{ms}) VALUES (?, ?) ON CONFLICT (sandbox) DO NOTHING`),
			id, d.ts(time.Now()))
		if err != nil {
			return err
		}
		if n, _ := res.RowsAffected(); n == 0 {
			return nil // released already
		}
		released = true
		anc := iam.Ancestors(path)
		for _, r := range resources {
			if err := d.addUse(ctx, tx, path, anc, r, -amounts[r]); err != nil {
				return err
			}
		}
		return nil
	})
	if err != nil {
		return false, d.fail(fmt.Sprintf("release the quota of sandbox %s of project %s", id, iam.Display(path)), err)
	}
	return released, nil
}

func (d *sqlDB) Uses(ctx context.Context, resources []Resource) ([]Use, error) {
	var out []Use
	err := d.retry(ctx, true, func(ctx context.Context) error {
		out = nil
		// One statement, so one snapshot in PostgreSQL: the use, the
		// children's and the holds as of one moment.
		rows, err := d.db.QueryContext(ctx, d.q(`SELECT j.path, q.resource, q.used, q.gen,
				coalesce((SELECT sum(c.used) FROM quotas c JOIN projects k ON k.id = c.project_id WHERE k.parent_id = j.id AND c.resource = q.resource), 0),
				coalesce(h.held, 0)
			FROM quotas q JOIN projects j ON j.id = q.project_id
			LEFT JOIN (SELECT project_id, resource, sum(amount) AS held FROM quota_holds GROUP BY project_id, resource) h
				ON h.project_id = q.project_id AND h.resource = q.resource
			WHERE q.resource IN (`+placeholders(len(resources))+`) ORDER BY j.path, q.resource`), anys(resources)...)
		if err != nil {
			return err
		}
		defer rows.Close()
		for rows.Next() {
			var u Use
			var r string
			var used, children int64
			if err := rows.Scan(&u.Project, &r, &used, &u.Gen, &children, &u.Held); err != nil {
				return err
			}
			u.Resource, u.Own = Resource(r), used-children
			out = append(out, u)
		}
		return rows.Err()
	})
	if err != nil {
		return nil, d.fail("read the quota use of every project", err)
	}
	return out, nil
}

func (d *sqlDB) CorrectUse(ctx context.Context, read Use, n int64) (bool, error) {
	resource := read.Resource
	path, err := iam.CleanPath(read.Project)
	if err != nil {
		return false, err
	}
	what := fmt.Sprintf("correct the %s use of project %s", resource, iam.Display(path))
	if _, err := ParseResource(string(resource)); err != nil || resource == CreatesPerSecond || n < 0 {
		return false, fmt.Errorf("%s to %d: a count resource and a use of at least 0 are required: %w", what, n, errdefs.ErrInvalidArgument)
	}
	corrected := false
	err = d.inTx(ctx, func(tx *sql.Tx) error {
		corrected = false
		rows, err := d.ancestorsLocked(ctx, tx, path, []Resource{resource})
		if err != nil {
			return err
		}
		self := rows[len(rows)-1]
		var now, children, held int64
		if err := tx.QueryRowContext(ctx, d.q(`SELECT q.gen,
				coalesce((SELECT sum(c.used) FROM quotas c JOIN projects k ON k.id = c.project_id WHERE k.parent_id = j.id AND c.resource = q.resource), 0),
				coalesce((SELECT sum(h.amount) FROM quota_holds h WHERE h.project_id = j.id AND h.resource = q.resource), 0)
			FROM quotas q JOIN projects j ON j.id = q.project_id WHERE j.path = ? AND q.resource = ?`), path, string(resource)).Scan(&now, &children, &held); err != nil {
			return err
		}
		if now != read.Gen || held != read.Held {
			return nil // charged, released or settled since it was read: not provable
		}
		corrected = true
		delta := n + held - (self.used - children)
		if delta == 0 {
			return nil
		}
		return d.addUse(ctx, tx, path, iam.Ancestors(path), resource, delta)
	})
	if err != nil {
		return false, d.fail(what, err)
	}
	return corrected, nil
}

func (d *sqlDB) ExpireHolds(ctx context.Context, now time.Time) (int, error) {
	n := 0
	err := d.inTx(ctx, func(tx *sql.Tx) error {
		var err error
		if err = tx.QueryRowContext(ctx, d.q(`SELECT count(DISTINCT id) FROM quota_holds WHERE expires{ms} < ?`), d.ts(now)).Scan(&n); err != nil || n == 0 {
			return err
		}
		// A delete's hold held no charge: it goes, and the sweep counts
		// what its apiserver left.
		if _, err := tx.ExecContext(ctx, d.q(`DELETE FROM quota_holds WHERE expires{ms} < ? AND id LIKE 'release:%'`), d.ts(now)); err != nil {
			return err
		}
		return d.settleTx(ctx, tx, `h.expires{ms} < ?`, []any{d.ts(now)}, true)
	})
	if err == nil {
		// A sandbox deleted that long ago is not deleted again.
		err = d.retry(ctx, true, func(ctx context.Context) error {
			_, err := d.db.ExecContext(ctx, d.q(`DELETE FROM quota_released WHERE at{ms} < ?`), d.ts(now.Add(-releasedKept)))
			return err
		})
	}
	if err != nil {
		return 0, d.fail("expire quota holds", err)
	}
	return n, nil
}

// chargeReservation charges r.Charge, if any, in tx, the transaction that
// has just reserved r.Key.
func (d *sqlDB) chargeReservation(ctx context.Context, tx *sql.Tx, r CreateReservation) error {
	c := r.Charge
	if c == nil {
		return nil
	}
	path, err := iam.CleanPath(c.Project)
	if err != nil {
		return err
	}
	holds, err := c.holds(r.Key, r.Nonce)
	if err != nil {
		return err
	}
	if err := d.chargeTx(ctx, tx, path, c.Amounts, holds); err != nil {
		return wrap("charge project "+iam.Display(path), d.kind(err))
	}
	return nil
}

// reserveCharged reserves r.Key and charges r.Charge in one transaction,
// or returns the reservation that holds the key (charging nothing). The
// combined single statement of ReserveCreate cannot lock quota rows, so a
// charged reservation takes a transaction of its own.
func (s *pgStore) reserveCharged(ctx context.Context, r CreateReservation) (CreateReservation, bool, error) {
	for range 10 {
		reserved := false
		err := s.inTx(ctx, func(tx *sql.Tx) error {
			res, err := tx.ExecContext(ctx, `INSERT INTO idempotency (key, request_hash, owner, placements, state, ids, created, updated, nonce)
				VALUES ($1, $2, $3, $4, 'pending', '{}', $5, $5, $6) ON CONFLICT (key) DO NOTHING`,
				r.Key, r.RequestHash, r.Owner, nonNil(r.Placements), r.Created, r.Nonce)
			if err != nil {
				return err
			}
			if n, _ := res.RowsAffected(); n == 0 {
				return nil
			}
			reserved = true
			return s.chargeReservation(ctx, tx, r)
		})
		if err != nil {
			return CreateReservation{}, false, wrap(fmt.Sprintf("reserve idempotency key %q", r.Key), pgKind(err))
		}
		if reserved {
			return r, true, nil
		}
		var got CreateReservation
		err = s.retry(ctx, true, func(ctx context.Context) error {
			var err error
			got, err = scanPGReservation(s.pool.QueryRow(ctx, `SELECT `+pgReservationCols+` FROM idempotency WHERE key = $1`, r.Key))
			return err
		})
		if errors.Is(err, pgx.ErrNoRows) {
			continue // released meanwhile: reserve it again
		}
		if err != nil {
			return CreateReservation{}, false, wrap(fmt.Sprintf("reserve idempotency key %q", r.Key), pgKind(err))
		}
		if got.RequestHash != r.RequestHash {
			return CreateReservation{}, false, differentRequest(r.Key)
		}
		return got, false, nil
	}
	return CreateReservation{}, false, fmt.Errorf("reserve idempotency key %q: the key is reserved and released over and over: %w", r.Key, errdefs.ErrUnavailable)
}

func (d *sqlDB) ReserveCharged(ctx context.Context, project string, amounts Amounts, holds []Hold, rs []CreateReservation) ([]CreateReservation, []bool, error) {
	path, err := iam.CleanPath(project)
	if err != nil {
		return nil, nil, err
	}
	if _, err := chargeOrder(amounts); err != nil {
		return nil, nil, err
	}
	filled := make([]CreateReservation, len(rs))
	for i, r := range rs {
		if r.Charge == nil {
			return nil, nil, fmt.Errorf("reserve idempotency key %q: a reservation without a charge: %w", r.Key, errdefs.ErrInvalidArgument)
		}
		if filled[i], err = newReservation(r); err != nil {
			return nil, nil, err
		}
	}
	var reserved []bool
	err = d.inTx(ctx, func(tx *sql.Tx) error {
		made, err := d.insertReservations(ctx, tx, filled)
		if err != nil {
			return err
		}
		sum := maps.Clone(amounts)
		if sum == nil {
			sum = Amounts{}
		}
		all := slices.Clone(holds)
		reserved = make([]bool, len(filled))
		for i, r := range filled {
			if !made[r.Key+"#"+r.Nonce] {
				continue
			}
			reserved[i] = true
			for res, n := range r.Charge.Amounts {
				sum[res] += n
			}
			hs, err := r.Charge.holds(r.Key, r.Nonce)
			if err != nil {
				return err
			}
			all = append(all, hs...)
		}
		return d.chargeTx(ctx, tx, path, sum, all)
	})
	if err != nil {
		return nil, nil, d.fail(fmt.Sprintf("reserve %d idempotency keys and charge project %s", len(rs), iam.Display(path)), err)
	}
	return filled, reserved, nil
}

// insertReservations inserts the pending reservations rs whose keys no
// reservation holds, in one statement and in the keys' order (two
// transactions inserting the same keys never wait on each other in a
// cycle), and returns the ones it made by key#nonce.
func (d *sqlDB) insertReservations(ctx context.Context, tx *sql.Tx, rs []CreateReservation) (map[string]bool, error) {
	made := map[string]bool{}
	if len(rs) == 0 {
		return made, nil
	}
	sorted := slices.Clone(rs)
	slices.SortStableFunc(sorted, func(a, b CreateReservation) int { return strings.Compare(a.Key, b.Key) })
	var args []any
	for _, r := range sorted {
		var placements, ids any = nonNil(r.Placements), []string{}
		if d.dialect == dialectSQLite {
			placements, ids = encodeList(r.Placements), "[]"
		}
		args = append(args, r.Key, r.RequestHash, r.Owner, placements, ids, d.ts(r.Created), d.ts(r.Updated), r.Nonce)
	}
	values := strings.TrimSuffix(strings.Repeat("(?, ?, ?, ?, 'pending', ?, ?, ?, ?), ", len(sorted)), ", ")
	rows, err := tx.QueryContext(ctx, d.q(`INSERT INTO idempotency (key, request_hash, owner, placements, state, ids, created{ms}, updated{ms}, nonce)
		VALUES `+values+` ON CONFLICT (key) DO NOTHING RETURNING key, nonce`), args...)
	if err != nil {
		return nil, err
	}
	defer rows.Close()
	for rows.Next() {
		var key, nonce string
		if err := rows.Scan(&key, &nonce); err != nil {
			return nil, err
		}
		made[key+"#"+nonce] = true
	}
	return made, rows.Err()
}

package store

import (
	"context"
	"crypto/rand"
	"database/sql"
	"encoding/hex"
	"errors"
	"fmt"
	"maps"
	"slices"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"

	"dsec.dev/dsec/internal/errdefs"
	"dsec.dev/dsec/internal/iam"
)

// A quota slice is headroom of a limited project that one apiserver leased
// (LeaseSlice) so that its creates need not lock the project's quota rows,
// and those of every project above it, which every create of the cluster
// would otherwise queue on. Taking a slice charges its size to the project
// and its ancestors as a create would, so every limit holds with the slice
// spent in full; the creates charged to it (ReserveSliced) count up its
// used, on the slice's own row, which no other apiserver writes. What is
// not spent (size - used) is headroom, not use: Quota and Uses leave it
// out. A slice goes back when its apiserver returns it (LeaseSlice again),
// or expires (ExpireHolds, as a dead apiserver's holds do), and a charge
// that would be refused while slices hold unspent headroom under the
// refusing project takes that headroom back first (chargeTx), so a quota
// still fills exactly.

// Slice is a leased quota slice: Size of each resource, charged to Project,
// usable until Expires.
type Slice struct {
	ID      string
	Project string
	Size    Amounts
	Expires time.Time
}

// ErrSliceSpent is ReserveSliced's refusal: the slice has no room for the
// charge, or was returned, taken back or expired. Nothing was reserved
// nor charged; the caller charges the create exactly (ReserveCreate with
// its Charge).
var ErrSliceSpent = fmt.Errorf("quota slice spent, taken back or expired: %w", errdefs.ErrFailedPrecondition)

// sliceShare is the part of a project's headroom one lease may take: each
// apiserver leaves room for the others, and near the limit slices shrink
// until none fits a create, and creates are charged exactly.
const sliceShare = 4

func (d *sqlDB) LeaseSlice(ctx context.Context, owner, project, old string, want, least Amounts, expires time.Time) (Slice, error) {
	path, err := iam.CleanPath(project)
	if err != nil {
		return Slice{}, err
	}
	resources, err := chargeOrder(want)
	if err != nil {
		return Slice{}, err
	}
	if slices.Contains(resources, CreatesPerSecond) {
		return Slice{}, fmt.Errorf("lease a quota slice of %s: a rate cannot be sliced: %w", CreatesPerSecond, errdefs.ErrInvalidArgument)
	}
	var out Slice
	err = d.inTx(ctx, func(tx *sql.Tx) error {
		out = Slice{}
		if len(resources) == 0 {
			if old == "" {
				return nil
			}
			return d.foldSlices(ctx, tx, `s.id = ?`, []any{old})
		}
		rows, err := d.ancestorsLocked(ctx, tx, path, resources)
		if err != nil {
			return err
		}
		// The old slice's rows, locked after the quota rows as every
		// change of slices does; its unspent headroom counts as free.
		unspent := Amounts{}
		if old != "" {
			held, err := tx.QueryContext(ctx, d.q(`SELECT s.resource, s.size - s.used FROM quota_slices s
				WHERE s.id = ? AND s.project_id = (SELECT id FROM projects WHERE path = ?) ORDER BY s.resource{locks}`), old, path)
			if err != nil {
				return err
			}
			for held.Next() {
				var r string
				var n int64
				if err := held.Scan(&r, &n); err != nil {
					held.Close()
					return err
				}
				unspent[Resource(r)] = max(n, 0)
			}
			held.Close()
			if err := held.Err(); err != nil {
				return err
			}
		}
		grant := maps.Clone(want)
		for _, r := range rows {
			if r.lim.Valid {
				free := r.lim.Int64 - r.used + unspent[r.resource]
				grant[r.resource] = min(grant[r.resource], max(free, 0)/sliceShare)
			}
		}
		fits := true
		for _, r := range resources {
			fits = fits && grant[r] >= max(least[r], 1)
		}
		same := len(unspent) == len(resources)
		for _, r := range resources {
			_, ok := unspent[r]
			same = same && ok
		}
		if old != "" && (!fits || !same) {
			if err := d.foldSlices(ctx, tx, `s.id = ?`, []any{old}); err != nil {
				return err
			}
		}
		if !fits {
			return nil // too near a limit: creates are charged exactly
		}
		anc := iam.Ancestors(path)
		if same {
			// Resized in place: creates charging it meanwhile keep going.
			out = Slice{ID: old, Project: path, Size: grant, Expires: expires}
			for _, r := range resources {
				if _, err := tx.ExecContext(ctx, d.q(`UPDATE quota_slices SET size = used + ?, expires{ms} = ?, gen = gen + 1 WHERE id = ? AND resource = ?`),
					grant[r], d.ts(ms(expires)), old, string(r)); err != nil {
					return err
				}
				if err := d.addUse(ctx, tx, path, anc, r, grant[r]-unspent[r]); err != nil {
					return err
				}
			}
			return nil
		}
		id := make([]byte, 12)
		rand.Read(id)
		out = Slice{ID: hex.EncodeToString(id), Project: path, Size: grant, Expires: expires}
		for _, r := range resources {
			if _, err := tx.ExecContext(ctx, d.q(`INSERT INTO quota_slices (id, resource, project_id, owner, size, expires{ms})
				SELECT ?, ?, id, ?, ?, ? FROM projects WHERE path = ?`), out.ID, string(r), owner, grant[r], d.ts(ms(expires)), path); err != nil {
				return err
			}
			if err := d.addUse(ctx, tx, path, anc, r, grant[r]); err != nil {
				return err
			}
		}
		return nil
	})
	if err != nil {
		return Slice{}, d.fail(fmt.Sprintf("lease a quota slice of project %s", iam.Display(path)), err)
	}
	return out, nil
}

// foldSlices ends the slices cond selects (over quota_slices s): what they
// spent stays charged (their sandboxes hold it), their headroom goes back,
// and the generation of their projects' rows moves past theirs, so that a
// reconciler that read a use with the slice sees it changed.
func (d *sqlDB) foldSlices(ctx context.Context, tx *sql.Tx, cond string, args []any) error {
	type row struct {
		path     string
		resource Resource
	}
	rows, err := tx.QueryContext(ctx, d.q(`SELECT DISTINCT j.path, s.resource FROM quota_slices s JOIN projects j ON j.id = s.project_id WHERE `+cond), args...)
	if err != nil {
		return err
	}
	var found []row
	for rows.Next() {
		var r row
		var res string
		if err := rows.Scan(&r.path, &res); err != nil {
			rows.Close()
			return err
		}
		r.resource = Resource(res)
		found = append(found, r)
	}
	rows.Close()
	if err := rows.Err(); err != nil || len(found) == 0 {
		return err
	}
	// The quota rows first, in lockQuotas's order, as every change of
	// quotas takes them.
	var paths []string
	var resources []Resource
	for _, r := range found {
		for _, a := range iam.Ancestors(r.path) {
			if !slices.Contains(paths, a) {
				paths = append(paths, a)
			}
		}
		if !slices.Contains(resources, r.resource) {
			resources = append(resources, r.resource)
		}
	}
	if _, err := d.lockQuotas(ctx, tx, paths, resources); err != nil {
		return err
	}
	rows, err = tx.QueryContext(ctx, d.q(`SELECT s.id, j.path, s.resource, s.size - s.used, s.gen FROM quota_slices s JOIN projects j ON j.id = s.project_id
		WHERE `+cond+` ORDER BY s.id, s.resource{locks}`), args...)
	if err != nil {
		return err
	}
	type slice struct {
		id, path     string
		resource     Resource
		unspent, gen int64
	}
	var ended []slice
	for rows.Next() {
		var s slice
		var res string
		if err := rows.Scan(&s.id, &s.path, &res, &s.unspent, &s.gen); err != nil {
			rows.Close()
			return err
		}
		s.resource = Resource(res)
		ended = append(ended, s)
	}
	rows.Close()
	if err := rows.Err(); err != nil {
		return err
	}
	for _, s := range ended {
		if _, err := tx.ExecContext(ctx, d.q(`DELETE FROM quota_slices WHERE id = ? AND resource = ?`), s.id, string(s.resource)); err != nil {
			return err
		}
		if err := d.addUse(ctx, tx, s.path, iam.Ancestors(s.path), s.resource, -max(s.unspent, 0)); err != nil {
			return err
		}
		if _, err := tx.ExecContext(ctx, d.q(`UPDATE quotas SET gen = gen + ?
			WHERE resource = ? AND project_id = (SELECT id FROM projects WHERE path = ?)`), s.gen, string(s.resource), s.path); err != nil {
			return err
		}
	}
	return nil
}

// takeBack takes back the unspent headroom of every slice of resource
// under the project at path (itself included): a charge there would be
// refused while it is leased. The slices stay, spent: their apiservers'
// next charges to them fail with ErrSliceSpent and are charged exactly.
// It reports whether it took any.
func (d *sqlDB) takeBack(ctx context.Context, tx *sql.Tx, path string, resource Resource) (bool, error) {
	cond, args := subtreeCond("j.path", path)
	rows, err := tx.QueryContext(ctx, d.q(`SELECT s.id, j.path, s.size - s.used FROM quota_slices s JOIN projects j ON j.id = s.project_id
		WHERE s.resource = ? AND s.size > s.used AND (j.path = ? OR `+cond+`) ORDER BY s.id{locks}`), append([]any{string(resource), path}, args...)...)
	if err != nil {
		return false, err
	}
	type slice struct {
		id, path string
		unspent  int64
	}
	var found []slice
	for rows.Next() {
		var s slice
		if err := rows.Scan(&s.id, &s.path, &s.unspent); err != nil {
			rows.Close()
			return false, err
		}
		found = append(found, s)
	}
	rows.Close()
	if err := rows.Err(); err != nil {
		return false, err
	}
	for _, s := range found {
		if _, err := tx.ExecContext(ctx, d.q(`UPDATE quota_slices SET size = used, gen = gen + 1 WHERE id = ? AND resource = ?`), s.id, string(resource)); err != nil {
			return false, err
		}
		if err := d.addUse(ctx, tx, s.path, iam.Ancestors(s.path), resource, -s.unspent); err != nil {
			return false, err
		}
	}
	return len(found) > 0, nil
}

// unspentUnder is the headroom the slices of resource hold under the
// project at path (itself included), by path.
func (d *sqlDB) unspentUnder(ctx context.Context, q interface {
	QueryContext(context.Context, string, ...any) (*sql.Rows, error)
}, path string) (map[string]Amounts, error) {
	rows, err := q.QueryContext(ctx, d.q(`SELECT j.path, s.resource, s.size - s.used FROM quota_slices s JOIN projects j ON j.id = s.project_id`))
	if err != nil {
		return nil, err
	}
	defer rows.Close()
	out := map[string]Amounts{}
	for rows.Next() {
		var p, r string
		var n int64
		if err := rows.Scan(&p, &r, &n); err != nil {
			return nil, err
		}
		for _, a := range iam.Ancestors(p) {
			if !iam.Within(a, path) {
				continue
			}
			if out[a] == nil {
				out[a] = Amounts{}
			}
			out[a][Resource(r)] += max(n, 0)
		}
	}
	return out, rows.Err()
}

func (d *sqlDB) ReserveSliced(ctx context.Context, slice string, r CreateReservation) (CreateReservation, bool, error) {
	c := r.Charge
	if c == nil || slice == "" {
		return CreateReservation{}, false, fmt.Errorf("reserve idempotency key %q: a sliced reservation needs a charge and a slice: %w", r.Key, errdefs.ErrInvalidArgument)
	}
	path, err := iam.CleanPath(c.Project)
	if err != nil {
		return CreateReservation{}, false, err
	}
	resources, err := chargeOrder(c.Amounts)
	if err != nil {
		return CreateReservation{}, false, err
	}
	if r, err = newReservation(r); err != nil {
		return CreateReservation{}, false, err
	}
	holds, err := c.holds(r.Key, r.Nonce)
	if err != nil {
		return CreateReservation{}, false, err
	}
	for i := range holds {
		holds[i].slice = slice
	}
	now := time.Now()
	reserved := false
	err = d.inTx(ctx, func(tx *sql.Tx) error {
		reserved = false
		made, err := d.insertReservations(ctx, tx, []CreateReservation{r})
		if err != nil || !made[r.Key+"#"+r.Nonce] {
			return err
		}
		if err := d.spend(ctx, tx, slice, resources, c.Amounts, now); err != nil {
			return err
		}
		reserved = true
		return d.insertHolds(ctx, tx, path, holds, now)
	})
	if errors.Is(err, ErrSliceSpent) {
		return CreateReservation{}, false, err
	}
	if err != nil {
		return CreateReservation{}, false, d.fail(fmt.Sprintf("reserve idempotency key %q charged to a quota slice of project %s", r.Key, iam.Display(path)), err)
	}
	return r, reserved, nil
}

// spend charges amounts of resources to slice, or fails with ErrSliceSpent.
func (d *sqlDB) spend(ctx context.Context, tx *sql.Tx, slice string, resources []Resource, amounts Amounts, now time.Time) error {
	for _, res := range resources {
		n := amounts[res]
		out, err := tx.ExecContext(ctx, d.q(`UPDATE quota_slices SET used = used + ?, gen = gen + 1
			WHERE id = ? AND resource = ? AND used + ? <= size AND expires{ms} > ?`), n, slice, string(res), n, d.ts(now))
		if err != nil {
			return err
		}
		if k, _ := out.RowsAffected(); k != 1 {
			return ErrSliceSpent
		}
	}
	return nil
}

// pgSlicedSQL reserves a key and, only if it did, charges its create to a
// slice and records the create's holds, in one statement, so that it
// goes to PostgreSQL with other creates' reservations in one batch
// (combiner): the slice's row is its apiserver's alone, so no other
// apiserver's creates wait on it. A charge that does not fit (or a slice
// gone) fails the statement (dsec_slice_spent), undoing its reservation.
//
// $1..$6 are pgReserveSQL's; $7 the slice, $8 and $9 the resources and
// amounts charged, $10 now, $11 the hold's ID, $12 and $13 the held
// resources and amounts, $14 the hold's expiry, $15 the project's path.
const pgSlicedSQL = `
WITH ins AS (
	INSERT INTO idempotency (` + pgReservationCols + `)
	VALUES ($1, $2, $3, $4, 'pending', '{}', $5, $5, $6)
	ON CONFLICT (key) DO NOTHING
	RETURNING ` + pgReservationCols + `),
spent AS (
	UPDATE quota_slices s SET used = s.used + v.n, gen = s.gen + 1
	FROM unnest($8::text[], $9::bigint[]) AS v (resource, n)
	WHERE s.id = $7 AND s.resource = v.resource AND s.used + v.n <= s.size AND s.expires > $10
		AND EXISTS (SELECT 1 FROM ins)
	RETURNING 1),
held AS (
	INSERT INTO quota_holds (id, resource, project_id, amount, expires, slice)
	SELECT $11, v.resource, p.id, v.n, $14, $7
	FROM unnest($12::text[], $13::bigint[]) AS v (resource, n), projects p
	WHERE p.path = $15 AND EXISTS (SELECT 1 FROM ins))
SELECT true, * FROM ins WHERE CASE WHEN (SELECT count(*) FROM spent) = cardinality($8::text[]) THEN true ELSE dsec_slice_spent() END
UNION ALL
SELECT false, ` + pgReservationCols + ` FROM idempotency WHERE key = $1 AND NOT EXISTS (SELECT 1 FROM ins)`

// pgSliceSpent is the SQLSTATE dsec_slice_spent raises.
const pgSliceSpent = "DS001"

func (s *pgStore) ReserveSliced(ctx context.Context, slice string, r CreateReservation) (CreateReservation, bool, error) {
	c := r.Charge
	if c == nil || slice == "" || c.Parts > 0 {
		return s.sqlDB.ReserveSliced(ctx, slice, r)
	}
	path, err := iam.CleanPath(c.Project)
	if err != nil {
		return CreateReservation{}, false, err
	}
	resources, err := chargeOrder(c.Amounts)
	if err != nil {
		return CreateReservation{}, false, err
	}
	if r, err = newReservation(r); err != nil {
		return CreateReservation{}, false, err
	}
	var charged, held []string
	var amounts, heldAmounts []int64
	for _, res := range resources {
		charged, amounts = append(charged, string(res)), append(amounts, c.Amounts[res])
		if n := c.Held[res]; n > 0 && res != CreatesPerSecond {
			held, heldAmounts = append(held, string(res)), append(heldAmounts, n)
		}
	}
	expires := c.Expires
	if expires.IsZero() {
		expires = time.Now().Add(DefaultHoldExpiry)
	}
	var got CreateReservation
	var reserved bool
	err = s.retry(ctx, false, func(ctx context.Context) error {
		for range 10 {
			err := s.reserve.queryRow(ctx, pgSlicedSQL,
				[]any{r.Key, r.RequestHash, r.Owner, nonNil(r.Placements), r.Created, r.Nonce,
					slice, charged, amounts, time.Now(), ReservationHold(r.Key, r.Nonce), held, heldAmounts, ms(expires), path},
				func(row pgx.Row) (err error) {
					got, err = scanPGReservation(row, &reserved)
					return err
				})
			if !errors.Is(err, pgx.ErrNoRows) {
				return err
			}
		}
		return fmt.Errorf("the key is reserved and released over and over: %w", errdefs.ErrUnavailable)
	})
	var pgErr *pgconn.PgError
	if errors.As(err, &pgErr) && pgErr.Code == pgSliceSpent {
		return CreateReservation{}, false, ErrSliceSpent
	}
	if err != nil {
		return CreateReservation{}, false, fmt.Errorf("reserve idempotency key %q charged to a quota slice of project %s: %w", r.Key, iam.Display(path), pgKind(err))
	}
	if !reserved && got.RequestHash != r.RequestHash {
		return CreateReservation{}, false, differentRequest(r.Key)
	}
	return got, reserved, nil
}

package store

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"strings"
	"time"

	"dsec.dev/dsec/internal/errdefs"
	"dsec.dev/dsec/internal/iam"
)

// Kinds of owned objects.
const (
	ObjectLayer    = "layer"
	ObjectImage    = "image"
	ObjectSnapshot = "snapshot"
	ObjectPool     = "pool"
)

// Object is a layer, image, snapshot or warm pool and the project it
// belongs to. A name no Object records belongs to the root (it was made
// before objects were recorded, or by the node).
type Object struct {
	// Name is what an environment calls it: name:tag for a layer or an
	// image, snap:NAME for a snapshot, pool:KEY for a warm pool.
	Name    string
	Kind    string
	Project string // path
	// Bytes is its size: the sum of its Blobs.
	Bytes int64
	// Blobs are the stored layers it holds (Object fills them in; lists
	// leave them out).
	Blobs []Blob
	// SharedWith are the paths of the projects it is shared with
	// (read-only), sorted.
	SharedWith []string
	Created    time.Time
	// Writer is the call making the object, or making it again, now (a
	// token of the caller's own; "" is none), and WriterUntil when its
	// claim lapses: a writer past it is a call that died, whose name a
	// later call may take over (TakeObject). One name has one writer at a
	// time, whichever apiserver serves it.
	Writer      string
	WriterUntil time.Time
}

// Blob is a stored layer an object holds, by digest: a layer holds one,
// an image its layers', a snapshot its own. A project is charged each blob
// once (to layer_bytes, or snapshot_bytes for a snapshot's), however many
// of its objects hold it.
type Blob struct {
	Digest string
	Bytes  int64
}

// Objects records which project each layer, image, snapshot and warm pool
// belongs to, and whom it is shared with; the apiserver decides with it
// who sees, uses and removes them.
type Objects interface {
	// ClaimObject records o (Name, Kind, Project, and Writer and
	// WriterUntil: the claiming call as its writer) when no object has its
	// name and returns it with claimed true; otherwise it returns the
	// object recorded, unchanged (with its blobs and writer), with claimed
	// false. Of concurrent claims of one name exactly one is claimed.
	ClaimObject(ctx context.Context, o Object) (got Object, claimed bool, err error)
	// TakeObject makes writer the one writer of name's record until
	// until, and returns the record as it was (with its blobs and the
	// writer before). A record with no writer, writer's own or one whose
	// writer's claim has lapsed (WriterUntil passed) is taken; one whose
	// claim is another's and live is refused with
	// errdefs.ErrFailedPrecondition, the record returned as it is. Of
	// concurrent takes of one name exactly one is taken; taking it again
	// as its writer renews the claim. errdefs.ErrNotFound for an unknown
	// name.
	TakeObject(ctx context.Context, name, writer string, until time.Time) (Object, error)
	// SetObjectBlobs records the blobs name holds now, in place of those
	// it held, and in the same transaction charges its project (and every
	// project above it) the change: the bytes of the blobs it holds now
	// that no other object of the project (of its resource) holds, less
	// those of the blobs it held so (a negative change is given back). A
	// charge past a limit is refused with errdefs.ErrResourceExhausted, in
	// Charge's words, and changes nothing. With a writer, a record whose
	// writer is another (writer's claim lapsed and another call took the
	// name) is refused with errdefs.ErrFailedPrecondition and changes
	// nothing; the writer keeps its claim. It returns the change;
	// errdefs.ErrNotFound for an unknown name.
	SetObjectBlobs(ctx context.Context, name, writer string, blobs []Blob) (change int64, err error)
	// ReleaseObject ends writer's claim of name: the record stays with no
	// writer or, with forget, goes as DeleteObject removes it (its bytes
	// given back). A record writer no longer holds (or none) is left
	// alone: nil.
	ReleaseObject(ctx context.Context, name, writer string, forget bool) error
	// Object returns the object called name, with its shares, or
	// errdefs.ErrNotFound.
	Object(ctx context.Context, name string) (Object, error)
	// ListObjects lists every object with its shares, by name.
	ListObjects(ctx context.Context) ([]Object, error)
	// DeleteObject forgets name, its blobs and its shares and, in the same
	// transaction, gives its project back the bytes of its blobs no other
	// object of the project holds; it returns what it was and those bytes.
	// errdefs.ErrNotFound for an unknown name.
	DeleteObject(ctx context.Context, name string) (o Object, release int64, err error)
	// ShareObject lets project (a path) and what lies under it read name;
	// sharing again is a no-op. errdefs.ErrNotFound for an unknown name or
	// project.
	ShareObject(ctx context.Context, name, project string) error
	// UnshareObject takes a share away; one that is not there is a no-op.
	UnshareObject(ctx context.Context, name, project string) error
	// LapsedObjects lists, by name, the records a call claimed and never
	// filled: layers, images and snapshots (never a pool, which has no
	// blobs by nature) with no blobs and a writer whose claim lapsed
	// before before (a call that died). Lists leave out Blobs and
	// SharedWith.
	LapsedObjects(ctx context.Context, before time.Time) ([]Object, error)
	// SweepObject removes name's record, as DeleteObject does, if it is
	// still one LapsedObjects lists at before: checked again in the
	// transaction that removes it, its project's row locked as a take or
	// a record of blobs locks it, so a call that took the name over or
	// recorded its blobs meanwhile keeps it. It reports whether it removed
	// the record; an unknown name is not removed (false, nil).
	SweepObject(ctx context.Context, name string, before time.Time) (bool, error)
}

func checkObject(o Object) error {
	switch o.Kind {
	case ObjectLayer, ObjectImage, ObjectSnapshot, ObjectPool:
	default:
		return fmt.Errorf("object %q: kind %q: %w", o.Name, o.Kind, errdefs.ErrInvalidArgument)
	}
	if o.Name == "" {
		return fmt.Errorf("object of kind %s: empty name: %w", o.Kind, errdefs.ErrInvalidArgument)
	}
	return nil
}

const objectCols = `name, kind, project, bytes, created{ms}, writer, writer_until{ms}`

func scanObject(row interface{ Scan(...any) error }) (Object, error) {
	var o Object
	err := row.Scan(&o.Name, &o.Kind, &o.Project, &o.Bytes, timeCol{&o.Created}, &o.Writer, timeCol{&o.WriterUntil})
	return o, err
}

// lapsed reports whether o is a record a call claimed and never filled,
// its claim lapsed before before (see LapsedObjects); o read with its
// blobs.
func (o Object) lapsed(before time.Time) bool {
	switch o.Kind {
	case ObjectLayer, ObjectImage, ObjectSnapshot:
	default:
		return false
	}
	return o.Writer != "" && !o.WriterUntil.IsZero() && o.WriterUntil.Before(before) && len(o.Blobs) == 0
}

// liveWriter reports whether o's writer holds its claim at now.
func (o Object) liveWriter(now time.Time) bool {
	return o.Writer != "" && now.Before(o.WriterUntil)
}

// writerHolds refuses a change of o by writer when o's writer is
// another's (a writer "" changes it regardless).
func writerHolds(o Object, writer string) error {
	if writer == "" || o.Writer == writer {
		return nil
	}
	return fmt.Errorf("object %s: the call's claim of the name lapsed and another call took it over: %w", o.Name, errdefs.ErrFailedPrecondition)
}

func (d *sqlDB) objectIn(ctx context.Context, q querier, name string) (Object, error) {
	o, err := scanObject(q.QueryRowContext(ctx, d.q(`SELECT `+objectCols+` FROM objects WHERE name = ?`), name))
	if errors.Is(err, sql.ErrNoRows) {
		return Object{}, fmt.Errorf("object %s: %w", name, errdefs.ErrNotFound)
	}
	if err != nil {
		return Object{}, err
	}
	rows, err := q.QueryContext(ctx, d.q(`SELECT project FROM object_shares WHERE name = ? ORDER BY project`), name)
	if err != nil {
		return Object{}, err
	}
	defer rows.Close()
	for rows.Next() {
		var p string
		if err := rows.Scan(&p); err != nil {
			return Object{}, err
		}
		o.SharedWith = append(o.SharedWith, p)
	}
	if err := rows.Err(); err != nil {
		return Object{}, err
	}
	blobs, err := q.QueryContext(ctx, d.q(`SELECT digest, bytes FROM object_blobs WHERE name = ? ORDER BY digest`), name)
	if err != nil {
		return Object{}, err
	}
	defer blobs.Close()
	for blobs.Next() {
		var b Blob
		if err := blobs.Scan(&b.Digest, &b.Bytes); err != nil {
			return Object{}, err
		}
		o.Blobs = append(o.Blobs, b)
	}
	return o, blobs.Err()
}

// kindsCharged are the kinds of objects whose blobs are charged to the
// same resource as kind's: snapshots to snapshot_bytes, the rest to
// layer_bytes.
func kindsCharged(kind string) []any {
	if kind == ObjectSnapshot {
		return []any{ObjectSnapshot}
	}
	return []any{ObjectLayer, ObjectImage, ObjectPool}
}

// ownBytes is what name's project is charged for it: the bytes of its
// blobs that no other object of the project, charged to the same
// resource, holds.
func (d *sqlDB) ownBytes(ctx context.Context, tx *sql.Tx, o Object) (int64, error) {
	kinds := kindsCharged(o.Kind)
	var n int64
	err := tx.QueryRowContext(ctx, d.q(`SELECT COALESCE(SUM(b.bytes), 0) FROM object_blobs b WHERE b.name = ? AND NOT EXISTS (
		SELECT 1 FROM object_blobs b2 JOIN objects o2 ON o2.name = b2.name
		WHERE b2.digest = b.digest AND o2.project = ? AND o2.name <> ? AND o2.kind IN (`+placeholders(len(kinds))+`))`),
		append([]any{o.Name, o.Project, o.Name}, kinds...)...).Scan(&n)
	return n, err
}

// chargeBytesIn charges o's project and every project above it n bytes
// (layer_bytes, or snapshot_bytes for a snapshot) in tx, or gives back
// -n (never below zero); a charge past a limit is refused as Charge
// refuses it, naming the highest project that is full. Rows are locked
// from the root down, as every charge locks them.
func (d *sqlDB) chargeBytesIn(ctx context.Context, tx *sql.Tx, o Object, n int64) error {
	if n == 0 {
		return nil
	}
	r := LayerBytes
	if o.Kind == ObjectSnapshot {
		r = SnapshotBytes
	}
	rows, err := d.ancestorsLocked(ctx, tx, o.Project, []Resource{r})
	if err != nil {
		return err
	}
	for _, row := range rows {
		if n > 0 && row.lim.Valid && row.used+n > row.lim.Int64 {
			return fmt.Errorf("quota of project %s: %d of %s in use: %w", iam.Display(row.path), row.used, r.amount(row.lim.Int64), errdefs.ErrResourceExhausted)
		}
	}
	anc := iam.Ancestors(o.Project)
	_, err = tx.ExecContext(ctx, d.q(`UPDATE quotas SET used = CASE WHEN used + ? > 0 THEN used + ? ELSE 0 END
		WHERE resource = ? AND project_id IN (SELECT id FROM projects WHERE path IN (`+placeholders(len(anc))+`))`),
		append([]any{n, n, string(r)}, anys(anc)...)...)
	return err
}

// lockedObject reads name's record with its project's row locked (see
// lockObjectsOf), read again once locked: a project deleted meanwhile
// hands its objects to its parent.
func (d *sqlDB) lockedObject(ctx context.Context, tx *sql.Tx, name string) (Object, error) {
	o, err := d.objectIn(ctx, tx, name)
	if err != nil {
		return Object{}, err
	}
	if err := d.lockObjectsOf(ctx, tx, o.Project); err != nil {
		return Object{}, err
	}
	again, err := d.objectIn(ctx, tx, name)
	if err != nil || again.Project == o.Project {
		return again, err
	}
	return again, d.lockObjectsOf(ctx, tx, again.Project)
}

// lockObjectsOf serialises the changes to project's objects' blobs (what
// one charges depends on what the others hold) by locking its row; a
// project that is gone has none to lock.
func (d *sqlDB) lockObjectsOf(ctx context.Context, tx *sql.Tx, project string) error {
	_, err := d.projectIn(ctx, tx, project, "{lock}")
	if errors.Is(err, errdefs.ErrNotFound) {
		return nil
	}
	return err
}

func (d *sqlDB) ClaimObject(ctx context.Context, o Object) (Object, bool, error) {
	if err := checkObject(o); err != nil {
		return Object{}, false, err
	}
	p, err := iam.CleanPath(o.Project)
	if err != nil {
		return Object{}, false, err
	}
	o.Project, o.Bytes, o.SharedWith, o.Blobs = p, 0, nil, nil
	if o.Created.IsZero() {
		o.Created = time.Now()
	}
	o.Created = ms(o.Created)
	if o.Writer == "" {
		o.WriterUntil = time.Time{}
	}
	o.WriterUntil = ms(o.WriterUntil)
	var got Object
	claimed := false
	err = d.inTx(ctx, func(tx *sql.Tx) error {
		res, err := tx.ExecContext(ctx, d.q(`INSERT INTO objects (name, kind, project, bytes, created{ms}, writer, writer_until{ms}) VALUES (?, ?, ?, 0, ?, ?, ?)
			ON CONFLICT (name) DO NOTHING`), o.Name, o.Kind, o.Project, d.ts(o.Created), o.Writer, d.ts(o.WriterUntil))
		if err != nil {
			return err
		}
		if n, err := res.RowsAffected(); err != nil {
			return err
		} else if n == 1 {
			got, claimed = o, true
			return nil
		}
		got, err = d.objectIn(ctx, tx, o.Name)
		return err
	})
	if err != nil {
		return Object{}, false, d.fail("claim object "+o.Name, err)
	}
	return got, claimed, nil
}

func (d *sqlDB) TakeObject(ctx context.Context, name, writer string, until time.Time) (Object, error) {
	if writer == "" {
		return Object{}, fmt.Errorf("take object %s: no writer: %w", name, errdefs.ErrInvalidArgument)
	}
	var o Object
	err := d.inTx(ctx, func(tx *sql.Tx) error {
		var err error
		if o, err = d.lockedObject(ctx, tx, name); err != nil {
			return err
		}
		if o.Writer != writer && o.liveWriter(time.Now()) {
			return fmt.Errorf("object %s is being made by another call until %s: %w",
				name, o.WriterUntil.UTC().Format(time.RFC3339), errdefs.ErrFailedPrecondition)
		}
		_, err = tx.ExecContext(ctx, d.q(`UPDATE objects SET writer = ?, writer_until{ms} = ? WHERE name = ?`), writer, d.ts(ms(until)), name)
		return err
	})
	if err != nil {
		if errors.Is(err, errdefs.ErrFailedPrecondition) {
			return o, err
		}
		return Object{}, d.fail("take object "+name, err)
	}
	return o, nil
}

func (d *sqlDB) ReleaseObject(ctx context.Context, name, writer string, forget bool) error {
	err := d.inTx(ctx, func(tx *sql.Tx) error {
		o, err := d.lockedObject(ctx, tx, name)
		if errors.Is(err, errdefs.ErrNotFound) {
			return nil
		}
		if err != nil {
			return err
		}
		if writer == "" || o.Writer != writer {
			return nil
		}
		if !forget {
			_, err := tx.ExecContext(ctx, d.q(`UPDATE objects SET writer = '', writer_until{ms} = NULL WHERE name = ?`), name)
			return err
		}
		return d.deleteObjectIn(ctx, tx, o)
	})
	if err != nil {
		return d.fail("release object "+name, err)
	}
	return nil
}

func (d *sqlDB) SetObjectBlobs(ctx context.Context, name, writer string, blobs []Blob) (int64, error) {
	seen := map[string]bool{}
	var total int64
	for _, b := range blobs {
		if b.Bytes < 0 || b.Digest == "" {
			return 0, fmt.Errorf("object %s: blob %q of %d bytes: %w", name, b.Digest, b.Bytes, errdefs.ErrInvalidArgument)
		}
		if seen[b.Digest] {
			return 0, fmt.Errorf("object %s: blob %s listed twice: %w", name, b.Digest, errdefs.ErrInvalidArgument)
		}
		seen[b.Digest] = true
		total += b.Bytes
	}
	var change int64
	err := d.inTx(ctx, func(tx *sql.Tx) error {
		o, err := d.lockedObject(ctx, tx, name)
		if err != nil {
			return err
		}
		if err := writerHolds(o, writer); err != nil {
			return err
		}
		before, err := d.ownBytes(ctx, tx, o)
		if err != nil {
			return err
		}
		if _, err := tx.ExecContext(ctx, d.q(`DELETE FROM object_blobs WHERE name = ?`), name); err != nil {
			return err
		}
		for _, b := range blobs {
			if _, err := tx.ExecContext(ctx, d.q(`INSERT INTO object_blobs (name, digest, bytes) VALUES (?, ?, ?)`), name, b.Digest, b.Bytes); err != nil {
				return err
			}
		}
		if _, err := tx.ExecContext(ctx, d.q(`UPDATE objects SET bytes = ? WHERE name = ?`), total, name); err != nil {
			return err
		}
		after, err := d.ownBytes(ctx, tx, o)
		if err != nil {
			return err
		}
		change = after - before
		return d.chargeBytesIn(ctx, tx, o, change)
	})
	if err != nil {
		return 0, d.fail("set the blobs of object "+name, err)
	}
	return change, nil
}

func (d *sqlDB) Object(ctx context.Context, name string) (Object, error) {
	var o Object
	err := d.retry(ctx, true, func(ctx context.Context) error {
		var err error
		o, err = d.objectIn(ctx, d.db, name)
		return err
	})
	if err != nil {
		return Object{}, d.fail("read object "+name, err)
	}
	return o, nil
}

func (d *sqlDB) ListObjects(ctx context.Context) ([]Object, error) {
	var out []Object
	err := d.retry(ctx, true, func(ctx context.Context) error {
		out = nil
		rows, err := d.db.QueryContext(ctx, d.q(`SELECT `+objectCols+` FROM objects ORDER BY name`))
		if err != nil {
			return err
		}
		defer rows.Close()
		byName := map[string]int{}
		for rows.Next() {
			o, err := scanObject(rows)
			if err != nil {
				return err
			}
			byName[o.Name] = len(out)
			out = append(out, o)
		}
		if err := rows.Err(); err != nil {
			return err
		}
		shares, err := d.db.QueryContext(ctx, `SELECT name, project FROM object_shares ORDER BY name, project`)
		if err != nil {
			return err
		}
		defer shares.Close()
		for shares.Next() {
			var name, p string
			if err := shares.Scan(&name, &p); err != nil {
				return err
			}
			if i, ok := byName[name]; ok {
				out[i].SharedWith = append(out[i].SharedWith, p)
			}
		}
		return shares.Err()
	})
	if err != nil {
		return nil, d.fail("list objects", err)
	}
	return out, nil
}

func (d *sqlDB) DeleteObject(ctx context.Context, name string) (Object, int64, error) {
	var o Object
	var release int64
	err := d.inTx(ctx, func(tx *sql.Tx) error {
		var err error
		if o, err = d.lockedObject(ctx, tx, name); err != nil {
			return err
		}
		if release, err = d.ownBytes(ctx, tx, o); err != nil {
			return err
		}
		return d.deleteObjectIn(ctx, tx, o)
	})
	if err != nil {
		return Object{}, 0, d.fail("delete object "+name, err)
	}
	return o, release, nil
}

// deleteObjectIn removes o's record, blobs and shares in tx, o's project's
// row locked (lockedObject), and gives its project back the bytes of its
// blobs no other object of the project holds.
func (d *sqlDB) deleteObjectIn(ctx context.Context, tx *sql.Tx, o Object) error {
	release, err := d.ownBytes(ctx, tx, o)
	if err != nil {
		return err
	}
	if err := d.chargeBytesIn(ctx, tx, o, -release); err != nil {
		return err
	}
	for _, table := range []string{"object_blobs", "object_shares", "objects"} {
		if _, err := tx.ExecContext(ctx, d.q(`DELETE FROM `+table+` WHERE name = ?`), o.Name); err != nil {
			return err
		}
	}
	return nil
}

func (d *sqlDB) ShareObject(ctx context.Context, name, project string) error {
	p, err := iam.CleanPath(project)
	if err != nil {
		return err
	}
	err = d.inTx(ctx, func(tx *sql.Tx) error {
		if _, err := d.objectIn(ctx, tx, name); err != nil {
			return err
		}
		if _, err := d.projectIn(ctx, tx, p, ""); err != nil {
			return err
		}
		_, err := tx.ExecContext(ctx, d.q(`INSERT INTO object_shares (name, project, created{ms}) VALUES (?, ?, ?)
			ON CONFLICT (name, project) DO NOTHING`), name, p, d.ts(time.Now()))
		return err
	})
	if err != nil {
		return d.fail(fmt.Sprintf("share %s with project %s", name, iam.Display(p)), err)
	}
	return nil
}

func (d *sqlDB) UnshareObject(ctx context.Context, name, project string) error {
	p, err := iam.CleanPath(project)
	if err != nil {
		return err
	}
	err = d.retry(ctx, true, func(ctx context.Context) error {
		_, err := d.db.ExecContext(ctx, d.q(`DELETE FROM object_shares WHERE name = ? AND project = ?`), name, p)
		return err
	})
	if err != nil {
		return d.fail(fmt.Sprintf("unshare %s with project %s", name, iam.Display(p)), err)
	}
	return nil
}

// objectResources are the resources objects' bytes are charged to.
var objectResources = []Resource{LayerBytes, SnapshotBytes}

// projectObjectsIn lists the objects of the project at path (their names
// and kinds), by name.
func (d *sqlDB) projectObjectsIn(ctx context.Context, tx *sql.Tx, path string) ([]Object, error) {
	rows, err := tx.QueryContext(ctx, d.q(`SELECT name, kind FROM objects WHERE project = ? ORDER BY name`), path)
	if err != nil {
		return nil, err
	}
	defer rows.Close()
	var out []Object
	for rows.Next() {
		o := Object{Project: path}
		if err := rows.Scan(&o.Name, &o.Kind); err != nil {
			return nil, err
		}
		out = append(out, o)
	}
	return out, rows.Err()
}

// maxNamed is how many objects of a kind a refusal names.
const maxNamed = 5

// describeObjects says what objects a project owns, by kind: "2 layers
// (env:1, env:2), 1 snapshot (snap:a)".
func describeObjects(objects []Object) string {
	var parts []string
	for _, kind := range []string{ObjectLayer, ObjectImage, ObjectSnapshot, ObjectPool} {
		var names []string
		for _, o := range objects {
			if o.Kind == kind {
				names = append(names, o.Name)
			}
		}
		if len(names) == 0 {
			continue
		}
		shown := names[:min(len(names), maxNamed)]
		list := strings.Join(shown, ", ")
		if more := len(names) - len(shown); more > 0 {
			list += fmt.Sprintf(" and %d more", more)
		}
		parts = append(parts, fmt.Sprintf("%s (%s)", plural(int64(len(names)), kind), list))
	}
	return strings.Join(parts, ", ")
}

// objectsToParentIn hands the objects of the project at path to parent.
// The parent's use already counts their bytes (a charge counts on every
// ancestor); a blob the parent's own objects hold too is given back from
// the parent and above, so the parent pays for it once. The quota rows
// of path and its ancestors must be locked.
func (d *sqlDB) objectsToParentIn(ctx context.Context, tx *sql.Tx, path, parent string) error {
	for _, r := range objectResources {
		kind := ObjectLayer
		if r == SnapshotBytes {
			kind = ObjectSnapshot
		}
		kinds := kindsCharged(kind)
		var twice int64
		err := tx.QueryRowContext(ctx, d.q(`SELECT COALESCE(SUM(t.bytes), 0) FROM (
			SELECT DISTINCT b.digest, b.bytes FROM object_blobs b JOIN objects o ON o.name = b.name
			WHERE o.project = ? AND o.kind IN (`+placeholders(len(kinds))+`) AND EXISTS (
				SELECT 1 FROM object_blobs b2 JOIN objects o2 ON o2.name = b2.name
				WHERE b2.digest = b.digest AND o2.project = ? AND o2.kind IN (`+placeholders(len(kinds))+`))) t`),
			append(append(append([]any{path}, kinds...), parent), kinds...)...).Scan(&twice)
		if err != nil {
			return err
		}
		if twice == 0 {
			continue
		}
		anc := iam.Ancestors(parent)
		if _, err := tx.ExecContext(ctx, d.q(`UPDATE quotas SET used = CASE WHEN used > ? THEN used - ? ELSE 0 END
			WHERE resource = ? AND project_id IN (SELECT id FROM projects WHERE path IN (`+placeholders(len(anc))+`))`),
			append([]any{twice, twice, string(r)}, anys(anc)...)...); err != nil {
			return err
		}
	}
	_, err := tx.ExecContext(ctx, d.q(`UPDATE objects SET project = ? WHERE project = ?`), parent, path)
	return err
}

func (d *sqlDB) LapsedObjects(ctx context.Context, before time.Time) ([]Object, error) {
	var out []Object
	err := d.retry(ctx, true, func(ctx context.Context) error {
		out = nil
		rows, err := d.db.QueryContext(ctx, d.q(`SELECT `+objectCols+` FROM objects o
			WHERE kind IN (?, ?, ?) AND writer <> '' AND writer_until{ms} < ?
			AND NOT EXISTS (SELECT 1 FROM object_blobs b WHERE b.name = o.name) ORDER BY name`),
			ObjectLayer, ObjectImage, ObjectSnapshot, d.ts(before))
		if err != nil {
			return err
		}
		defer rows.Close()
		for rows.Next() {
			o, err := scanObject(rows)
			if err != nil {
				return err
			}
			out = append(out, o)
		}
		return rows.Err()
	})
	if err != nil {
		return nil, d.fail(fmt.Sprintf("list the records whose claim lapsed before %s", before.UTC().Format(time.RFC3339)), err)
	}
	return out, nil
}

func (d *sqlDB) SweepObject(ctx context.Context, name string, before time.Time) (bool, error) {
	swept := false
	err := d.inTx(ctx, func(tx *sql.Tx) error {
		swept = false
		o, err := d.lockedObject(ctx, tx, name)
		if errors.Is(err, errdefs.ErrNotFound) {
			return nil
		}
		if err != nil {
			return err
		}
		if !o.lapsed(before) {
			return nil
		}
		swept = true
		return d.deleteObjectIn(ctx, tx, o)
	})
	if err != nil {
		return false, d.fail("sweep object "+name, err)
	}
	return swept, nil
}

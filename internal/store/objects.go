package store

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
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
	// Bytes is what is charged for it to Project's layer_bytes or
	// snapshot_bytes.
	Bytes int64
	// SharedWith are the paths of the projects it is shared with
	// (read-only), sorted.
	SharedWith []string
	Created    time.Time
}

// Objects records which project each layer, image, snapshot and warm pool
// belongs to, and whom it is shared with; the apiserver decides with it
// who sees, uses and removes them.
type Objects interface {
	// ClaimObject records o (Name, Kind, Project) when no object has its
	// name and returns it with claimed true; otherwise it returns the
	// object recorded, unchanged, with claimed false. Of concurrent
	// claims of one name exactly one is claimed.
	ClaimObject(ctx context.Context, o Object) (got Object, claimed bool, err error)
	// SetObjectBytes sets the bytes charged for name and returns what it
	// held before; errdefs.ErrNotFound for an unknown name.
	SetObjectBytes(ctx context.Context, name string, bytes int64) (old int64, err error)
	// Object returns the object called name, with its shares, or
	// errdefs.ErrNotFound.
	Object(ctx context.Context, name string) (Object, error)
	// ListObjects lists every object with its shares, by name.
	ListObjects(ctx context.Context) ([]Object, error)
	// DeleteObject forgets name and its shares and returns what it was;
	// errdefs.ErrNotFound for an unknown name.
	DeleteObject(ctx context.Context, name string) (Object, error)
	// ShareObject lets project (a path) and what lies under it read name;
	// sharing again is a no-op. errdefs.ErrNotFound for an unknown name or
	// project.
	ShareObject(ctx context.Context, name, project string) error
	// UnshareObject takes a share away; one that is not there is a no-op.
	UnshareObject(ctx context.Context, name, project string) error
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

const objectCols = `name, kind, project, bytes, created{ms}`

func scanObject(row interface{ Scan(...any) error }) (Object, error) {
	var o Object
	err := row.Scan(&o.Name, &o.Kind, &o.Project, &o.Bytes, timeCol{&o.Created})
	return o, err
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
	return o, rows.Err()
}

func (d *sqlDB) ClaimObject(ctx context.Context, o Object) (Object, bool, error) {
	if err := checkObject(o); err != nil {
		return Object{}, false, err
	}
	p, err := iam.CleanPath(o.Project)
	if err != nil {
		return Object{}, false, err
	}
	o.Project, o.Bytes, o.SharedWith = p, 0, nil
	if o.Created.IsZero() {
		o.Created = time.Now()
	}
	o.Created = ms(o.Created)
	var got Object
	claimed := false
	err = d.inTx(ctx, func(tx *sql.Tx) error {
		res, err := tx.ExecContext(ctx, d.q(`INSERT INTO objects (name, kind, project, bytes, created{ms}) VALUES (?, ?, ?, 0, ?)
			ON CONFLICT (name) DO NOTHING`), o.Name, o.Kind, o.Project, d.ts(o.Created))
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

func (d *sqlDB) SetObjectBytes(ctx context.Context, name string, bytes int64) (int64, error) {
	if bytes < 0 {
		return 0, fmt.Errorf("object %s: %d bytes: %w", name, bytes, errdefs.ErrInvalidArgument)
	}
	var old int64
	err := d.inTx(ctx, func(tx *sql.Tx) error {
		err := tx.QueryRowContext(ctx, d.q(`SELECT bytes FROM objects WHERE name = ?{lock}`), name).Scan(&old)
		if errors.Is(err, sql.ErrNoRows) {
			return fmt.Errorf("object %s: %w", name, errdefs.ErrNotFound)
		}
		if err != nil {
			return err
		}
		_, err = tx.ExecContext(ctx, d.q(`UPDATE objects SET bytes = ? WHERE name = ?`), bytes, name)
		return err
	})
	if err != nil {
		return 0, d.fail("set the bytes of object "+name, err)
	}
	return old, nil
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

func (d *sqlDB) DeleteObject(ctx context.Context, name string) (Object, error) {
	var o Object
	err := d.inTx(ctx, func(tx *sql.Tx) error {
		var err error
		if o, err = d.objectIn(ctx, tx, name); err != nil {
			return err
		}
		if _, err := tx.ExecContext(ctx, d.q(`DELETE FROM object_shares WHERE name = ?`), name); err != nil {
			return err
		}
		_, err = tx.ExecContext(ctx, d.q(`DELETE FROM objects WHERE name = ?`), name)
		return err
	})
	if err != nil {
		return Object{}, d.fail("delete object "+name, err)
	}
	return o, nil
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

package store

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"slices"
	"strconv"
	"strings"
	"time"

	"dsec.dev/dsec/internal/errdefs"
	"dsec.dev/dsec/internal/iam"
)

// sqlDB runs the IAM part of the store (projects, principals, role
// bindings, tokens, quotas, audit) on database/sql, for both dialects: the
// rules are the same, and the SQL differs only in placeholders, time
// columns and row locks, which q rewrites. (The older parts of the store
// are written twice, once per driver; these are written once so the rules
// cannot drift between SQLite and PostgreSQL.)
type sqlDB struct {
	db      *sql.DB
	dialect string
	// retry runs op again when the database undid it whole (PostgreSQL's
	// serialization failures and deadlocks, a connection that could not be
	// made); idempotent ops also after a connection lost midway.
	retry func(ctx context.Context, idempotent bool, op func(ctx context.Context) error) error
	// kind adds the errdefs kind a driver error stands for.
	kind func(error) error
}

// q rewrites a statement written for both dialects: "?" placeholders, "{ms}"
// after the name of a time column (created{ms}: created in PostgreSQL, a
// timestamptz; created_ms in SQLite, Unix milliseconds), "{lock}" and
// "{lockq}" and "{share}" for row locks (SQLite's writers hold the whole
// file: it needs none).
func (d *sqlDB) q(s string) string {
	if d.dialect == dialectSQLite {
		s = strings.ReplaceAll(s, "{ms}", "_ms")
		s = strings.ReplaceAll(s, "{lockq}", "")
		s = strings.ReplaceAll(s, "{lock}", "")
		return strings.ReplaceAll(s, "{share}", "")
	}
	s = strings.ReplaceAll(s, "{ms}", "")
	s = strings.ReplaceAll(s, "{lockq}", " FOR UPDATE OF q")
	s = strings.ReplaceAll(s, "{lock}", " FOR UPDATE")
	s = strings.ReplaceAll(s, "{share}", " FOR SHARE OF t")
	var b strings.Builder
	n := 0
	for _, c := range s {
		if c == '?' {
			n++
			b.WriteString("$" + strconv.Itoa(n))
			continue
		}
		b.WriteRune(c)
	}
	return b.String()
}

// ts is t as an argument for a time column; the zero time is NULL.
func (d *sqlDB) ts(t time.Time) any {
	if t.IsZero() {
		return nil
	}
	if d.dialect == dialectSQLite {
		return t.UnixMilli()
	}
	return ms(t)
}

// timeCol scans a time column of either dialect; NULL is the zero time.
type timeCol struct{ t *time.Time }

func (c timeCol) Scan(src any) error {
	switch v := src.(type) {
	case nil:
		*c.t = time.Time{}
	case time.Time:
		*c.t = ms(v)
	case int64:
		*c.t = time.UnixMilli(v)
	default:
		return fmt.Errorf("scan time column: unexpected %T", src)
	}
	return nil
}

type querier interface {
	QueryContext(ctx context.Context, query string, args ...any) (*sql.Rows, error)
	QueryRowContext(ctx context.Context, query string, args ...any) *sql.Row
	ExecContext(ctx context.Context, query string, args ...any) (sql.Result, error)
}

// inTx runs fn in a transaction and commits it if fn returns nil, trying
// again as d.retry allows (a transaction rolled back whole is safe to run
// again).
func (d *sqlDB) inTx(ctx context.Context, fn func(tx *sql.Tx) error) error {
	return d.retry(ctx, false, func(ctx context.Context) error {
		tx, err := d.db.BeginTx(ctx, nil)
		if err != nil {
			return err
		}
		if err := fn(tx); err != nil {
			tx.Rollback()
			return err
		}
		return tx.Commit()
	})
}

// fail wraps err for the caller: what was being done, and the kind.
func (d *sqlDB) fail(what string, err error) error {
	return wrap(what, d.kind(err))
}

// wrap is fmt.Errorf("what: %w", err), but a quota's refusal is returned
// as it is: it says everything itself (project, resource, limit and use:
// "quota of project ml: 64 of 64 sandboxes in use", quota.go), and it is
// what a caller shows its user.
func wrap(what string, err error) error {
	if errors.Is(err, errdefs.ErrResourceExhausted) {
		return err
	}
	return fmt.Errorf("%s: %w", what, err)
}

func (d *sqlDB) unique(err error) bool {
	if d.dialect == dialectSQLite {
		return sqliteUnique(err)
	}
	return pgUnique(err)
}

func placeholders(n int) string {
	return strings.TrimSuffix(strings.Repeat("?, ", n), ", ")
}

func anys[T any](l []T) []any {
	out := make([]any, len(l))
	for i, v := range l {
		out[i] = v
	}
	return out
}

// bumpGeneration records that authority was taken away, so caches of
// authentications drop what they hold.
func bumpGeneration(ctx context.Context, tx *sql.Tx) error {
	_, err := tx.ExecContext(ctx, `UPDATE iam_generation SET generation = generation + 1 WHERE id = 1`)
	return err
}

func (d *sqlDB) Generation(ctx context.Context) (int64, error) {
	var g int64
	err := d.retry(ctx, true, func(ctx context.Context) error {
		return d.db.QueryRowContext(ctx, `SELECT generation FROM iam_generation WHERE id = 1`).Scan(&g)
	})
	if err != nil {
		return 0, d.fail("read the authority generation", err)
	}
	return g, nil
}

// --- projects

const projectCols = `id, coalesce(parent_id, ''), name, path, depth, created{ms}`

func scanProject(row interface{ Scan(...any) error }) (Project, error) {
	var p Project
	err := row.Scan(&p.ID, &p.Parent, &p.Name, &p.Path, &p.Depth, timeCol{&p.Created})
	return p, err
}

// projectIn reads the project at path in q; errdefs.ErrNotFound when there
// is none.
func (d *sqlDB) projectIn(ctx context.Context, q querier, path, lock string) (Project, error) {
	p, err := scanProject(q.QueryRowContext(ctx, d.q(`SELECT `+projectCols+` FROM projects WHERE path = ?`+lock), path))
	if errors.Is(err, sql.ErrNoRows) {
		return Project{}, fmt.Errorf("project %s does not exist: %w", iam.Display(path), errdefs.ErrNotFound)
	}
	return p, err
}

func (d *sqlDB) CreateProject(ctx context.Context, actor iam.Authority, path string) (Project, error) {
	path, err := iam.CleanPath(path)
	if err != nil {
		return Project{}, err
	}
	what := "create project " + iam.Display(path)
	parentPath, ok := iam.Parent(path)
	if !ok {
		return Project{}, fmt.Errorf("%s: the root project always exists: %w", what, errdefs.ErrAlreadyExists)
	}
	var p Project
	err = d.inTx(ctx, func(tx *sql.Tx) error {
		a, err := d.actorIn(ctx, tx, actor)
		if err != nil {
			return err
		}
		if err := iam.Allow(a, iam.OpCreateProject, parentPath); err != nil {
			return err
		}
		parent, err := d.projectIn(ctx, tx, parentPath, "")
		if err != nil {
			return err
		}
		p = Project{ID: newID("prj-"), Parent: parent.ID, Name: path[strings.LastIndexByte(path, '/')+1:],
			Path: path, Depth: parent.Depth + 1, Created: ms(time.Now())}
		_, err = tx.ExecContext(ctx, d.q(`INSERT INTO projects (id, parent_id, name, path, depth, created{ms}) VALUES (?, ?, ?, ?, ?, ?)`),
			p.ID, p.Parent, p.Name, p.Path, p.Depth, d.ts(p.Created))
		if d.unique(err) {
			return fmt.Errorf("the project exists: %w", errdefs.ErrAlreadyExists)
		}
		if err != nil {
			return err
		}
		for _, r := range Resources {
			if _, err := tx.ExecContext(ctx, d.q(`INSERT INTO quotas (project_id, resource, refilled{ms}) VALUES (?, ?, ?)`),
				p.ID, string(r), d.ts(p.Created)); err != nil {
				return err
			}
		}
		return nil
	})
	if err != nil {
		return Project{}, d.fail(what, err)
	}
	return p, nil
}

func (d *sqlDB) Project(ctx context.Context, path string) (Project, error) {
	path, err := iam.CleanPath(path)
	if err != nil {
		return Project{}, err
	}
	var p Project
	err = d.retry(ctx, true, func(ctx context.Context) error {
		var err error
		p, err = d.projectIn(ctx, d.db, path, "")
		return err
	})
	if err != nil {
		return Project{}, d.fail("read project "+iam.Display(path), err)
	}
	return p, nil
}

func (d *sqlDB) ProjectByID(ctx context.Context, id string) (Project, error) {
	var p Project
	err := d.retry(ctx, true, func(ctx context.Context) error {
		var err error
		p, err = scanProject(d.db.QueryRowContext(ctx, d.q(`SELECT `+projectCols+` FROM projects WHERE id = ?`), id))
		return err
	})
	if errors.Is(err, sql.ErrNoRows) {
		return Project{}, fmt.Errorf("project %s does not exist: %w", id, errdefs.ErrNotFound)
	}
	if err != nil {
		return Project{}, d.fail("read project "+id, err)
	}
	return p, nil
}

// subtreeCond is an SQL condition (and its arguments) selecting the paths
// strictly under path in column col.
func subtreeCond(col, path string) (string, []any) {
	if path == "" {
		return col + ` <> ''`, nil
	}
	return `substr(` + col + `, 1, ?) = ?`, []any{len(path) + 1, path + "/"}
}

func (d *sqlDB) ListProjects(ctx context.Context, path string, subtree bool) ([]Project, error) {
	path, err := iam.CleanPath(path)
	if err != nil {
		return nil, err
	}
	what := "list projects under " + iam.Display(path)
	var out []Project
	err = d.retry(ctx, true, func(ctx context.Context) error {
		out = nil
		p, err := d.projectIn(ctx, d.db, path, "")
		if err != nil {
			return err
		}
		cond, args := `parent_id = ?`, []any{p.ID}
		if subtree {
			cond, args = subtreeCond("path", path)
		}
		rows, err := d.db.QueryContext(ctx, d.q(`SELECT `+projectCols+` FROM projects WHERE `+cond+` ORDER BY path`), args...)
		if err != nil {
			return err
		}
		defer rows.Close()
		for rows.Next() {
			p, err := scanProject(rows)
			if err != nil {
				return err
			}
			out = append(out, p)
		}
		return rows.Err()
	})
	if err != nil {
		return nil, d.fail(what, err)
	}
	return out, nil
}

func (d *sqlDB) DeleteProject(ctx context.Context, actor iam.Authority, path string, opts DeleteProjectOptions) error {
	path, err := iam.CleanPath(path)
	if err != nil {
		return err
	}
	what := "delete project " + iam.Display(path)
	parentPath, ok := iam.Parent(path)
	if !ok {
		return fmt.Errorf("%s: the root project cannot be deleted: %w", what, errdefs.ErrFailedPrecondition)
	}
	err = d.inTx(ctx, func(tx *sql.Tx) error {
		a, err := d.actorIn(ctx, tx, actor)
		if err != nil {
			return err
		}
		if err := iam.Allow(a, iam.OpDeleteProject, parentPath); err != nil {
			return err
		}
		p, err := d.projectIn(ctx, tx, path, "{lock}")
		if err != nil {
			return err
		}
		var inUse []string
		var children int
		if err := tx.QueryRowContext(ctx, d.q(`SELECT count(*) FROM projects WHERE parent_id = ?`), p.ID).Scan(&children); err != nil {
			return err
		}
		if children > 0 {
			inUse = append(inUse, plural(int64(children), "child project"))
		}
		var principals int
		if err := tx.QueryRowContext(ctx, d.q(`SELECT count(*) FROM principals WHERE project_id = ?`), p.ID).Scan(&principals); err != nil {
			return err
		}
		if principals > 0 {
			inUse = append(inUse, plural(int64(principals), "principal"))
		}
		objects, err := d.projectObjectsIn(ctx, tx, path)
		if err != nil {
			return err
		}
		if len(objects) > 0 && opts.ObjectsToParent && parentPath == "" {
			return fmt.Errorf("its parent is the root, whose layers, images and snapshots every project sees: remove its %s first: %w",
				describeObjects(objects), errdefs.ErrFailedPrecondition)
		}
		if len(objects) > 0 && !opts.ObjectsToParent {
			inUse = append(inUse, describeObjects(objects))
		}
		if opts.ObjectsToParent {
			// The parent's and its ancestors' rows first, from the root
			// down, as every charge locks them.
			if _, err := d.ancestorsLocked(ctx, tx, path, objectResources); err != nil {
				return err
			}
		}
		// Locked, so no charge lands between this look and the delete.
		rows, err := tx.QueryContext(ctx, d.q(`SELECT resource, used FROM quotas q WHERE project_id = ? ORDER BY resource{lockq}`), p.ID)
		if err != nil {
			return err
		}
		use := map[Resource]int64{}
		for rows.Next() {
			var r string
			var n int64
			if err := rows.Scan(&r, &n); err != nil {
				rows.Close()
				return err
			}
			use[Resource(r)] = n
		}
		rows.Close()
		if err := rows.Err(); err != nil {
			return err
		}
		for _, r := range Resources {
			if opts.ObjectsToParent && slices.Contains(objectResources, r) {
				continue // handed to the parent with the objects
			}
			if use[r] > 0 && r != CreatesPerSecond {
				inUse = append(inUse, r.amount(use[r]))
			}
		}
		if len(inUse) > 0 {
			return fmt.Errorf("the project is in use: %s: %w", strings.Join(inUse, ", "), errdefs.ErrFailedPrecondition)
		}
		if len(objects) > 0 {
			if err := d.objectsToParentIn(ctx, tx, path, parentPath); err != nil {
				return err
			}
		}
		if _, err := tx.ExecContext(ctx, d.q(`DELETE FROM object_shares WHERE project = ?`), path); err != nil {
			return err
		}
		// Its bindings, tokens and quota rows go with it.
		if _, err := tx.ExecContext(ctx, d.q(`DELETE FROM projects WHERE id = ?`), p.ID); err != nil {
			return err
		}
		return bumpGeneration(ctx, tx)
	})
	if err != nil {
		return d.fail(what, err)
	}
	return nil
}

func plural(n int64, what string) string {
	if n == 1 {
		return "1 " + what
	}
	return fmt.Sprintf("%d %ss", n, what)
}

// --- principals and role bindings

func (d *sqlDB) CreatePrincipal(ctx context.Context, actor iam.Authority, spec PrincipalSpec) (Principal, error) {
	what := fmt.Sprintf("create principal %q", spec.Name)
	if err := checkPrincipalName(spec.Name); err != nil {
		return Principal{}, err
	}
	if spec.Kind == "" {
		spec.Kind = KindUser
	}
	if spec.Kind != KindUser && spec.Kind != KindService {
		return Principal{}, fmt.Errorf("%s: kind %q: want %s or %s: %w", what, spec.Kind, KindUser, KindService, errdefs.ErrInvalidArgument)
	}
	path, err := iam.CleanPath(spec.Project)
	if err != nil {
		return Principal{}, err
	}
	p := Principal{ID: newID("prn-"), Name: spec.Name, Kind: spec.Kind, Project: path, Created: ms(time.Now())}
	err = d.inTx(ctx, func(tx *sql.Tx) error {
		a, err := d.actorIn(ctx, tx, actor)
		if err != nil {
			return err
		}
		if err := iam.Allow(a, iam.OpCreatePrincipal, path); err != nil {
			return err
		}
		proj, err := d.projectIn(ctx, tx, path, "")
		if err != nil {
			return err
		}
		_, err = tx.ExecContext(ctx, d.q(`INSERT INTO principals (id, project_id, name, kind, created{ms}) VALUES (?, ?, ?, ?, ?)`),
			p.ID, proj.ID, p.Name, p.Kind, d.ts(p.Created))
		if d.unique(err) {
			return fmt.Errorf("the name is taken: %w", errdefs.ErrAlreadyExists)
		}
		return err
	})
	if err != nil {
		return Principal{}, d.fail(what, err)
	}
	return p, nil
}

func (d *sqlDB) DeletePrincipal(ctx context.Context, actor iam.Authority, name string) error {
	err := d.inTx(ctx, func(tx *sql.Tx) error {
		a, err := d.actorIn(ctx, tx, actor)
		if err != nil {
			return err
		}
		p, err := d.principalIn(ctx, tx, name)
		if err != nil {
			return err
		}
		if err := iam.Allow(a, iam.OpDeletePrincipal, p.Project); err != nil {
			return err
		}
		// Its bindings and tokens go with it, and the tokens minted from
		// those (foreign keys, on delete cascade).
		if _, err := tx.ExecContext(ctx, d.q(`DELETE FROM principals WHERE id = ?`), p.ID); err != nil {
			return err
		}
		return bumpGeneration(ctx, tx)
	})
	if err != nil {
		return d.fail(fmt.Sprintf("delete principal %q", name), err)
	}
	return nil
}

const principalCols = `p.id, p.name, p.kind, j.path, p.created{ms}`

func scanPrincipal(row interface{ Scan(...any) error }) (Principal, error) {
	var p Principal
	err := row.Scan(&p.ID, &p.Name, &p.Kind, &p.Project, timeCol{&p.Created})
	return p, err
}

func (d *sqlDB) principalIn(ctx context.Context, q querier, name string) (Principal, error) {
	p, err := scanPrincipal(q.QueryRowContext(ctx, d.q(`SELECT `+principalCols+`
		FROM principals p JOIN projects j ON j.id = p.project_id WHERE p.name = ?`), name))
	if errors.Is(err, sql.ErrNoRows) {
		return Principal{}, fmt.Errorf("principal %q does not exist: %w", name, errdefs.ErrNotFound)
	}
	return p, err
}

func (d *sqlDB) Principal(ctx context.Context, name string) (Principal, error) {
	var p Principal
	err := d.retry(ctx, true, func(ctx context.Context) error {
		var err error
		p, err = d.principalIn(ctx, d.db, name)
		return err
	})
	if err != nil {
		return Principal{}, d.fail(fmt.Sprintf("read principal %q", name), err)
	}
	return p, nil
}

func (d *sqlDB) ListPrincipals(ctx context.Context) ([]Principal, error) {
	var out []Principal
	err := d.retry(ctx, true, func(ctx context.Context) error {
		out = nil
		rows, err := d.db.QueryContext(ctx, d.q(`SELECT `+principalCols+`
			FROM principals p JOIN projects j ON j.id = p.project_id ORDER BY p.name`))
		if err != nil {
			return err
		}
		defer rows.Close()
		for rows.Next() {
			p, err := scanPrincipal(rows)
			if err != nil {
				return err
			}
			out = append(out, p)
		}
		return rows.Err()
	})
	if err != nil {
		return nil, d.fail("list principals", err)
	}
	return out, nil
}

// bindingsIn reads the role bindings of the principal with ID id.
func (d *sqlDB) bindingsIn(ctx context.Context, q querier, id string) ([]iam.Binding, error) {
	rows, err := q.QueryContext(ctx, d.q(`SELECT j.path, b.role FROM role_bindings b JOIN projects j ON j.id = b.project_id
		WHERE b.principal_id = ? ORDER BY j.path`), id)
	if err != nil {
		return nil, err
	}
	defer rows.Close()
	var out []iam.Binding
	for rows.Next() {
		var b iam.Binding
		var role string
		if err := rows.Scan(&b.Project, &role); err != nil {
			return nil, err
		}
		if b.Role, err = iam.ParseRole(role); err != nil {
			return nil, err
		}
		out = append(out, b)
	}
	return out, rows.Err()
}

func (d *sqlDB) Bindings(ctx context.Context, principal string) ([]iam.Binding, error) {
	var out []iam.Binding
	err := d.retry(ctx, true, func(ctx context.Context) error {
		p, err := d.principalIn(ctx, d.db, principal)
		if err != nil {
			return err
		}
		out, err = d.bindingsIn(ctx, d.db, p.ID)
		return err
	})
	if err != nil {
		return nil, d.fail(fmt.Sprintf("list role bindings of %q", principal), err)
	}
	return out, nil
}

func (d *sqlDB) Grant(ctx context.Context, actor iam.Authority, principal, project string, role iam.Role) error {
	path, err := iam.CleanPath(project)
	if err != nil {
		return err
	}
	what := fmt.Sprintf("grant %s on %s to %q", role, iam.Display(path), principal)
	err = d.inTx(ctx, func(tx *sql.Tx) error {
		a, err := d.actorIn(ctx, tx, actor)
		if err != nil {
			return err
		}
		if err := iam.CheckGrant(a, path, role); err != nil {
			return err
		}
		p, err := d.principalIn(ctx, tx, principal)
		if err != nil {
			return err
		}
		proj, err := d.projectIn(ctx, tx, path, "")
		if err != nil {
			return err
		}
		var old string
		err = tx.QueryRowContext(ctx, d.q(`SELECT role FROM role_bindings WHERE principal_id = ? AND project_id = ?`), p.ID, proj.ID).Scan(&old)
		switch {
		case errors.Is(err, sql.ErrNoRows):
			_, err = tx.ExecContext(ctx, d.q(`INSERT INTO role_bindings (principal_id, project_id, role, created{ms}) VALUES (?, ?, ?, ?)`),
				p.ID, proj.ID, role.String(), d.ts(time.Now()))
			return err
		case err != nil:
			return err
		case old == role.String():
			return nil
		}
		// Replacing a binding may lower it: cached authorities must go.
		oldRole, err := iam.ParseRole(old)
		if err != nil {
			return err
		}
		if err := iam.CheckGrant(a, path, oldRole); err != nil {
			return fmt.Errorf("replace its %s binding: %w", old, err)
		}
		if _, err := tx.ExecContext(ctx, d.q(`UPDATE role_bindings SET role = ? WHERE principal_id = ? AND project_id = ?`),
			role.String(), p.ID, proj.ID); err != nil {
			return err
		}
		return bumpGeneration(ctx, tx)
	})
	if err != nil {
		return d.fail(what, err)
	}
	return nil
}

func (d *sqlDB) Ungrant(ctx context.Context, actor iam.Authority, principal, project string) error {
	path, err := iam.CleanPath(project)
	if err != nil {
		return err
	}
	what := fmt.Sprintf("remove the role of %q on %s", principal, iam.Display(path))
	err = d.inTx(ctx, func(tx *sql.Tx) error {
		a, err := d.actorIn(ctx, tx, actor)
		if err != nil {
			return err
		}
		p, err := d.principalIn(ctx, tx, principal)
		if err != nil {
			return err
		}
		proj, err := d.projectIn(ctx, tx, path, "")
		if err != nil {
			return err
		}
		var old string
		err = tx.QueryRowContext(ctx, d.q(`SELECT role FROM role_bindings WHERE principal_id = ? AND project_id = ?`), p.ID, proj.ID).Scan(&old)
		if errors.Is(err, sql.ErrNoRows) {
			return fmt.Errorf("it has no binding there: %w", errdefs.ErrNotFound)
		}
		if err != nil {
			return err
		}
		// Removing a role takes as much authority as granting it.
		oldRole, err := iam.ParseRole(old)
		if err != nil {
			return err
		}
		if err := iam.CheckGrant(a, path, oldRole); err != nil {
			return err
		}
		if _, err := tx.ExecContext(ctx, d.q(`DELETE FROM role_bindings WHERE principal_id = ? AND project_id = ?`), p.ID, proj.ID); err != nil {
			return err
		}
		return bumpGeneration(ctx, tx)
	})
	if err != nil {
		return d.fail(what, err)
	}
	return nil
}

// --- tokens

// authoritySQL reads a token with its principal and project; the caller
// appends the condition.
const authoritySQL = `SELECT t.id, t.hash, t.role, t.expires{ms}, t.revoked{ms}, p.id, p.name, j.path
	FROM tokens t JOIN principals p ON p.id = t.principal_id JOIN projects j ON j.id = t.project_id WHERE `

// authorityIn reads the authority of the token matching cond (on its ID or
// hash). lock is "{share}" inside a transaction that relies on the token
// staying unrevoked until it commits (minting from it), else "". The error
// is an *AuthError when the token is not valid now.
func (d *sqlDB) authorityIn(ctx context.Context, q querier, cond string, arg any, lock string) (iam.Authority, error) {
	var a iam.Authority
	var hash []byte
	var role, principalID string
	var revoked time.Time
	err := q.QueryRowContext(ctx, d.q(authoritySQL+cond+lock), arg).
		Scan(&a.TokenID, &hash, &role, timeCol{&a.Expires}, timeCol{&revoked}, &principalID, &a.Principal, &a.Project)
	if errors.Is(err, sql.ErrNoRows) {
		return iam.Authority{}, &AuthError{Reason: AuthUnknown}
	}
	if err != nil {
		return iam.Authority{}, err
	}
	if h, ok := arg.([]byte); ok && !tokenValid(hash, h, time.Time{}, time.Time{}, time.Now()) {
		return iam.Authority{}, &AuthError{Reason: AuthUnknown, TokenID: a.TokenID}
	}
	switch {
	case !revoked.IsZero():
		return iam.Authority{}, &AuthError{Reason: AuthRevoked, TokenID: a.TokenID}
	case !a.Expires.IsZero() && !time.Now().Before(a.Expires):
		return iam.Authority{}, &AuthError{Reason: AuthExpired, TokenID: a.TokenID}
	}
	if a.Role, err = iam.ParseRole(role); err != nil {
		return iam.Authority{}, err
	}
	if a.Bindings, err = d.bindingsIn(ctx, q, principalID); err != nil {
		return iam.Authority{}, err
	}
	return a, nil
}

// actorIn is the actor's authority as the store holds it now, inside tx:
// a token is read again (its bindings may have changed, it may have been
// revoked since the caller authenticated it) and held unrevoked until tx
// ends.
func (d *sqlDB) actorIn(ctx context.Context, tx *sql.Tx, actor iam.Authority) (iam.Authority, error) {
	if actor.Node {
		return actor, nil
	}
	a, err := d.authorityIn(ctx, tx, `t.id = ?`, actor.TokenID, "{share}")
	if err != nil {
		return iam.Authority{}, fmt.Errorf("the acting token %s: %w", actor.TokenID, err)
	}
	return a, nil
}

func (d *sqlDB) Authenticate(ctx context.Context, token string) (iam.Authority, error) {
	if !wellFormedToken(token) {
		return iam.Authority{}, &AuthError{Reason: AuthMalformed}
	}
	hash := hashToken(token)
	var a iam.Authority
	err := d.retry(ctx, true, func(ctx context.Context) error {
		var err error
		a, err = d.authorityIn(ctx, d.db, `t.hash = ?`, hash, "")
		return err
	})
	var ae *AuthError
	if errors.As(err, &ae) {
		return iam.Authority{}, err
	}
	if err != nil {
		return iam.Authority{}, d.fail("authenticate", err)
	}
	return a, nil
}

func (d *sqlDB) MintToken(ctx context.Context, actor iam.Authority, spec TokenSpec) (string, TokenInfo, error) {
	what := fmt.Sprintf("mint token for %q", spec.Principal)
	if spec.TTL < 0 {
		return "", TokenInfo{}, fmt.Errorf("%s: negative ttl %s: %w", what, spec.TTL, errdefs.ErrInvalidArgument)
	}
	path, err := iam.CleanPath(spec.Project)
	if err != nil {
		return "", TokenInfo{}, err
	}
	tok, hash := newToken()
	info := TokenInfo{ID: newID("tok-"), Principal: spec.Principal, Project: path, Role: spec.Role, Created: ms(time.Now())}
	info.Expires = expiresAt(info.Created, spec.TTL)
	err = d.inTx(ctx, func(tx *sql.Tx) error {
		a, err := d.actorIn(ctx, tx, actor)
		if err != nil {
			return err
		}
		p, err := d.principalIn(ctx, tx, spec.Principal)
		if err != nil {
			return err
		}
		proj, err := d.projectIn(ctx, tx, path, "")
		if err != nil {
			return err
		}
		err = iam.CheckMint(a, iam.Mint{Project: path, Role: spec.Role, Expires: info.Expires,
			Principal: p.Name, PrincipalProject: p.Project})
		if err != nil {
			return err
		}
		var parent any
		if !a.Node {
			parent, info.Parent = a.TokenID, a.TokenID
		}
		_, err = tx.ExecContext(ctx, d.q(`INSERT INTO tokens (id, principal_id, hash, created{ms}, expires{ms}, project_id, role, parent_id)
			VALUES (?, ?, ?, ?, ?, ?, ?, ?)`),
			info.ID, p.ID, hash, d.ts(info.Created), d.ts(info.Expires), proj.ID, spec.Role.String(), parent)
		return err
	})
	if err != nil {
		return "", TokenInfo{}, d.fail(what, err)
	}
	return tok, info, nil
}

// revokeTreeSQL revokes every token minted, directly or not, from the
// token ?1 (the parent itself is revoked by its own statement first, which
// holds its row: a mint from it either committed before, and its token is
// found here, or waits and then finds its parent revoked).
const revokeTreeSQL = `WITH RECURSIVE tree (id) AS (
	SELECT id FROM tokens WHERE parent_id = ?
	UNION ALL
	SELECT t.id FROM tokens t JOIN tree ON t.parent_id = tree.id)
UPDATE tokens SET revoked{ms} = ? WHERE revoked{ms} IS NULL AND id IN (SELECT id FROM tree)`

func (d *sqlDB) RevokeToken(ctx context.Context, actor iam.Authority, tokenID string) (int, string, error) {
	what := "revoke token " + tokenID
	n := 0
	var path string
	err := d.inTx(ctx, func(tx *sql.Tx) error {
		n = 0
		a, err := d.actorIn(ctx, tx, actor)
		if err != nil && tokenID != actor.TokenID {
			return err
		}
		var revoked time.Time
		err = tx.QueryRowContext(ctx, d.q(`SELECT j.path, t.revoked{ms} FROM tokens t JOIN projects j ON j.id = t.project_id WHERE t.id = ?`),
			tokenID).Scan(&path, timeCol{&revoked})
		if errors.Is(err, sql.ErrNoRows) {
			return fmt.Errorf("no such token: %w", errdefs.ErrNotFound)
		}
		if err != nil {
			return err
		}
		// A token may always revoke itself (and so what it minted). One of
		// a project the caller holds no role on does not exist for it.
		if tokenID != actor.TokenID {
			if a.On(path) == iam.None {
				return fmt.Errorf("no such token: %w", errdefs.ErrNotFound)
			}
			if err := iam.Allow(a, iam.OpRevokeToken, path); err != nil {
				return err
			}
		}
		now := d.ts(time.Now())
		if _, err := tx.ExecContext(ctx, d.q(`UPDATE tokens SET revoked{ms} = coalesce(revoked{ms}, ?) WHERE id = ?`), now, tokenID); err != nil {
			return err
		}
		if revoked.IsZero() {
			n++
		}
		// Until a pass finds nothing more: in PostgreSQL a pass's snapshot
		// misses a token minted from one of the tree's while the pass
		// waited for that minter's row (the mint held it); the next pass
		// sees it. Once a pass has locked every token of the tree, a mint
		// from any of them waits for this transaction and then finds its
		// minter revoked.
		for {
			res, err := tx.ExecContext(ctx, d.q(revokeTreeSQL), tokenID, now)
			if err != nil {
				return err
			}
			more, _ := res.RowsAffected()
			if more == 0 {
				break
			}
			n += int(more)
		}
		if err := endConsoleSessions(ctx, d, tx); err != nil {
			return err
		}
		return bumpGeneration(ctx, tx)
	})
	if err != nil {
		return 0, "", d.fail(what, err)
	}
	return n, path, nil
}

func (d *sqlDB) ListTokens(ctx context.Context, principal string) ([]TokenInfo, error) {
	var out []TokenInfo
	err := d.retry(ctx, true, func(ctx context.Context) error {
		out = nil
		p, err := d.principalIn(ctx, d.db, principal)
		if err != nil {
			return err
		}
		rows, err := d.db.QueryContext(ctx, d.q(`SELECT t.id, j.path, t.role, coalesce(t.parent_id, ''), t.created{ms}, t.expires{ms}, t.revoked{ms}
			FROM tokens t JOIN projects j ON j.id = t.project_id WHERE t.principal_id = ? ORDER BY t.created{ms}, t.id`), p.ID)
		if err != nil {
			return err
		}
		defer rows.Close()
		for rows.Next() {
			info := TokenInfo{Principal: principal}
			var role string
			if err := rows.Scan(&info.ID, &info.Project, &role, &info.Parent,
				timeCol{&info.Created}, timeCol{&info.Expires}, timeCol{&info.Revoked}); err != nil {
				return err
			}
			if info.Role, err = iam.ParseRole(role); err != nil {
				return err
			}
			out = append(out, info)
		}
		return rows.Err()
	})
	if err != nil {
		return nil, d.fail(fmt.Sprintf("list tokens of %q", principal), err)
	}
	return out, nil
}

package store

import (
	"context"
	"database/sql"
	"path/filepath"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/stdlib"

	"dsec.dev/dsec/internal/iam"
	"dsec.dev/dsec/internal/testutil"
)

// TestMigrationsDownAndUp: every migration's Down undoes its Up, so the
// schema can be rolled back to nothing and built again.
func TestMigrationsDownAndUp(t *testing.T) {
	for _, tc := range []struct {
		dialect string
		dsn     func(t *testing.T) string
	}{
		{dialectSQLite, func(t *testing.T) string { return filepath.Join(t.TempDir(), "meta.db") }},
		{dialectPostgres, func(t *testing.T) string { return testutil.StartPostgres(t) }},
	} {
		t.Run(tc.dialect, func(t *testing.T) {
			ctx := t.Context()
			dsn := tc.dsn(t)
			st, err := Open(ctx, dsn)
			if err != nil {
				t.Fatal(err)
			}
			if err := st.PutIdempotency(ctx, Idempotency{Key: "k", RequestHash: "h", IDs: []string{"sb-1", "sb-2"}}); err != nil {
				t.Fatal(err)
			}
			var db *sql.DB
			switch s := st.(type) {
			case *sqliteStore:
				db = s.db
			case *pgStore:
				db = stdlib.OpenDBFromPool(s.pool)
				defer db.Close()
			}
			p, err := migrator(db, tc.dialect)
			if err != nil {
				t.Fatal(err)
			}
			if tc.dialect == dialectSQLite {
				// Down to the table older dsecd made: the record is back in
				// its old form, and comes through the way up again.
				if _, err := p.DownTo(ctx, 1); err != nil {
					t.Fatalf("migrate down to 1: %v", err)
				}
				var ids string
				if err := db.QueryRowContext(ctx, `SELECT ids FROM idempotency WHERE key = 'k'`).Scan(&ids); err != nil || ids != "sb-1,sb-2" {
					t.Fatalf("legacy ids after down: %q, %v", ids, err)
				}
				if _, err := p.Up(ctx); err != nil {
					t.Fatalf("migrate up from 1: %v", err)
				}
				rec, err := st.GetIdempotency(context.Background(), "k")
				if err != nil || len(rec.IDs) != 2 {
					t.Fatalf("record after down and up: %+v, %v", rec, err)
				}
			}
			if _, err := p.DownTo(ctx, 0); err != nil {
				t.Fatalf("migrate down: %v", err)
			}
			if v, err := p.GetDBVersion(ctx); err != nil || v != 0 {
				t.Fatalf("version after down: %d, %v", v, err)
			}
			if _, err := p.Up(ctx); err != nil {
				t.Fatalf("migrate up again: %v", err)
			}
			if _, err := st.CreatePrincipal(ctx, iam.NodeAdmin(), PrincipalSpec{Name: "p"}); err != nil {
				t.Fatal(err)
			}
			st.Close()
		})
	}
}

// TestIAMMigrationKeepsPower: a principal and token made before the IAM
// migration (every token was all-powerful then) are the root's admin after
// it.
func TestIAMMigrationKeepsPower(t *testing.T) {
	for _, tc := range []struct {
		dialect string
		before  int64 // the version before the IAM migration
		dsn     func(t *testing.T) string
	}{
		{dialectSQLite, 3, func(t *testing.T) string { return filepath.Join(t.TempDir(), "meta.db") }},
		{dialectPostgres, 2, func(t *testing.T) string { return testutil.StartPostgres(t) }},
	} {
		t.Run(tc.dialect, func(t *testing.T) {
			ctx := t.Context()
			st, err := Open(ctx, tc.dsn(t))
			if err != nil {
				t.Fatal(err)
			}
			defer st.Close()
			var db *sql.DB
			switch s := st.(type) {
			case *sqliteStore:
				db = s.db
			case *pgStore:
				db = stdlib.OpenDBFromPool(s.pool)
				defer db.Close()
			}
			p, err := migrator(db, tc.dialect)
			if err != nil {
				t.Fatal(err)
			}
			if _, err := p.DownTo(ctx, tc.before); err != nil {
				t.Fatalf("migrate down to %d: %v", tc.before, err)
			}
			tok, hash := newToken()
			now := any(time.Now())
			insP := `INSERT INTO principals (id, project_id, name, created) VALUES ('prn-1', 'root', 'old', $1)`
			insT := `INSERT INTO tokens (id, principal_id, hash, created) VALUES ('tok-1', 'prn-1', $1, $2)`
			if tc.dialect == dialectSQLite {
				now = time.Now().UnixMilli()
				insP = `INSERT INTO principals (id, project_id, name, created_ms) VALUES ('prn-1', 'root', 'old', ?)`
				insT = `INSERT INTO tokens (id, principal_id, hash, created_ms) VALUES ('tok-1', 'prn-1', ?, ?)`
			}
			if _, err := db.ExecContext(ctx, insP, now); err != nil {
				t.Fatal(err)
			}
			if _, err := db.ExecContext(ctx, insT, hash, now); err != nil {
				t.Fatal(err)
			}
			if _, err := p.Up(ctx); err != nil {
				t.Fatalf("migrate up: %v", err)
			}
			a, err := st.Authenticate(ctx, tok)
			if err != nil {
				t.Fatal(err)
			}
			if a.Principal != "old" || a.Project != "" || a.Role != iam.Admin || a.On("any/project") != iam.Admin {
				t.Fatalf("an old token after the migration: %+v", a)
			}
		})
	}
}

// TestObjectBlobsMigration: an object recorded before blobs holds one of
// its own with the bytes it was charged, so its delete gives back as
// much; a share with a project deleted before is dropped, and an object of
// one stays its (not the root's, which every project sees).
func TestObjectBlobsMigration(t *testing.T) {
	for _, tc := range []struct {
		dialect string
		before  int64 // the version of the objects migration
		dsn     func(t *testing.T) string
	}{
		{dialectSQLite, 5, func(t *testing.T) string { return filepath.Join(t.TempDir(), "meta.db") }},
		{dialectPostgres, 4, func(t *testing.T) string { return testutil.StartPostgres(t) }},
	} {
		t.Run(tc.dialect, func(t *testing.T) {
			ctx := t.Context()
			st, err := Open(ctx, tc.dsn(t))
			if err != nil {
				t.Fatal(err)
			}
			defer st.Close()
			if _, err := st.CreateProject(ctx, iam.NodeAdmin(), "build"); err != nil {
				t.Fatal(err)
			}
			var db *sql.DB
			switch s := st.(type) {
			case *sqliteStore:
				db = s.db
			case *pgStore:
				db = stdlib.OpenDBFromPool(s.pool)
				defer db.Close()
			}
			p, err := migrator(db, tc.dialect)
			if err != nil {
				t.Fatal(err)
			}
			if _, err := p.DownTo(ctx, tc.before); err != nil {
				t.Fatalf("migrate down to %d: %v", tc.before, err)
			}
			now := any(time.Now())
			insO := `INSERT INTO objects (name, kind, project, bytes, created) VALUES ($1, 'layer', $2, $3, $4)`
			insS := `INSERT INTO object_shares (name, project, created) VALUES ($1, $2, $3)`
			if tc.dialect == dialectSQLite {
				now = time.Now().UnixMilli()
				insO = `INSERT INTO objects (name, kind, project, bytes, created_ms) VALUES (?, 'layer', ?, ?, ?)`
				insS = `INSERT INTO object_shares (name, project, created_ms) VALUES (?, ?, ?)`
			}
			for _, o := range []struct {
				name, project string
				bytes         int64
			}{{"env:1", "build", 1000}, {"gone:1", "deleted", 0}} {
				if _, err := db.ExecContext(ctx, insO, o.name, o.project, o.bytes, now); err != nil {
					t.Fatal(err)
				}
			}
			if _, err := db.ExecContext(ctx, insS, "env:1", "deleted", now); err != nil {
				t.Fatal(err)
			}
			if _, err := p.Up(ctx); err != nil {
				t.Fatalf("migrate up: %v", err)
			}
			o, err := st.Object(ctx, "env:1")
			if err != nil || len(o.Blobs) != 1 || o.Blobs[0] != (Blob{Digest: "object:env:1", Bytes: 1000}) || o.SharedWith != nil {
				t.Fatalf("env:1 after the migration: %+v, %v; want one blob object:env:1 of 1000 bytes, no shares", o, err)
			}
			if o, err := st.Object(ctx, "gone:1"); err != nil || o.Project != "deleted" {
				t.Fatalf("an object of a deleted project after the migration: %+v, %v; want it kept as it was", o, err)
			}
			if _, release, err := st.DeleteObject(ctx, "env:1"); err != nil || release != 1000 {
				t.Fatalf("DeleteObject env:1: release %d, %v; want 1000", release, err)
			}
		})
	}
}

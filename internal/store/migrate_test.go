package store

import (
	"context"
	"database/sql"
	"fmt"
	"path/filepath"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/stdlib"
	"github.com/pressly/goose/v3"

	"dsec.dev/dsec/internal/iam"
	"dsec.dev/dsec/internal/testutil"
)

// openMigrating opens a new store of dialect for a migration test (a
// SQLite file, or a PostgreSQL database of its own) and returns it, its
// database and the dialect's migrator over it, all closed when the test
// ends.
func openMigrating(t *testing.T, dialect string) (Store, *sql.DB, *goose.Provider) {
	t.Helper()
	dsn := filepath.Join(t.TempDir(), "meta.db")
	if dialect == dialectPostgres {
		dsn = testutil.StartPostgres(t)
	}
	st, err := Open(t.Context(), dsn)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { st.Close() })
	var db *sql.DB
	switch s := st.(type) {
	case *sqliteStore:
		db = s.db
	case *pgStore:
		db = stdlib.OpenDBFromPool(s.pool)
		t.Cleanup(func() { db.Close() })
	}
	p, err := migrator(db, dialect)
	if err != nil {
		t.Fatal(err)
	}
	return st, db, p
}

// TestMigrationsDownAndUp: every migration's Down undoes its Up, so the
// schema can be rolled back to nothing and built again.
func TestMigrationsDownAndUp(t *testing.T) {
	for _, dialect := range []string{dialectSQLite, dialectPostgres} {
		t.Run(dialect, func(t *testing.T) {
			ctx := t.Context()
			st, db, p := openMigrating(t, dialect)
			if err := st.PutIdempotency(ctx, Idempotency{Key: "k", RequestHash: "h", IDs: []string{"sb-1", "sb-2"}}); err != nil {
				t.Fatal(err)
			}
			if dialect == dialectSQLite {
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
	}{
		{dialectSQLite, 3},
		{dialectPostgres, 2},
	} {
		t.Run(tc.dialect, func(t *testing.T) {
			ctx := t.Context()
			st, db, p := openMigrating(t, tc.dialect)
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
	}{
		{dialectSQLite, 5},
		{dialectPostgres, 4},
	} {
		t.Run(tc.dialect, func(t *testing.T) {
			ctx := t.Context()
			st, db, p := openMigrating(t, tc.dialect)
			if _, err := st.CreateProject(ctx, iam.NodeAdmin(), "build"); err != nil {
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

// TestEventPackMigration: the events table's rows become packs under
// their IDs (runs of consecutive IDs of a project in one pack), the IDs
// then given go on after the last the table gave (a row expired at the
// end included), and down again they are rows as before.
func TestEventPackMigration(t *testing.T) {
	for _, dialect := range []string{dialectSQLite, dialectPostgres} {
		t.Run(dialect, func(t *testing.T) {
			ctx := t.Context()
			st, db, p := openMigrating(t, dialect)
			before := eventPackMigration[dialect] - 2 // the version before event_packs
			if _, err := p.DownTo(ctx, before); err != nil {
				t.Fatalf("migrate down to %d: %v", before, err)
			}
			at := any(time.Now())
			ins := `INSERT INTO events (key, at, project, sandbox_id, kind, node, reason, message) VALUES ($1, $2, $3, 'sb-1', 'created', 'n1', '', $4)`
			del := `DELETE FROM events WHERE key = $1`
			if dialect == dialectSQLite {
				at = time.Now().UnixMilli()
				ins = `INSERT INTO events (key, at_ms, project, sandbox_id, kind, node, reason, message) VALUES (?, ?, ?, 'sb-1', 'created', 'n1', '', ?)`
				del = `DELETE FROM events WHERE key = ?`
			}
			// IDs 1–7 given; 3 and 7 gone (expired, say): runs 1–2 (a),
			// 4 (a), 5–6 (b).
			projects := []string{"a", "a", "a", "a", "b", "b", "b"}
			for i, pr := range projects {
				if _, err := db.ExecContext(ctx, ins, fmt.Sprintf("k%d", i+1), at, pr, fmt.Sprintf("message %d", i+1)); err != nil {
					t.Fatal(err)
				}
			}
			for _, k := range []string{"k3", "k7"} {
				if _, err := db.ExecContext(ctx, del, k); err != nil {
					t.Fatal(err)
				}
			}
			if _, err := p.Up(ctx); err != nil {
				t.Fatalf("migrate up: %v", err)
			}
			var packs int
			if err := db.QueryRowContext(ctx, `SELECT COUNT(*) FROM event_packs`).Scan(&packs); err != nil || packs != 3 {
				t.Fatalf("packs after the migration: %d, %v; want 3", packs, err)
			}
			got, err := st.ListEvents(ctx, EventQuery{})
			if err != nil {
				t.Fatal(err)
			}
			want := []int64{1, 2, 4, 5, 6}
			if len(got) != len(want) {
				t.Fatalf("events after the migration: %+v; want IDs %v", got, want)
			}
			for i, e := range got {
				if e.ID != want[i] || e.Key != fmt.Sprintf("k%d", e.ID) || e.Project != projects[e.ID-1] ||
					e.Message != fmt.Sprintf("message %d", e.ID) || e.SandboxID != "sb-1" || e.Node != "n1" {
					t.Fatalf("event %d after the migration: %+v", i, e)
				}
			}
			if _, err := st.AppendEvents(ctx, Event{Key: "k8", Project: "a", SandboxID: "sb-2", Kind: "created"}); err != nil {
				t.Fatal(err)
			}
			if last, err := st.LastEventID(ctx); err != nil || last != 8 {
				t.Fatalf("LastEventID after an append: %d, %v; want 8 (7 was given)", last, err)
			}
			if _, err := p.DownTo(ctx, before); err != nil {
				t.Fatalf("migrate down to %d again: %v", before, err)
			}
			var n int
			var maxID int64
			if err := db.QueryRowContext(ctx, `SELECT COUNT(*), MAX(id) FROM events`).Scan(&n, &maxID); err != nil || n != 6 || maxID != 8 {
				t.Fatalf("rows after down: %d, max ID %d, %v; want 6, 8", n, maxID, err)
			}
			if _, err := p.Up(ctx); err != nil {
				t.Fatalf("migrate up again: %v", err)
			}
			if last, err := st.LastEventID(ctx); err != nil || last != 8 {
				t.Fatalf("LastEventID up again: %d, %v; want 8", last, err)
			}
		})
	}
}

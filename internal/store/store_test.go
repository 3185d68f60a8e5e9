package store_test

import (
	"context"
	"database/sql"
	"errors"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"

	"dsec.dev/dsec/internal/errdefs"
	"dsec.dev/dsec/internal/iam"
	"dsec.dev/dsec/internal/store"
	"dsec.dev/dsec/internal/store/storetest"
)

func openSQLite(t *testing.T, dsn string) store.Store {
	t.Helper()
	st, err := store.Open(t.Context(), dsn)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { st.Close() })
	return st
}

func TestSQLite(t *testing.T) {
	storetest.Run(t, func(t *testing.T) store.Store {
		return openSQLite(t, filepath.Join(t.TempDir(), "meta.db"))
	})
}

// TestSQLiteReplicas runs the two-replica cases on two handles of one file,
// as two processes on one machine would hold it.
func TestSQLiteReplicas(t *testing.T) {
	storetest.RunReplicas(t, func(t *testing.T) (store.Store, store.Store) {
		path := filepath.Join(t.TempDir(), "meta.db")
		return openSQLite(t, path), openSQLite(t, "sqlite:"+path)
	})
}

// TestSQLiteDurable: a reopened store still has what was written.
func TestSQLiteDurable(t *testing.T) {
	ctx := t.Context()
	path := filepath.Join(t.TempDir(), "meta.db")
	st, err := store.Open(ctx, path)
	if err != nil {
		t.Fatal(err)
	}
	want := store.Idempotency{Key: "k1", RequestHash: "h", IDs: []string{"sb-a-1", "sb-a-2"}, Created: time.UnixMilli(time.Now().UnixMilli())}
	if err := st.PutIdempotency(ctx, want); err != nil {
		t.Fatal(err)
	}
	n, err := st.RegisterNode(ctx, store.Node{Name: "n1", Identity: "fp"}, time.Minute)
	if err != nil {
		t.Fatal(err)
	}
	st.Close()

	st = openSQLite(t, path)
	got, err := st.GetIdempotency(ctx, "k1")
	if err != nil {
		t.Fatal(err)
	}
	if diff := cmp.Diff(want, got); diff != "" {
		t.Fatalf("record mismatch (-want +got):\n%s", diff)
	}
	if got, err := st.NodeBySlot(ctx, n.Slot); err != nil || got.Generation != n.Generation {
		t.Fatalf("node after reopening: %+v, %v", got, err)
	}
}

// TestSQLiteLegacyFile: a meta.db written by a dsecd from before migrations
// (one idempotency table, IDs comma-separated) opens, keeps its records and
// gains the new tables.
func TestSQLiteLegacyFile(t *testing.T) {
	ctx := t.Context()
	path := filepath.Join(t.TempDir(), "meta.db")
	db, err := sql.Open("sqlite", "file:"+path)
	if err != nil {
		t.Fatal(err)
	}
	for _, q := range []string{
		`CREATE TABLE IF NOT EXISTS idempotency (
	key          TEXT PRIMARY KEY,
	request_hash TEXT NOT NULL,
	ids          TEXT NOT NULL,
	created_ms   INTEGER NOT NULL
);`,
		`INSERT INTO idempotency VALUES ('two', 'h2', 'sb-n1-a,sb-n1-b', 1700000000000)`,
		`INSERT INTO idempotency VALUES ('none', 'h0', '', 1700000000001)`,
	} {
		if _, err := db.ExecContext(ctx, q); err != nil {
			t.Fatal(err)
		}
	}
	db.Close()

	st := openSQLite(t, path)
	for _, want := range []store.Idempotency{
		{Key: "two", RequestHash: "h2", IDs: []string{"sb-n1-a", "sb-n1-b"}, Created: time.UnixMilli(1700000000000)},
		{Key: "none", RequestHash: "h0", Created: time.UnixMilli(1700000000001)},
	} {
		got, err := st.GetIdempotency(ctx, want.Key)
		if err != nil {
			t.Fatal(err)
		}
		if diff := cmp.Diff(want, got); diff != "" {
			t.Fatalf("legacy record %s (-want +got):\n%s", want.Key, diff)
		}
	}
	// A legacy record is done: it cannot be reserved again or released.
	_, reserved, err := st.ReserveCreate(ctx, store.CreateReservation{Key: "two", RequestHash: "h2"})
	if err != nil || reserved {
		t.Fatalf("ReserveCreate of a legacy key: reserved=%v, %v", reserved, err)
	}
	if _, err := st.CreatePrincipal(ctx, iam.NodeAdmin(), store.PrincipalSpec{Name: "p"}); err != nil {
		t.Fatal(err)
	}
}

// TestSQLiteTokensHashOnly reads the tokens table: it holds the SHA-256 of
// each token and nothing from which the token could be read back.
func TestSQLiteTokensHashOnly(t *testing.T) {
	ctx := t.Context()
	path := filepath.Join(t.TempDir(), "meta.db")
	st := openSQLite(t, path)
	if _, err := st.CreatePrincipal(ctx, iam.NodeAdmin(), store.PrincipalSpec{Name: "trainer"}); err != nil {
		t.Fatal(err)
	}
	tok, info, err := st.MintToken(ctx, iam.NodeAdmin(), store.TokenSpec{Principal: "trainer", Role: iam.Admin, TTL: time.Hour})
	if err != nil {
		t.Fatal(err)
	}
	db, err := sql.Open("sqlite", "file:"+path+"?mode=ro")
	if err != nil {
		t.Fatal(err)
	}
	defer db.Close()
	checkTokenRows(t, tok, info.ID, func() (*sql.Rows, error) {
		return db.QueryContext(ctx, `SELECT * FROM tokens`)
	})
}

// checkTokenRows fails if any column of the one token row holds the token
// or a part of it, or if the row lacks its SHA-256.
func checkTokenRows(t *testing.T, tok, id string, query func() (*sql.Rows, error)) {
	t.Helper()
	rows, err := query()
	if err != nil {
		t.Fatal(err)
	}
	defer rows.Close()
	cols, _ := rows.Columns()
	n := 0
	for rows.Next() {
		n++
		vals := make([]any, len(cols))
		ptrs := make([]any, len(cols))
		for i := range vals {
			ptrs[i] = &vals[i]
		}
		if err := rows.Scan(ptrs...); err != nil {
			t.Fatal(err)
		}
		checkTokenRow(t, tok, id, cols, vals)
	}
	if n != 1 {
		t.Fatalf("%d token rows, want 1", n)
	}
}

func checkTokenRow(t *testing.T, tok, id string, cols []string, vals []any) {
	t.Helper()
	secret := strings.TrimPrefix(tok, "dsec_")
	sum := store.TokenHashForTest(tok)
	sawHash := false
	for i, v := range vals {
		var s string
		switch v := v.(type) {
		case []byte:
			s = string(v)
			if string(v) == string(sum) {
				sawHash = true
				continue
			}
		case string:
			s = v
		default:
			continue
		}
		// No column holds the token, its random part, or a long piece of it.
		for j := 0; j+12 <= len(secret); j++ {
			if strings.Contains(s, secret[j:j+12]) {
				t.Fatalf("column %s holds part of the token: %q", cols[i], s)
			}
		}
	}
	if !sawHash {
		t.Fatalf("no column holds the token's SHA-256 (columns %v)", cols)
	}
}

func TestOpenErrors(t *testing.T) {
	for _, tc := range []struct {
		name, dsn string
		kind      error
	}{
		{"empty", "", errdefs.ErrInvalidArgument},
		{"sqlite prefix without a path", "sqlite:", errdefs.ErrInvalidArgument},
		{"bad postgres URL", "postgres://%zz", errdefs.ErrInvalidArgument},
		{"no such directory", filepath.Join(t.TempDir(), "missing", "meta.db"), nil},
	} {
		t.Run(tc.name, func(t *testing.T) {
			ctx, cancel := context.WithTimeout(t.Context(), 10*time.Second)
			defer cancel()
			st, err := store.Open(ctx, tc.dsn)
			if err == nil {
				st.Close()
				t.Fatal("Open succeeded")
			}
			if tc.kind != nil && !errors.Is(err, tc.kind) {
				t.Fatalf("Open: %v, want %v", err, tc.kind)
			}
		})
	}
}

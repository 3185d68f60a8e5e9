package daemon

import (
	"os"
	"path/filepath"
	"strings"
	"testing"

	"dsec.dev/dsec/internal/iam"
	"dsec.dev/dsec/internal/store"
)

// TestAdminToken: the all-in-one's admin token is the root project's
// admin, and is kept across restarts; dsecd token mints narrower ones.
func TestAdminToken(t *testing.T) {
	ctx := t.Context()
	dir := t.TempDir()
	dsn := filepath.Join(dir, "meta.db")
	st, err := store.Open(ctx, dsn)
	if err != nil {
		t.Fatal(err)
	}
	defer st.Close()
	path := filepath.Join(dir, AdminTokenFile)
	if err := ensureAdminToken(ctx, st, path); err != nil {
		t.Fatal(err)
	}
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	a, err := st.Authenticate(ctx, strings.TrimSpace(string(b)))
	if err != nil {
		t.Fatal(err)
	}
	if a.Principal != AdminPrincipal || a.Project != "" || a.Role != iam.Admin || a.On("any/project") != iam.Admin || !a.Expires.IsZero() {
		t.Fatalf("the admin token's authority: %+v", a)
	}
	if err := ensureAdminToken(ctx, st, path); err != nil {
		t.Fatal(err)
	}
	if again, _ := os.ReadFile(path); string(again) != string(b) {
		t.Fatal("a second start replaced a valid admin token")
	}

	if _, err := st.CreateProject(ctx, iam.NodeAdmin(), "ml"); err != nil {
		t.Fatal(err)
	}
	tok, err := IssueToken(ctx, dsn, "trainer", "ml", iam.Runner, 0)
	if err != nil {
		t.Fatal(err)
	}
	a, err = st.Authenticate(ctx, tok)
	if err != nil {
		t.Fatal(err)
	}
	if a.On("ml") != iam.Runner || a.On("") != iam.None {
		t.Fatalf("dsecd token --project ml --role runner: %+v", a)
	}
}

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

// TestTokenlessProject: --sandboxfusion-project read as the apiserver's
// Config.TokenlessFnCall: the default when unset ("/" in the all-in-one,
// refused in a cluster's apiserver), "none" refuses, a path is checked.
func TestTokenlessProject(t *testing.T) {
	for _, tc := range []struct {
		flag, def, want string
		bad             bool
	}{
		{"", "/", "/", false},
		{"", "", "", false},
		{"none", "/", "", false},
		{"/", "", "/", false},
		{"ml/rl", "", "/ml/rl", false},
		{"/ml", "/", "/ml", false},
		{"ML!", "", "", true},
	} {
		got, err := tokenlessProject(tc.flag, tc.def)
		if (err != nil) != tc.bad || got != tc.want {
			t.Errorf("tokenlessProject(%q, %q) = %q, %v; want %q (error: %v)", tc.flag, tc.def, got, err, tc.want, tc.bad)
		}
	}
}

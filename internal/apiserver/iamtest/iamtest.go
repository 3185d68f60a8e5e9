// Package iamtest starts an apiserver serving the IAM service on a real
// metadata store (SQLite, or a throwaway PostgreSQL), over TCP, where
// every call needs a token, for the tests of the IAM surfaces: the CLI,
// the Go SDK. It has no edges: calls to sandboxes find no node.
package iamtest

import (
	"context"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"path/filepath"
	"testing"

	"dsec.dev/dsec/internal/apiserver"
	"dsec.dev/dsec/internal/iam"
	"dsec.dev/dsec/internal/store"
	"dsec.dev/dsec/internal/testutil"
	"dsec.dev/dsec/internal/watcher"
)

// Server is an apiserver over a store, with the root's admin token.
type Server struct {
	URL   string
	Store store.Store
	// AdminToken belongs to the principal "admin", admin on the root, as
	// the all-in-one dsecd's admin.token.
	AdminToken string
}

// Databases are the stores the tests run on, by name: "sqlite" (a file in
// the test's directory) and "postgres" (a throwaway server, which needs
// root and skips without it, or fails under DSEC_TEST_ROOT=1). Each gives
// a DSN for store.Open.
func Databases() map[string]func(t *testing.T) string {
	return map[string]func(t *testing.T) string{
		"sqlite":   func(t *testing.T) string { return filepath.Join(t.TempDir(), "meta.db") },
		"postgres": func(t *testing.T) string { return testutil.StartPostgres(t) },
	}
}

// Start serves an apiserver on a store opened from dsn, until the test
// ends.
func Start(t *testing.T, dsn string) *Server {
	t.Helper()
	ctx := context.Background()
	st, err := store.Open(ctx, dsn)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { st.Close() })
	if _, err := st.CreatePrincipal(ctx, iam.NodeAdmin(), store.PrincipalSpec{Name: "admin"}); err != nil {
		t.Fatal(err)
	}
	if err := st.Grant(ctx, iam.NodeAdmin(), "admin", "", iam.Admin); err != nil {
		t.Fatal(err)
	}
	tok, _, err := st.MintToken(ctx, iam.NodeAdmin(), store.TokenSpec{Principal: "admin", Role: iam.Admin})
	if err != nil {
		t.Fatal(err)
	}
	log := slog.New(slog.NewTextHandler(io.Discard, nil))
	api := apiserver.New(apiserver.Config{Name: "iamtest", Auth: st, IAM: st}, st, watcher.NewFixed(), log)
	hs := httptest.NewUnstartedServer(api.Handler())
	hs.Config.Protocols = new(http.Protocols)
	hs.Config.Protocols.SetHTTP1(true)
	hs.Config.Protocols.SetUnencryptedHTTP2(true)
	hs.Start()
	t.Cleanup(hs.Close)
	return &Server{URL: hs.URL, Store: st, AdminToken: tok}
}

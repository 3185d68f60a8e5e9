package apiserver

import (
	"bytes"
	"context"
	"log/slog"
	"net"
	"net/http"
	"net/http/httptest"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"connectrpc.com/connect"

	dsecv1 "dsec.dev/dsec/api/gen/dsec/v1"
	"dsec.dev/dsec/api/gen/dsec/v1/dsecv1connect"
	"dsec.dev/dsec/internal/iam"
	"dsec.dev/dsec/internal/store"
	"dsec.dev/dsec/internal/watcher"
)

// TestBearerTokens: over TCP every call needs a token of the store; none,
// a forged one and an expired one are refused (and logged, without the
// token); over a Unix socket none is needed.
func TestBearerTokens(t *testing.T) {
	ctx := context.Background()
	st, err := store.Open(ctx, filepath.Join(t.TempDir(), "meta.db"))
	if err != nil {
		t.Fatal(err)
	}
	defer st.Close()
	if _, err := st.CreatePrincipal(ctx, iam.NodeAdmin(), store.PrincipalSpec{Name: "alice"}); err != nil {
		t.Fatal(err)
	}
	good, _, err := st.MintToken(ctx, iam.NodeAdmin(), store.TokenSpec{Principal: "alice", Role: iam.Admin, TTL: 0})
	if err != nil {
		t.Fatal(err)
	}
	expired, _, err := st.MintToken(ctx, iam.NodeAdmin(), store.TokenSpec{Principal: "alice", Role: iam.Admin, TTL: time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	time.Sleep(5 * time.Millisecond)
	var logs bytes.Buffer
	s := New(Config{Auth: st}, st, watcher.NewFixed(nodesOf(newFakeEdge("n1"))...), slog.New(slog.NewTextHandler(&logs, nil)))
	hs := httptest.NewUnstartedServer(s.Handler())
	hs.Config.ConnContext = ConnContext
	hs.Start()
	defer hs.Close()

	call := func(c *http.Client, base, token string) error {
		opts := []connect.ClientOption{}
		if token != "" {
			opts = append(opts, connect.WithInterceptors(bearer(token)))
		}
		cl := dsecv1connect.NewSandboxServiceClient(c, base, opts...)
		_, err := cl.List(ctx, connect.NewRequest(&dsecv1.ListRequest{}))
		return err
	}
	for name, tok := range map[string]string{"no token": "", "forged": "dsec_" + strings.Repeat("A", 43), "expired": expired, "garbage": "x y"} {
		err := call(hs.Client(), hs.URL, tok)
		if connect.CodeOf(err) != connect.CodeUnauthenticated {
			t.Errorf("%s: %v, want unauthenticated", name, err)
		}
		if tok != "" && strings.Contains(err.Error(), tok) {
			t.Errorf("%s: the refusal echoes the token", name)
		}
	}
	if err := call(hs.Client(), hs.URL, good); err != nil {
		t.Fatalf("a good token: %v", err)
	}
	if !strings.Contains(logs.String(), "token refused") || strings.Contains(logs.String(), expired) {
		t.Errorf("log: %s", logs.String())
	}

	// The same handler on a Unix socket: trusted without a token.
	sock := filepath.Join(t.TempDir(), "api.sock")
	ln, err := net.Listen("unix", sock)
	if err != nil {
		t.Fatal(err)
	}
	us := &http.Server{Handler: s.Handler(), ConnContext: ConnContext}
	go us.Serve(ln)
	defer us.Close()
	uc := &http.Client{Transport: &http.Transport{DialContext: func(ctx context.Context, _, _ string) (net.Conn, error) {
		return (&net.Dialer{}).DialContext(ctx, "unix", sock)
	}}}
	if err := call(uc, "http://local", ""); err != nil {
		t.Fatalf("over the Unix socket: %v", err)
	}
}

type bearer string

func (b bearer) WrapUnary(next connect.UnaryFunc) connect.UnaryFunc {
	return func(ctx context.Context, req connect.AnyRequest) (connect.AnyResponse, error) {
		req.Header().Set("Authorization", "Bearer "+string(b))
		return next(ctx, req)
	}
}
func (b bearer) WrapStreamingClient(next connect.StreamingClientFunc) connect.StreamingClientFunc {
	return next
}
func (b bearer) WrapStreamingHandler(next connect.StreamingHandlerFunc) connect.StreamingHandlerFunc {
	return next
}

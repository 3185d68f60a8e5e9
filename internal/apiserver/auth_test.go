package apiserver

import (
	"bytes"
	"context"
	"errors"
	"log/slog"
	"net"
	"net/http"
	"net/http/httptest"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"connectrpc.com/connect"

	dsecv1 "dsec.dev/dsec/api/gen/dsec/v1"
	"dsec.dev/dsec/api/gen/dsec/v1/dsecv1connect"
	"dsec.dev/dsec/internal/errdefs"
	"dsec.dev/dsec/internal/iam"
	"dsec.dev/dsec/internal/memconn"
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
	if err := st.Grant(ctx, iam.NodeAdmin(), "alice", "", iam.Admin); err != nil {
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

// recordingAuditor keeps the audit records RunAudit writes.
type recordingAuditor struct {
	mu   sync.Mutex
	recs []store.AuditRecord
}

func (r *recordingAuditor) AppendAudit(_ context.Context, recs ...store.AuditRecord) error {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.recs = append(r.recs, recs...)
	return nil
}

func (r *recordingAuditor) find(op, code string) (store.AuditRecord, bool) {
	r.mu.Lock()
	defer r.mu.Unlock()
	for _, rec := range r.recs {
		if rec.Operation == op && rec.Code == code {
			return rec, true
		}
	}
	return store.AuditRecord{}, false
}

// TestRoles: every call is decided by its token's role on its project
// (ops.go's table): a viewer reads but runs nothing, a runner runs
// sandboxes but makes no layer or pool, a builder does both; each refusal
// is PermissionDenied, names what was needed, and is audited, as is every
// management call that passes.
func TestRoles(t *testing.T) {
	ctx := context.Background()
	st, err := store.Open(ctx, filepath.Join(t.TempDir(), "meta.db"))
	if err != nil {
		t.Fatal(err)
	}
	defer st.Close()
	if _, err := st.CreateProject(ctx, iam.NodeAdmin(), "ml"); err != nil {
		t.Fatal(err)
	}
	tokens := map[iam.Role]string{}
	for _, role := range []iam.Role{iam.Viewer, iam.Runner, iam.Builder} {
		name := role.String()
		if _, err := st.CreatePrincipal(ctx, iam.NodeAdmin(), store.PrincipalSpec{Name: name, Kind: store.KindService, Project: "ml"}); err != nil {
			t.Fatal(err)
		}
		if err := st.Grant(ctx, iam.NodeAdmin(), name, "ml", role); err != nil {
			t.Fatal(err)
		}
		tok, _, err := st.MintToken(ctx, iam.NodeAdmin(), store.TokenSpec{Principal: name, Project: "ml", Role: role})
		if err != nil {
			t.Fatal(err)
		}
		tokens[role] = tok
	}
	audit := &recordingAuditor{}
	s := New(Config{Auth: st, Audit: audit}, st, watcher.NewFixed(nodesOf(newFakeEdge("n1"))...), slog.New(slog.DiscardHandler))
	actx, stop := context.WithCancel(ctx)
	done := make(chan struct{})
	go func() { defer close(done); s.RunAudit(actx) }()
	hs := httptest.NewUnstartedServer(s.Handler())
	hs.Config.ConnContext = ConnContext
	hs.EnableHTTP2 = true
	hs.Start()
	defer hs.Close()

	calls := map[string]func(opt connect.ClientOption) error{
		"list": func(opt connect.ClientOption) error {
			_, err := dsecv1connect.NewSandboxServiceClient(hs.Client(), hs.URL, opt).List(ctx, connect.NewRequest(&dsecv1.ListRequest{}))
			return err
		},
		"create": func(opt connect.ClientOption) error {
			_, err := dsecv1connect.NewSandboxServiceClient(hs.Client(), hs.URL, opt).Create(ctx,
				connect.NewRequest(&dsecv1.CreateRequest{Spec: &dsecv1.SandboxSpec{Environment: "base:1"}}))
			return err
		},
		"exec": func(opt connect.ClientOption) error {
			st, err := dsecv1connect.NewSandboxServiceClient(hs.Client(), hs.URL, opt).Exec(ctx,
				connect.NewRequest(&dsecv1.ExecRequest{SandboxId: "sb-none", Command: "true"}))
			if err != nil {
				return err
			}
			defer st.Close()
			for st.Receive() {
			}
			return st.Err()
		},
		"set warm pool": func(opt connect.ClientOption) error {
			_, err := dsecv1connect.NewSandboxServiceClient(hs.Client(), hs.URL, opt).SetWarmPool(ctx,
				connect.NewRequest(&dsecv1.SetWarmPoolRequest{Spec: &dsecv1.SandboxSpec{Environment: "base:1"}}))
			return err
		},
		"remove layer": func(opt connect.ClientOption) error {
			_, err := dsecv1connect.NewLayerServiceClient(hs.Client(), hs.URL, opt).RemoveLayer(ctx,
				connect.NewRequest(&dsecv1.RemoveLayerRequest{Ref: "none:1"}))
			return err
		},
	}
	// allowed[call] is the lowest role the call passes the check with.
	allowed := map[string]iam.Role{"list": iam.Viewer, "create": iam.Runner, "exec": iam.Runner, "set warm pool": iam.Builder, "remove layer": iam.Builder}
	for _, role := range []iam.Role{iam.Viewer, iam.Runner, iam.Builder} {
		for name, call := range calls {
			err := call(connect.WithInterceptors(bearerBoth(tokens[role])))
			denied := connect.CodeOf(err) == connect.CodePermissionDenied
			if want := role < allowed[name]; denied != want {
				t.Errorf("%s by a %s: %v, want denied %v", name, role, err, want)
			}
			if denied && !strings.Contains(err.Error(), "needs "+allowed[name].String()) {
				t.Errorf("%s by a %s: the refusal does not say what is needed: %v", name, role, err)
			}
		}
	}
	stop()
	<-done
	if rec, ok := audit.find("/dsec.v1.SandboxService/Create", "permission_denied"); !ok || rec.Principal != "viewer" || rec.Project != "ml" || rec.Peer == "" {
		t.Errorf("a viewer's refused create is not audited as such: %+v (found %v)", rec, ok)
	}
	if rec, ok := audit.find("/dsec.v1.SandboxService/Create", "ok"); !ok || rec.Object == "" {
		t.Errorf("a runner's create is not audited with its sandbox: %+v (found %v)", rec, ok)
	}
	if _, ok := audit.find("/dsec.v1.SandboxService/List", "ok"); ok {
		t.Error("a list, a read, is audited")
	}
}

// bearerBoth sets a bearer token on unary and streaming calls.
type bearerBoth string

func (b bearerBoth) WrapUnary(next connect.UnaryFunc) connect.UnaryFunc {
	return func(ctx context.Context, req connect.AnyRequest) (connect.AnyResponse, error) {
		req.Header().Set("Authorization", "Bearer "+string(b))
		return next(ctx, req)
	}
}
func (b bearerBoth) WrapStreamingClient(next connect.StreamingClientFunc) connect.StreamingClientFunc {
	return func(ctx context.Context, spec connect.Spec) connect.StreamingClientConn {
		c := next(ctx, spec)
		c.RequestHeader().Set("Authorization", "Bearer "+string(b))
		return c
	}
}
func (b bearerBoth) WrapStreamingHandler(next connect.StreamingHandlerFunc) connect.StreamingHandlerFunc {
	return next
}

// TestAuthorizeFnCall: SandboxFusion's calls are decided as RunCode: a
// viewer's token is refused, a runner's passes with its authority in the
// context, a forged one is Unauthenticated, and a call without a token is
// a runner of the project the operator names, or refused without one.
func TestAuthorizeFnCall(t *testing.T) {
	ctx := context.Background()
	st, err := store.Open(ctx, filepath.Join(t.TempDir(), "meta.db"))
	if err != nil {
		t.Fatal(err)
	}
	defer st.Close()
	tokens := map[iam.Role]string{}
	for _, role := range []iam.Role{iam.Viewer, iam.Runner} {
		if _, err := st.CreatePrincipal(ctx, iam.NodeAdmin(), store.PrincipalSpec{Name: role.String()}); err != nil {
			t.Fatal(err)
		}
		if err := st.Grant(ctx, iam.NodeAdmin(), role.String(), "", role); err != nil {
			t.Fatal(err)
		}
		tok, _, err := st.MintToken(ctx, iam.NodeAdmin(), store.TokenSpec{Principal: role.String(), Role: role})
		if err != nil {
			t.Fatal(err)
		}
		tokens[role] = tok
	}
	s := New(Config{Auth: st}, st, watcher.NewFixed(), slog.New(slog.DiscardHandler))
	if _, err := s.AuthorizeFnCall(ctx, tokens[iam.Viewer], "peer"); !errors.Is(err, errdefs.ErrPermissionDenied) {
		t.Errorf("a viewer: %v, want permission denied", err)
	}
	if _, err := s.AuthorizeFnCall(ctx, "dsec_"+strings.Repeat("A", 43), "peer"); !errors.Is(err, errdefs.ErrUnauthenticated) {
		t.Errorf("a forged token: %v, want unauthenticated", err)
	}
	rctx, err := s.AuthorizeFnCall(ctx, tokens[iam.Runner], "peer")
	if a, ok := iam.AuthorityFrom(rctx); err != nil || !ok || a.Principal != "runner" {
		t.Errorf("a runner: %v, authority %+v", err, a)
	}
	if _, err := s.AuthorizeFnCall(ctx, "", "peer"); !errors.Is(err, errdefs.ErrUnauthenticated) || !strings.Contains(err.Error(), "--sandboxfusion-project") {
		t.Errorf("no token and no project for such calls: %v, want unauthenticated naming the flag", err)
	}
	for _, project := range []string{"/", "/ml", "ml/rl"} {
		s := New(Config{Auth: st, TokenlessFnCall: project}, st, watcher.NewFixed(), slog.New(slog.DiscardHandler))
		nctx, err := s.AuthorizeFnCall(ctx, "", "peer")
		a, ok := iam.AuthorityFrom(nctx)
		want := strings.TrimPrefix(project, "/")
		if err != nil || !ok || a.Node || a.Project != want || a.On(want) != iam.Runner || a.On(want+"/sub") != iam.Runner {
			t.Errorf("no token, calls in %s: %v, authority %+v", project, err, a)
		}
		if want != "" && a.On("other") != iam.None {
			t.Errorf("no token, calls in %s: a role on another project: %+v", project, a)
		}
		if err := iam.Allow(a, "/dsec.v1.FnCallService/RunCode", want); err != nil {
			t.Errorf("no token, calls in %s: RunCode refused: %v", project, err)
		}
		if err := iam.Allow(a, iam.OpCreateToken, want); err == nil {
			t.Errorf("no token, calls in %s: may mint tokens", project)
		}
	}
}

// TestPeerOf: the audit trail takes an adapter's word for its client's
// address on in-process calls only; over a socket the header is ignored.
func TestPeerOf(t *testing.T) {
	h := http.Header{}
	h.Set(memconn.PeerHeader, "198.51.100.7:5000")
	inProc := connect.Peer{Addr: (memconn.Addr{}).String()}
	if got := peerOf(inProc, h).Addr; got != "198.51.100.7:5000" {
		t.Errorf("an in-process call for a client: peer %q, want the client's", got)
	}
	if got := peerOf(inProc, http.Header{}).Addr; got != "in-process" {
		t.Errorf("an in-process call of the process's own: peer %q", got)
	}
	tcp := connect.Peer{Addr: "127.0.0.1:4000"}
	if got := peerOf(tcp, h).Addr; got != "127.0.0.1:4000" {
		t.Errorf("a socket's call sending the header: peer %q, want the socket's", got)
	}
}

// TestAuditStreamsAndRevokes: a streaming call is recorded with the
// object its first message names, as a unary call is (before, with none
// and under the token's project): an exec refused before its handler ran
// names its sandbox, an upload and an image import their ref, under the
// project they name. A token revoked and a principal deleted by a
// root-wide token are recorded under the token's and the principal's own
// project (before: the root's, where the project's admins never saw
// them).
func TestAuditStreamsAndRevokes(t *testing.T) {
	ctx := t.Context()
	st, err := store.Open(ctx, filepath.Join(t.TempDir(), "meta.db"))
	if err != nil {
		t.Fatal(err)
	}
	defer st.Close()
	node := iam.NodeAdmin()
	for _, p := range []string{"ml", "ml/b"} {
		if _, err := st.CreateProject(ctx, node, p); err != nil {
			t.Fatal(err)
		}
	}
	tokens := map[string]string{}
	ids := map[string]string{}
	for _, p := range []struct {
		name, project string
		role          iam.Role
	}{{"root-admin", "", iam.Admin}, {"viewer", "ml", iam.Viewer}, {"builder", "ml", iam.Builder}, {"gone", "ml", iam.Runner}} {
		if _, err := st.CreatePrincipal(ctx, node, store.PrincipalSpec{Name: p.name, Kind: store.KindService, Project: p.project}); err != nil {
			t.Fatal(err)
		}
		if err := st.Grant(ctx, node, p.name, p.project, p.role); err != nil {
			t.Fatal(err)
		}
		tok, info, err := st.MintToken(ctx, node, store.TokenSpec{Principal: p.name, Project: p.project, Role: p.role})
		if err != nil {
			t.Fatal(err)
		}
		tokens[p.name], ids[p.name] = tok, info.ID
	}
	audit := &recordingAuditor{}
	s := New(Config{Auth: st, IAM: st, Audit: audit}, st, watcher.NewFixed(nodesOf(newFakeEdge("n1"))...), slog.New(slog.DiscardHandler))
	actx, stop := context.WithCancel(ctx)
	done := make(chan struct{})
	go func() { defer close(done); s.RunAudit(actx) }()
	hs := httptest.NewUnstartedServer(s.Handler())
	hs.Config.ConnContext = ConnContext
	hs.EnableHTTP2 = true
	hs.Start()
	defer hs.Close()
	as := func(who string) connect.ClientOption { return connect.WithInterceptors(bearerBoth(tokens[who])) }

	// A viewer's exec, refused before its handler reads the request.
	ex, err := dsecv1connect.NewSandboxServiceClient(hs.Client(), hs.URL, as("viewer")).Exec(ctx,
		connect.NewRequest(&dsecv1.ExecRequest{SandboxId: "sb-x", Command: "true"}))
	if err == nil {
		for ex.Receive() {
		}
		err = ex.Err()
		ex.Close()
	}
	if connect.CodeOf(err) != connect.CodePermissionDenied {
		t.Fatalf("a viewer's exec: %v, want permission denied", err)
	}
	// A builder's upload to ml/b (the node takes none: it fails, and is
	// recorded all the same).
	layers := dsecv1connect.NewLayerServiceClient(hs.Client(), hs.URL, as("builder"))
	up := layers.UploadLayer(ctx)
	if err := up.Send(&dsecv1.UploadLayerRequest{Part: &dsecv1.UploadLayerRequest_Header{Header: &dsecv1.UploadLayerHeader{Ref: "up:1", Project: "ml/b"}}}); err != nil {
		t.Fatal(err)
	}
	up.Send(&dsecv1.UploadLayerRequest{Part: &dsecv1.UploadLayerRequest_End{End: true}})
	up.CloseAndReceive()
	// A builder's image import to ml/b.
	imp, err := layers.ImportImage(ctx, connect.NewRequest(&dsecv1.ImportImageRequest{Ref: "img:1", Source: "oci:/nowhere", Project: "ml/b"}))
	if err == nil {
		for imp.Receive() {
		}
		imp.Close()
	}
	// The root's admin revokes a token of ml and deletes a principal at
	// home there.
	iamc := dsecv1connect.NewIAMServiceClient(hs.Client(), hs.URL, as("root-admin"))
	if _, err := iamc.RevokeToken(ctx, connect.NewRequest(&dsecv1.RevokeTokenRequest{Id: ids["viewer"]})); err != nil {
		t.Fatal(err)
	}
	if _, err := iamc.DeletePrincipal(ctx, connect.NewRequest(&dsecv1.DeletePrincipalRequest{Name: "gone"})); err != nil {
		t.Fatal(err)
	}
	stop()
	<-done

	for _, want := range []struct{ op, project, object string }{
		{"/dsec.v1.SandboxService/Exec", "ml", "sb-x"},
		{"/dsec.v1.LayerService/UploadLayer", "ml/b", "up:1"},
		{"/dsec.v1.LayerService/ImportImage", "ml/b", "img:1"},
		{string(iam.OpRevokeToken), "ml", ids["viewer"]},
		{"/dsec.v1.IAMService/DeletePrincipal", "ml", "gone"},
	} {
		audit.mu.Lock()
		var got []store.AuditRecord
		for _, r := range audit.recs {
			if r.Operation == want.op {
				got = append(got, r)
			}
		}
		audit.mu.Unlock()
		if len(got) != 1 || got[0].Project != want.project || got[0].Object != want.object {
			t.Errorf("%s recorded as %+v; want once, under %q, object %q", want.op, got, want.project, want.object)
		}
	}
}

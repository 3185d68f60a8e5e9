package dsec

import (
	"context"
	"crypto/x509"
	"encoding/pem"
	"errors"
	"io"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"connectrpc.com/connect"

	dsecv1 "dsec.dev/dsec/api/gen/dsec/v1"
)

// The tests of Conn, the raw API over the SDK's transport, with the
// apiserver of failover_test.go.

func dialConn(t *testing.T, addr string, o DialOptions) *Conn {
	t.Helper()
	c, err := Dial(addr, o)
	if err != nil {
		t.Fatal(err)
	}
	return c
}

func connUnary[T any](_ *connect.Response[T], err error) error { return err }

func connDrain[T any](s *connect.ServerStreamForClient[T], err error) error {
	if err != nil {
		return err
	}
	defer s.Close()
	for s.Receive() {
	}
	return s.Err()
}

// shell opens a shell, sends its start and reads it to its exit status.
func connShell(ctx context.Context, c *Conn) error {
	st := c.Sandboxes.Shell(ctx)
	defer st.CloseResponse()
	if err := st.Send(&dsecv1.ShellInput{Input: &dsecv1.ShellInput_Start{Start: &dsecv1.ShellStart{SandboxId: "sb-n-1"}}}); err != nil && !errors.Is(err, io.EOF) {
		return err
	}
	st.CloseRequest()
	for {
		out, err := st.Receive()
		if err != nil {
			return err
		}
		if out.GetExited() != nil {
			return nil
		}
	}
}

func req[T any](m *T) *connect.Request[T] { return connect.NewRequest(m) }

// everyConnCall makes each call of the API once.
var everyConnCall = []struct {
	name string
	call func(ctx context.Context, c *Conn) error
}{
	{"Create", func(ctx context.Context, c *Conn) error {
		return connUnary(c.Sandboxes.Create(ctx, req(&dsecv1.CreateRequest{IdempotencyKey: "k"})))
	}},
	{"Get", func(ctx context.Context, c *Conn) error {
		return connUnary(c.Sandboxes.Get(ctx, req(&dsecv1.GetRequest{Id: "sb-n-1"})))
	}},
	{"List", func(ctx context.Context, c *Conn) error {
		return connUnary(c.Sandboxes.List(ctx, req(&dsecv1.ListRequest{})))
	}},
	{"Delete", func(ctx context.Context, c *Conn) error {
		return connUnary(c.Sandboxes.Delete(ctx, req(&dsecv1.DeleteRequest{})))
	}},
	{"Exec", func(ctx context.Context, c *Conn) error {
		return connDrain(c.Sandboxes.Exec(ctx, req(&dsecv1.ExecRequest{})))
	}},
	{"Attach", func(ctx context.Context, c *Conn) error {
		return connDrain(c.Sandboxes.Attach(ctx, req(&dsecv1.AttachRequest{})))
	}},
	{"WriteStdin", func(ctx context.Context, c *Conn) error {
		return connUnary(c.Sandboxes.WriteStdin(ctx, req(&dsecv1.WriteStdinRequest{})))
	}},
	{"Signal", func(ctx context.Context, c *Conn) error {
		return connUnary(c.Sandboxes.Signal(ctx, req(&dsecv1.SignalRequest{})))
	}},
	{"ListProcesses", func(ctx context.Context, c *Conn) error {
		return connUnary(c.Sandboxes.ListProcesses(ctx, req(&dsecv1.ListProcessesRequest{})))
	}},
	{"SessionRun", func(ctx context.Context, c *Conn) error {
		return connDrain(c.Sandboxes.SessionRun(ctx, req(&dsecv1.SessionRunRequest{})))
	}},
	{"SessionInterrupt", func(ctx context.Context, c *Conn) error {
		return connUnary(c.Sandboxes.SessionInterrupt(ctx, req(&dsecv1.SessionInterruptRequest{})))
	}},
	{"SessionClose", func(ctx context.Context, c *Conn) error {
		return connUnary(c.Sandboxes.SessionClose(ctx, req(&dsecv1.SessionCloseRequest{})))
	}},
	{"Shell", connShell},
	{"ReadFile", func(ctx context.Context, c *Conn) error {
		return connUnary(c.Sandboxes.ReadFile(ctx, req(&dsecv1.ReadFileRequest{})))
	}},
	{"WriteFile", func(ctx context.Context, c *Conn) error {
		return connUnary(c.Sandboxes.WriteFile(ctx, req(&dsecv1.WriteFileRequest{Data: []byte("x")})))
	}},
	{"ListDir", func(ctx context.Context, c *Conn) error {
		return connUnary(c.Sandboxes.ListDir(ctx, req(&dsecv1.ListDirRequest{})))
	}},
	{"Stat", func(ctx context.Context, c *Conn) error {
		return connUnary(c.Sandboxes.Stat(ctx, req(&dsecv1.StatRequest{})))
	}},
	{"Remove", func(ctx context.Context, c *Conn) error {
		return connUnary(c.Sandboxes.Remove(ctx, req(&dsecv1.RemoveRequest{})))
	}},
	{"MakeDir", func(ctx context.Context, c *Conn) error {
		return connUnary(c.Sandboxes.MakeDir(ctx, req(&dsecv1.MakeDirRequest{})))
	}},
	{"Move", func(ctx context.Context, c *Conn) error {
		return connUnary(c.Sandboxes.Move(ctx, req(&dsecv1.MoveRequest{})))
	}},
	{"WatchDir", func(ctx context.Context, c *Conn) error {
		return connDrain(c.Sandboxes.WatchDir(ctx, req(&dsecv1.WatchDirRequest{})))
	}},
	{"Upload", func(ctx context.Context, c *Conn) error {
		return connUnary(c.Sandboxes.Upload(ctx, req(&dsecv1.UploadRequest{})))
	}},
	{"Download", func(ctx context.Context, c *Conn) error {
		return connDrain(c.Sandboxes.Download(ctx, req(&dsecv1.DownloadRequest{})))
	}},
	{"SetNetworkRules", func(ctx context.Context, c *Conn) error {
		return connUnary(c.Sandboxes.SetNetworkRules(ctx, req(&dsecv1.SetNetworkRulesRequest{})))
	}},
	{"NetworkLog", func(ctx context.Context, c *Conn) error {
		return connUnary(c.Sandboxes.NetworkLog(ctx, req(&dsecv1.NetworkLogRequest{})))
	}},
	{"SetWarmPool", func(ctx context.Context, c *Conn) error {
		return connUnary(c.Sandboxes.SetWarmPool(ctx, req(&dsecv1.SetWarmPoolRequest{})))
	}},
	{"ListWarmPools", func(ctx context.Context, c *Conn) error {
		return connUnary(c.Sandboxes.ListWarmPools(ctx, req(&dsecv1.ListWarmPoolsRequest{})))
	}},
	{"ImportLayer", func(ctx context.Context, c *Conn) error {
		return connUnary(c.Layers.ImportLayer(ctx, req(&dsecv1.ImportLayerRequest{})))
	}},
	{"ListLayers", func(ctx context.Context, c *Conn) error {
		return connUnary(c.Layers.ListLayers(ctx, req(&dsecv1.ListLayersRequest{})))
	}},
	{"ListEnvironments", func(ctx context.Context, c *Conn) error {
		return connUnary(c.Layers.ListEnvironments(ctx, req(&dsecv1.ListEnvironmentsRequest{})))
	}},
	{"LayerStats", func(ctx context.Context, c *Conn) error {
		return connUnary(c.Layers.LayerStats(ctx, req(&dsecv1.LayerStatsRequest{})))
	}},
	{"ImportImage", func(ctx context.Context, c *Conn) error {
		return connDrain(c.Layers.ImportImage(ctx, req(&dsecv1.ImportImageRequest{})))
	}},
}

// TestConnFailoverBeforeAServer: the first address refuses connections, so
// every call, the streams and the shell included, goes on to the second.
func TestConnFailoverBeforeAServer(t *testing.T) {
	noToken(t)
	s := &apiserver{}
	srv := startAPIServer(t, s, false)
	c := dialConn(t, closedAddr(t)+","+srv.URL, DialOptions{})
	for _, tc := range everyConnCall {
		t.Run(tc.name, func(t *testing.T) {
			c.pool.cur.Store(0) // start each call on the closed address
			before, _, _ := s.got()
			if err := tc.call(t.Context(), c); err != nil {
				t.Fatalf("%s: %v", tc.name, err)
			}
			if after, _, _ := s.got(); !slices.Equal(after[len(before):], []string{tc.name}) {
				t.Fatalf("the second server got %v, want %s once", after[len(before):], tc.name)
			}
		})
	}
}

// TestConnFailoverOnUnavailable: a server that answers Unavailable sends the
// calls that may repeat to the next address, a keyed create with the same
// key; an exec, a write, a create without a key are not sent again.
func TestConnFailoverOnUnavailable(t *testing.T) {
	noToken(t)
	first, second := &apiserver{}, &apiserver{}
	first.setDown(true, 0)
	s1, s2 := startAPIServer(t, first, false), startAPIServer(t, second, false)
	c := dialConn(t, s1.URL+","+s2.URL, DialOptions{})
	p := c.pool
	ctx := t.Context()
	again := map[string]bool{"Create": true, "Get": true, "List": true, "Delete": true, "Attach": true, "ListProcesses": true,
		"ReadFile": true, "ListDir": true, "Stat": true, "Remove": true, "MakeDir": true, "Download": true, "WatchDir": true,
		"SetNetworkRules": true, "NetworkLog": true, "SetWarmPool": true, "ListWarmPools": true,
		"ListLayers": true, "ListEnvironments": true, "LayerStats": true}
	for _, tc := range everyConnCall {
		t.Run(tc.name, func(t *testing.T) {
			p.cur.Store(0)
			b1, _, _ := first.got()
			b2, _, _ := second.got()
			err := tc.call(ctx, c)
			a1, _, _ := first.got()
			a2, _, _ := second.got()
			if !slices.Equal(a1[len(b1):], []string{tc.name}) {
				t.Fatalf("the first server got %v, want %s once", a1[len(b1):], tc.name)
			}
			if again[tc.name] {
				if err != nil || !slices.Equal(a2[len(b2):], []string{tc.name}) {
					t.Fatalf("%s: %v; the second server got %v, want it once", tc.name, err, a2[len(b2):])
				}
				return
			}
			if connect.CodeOf(err) != connect.CodeUnavailable || len(a2) != len(b2) {
				t.Fatalf("%s: %v, want unavailable; the second server got %v", tc.name, err, a2[len(b2):])
			}
		})
	}
	_, _, k1 := first.got()
	_, _, k2 := second.got()
	if !slices.Equal(k1, []string{"k"}) || !slices.Equal(k2, []string{"k"}) {
		t.Fatalf("idempotency keys: first %v, second %v; want k on both", k1, k2)
	}
	p.cur.Store(0)
	if err := connUnary(c.Sandboxes.Create(ctx, req(&dsecv1.CreateRequest{}))); connect.CodeOf(err) != connect.CodeUnavailable {
		t.Fatalf("Create without a key: %v, want it not sent again", err)
	}
	if _, _, k2 := second.got(); len(k2) != 1 {
		t.Fatalf("a create without a key went on to the second server")
	}

	// A proxy in front of a dead apiserver answers 503 with no Connect body.
	proxy := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) {
		http.Error(w, "no healthy upstream", http.StatusBadGateway)
	}))
	defer proxy.Close()
	pc := dialConn(t, proxy.URL+","+s2.URL, DialOptions{})
	if err := connUnary(pc.Layers.ListLayers(ctx, req(&dsecv1.ListLayersRequest{}))); err != nil {
		t.Fatalf("ListLayers behind a 502 proxy: %v", err)
	}
	if err := connDrain(pc.Sandboxes.Download(ctx, req(&dsecv1.DownloadRequest{}))); err != nil {
		t.Fatalf("Download behind a 502 proxy: %v", err)
	}
}

// TestConnOneAddressUnchanged: with one address nothing is sent twice.
func TestConnOneAddressUnchanged(t *testing.T) {
	noToken(t)
	s := &apiserver{}
	s.setDown(true, 0)
	c := dialConn(t, startAPIServer(t, s, false).URL, DialOptions{})
	if err := connUnary(c.Sandboxes.Get(t.Context(), req(&dsecv1.GetRequest{}))); connect.CodeOf(err) != connect.CodeUnavailable {
		t.Fatalf("Get: %v", err)
	}
	if calls, _, _ := s.got(); len(calls) != 1 {
		t.Fatalf("calls: %v", calls)
	}
	c = dialConn(t, closedAddr(t), DialOptions{})
	err := connUnary(c.Sandboxes.Get(t.Context(), req(&dsecv1.GetRequest{})))
	if connect.CodeOf(err) != connect.CodeUnavailable || !Unreachable(err) || !strings.Contains(err.Error(), "connect: connection refused") {
		t.Fatalf("Get of a closed address: %v", err)
	}
}

// TestConnToken: the token goes on unary, server-stream and bidi calls and on
// Clients.HTTP, from the option, else $DSEC_TOKEN, else $DSEC_TOKEN_FILE,
// else the node's token file.
func TestConnToken(t *testing.T) {
	noToken(t)
	s := &apiserver{}
	srv := startAPIServer(t, s, false)
	dir := t.TempDir()
	file := filepath.Join(dir, "token")
	os.WriteFile(file, []byte("from-file\n"), 0o600)
	node := filepath.Join(dir, "admin.token")
	os.WriteFile(node, []byte("from-node\n"), 0o600)

	tests := []struct {
		name                        string
		opt, env, envFile, nodeFile string
		want                        string
	}{
		{name: "option wins", opt: "from-option", env: "from-env", envFile: file, nodeFile: node, want: "Bearer from-option"},
		{name: "env", env: "from-env", envFile: file, nodeFile: node, want: "Bearer from-env"},
		{name: "env file", envFile: file, nodeFile: node, want: "Bearer from-file"},
		{name: "node file", nodeFile: node, want: "Bearer from-node"},
		{name: "none", nodeFile: filepath.Join(dir, "absent"), want: ""},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			t.Setenv("DSEC_TOKEN", tt.env)
			t.Setenv("DSEC_TOKEN_FILE", tt.envFile)
			defaultTokenFile = tt.nodeFile
			c := dialConn(t, srv.URL, DialOptions{Token: tt.opt})
			before, _, _ := s.got()
			ctx := t.Context()
			if err := connUnary(c.Sandboxes.Get(ctx, req(&dsecv1.GetRequest{}))); err != nil {
				t.Fatal(err)
			}
			if err := connDrain(c.Sandboxes.Exec(ctx, req(&dsecv1.ExecRequest{}))); err != nil {
				t.Fatal(err)
			}
			if err := connShell(ctx, c); err != nil {
				t.Fatal(err)
			}
			calls, auth, _ := s.got()
			if !slices.Equal(calls[len(before):], []string{"Get", "Exec", "Shell"}) {
				t.Fatalf("calls %v", calls[len(before):])
			}
			for i := len(before); i < len(calls); i++ {
				if auth[i] != tt.want {
					t.Errorf("%s carried Authorization %q, want %q", calls[i], auth[i], tt.want)
				}
			}
		})
	}

	t.Run("HTTP", func(t *testing.T) {
		var got string
		hs := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { got = r.Header.Get("Authorization") }))
		defer hs.Close()
		c := dialConn(t, closedAddr(t)+","+hs.URL, DialOptions{Token: "t0"})
		resp, err := c.HTTP.Get(c.BaseURL + "/healthz")
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
		if got != "Bearer t0" {
			t.Fatalf("Authorization %q", got)
		}
	})
	t.Run("unreadable env file", func(t *testing.T) {
		t.Setenv("DSEC_TOKEN", "")
		t.Setenv("DSEC_TOKEN_FILE", filepath.Join(dir, "absent"))
		if _, err := Dial(srv.URL, DialOptions{}); !errors.Is(err, ErrInvalidArgument) || !strings.Contains(err.Error(), "DSEC_TOKEN_FILE") {
			t.Fatalf("Dial = %v, want an error naming $DSEC_TOKEN_FILE", err)
		}
	})
	t.Run("bad token", func(t *testing.T) {
		t.Setenv("DSEC_TOKEN", "two words")
		if _, err := Dial(srv.URL, DialOptions{}); !errors.Is(err, ErrInvalidArgument) || strings.Contains(err.Error(), "two words") {
			t.Fatalf("Dial = %v, want an error without the token", err)
		}
	})
}

// TestConnUnauthenticated: not sent again, not failed over, and the message
// says where the token came from without it.
func TestConnUnauthenticated(t *testing.T) {
	noToken(t)
	first, second := &apiserver{}, &apiserver{}
	first.setDown(true, connect.CodeUnauthenticated)
	s1, s2 := startAPIServer(t, first, false), startAPIServer(t, second, false)
	for _, tc := range []struct {
		o        DialOptions
		env      string
		nodeFile string // the default root's token file holds this
		want     string
	}{
		{o: DialOptions{Token: "s3cret-flag", TokenName: "--token"}, want: "token from --token"},
		{env: "s3cret-env", want: "token from $DSEC_TOKEN"},
		{want: "no token sent"},
		{nodeFile: "s3cret-node", want: "default root's: a dsecd started with --root DIR keeps its own in DIR/admin.token, so export DSEC_TOKEN_FILE=DIR/admin.token"},
	} {
		t.Setenv("DSEC_TOKEN", tc.env)
		if tc.nodeFile != "" {
			defaultTokenFile = filepath.Join(t.TempDir(), "admin.token")
			if err := os.WriteFile(defaultTokenFile, []byte(tc.nodeFile+"\n"), 0o600); err != nil {
				t.Fatal(err)
			}
		}
		c := dialConn(t, s1.URL+","+s2.URL, tc.o)
		for _, name := range []string{"Get", "Attach", "Shell"} {
			i := slices.IndexFunc(everyConnCall, func(c struct {
				name string
				call func(ctx context.Context, c *Conn) error
			}) bool {
				return c.name == name
			})
			err := everyConnCall[i].call(t.Context(), c)
			if connect.CodeOf(err) != connect.CodeUnauthenticated {
				t.Fatalf("%s: %v, want unauthenticated", name, err)
			}
			if msg := err.Error(); !strings.Contains(msg, tc.want) || strings.Contains(msg, "s3cret") {
				t.Fatalf("%s: message %q: want %q and not the token", name, msg, tc.want)
			}
		}
	}
	if calls, _, _ := first.got(); len(calls) != 12 {
		t.Fatalf("first server got %v, want each call once", calls)
	}
	if calls, _, _ := second.got(); len(calls) != 0 {
		t.Fatalf("second server got %v", calls)
	}
}

// TestConnHTTPS: https:// addresses are verified with Options.CAFile or
// $DSEC_CA_FILE, over HTTP/1.1 and HTTP/2 (the shell); a failed handshake
// goes on to the next address.
func TestConnHTTPS(t *testing.T) {
	noToken(t)
	s := &apiserver{}
	srv := startAPIServer(t, s, true)
	ca := filepath.Join(t.TempDir(), "ca.pem")
	os.WriteFile(ca, pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: srv.Certificate().Raw}), 0o644)

	c := dialConn(t, srv.URL, DialOptions{})
	var uae x509.UnknownAuthorityError
	if err := connUnary(c.Sandboxes.Get(t.Context(), req(&dsecv1.GetRequest{}))); !errors.As(err, &uae) {
		t.Fatalf("Get without the CA: %v, want an unknown authority", err)
	}
	c = dialConn(t, srv.URL, DialOptions{CAFile: ca})
	if err := connUnary(c.Sandboxes.Get(t.Context(), req(&dsecv1.GetRequest{}))); err != nil {
		t.Fatalf("Get with Options.CAFile: %v", err)
	}

	// A plain HTTP server named https:// fails the handshake: on to the next.
	plain := startAPIServer(t, &apiserver{}, false)
	t.Setenv("DSEC_CA_FILE", ca)
	c = dialConn(t, "https://"+strings.TrimPrefix(plain.URL, "http://")+","+srv.URL, DialOptions{})
	if err := connDrain(c.Sandboxes.Exec(t.Context(), req(&dsecv1.ExecRequest{}))); err != nil {
		t.Fatalf("Exec after a failed handshake: %v", err)
	}
	c.pool.cur.Store(0)
	if err := connShell(t.Context(), c); err != nil {
		t.Fatalf("Shell over TLS after a failed handshake: %v", err)
	}

	t.Setenv("DSEC_CA_FILE", filepath.Join(t.TempDir(), "absent.pem"))
	if _, err := Dial(srv.URL, DialOptions{}); !errors.Is(err, ErrInvalidArgument) {
		t.Fatalf("Dial with a missing CA file: %v", err)
	}
}

// TestConnAddressLists: lists parse, and a bad entry is refused.
func TestConnAddressLists(t *testing.T) {
	noToken(t)
	c := dialConn(t, " 127.0.0.1:1 , unix:///run/d.sock,https://h:443/api/ ", DialOptions{})
	var got []string
	for _, ep := range c.pool.eps {
		got = append(got, ep.scheme+"://"+ep.host+ep.prefix)
	}
	if want := []string{"http://127.0.0.1:1", "http://dsecd", "https://h:443/api"}; !slices.Equal(got, want) {
		t.Fatalf("endpoints %v, want %v", got, want)
	}
	if c.BaseURL != "http://127.0.0.1:1" {
		t.Fatalf("BaseURL %q", c.BaseURL)
	}
	for _, bad := range []string{"127.0.0.1:1,,127.0.0.1:2", "127.0.0.1:1,ftp://x:1", "a:1,nohost", "unix://"} {
		if _, err := Dial(bad, DialOptions{}); !errors.Is(err, ErrInvalidArgument) {
			t.Errorf("Dial(%q) = %v, want ErrInvalidArgument", bad, err)
		}
	}
}

package dsec

import (
	"context"
	"crypto/x509"
	"encoding/pem"
	"errors"
	"io"
	"log"
	"net"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"connectrpc.com/connect"

	dsecv1 "dsec.dev/dsec/api/gen/dsec/v1"
	"dsec.dev/dsec/api/gen/dsec/v1/dsecv1connect"
)

// apiserver answers every call the SDK makes, records each one with its
// Authorization header, and answers Unavailable to all of them while down.
type apiserver struct {
	dsecv1connect.UnimplementedSandboxServiceHandler
	layers layerServer

	mu    sync.Mutex
	calls []string // procedure names, e.g. "Get"
	auth  []string // the Authorization header of each call
	keys  []string // idempotency keys of the creates
	down  bool
	code  connect.Code // the answer while down (default Unavailable)
}

type layerServer struct {
	dsecv1connect.UnimplementedLayerServiceHandler
}

func (s *apiserver) record(procedure, auth string, msg any) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	if r, ok := msg.(*dsecv1.CreateRequest); ok {
		s.keys = append(s.keys, r.GetIdempotencyKey())
	}
	s.calls = append(s.calls, procedure[strings.LastIndex(procedure, "/")+1:])
	s.auth = append(s.auth, auth)
	if s.down {
		code := s.code
		if code == 0 {
			code = connect.CodeUnavailable
		}
		return connect.NewError(code, errors.New("apiserver is draining"))
	}
	return nil
}

func (s *apiserver) setDown(down bool, code connect.Code) {
	s.mu.Lock()
	s.down, s.code = down, code
	s.mu.Unlock()
}

func (s *apiserver) got() (calls, auth, keys []string) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return slices.Clone(s.calls), slices.Clone(s.auth), slices.Clone(s.keys)
}

func (s *apiserver) WrapUnary(next connect.UnaryFunc) connect.UnaryFunc {
	return func(ctx context.Context, req connect.AnyRequest) (connect.AnyResponse, error) {
		if err := s.record(req.Spec().Procedure, req.Header().Get("Authorization"), req.Any()); err != nil {
			return nil, err
		}
		return next(ctx, req)
	}
}

func (s *apiserver) WrapStreamingClient(next connect.StreamingClientFunc) connect.StreamingClientFunc {
	return next
}

func (s *apiserver) WrapStreamingHandler(next connect.StreamingHandlerFunc) connect.StreamingHandlerFunc {
	return func(ctx context.Context, conn connect.StreamingHandlerConn) error {
		if err := s.record(conn.Spec().Procedure, conn.RequestHeader().Get("Authorization"), nil); err != nil {
			return err
		}
		return next(ctx, conn)
	}
}

func ok[T any](m *T) (*connect.Response[T], error) { return connect.NewResponse(m), nil }

func (s *apiserver) Create(context.Context, *connect.Request[dsecv1.CreateRequest]) (*connect.Response[dsecv1.CreateResponse], error) {
	return ok(&dsecv1.CreateResponse{Sandboxes: []*dsecv1.Sandbox{{Id: "sb-n-1", State: dsecv1.State_STATE_RUNNING}}})
}

func (s *apiserver) Get(_ context.Context, r *connect.Request[dsecv1.GetRequest]) (*connect.Response[dsecv1.Sandbox], error) {
	return ok(&dsecv1.Sandbox{Id: r.Msg.GetId(), State: dsecv1.State_STATE_RUNNING})
}

func (s *apiserver) List(context.Context, *connect.Request[dsecv1.ListRequest]) (*connect.Response[dsecv1.ListResponse], error) {
	return ok(&dsecv1.ListResponse{})
}

func (s *apiserver) Delete(context.Context, *connect.Request[dsecv1.DeleteRequest]) (*connect.Response[dsecv1.DeleteResponse], error) {
	return ok(&dsecv1.DeleteResponse{})
}

func (s *apiserver) Exec(_ context.Context, r *connect.Request[dsecv1.ExecRequest], st *connect.ServerStream[dsecv1.ExecEvent]) error {
	st.Send(&dsecv1.ExecEvent{Event: &dsecv1.ExecEvent_Started{Started: &dsecv1.ExecStarted{ProcessId: "p1", Pid: 7}}})
	if r.Msg.GetBackground() {
		return nil
	}
	st.Send(&dsecv1.ExecEvent{Event: &dsecv1.ExecEvent_Stdout{Stdout: []byte("hi\n")}})
	return st.Send(exitedEvent(dsecv1.ExitStatus_EXIT_STATUS_OK, 0))
}

func (s *apiserver) Attach(_ context.Context, _ *connect.Request[dsecv1.AttachRequest], st *connect.ServerStream[dsecv1.ExecEvent]) error {
	st.Send(&dsecv1.ExecEvent{Event: &dsecv1.ExecEvent_Started{Started: &dsecv1.ExecStarted{ProcessId: "p1", Pid: 7}}})
	return st.Send(exitedEvent(dsecv1.ExitStatus_EXIT_STATUS_OK, 0))
}

func (s *apiserver) WriteStdin(context.Context, *connect.Request[dsecv1.WriteStdinRequest]) (*connect.Response[dsecv1.WriteStdinResponse], error) {
	return ok(&dsecv1.WriteStdinResponse{})
}

func (s *apiserver) Signal(context.Context, *connect.Request[dsecv1.SignalRequest]) (*connect.Response[dsecv1.SignalResponse], error) {
	return ok(&dsecv1.SignalResponse{})
}

func (s *apiserver) ListProcesses(context.Context, *connect.Request[dsecv1.ListProcessesRequest]) (*connect.Response[dsecv1.ListProcessesResponse], error) {
	return ok(&dsecv1.ListProcessesResponse{Processes: []*dsecv1.ProcessInfo{{ProcessId: "p1", Running: true}}})
}

func (s *apiserver) SessionRun(_ context.Context, _ *connect.Request[dsecv1.SessionRunRequest], st *connect.ServerStream[dsecv1.ExecEvent]) error {
	return st.Send(exitedEvent(dsecv1.ExitStatus_EXIT_STATUS_OK, 0))
}

func (s *apiserver) SessionInterrupt(context.Context, *connect.Request[dsecv1.SessionInterruptRequest]) (*connect.Response[dsecv1.SessionInterruptResponse], error) {
	return ok(&dsecv1.SessionInterruptResponse{})
}

func (s *apiserver) SessionClose(context.Context, *connect.Request[dsecv1.SessionCloseRequest]) (*connect.Response[dsecv1.SessionCloseResponse], error) {
	return ok(&dsecv1.SessionCloseResponse{})
}

func (s *apiserver) ReadFile(context.Context, *connect.Request[dsecv1.ReadFileRequest]) (*connect.Response[dsecv1.ReadFileResponse], error) {
	return ok(&dsecv1.ReadFileResponse{Data: []byte("content")})
}

func (s *apiserver) WriteFile(_ context.Context, r *connect.Request[dsecv1.WriteFileRequest]) (*connect.Response[dsecv1.WriteFileResponse], error) {
	return ok(&dsecv1.WriteFileResponse{Written: int64(len(r.Msg.GetData()))})
}

func (s *apiserver) ListDir(context.Context, *connect.Request[dsecv1.ListDirRequest]) (*connect.Response[dsecv1.ListDirResponse], error) {
	return ok(&dsecv1.ListDirResponse{})
}

func (s *apiserver) Stat(context.Context, *connect.Request[dsecv1.StatRequest]) (*connect.Response[dsecv1.StatResponse], error) {
	return ok(&dsecv1.StatResponse{Info: &dsecv1.FileInfo{Name: "x"}})
}

func (s *apiserver) Remove(context.Context, *connect.Request[dsecv1.RemoveRequest]) (*connect.Response[dsecv1.RemoveResponse], error) {
	return ok(&dsecv1.RemoveResponse{})
}

func (s *apiserver) MakeDir(context.Context, *connect.Request[dsecv1.MakeDirRequest]) (*connect.Response[dsecv1.MakeDirResponse], error) {
	return ok(&dsecv1.MakeDirResponse{})
}

func (s *apiserver) Shell(_ context.Context, st *connect.BidiStream[dsecv1.ShellInput, dsecv1.ShellOutput]) error {
	in, err := st.Receive()
	if err != nil {
		return err
	}
	if in.GetStart().GetSandboxId() == "" {
		return connect.NewError(connect.CodeInvalidArgument, errors.New("no start"))
	}
	st.Send(&dsecv1.ShellOutput{Output: &dsecv1.ShellOutput_Data{Data: []byte("$ ")}})
	return st.Send(&dsecv1.ShellOutput{Output: &dsecv1.ShellOutput_Exited{Exited: &dsecv1.ExecExited{Status: dsecv1.ExitStatus_EXIT_STATUS_OK}}})
}

func (s *apiserver) Move(context.Context, *connect.Request[dsecv1.MoveRequest]) (*connect.Response[dsecv1.MoveResponse], error) {
	return ok(&dsecv1.MoveResponse{Info: &dsecv1.FileInfo{Name: "b"}})
}

func (s *apiserver) WatchDir(_ context.Context, _ *connect.Request[dsecv1.WatchDirRequest], st *connect.ServerStream[dsecv1.WatchEvent]) error {
	return st.Send(&dsecv1.WatchEvent{Started: true})
}

func (s *apiserver) Upload(context.Context, *connect.Request[dsecv1.UploadRequest]) (*connect.Response[dsecv1.UploadResponse], error) {
	return ok(&dsecv1.UploadResponse{Files: 1})
}

func (s *apiserver) Download(_ context.Context, _ *connect.Request[dsecv1.DownloadRequest], st *connect.ServerStream[dsecv1.DownloadChunk]) error {
	return st.Send(&dsecv1.DownloadChunk{Data: []byte("tar")})
}

func (s *apiserver) SetNetworkRules(context.Context, *connect.Request[dsecv1.SetNetworkRulesRequest]) (*connect.Response[dsecv1.SetNetworkRulesResponse], error) {
	return ok(&dsecv1.SetNetworkRulesResponse{})
}

func (s *apiserver) NetworkLog(context.Context, *connect.Request[dsecv1.NetworkLogRequest]) (*connect.Response[dsecv1.NetworkLogResponse], error) {
	return ok(&dsecv1.NetworkLogResponse{})
}

func (s *apiserver) SetWarmPool(_ context.Context, r *connect.Request[dsecv1.SetWarmPoolRequest]) (*connect.Response[dsecv1.WarmPool], error) {
	return ok(&dsecv1.WarmPool{Spec: r.Msg.GetSpec(), Size: r.Msg.GetSize()})
}

func (s *apiserver) ListWarmPools(context.Context, *connect.Request[dsecv1.ListWarmPoolsRequest]) (*connect.Response[dsecv1.ListWarmPoolsResponse], error) {
	return ok(&dsecv1.ListWarmPoolsResponse{})
}

func (layerServer) ImportLayer(_ context.Context, r *connect.Request[dsecv1.ImportLayerRequest]) (*connect.Response[dsecv1.Layer], error) {
	return ok(&dsecv1.Layer{Refs: []string{r.Msg.GetRef()}})
}

func (layerServer) UploadLayer(_ context.Context, st *connect.ClientStream[dsecv1.UploadLayerRequest]) (*connect.Response[dsecv1.Layer], error) {
	for st.Receive() {
	}
	return ok(&dsecv1.Layer{})
}

func (layerServer) ListLayers(context.Context, *connect.Request[dsecv1.ListLayersRequest]) (*connect.Response[dsecv1.ListLayersResponse], error) {
	return ok(&dsecv1.ListLayersResponse{})
}

func (layerServer) ListEnvironments(context.Context, *connect.Request[dsecv1.ListEnvironmentsRequest]) (*connect.Response[dsecv1.ListEnvironmentsResponse], error) {
	return ok(&dsecv1.ListEnvironmentsResponse{})
}

func (layerServer) LayerStats(context.Context, *connect.Request[dsecv1.LayerStatsRequest]) (*connect.Response[dsecv1.LayerStatsResponse], error) {
	return ok(&dsecv1.LayerStatsResponse{})
}

func (layerServer) ImportImage(_ context.Context, _ *connect.Request[dsecv1.ImportImageRequest], st *connect.ServerStream[dsecv1.ImportImageProgress]) error {
	return st.Send(&dsecv1.ImportImageProgress{Done: true})
}

// startAPIServer serves s on 127.0.0.1 (tls: with httptest's certificate).
func startAPIServer(t *testing.T, s *apiserver, tls bool) *httptest.Server {
	t.Helper()
	mux := http.NewServeMux()
	opt := connect.WithInterceptors(s)
	mux.Handle(dsecv1connect.NewSandboxServiceHandler(s, opt))
	mux.Handle(dsecv1connect.NewLayerServiceHandler(s.layers, opt))
	srv := httptest.NewUnstartedServer(mux)
	srv.Config.ErrorLog = log.New(io.Discard, "", 0) // failed handshakes are what some tests are about
	srv.Config.Protocols = new(http.Protocols)       // as dsecd serves it: HTTP/1.1 and HTTP/2
	srv.Config.Protocols.SetHTTP1(true)
	srv.Config.Protocols.SetUnencryptedHTTP2(true)
	srv.EnableHTTP2 = true
	if tls {
		srv.StartTLS()
	} else {
		srv.Start()
	}
	t.Cleanup(srv.Close)
	return srv
}

// closedAddr is a loopback address nothing listens on.
func closedAddr(t *testing.T) string {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := ln.Addr().String()
	ln.Close()
	return addr
}

// noToken keeps the environment and the node's token file out of a test.
func noToken(t *testing.T) {
	t.Setenv("DSEC_TOKEN", "")
	t.Setenv("DSEC_TOKEN_FILE", "")
	t.Setenv("DSEC_CA_FILE", "")
	old := defaultTokenFile
	defaultTokenFile = filepath.Join(t.TempDir(), "absent.token")
	t.Cleanup(func() { defaultTokenFile = old })
}

// everyCall makes each kind of call the SDK has once.
var everyCall = []struct {
	name string
	call func(ctx context.Context, t *testing.T, c *Client) error
}{
	{"Create", func(ctx context.Context, _ *testing.T, c *Client) error {
		_, err := c.Create(ctx, "e", nil)
		return err
	}},
	{"Get", func(ctx context.Context, _ *testing.T, c *Client) error { _, err := c.Get(ctx, "sb-n-1"); return err }},
	{"List", func(ctx context.Context, _ *testing.T, c *Client) error { _, err := c.List(ctx, nil); return err }},
	{"Delete", func(ctx context.Context, _ *testing.T, c *Client) error { return c.Delete(ctx, "sb-n-1") }},
	{"Exec", func(ctx context.Context, _ *testing.T, c *Client) error {
		res, err := c.Sandbox("sb-n-1").Exec(ctx, Sh("echo hi"), nil)
		if err == nil && string(res.Stdout) != "hi\n" {
			return errors.New("exec: stdout " + string(res.Stdout))
		}
		return err
	}},
	{"ExecStream", func(ctx context.Context, _ *testing.T, c *Client) error {
		x, err := c.Sandbox("sb-n-1").ExecStream(ctx, Sh("echo hi"), nil)
		if err != nil {
			return err
		}
		for x.Next() {
		}
		return x.Err()
	}},
	{"Spawn", func(ctx context.Context, _ *testing.T, c *Client) error {
		_, err := c.Sandbox("sb-n-1").Spawn(ctx, Sh("sleep 1"), nil)
		return err
	}},
	{"Wait", func(ctx context.Context, _ *testing.T, c *Client) error {
		_, err := c.Sandbox("sb-n-1").Job("p1", "").Wait(ctx)
		return err
	}},
	{"Output", func(ctx context.Context, _ *testing.T, c *Client) error {
		_, err := c.Sandbox("sb-n-1").Job("p1", "").Output(ctx)
		return err
	}},
	{"WriteStdin", func(ctx context.Context, _ *testing.T, c *Client) error {
		return c.Sandbox("sb-n-1").Job("p1", "").WriteStdin(ctx, []byte("x"), true)
	}},
	{"Kill", func(ctx context.Context, _ *testing.T, c *Client) error {
		return c.Sandbox("sb-n-1").Job("p1", "").Kill(ctx, 9)
	}},
	{"Processes", func(ctx context.Context, _ *testing.T, c *Client) error {
		_, err := c.Sandbox("sb-n-1").Processes(ctx)
		return err
	}},
	{"SessionRun", func(ctx context.Context, _ *testing.T, c *Client) error {
		_, err := c.Sandbox("sb-n-1").Session("s").Run(ctx, "cd /", 0)
		return err
	}},
	{"SessionInterrupt", func(ctx context.Context, _ *testing.T, c *Client) error {
		return c.Sandbox("sb-n-1").Session("s").Interrupt(ctx)
	}},
	{"SessionClose", func(ctx context.Context, _ *testing.T, c *Client) error {
		return c.Sandbox("sb-n-1").Session("s").Close(ctx)
	}},
	{"ReadFile", func(ctx context.Context, _ *testing.T, c *Client) error {
		_, err := c.Sandbox("sb-n-1").ReadFile(ctx, "/x")
		return err
	}},
	{"WriteFile", func(ctx context.Context, _ *testing.T, c *Client) error {
		return c.Sandbox("sb-n-1").WriteFile(ctx, "/x", []byte("1"), 0)
	}},
	{"ListDir", func(ctx context.Context, _ *testing.T, c *Client) error {
		_, err := c.Sandbox("sb-n-1").ListDir(ctx, "/")
		return err
	}},
	{"Stat", func(ctx context.Context, _ *testing.T, c *Client) error {
		_, err := c.Sandbox("sb-n-1").Stat(ctx, "/x")
		return err
	}},
	{"Remove", func(ctx context.Context, _ *testing.T, c *Client) error {
		return c.Sandbox("sb-n-1").Remove(ctx, "/x", false)
	}},
	{"MakeDir", func(ctx context.Context, _ *testing.T, c *Client) error {
		return c.Sandbox("sb-n-1").MkdirAll(ctx, "/d", 0o755)
	}},
	{"Upload", func(ctx context.Context, t *testing.T, c *Client) error {
		f := filepath.Join(t.TempDir(), "f")
		os.WriteFile(f, []byte("x"), 0o644)
		_, err := c.Sandbox("sb-n-1").Upload(ctx, f, "/d")
		return err
	}},
	{"Download", func(ctx context.Context, _ *testing.T, c *Client) error {
		_, err := c.Sandbox("sb-n-1").DownloadTar(ctx, "/d")
		return err
	}},
	{"SetNetworkRules", func(ctx context.Context, _ *testing.T, c *Client) error {
		_, err := c.Sandbox("sb-n-1").SetNetworkRules(ctx, map[string]bool{"pypi": true}, false)
		return err
	}},
	{"NetworkLog", func(ctx context.Context, _ *testing.T, c *Client) error {
		_, err := c.Sandbox("sb-n-1").NetworkLog(ctx, time.Time{}, 0)
		return err
	}},
	{"SetWarmPool", func(ctx context.Context, _ *testing.T, c *Client) error {
		_, err := c.SetWarmPool(ctx, "e", 1, nil)
		return err
	}},
	{"ListWarmPools", func(ctx context.Context, _ *testing.T, c *Client) error { _, err := c.WarmPools(ctx); return err }},
	{"ImportLayer", func(ctx context.Context, _ *testing.T, c *Client) error {
		_, err := c.ImportLayer(ctx, "b:1", dsecv1.LayerKind_LAYER_KIND_BASE, "/x", nil)
		return err
	}},
	{"UploadLayer", func(ctx context.Context, t *testing.T, c *Client) error {
		f := filepath.Join(t.TempDir(), "layer.tar")
		os.WriteFile(f, []byte("x"), 0o644)
		_, err := c.ImportLayer(ctx, "b:1", dsecv1.LayerKind_LAYER_KIND_BASE, f, &LayerOptions{Upload: true})
		return err
	}},
	{"ListLayers", func(ctx context.Context, _ *testing.T, c *Client) error { _, err := c.ListLayers(ctx); return err }},
	{"ListEnvironments", func(ctx context.Context, _ *testing.T, c *Client) error {
		_, err := c.ListEnvironments(ctx)
		return err
	}},
	{"LayerStats", func(ctx context.Context, _ *testing.T, c *Client) error { _, err := c.LayerStats(ctx); return err }},
	{"ImportImage", func(ctx context.Context, _ *testing.T, c *Client) error {
		_, err := c.ImportImage(ctx, "i:1", "oci:/x", nil)
		return err
	}},
}

// procedureOf names the procedure of the calls of everyCall named otherwise.
var procedureOf = map[string]string{"ExecStream": "Exec", "Spawn": "Exec", "Wait": "Attach", "Output": "Attach",
	"Kill": "Signal", "Processes": "ListProcesses"}

// TestFailoverBeforeAServer: the first address refuses connections, so
// every call, Exec and writes included, goes on to the second, once.
func TestFailoverBeforeAServer(t *testing.T) {
	noToken(t)
	s := &apiserver{}
	srv := startAPIServer(t, s, false)
	c, err := NewClient(closedAddr(t)+","+srv.URL, WithTimeout(5*time.Second))
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	for _, tc := range everyCall {
		t.Run(tc.name, func(t *testing.T) {
			c.pool.cur.Store(0) // start each call on the closed address
			before, _, _ := s.got()
			if err := tc.call(t.Context(), t, c); err != nil {
				t.Fatalf("%s: %v", tc.name, err)
			}
			after, _, _ := s.got()
			want := tc.name
			if p, ok := procedureOf[tc.name]; ok {
				want = p
			}
			if got := after[len(before):]; len(got) == 0 || got[0] != want {
				t.Fatalf("the second server got %v, want %s first", got, want)
			}
			if cur := c.pool.cur.Load(); cur != 1 {
				t.Fatalf("current address is %d after the first refused, want 1", cur)
			}
		})
	}
}

// TestFailoverOnUnavailable: a server that answers Unavailable (itself, or
// as a proxy's 503) sends the calls that may repeat to the next address, a
// keyed create with the same key; an exec is not sent again.
func TestFailoverOnUnavailable(t *testing.T) {
	noToken(t)
	first, second := &apiserver{}, &apiserver{}
	first.setDown(true, 0)
	s1, s2 := startAPIServer(t, first, false), startAPIServer(t, second, false)
	c, err := NewClient(s1.URL+","+s2.URL, WithTimeout(5*time.Second))
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	ctx := t.Context()

	if _, err := c.Get(ctx, "sb-n-1"); err != nil {
		t.Fatalf("Get: %v", err)
	}
	if calls, _, _ := first.got(); !slices.Equal(calls, []string{"Get"}) {
		t.Fatalf("first server got %v", calls)
	}
	if c.pool.cur.Load() != 1 {
		t.Fatal("the client did not move to the second address")
	}

	c.pool.cur.Store(0)
	if _, err := c.Create(ctx, "e", &CreateOptions{IdempotencyKey: "key-1"}); err != nil {
		t.Fatalf("Create: %v", err)
	}
	_, _, k1 := first.got()
	_, _, k2 := second.got()
	if !slices.Equal(k1, []string{"key-1"}) || !slices.Equal(k2, k1) {
		t.Fatalf("keys: first %v, second %v; want key-1 on both", k1, k2)
	}
	c.pool.cur.Store(0)
	if _, err := c.Create(ctx, "e", nil); err != nil {
		t.Fatalf("Create: %v", err)
	}
	_, _, k1 = first.got()
	_, _, k2 = second.got()
	if len(k2) != 2 || k2[1] == "" || !slices.Equal(k1, k2) {
		t.Fatalf("keys: first %v, second %v; want the same made key on both", k1, k2)
	}

	c.pool.cur.Store(0)
	before, _, _ := second.got()
	if _, err := c.Sandbox("sb-n-1").Exec(ctx, Sh("touch /x"), nil); !errors.Is(err, ErrUnavailable) {
		t.Fatalf("Exec: %v, want ErrUnavailable", err)
	}
	if after, _, _ := second.got(); len(after) != len(before) {
		t.Fatalf("the exec went on to the second server: %v", after[len(before):])
	}
	for _, call := range []func() error{
		func() error { return c.Sandbox("sb-n-1").WriteFile(ctx, "/x", nil, 0) },
		func() error { return c.Sandbox("sb-n-1").Session("s").Close(ctx) },
	} {
		c.pool.cur.Store(0)
		if err := call(); !errors.Is(err, ErrUnavailable) {
			t.Fatalf("err = %v, want ErrUnavailable", err)
		}
	}
	if after, _, _ := second.got(); len(after) != len(before) {
		t.Fatalf("a write went on to the second server: %v", after[len(before):])
	}

	// A stream that may repeat (Attach) goes on too.
	c.pool.cur.Store(0)
	if _, err := c.Sandbox("sb-n-1").Job("p1", "").Wait(ctx); err != nil {
		t.Fatalf("Wait: %v", err)
	}

	// A proxy in front of a dead apiserver answers 503 with no Connect body.
	proxy := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) {
		http.Error(w, "no healthy upstream", http.StatusServiceUnavailable)
	}))
	defer proxy.Close()
	pc, err := NewClient(proxy.URL+","+s2.URL, WithTimeout(5*time.Second))
	if err != nil {
		t.Fatal(err)
	}
	defer pc.Close()
	if _, err := pc.ListLayers(ctx); err != nil {
		t.Fatalf("ListLayers behind a 503 proxy: %v", err)
	}
}

// TestFailoverAllDown: with every address answering Unavailable, a call
// that may repeat tries each once at once, then backs off, within its
// attempts; one that may not is sent once.
func TestFailoverAllDown(t *testing.T) {
	noToken(t)
	a, b := &apiserver{}, &apiserver{}
	a.setDown(true, 0)
	b.setDown(true, 0)
	sa, sb := startAPIServer(t, a, false), startAPIServer(t, b, false)
	c, err := NewClient(sa.URL+","+sb.URL, WithMaxRetries(3))
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	if _, err := c.Get(t.Context(), "sb-n-1"); !errors.Is(err, ErrUnavailable) {
		t.Fatalf("Get: %v", err)
	}
	ca, _, _ := a.got()
	cb, _, _ := b.got()
	if len(ca)+len(cb) != 4 || len(ca) != 2 || len(cb) != 2 {
		t.Fatalf("attempts: %d on the first, %d on the second; want 2 and 2", len(ca), len(cb))
	}
	if err := c.Sandbox("sb-n-1").WriteFile(t.Context(), "/x", nil, 0); !errors.Is(err, ErrUnavailable) {
		t.Fatalf("WriteFile: %v", err)
	}
	ca2, _, _ := a.got()
	cb2, _, _ := b.got()
	if len(ca2)+len(cb2) != 5 {
		t.Fatalf("WriteFile was sent %d times", len(ca2)+len(cb2)-4)
	}
}

// TestToken: the token goes on unary and streamed calls, from the option,
// else $DSEC_TOKEN, else $DSEC_TOKEN_FILE, else the node's token file.
func TestToken(t *testing.T) {
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
			var opts []Option
			if tt.opt != "" {
				opts = append(opts, WithToken(tt.opt))
			}
			c, err := NewClient(srv.URL, opts...)
			if err != nil {
				t.Fatal(err)
			}
			defer c.Close()
			before, _, _ := s.got()
			if _, err := c.Get(t.Context(), "sb-n-1"); err != nil {
				t.Fatal(err)
			}
			if _, err := c.Sandbox("sb-n-1").Exec(t.Context(), Sh("true"), nil); err != nil {
				t.Fatal(err)
			}
			if _, err := c.Sandbox("sb-n-1").DownloadTar(t.Context(), "/"); err != nil {
				t.Fatal(err)
			}
			calls, auth, _ := s.got()
			for i := len(before); i < len(calls); i++ {
				if auth[i] != tt.want {
					t.Errorf("%s carried Authorization %q, want %q", calls[i], auth[i], tt.want)
				}
			}
		})
	}

	t.Run("unreadable env file", func(t *testing.T) {
		t.Setenv("DSEC_TOKEN", "")
		t.Setenv("DSEC_TOKEN_FILE", filepath.Join(dir, "absent"))
		if _, err := NewClient(srv.URL); !errors.Is(err, ErrInvalidArgument) || !strings.Contains(err.Error(), "DSEC_TOKEN_FILE") {
			t.Fatalf("NewClient = %v, want an error naming $DSEC_TOKEN_FILE", err)
		}
	})
	t.Run("bad token", func(t *testing.T) {
		t.Setenv("DSEC_TOKEN", "two words")
		_, err := NewClient(srv.URL)
		if !errors.Is(err, ErrInvalidArgument) || strings.Contains(err.Error(), "two words") {
			t.Fatalf("NewClient = %v, want an error without the token", err)
		}
	})
}

// TestUnauthenticated: not retried, not failed over, and the message says
// where the token came from without it.
func TestUnauthenticated(t *testing.T) {
	noToken(t)
	first, second := &apiserver{}, &apiserver{}
	first.setDown(true, connect.CodeUnauthenticated)
	s1, s2 := startAPIServer(t, first, false), startAPIServer(t, second, false)
	t.Setenv("DSEC_TOKEN", "s3cret-token")
	c, err := NewClient(s1.URL + "," + s2.URL)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	for _, call := range []func() error{
		func() error { _, err := c.Get(t.Context(), "sb-n-1"); return err },
		func() error { _, err := c.Sandbox("sb-n-1").Exec(t.Context(), Sh("true"), nil); return err },
	} {
		err := call()
		if !errors.Is(err, ErrUnauthenticated) {
			t.Fatalf("err = %v, want ErrUnauthenticated", err)
		}
		if msg := err.Error(); !strings.Contains(msg, "$DSEC_TOKEN") || strings.Contains(msg, "s3cret") {
			t.Fatalf("message %q: want the token's source and not the token", msg)
		}
	}
	if calls, _, _ := first.got(); len(calls) != 2 {
		t.Fatalf("first server got %v, want each call once", calls)
	}
	if calls, _, _ := second.got(); len(calls) != 0 {
		t.Fatalf("second server got %v", calls)
	}
}

// TestHTTPS: https:// addresses are verified with the CA bundle of
// WithCAFile or $DSEC_CA_FILE; a failed handshake goes on to the next address.
func TestHTTPS(t *testing.T) {
	noToken(t)
	s := &apiserver{}
	srv := startAPIServer(t, s, true)
	ca := filepath.Join(t.TempDir(), "ca.pem")
	os.WriteFile(ca, pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: srv.Certificate().Raw}), 0o644)

	c, err := NewClient(srv.URL, WithTimeout(5*time.Second))
	if err != nil {
		t.Fatal(err)
	}
	var uae x509.UnknownAuthorityError
	if _, err := c.Get(t.Context(), "sb-n-1"); !errors.As(err, &uae) {
		t.Fatalf("Get without the CA: %v, want an unknown authority", err)
	}
	c.Close()

	c, err = NewClient(srv.URL, WithCAFile(ca))
	if err != nil {
		t.Fatal(err)
	}
	if _, err := c.Get(t.Context(), "sb-n-1"); err != nil {
		t.Fatalf("Get with WithCAFile: %v", err)
	}
	c.Close()

	// A plain HTTP server named https:// fails the handshake: on to the next.
	plain := startAPIServer(t, &apiserver{}, false)
	t.Setenv("DSEC_CA_FILE", ca)
	c, err = NewClient("https://" + strings.TrimPrefix(plain.URL, "http://") + "," + srv.URL)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	if _, err := c.Sandbox("sb-n-1").Exec(t.Context(), Sh("true"), nil); err != nil {
		t.Fatalf("Exec after a failed handshake: %v", err)
	}

	t.Setenv("DSEC_CA_FILE", filepath.Join(t.TempDir(), "absent.pem"))
	if _, err := NewClient(srv.URL); !errors.Is(err, ErrInvalidArgument) {
		t.Fatalf("NewClient with a missing CA file: %v", err)
	}
}

// TestAddressLists: lists parse, and a bad entry is refused by name.
func TestAddressLists(t *testing.T) {
	noToken(t)
	c, err := NewClient(" 127.0.0.1:1 , unix:///run/d.sock,https://h:443/api/ ")
	if err != nil {
		t.Fatal(err)
	}
	var got []string
	for _, ep := range c.pool.eps {
		got = append(got, ep.scheme+"://"+ep.host+ep.prefix)
	}
	if want := []string{"http://127.0.0.1:1", "http://dsecd", "https://h:443/api"}; !slices.Equal(got, want) {
		t.Fatalf("endpoints %v, want %v", got, want)
	}
	for _, bad := range []string{"127.0.0.1:1,,127.0.0.1:2", "127.0.0.1:1,ftp://x:1", "a:1,nohost"} {
		if _, err := NewClient(bad); !errors.Is(err, ErrInvalidArgument) {
			t.Errorf("NewClient(%q) = %v, want ErrInvalidArgument", bad, err)
		}
	}
}

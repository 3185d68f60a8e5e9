package apiclient

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

	"connectrpc.com/connect"

	dsecv1 "dsec.dev/dsec/api/gen/dsec/v1"
	"dsec.dev/dsec/api/gen/dsec/v1/dsecv1connect"
	"dsec.dev/dsec/internal/errdefs"
)

func exited() *dsecv1.ExecEvent {
	return &dsecv1.ExecEvent{Event: &dsecv1.ExecEvent_Exited{Exited: &dsecv1.ExecExited{Status: dsecv1.ExitStatus_EXIT_STATUS_OK}}}
}

// apiserver answers every call the clients make, records each one with its
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
	return st.Send(exited())
}

func (s *apiserver) Attach(_ context.Context, _ *connect.Request[dsecv1.AttachRequest], st *connect.ServerStream[dsecv1.ExecEvent]) error {
	st.Send(&dsecv1.ExecEvent{Event: &dsecv1.ExecEvent_Started{Started: &dsecv1.ExecStarted{ProcessId: "p1", Pid: 7}}})
	return st.Send(exited())
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
	return st.Send(exited())
}

func (s *apiserver) SessionInterrupt(context.Context, *connect.Request[dsecv1.SessionInterruptRequest]) (*connect.Response[dsecv1.SessionInterruptResponse], error) {
	return ok(&dsecv1.SessionInterruptResponse{})
}

func (s *apiserver) SessionClose(context.Context, *connect.Request[dsecv1.SessionCloseRequest]) (*connect.Response[dsecv1.SessionCloseResponse], error) {
	return ok(&dsecv1.SessionCloseResponse{})
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
	if tls {
		srv.EnableHTTP2 = true
		srv.StartTLS()
	} else {
		srv.Config.Protocols = new(http.Protocols)
		srv.Config.Protocols.SetHTTP1(true)
		srv.Config.Protocols.SetUnencryptedHTTP2(true)
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

func dial(t *testing.T, addr string, o Options) *Clients {
	t.Helper()
	c, err := DialWith(addr, o)
	if err != nil {
		t.Fatal(err)
	}
	return c
}

func unary[T any](_ *connect.Response[T], err error) error { return err }

func drain[T any](s *connect.ServerStreamForClient[T], err error) error {
	if err != nil {
		return err
	}
	defer s.Close()
	for s.Receive() {
	}
	return s.Err()
}

// shell opens a shell, sends its start and reads it to its exit status.
func shell(ctx context.Context, c *Clients) error {
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

// everyCall makes each call of the API once.
var everyCall = []struct {
	name string
	call func(ctx context.Context, c *Clients) error
}{
	{"Create", func(ctx context.Context, c *Clients) error {
		return unary(c.Sandboxes.Create(ctx, req(&dsecv1.CreateRequest{IdempotencyKey: "k"})))
	}},
	{"Get", func(ctx context.Context, c *Clients) error {
		return unary(c.Sandboxes.Get(ctx, req(&dsecv1.GetRequest{Id: "sb-n-1"})))
	}},
	{"List", func(ctx context.Context, c *Clients) error {
		return unary(c.Sandboxes.List(ctx, req(&dsecv1.ListRequest{})))
	}},
	{"Delete", func(ctx context.Context, c *Clients) error {
		return unary(c.Sandboxes.Delete(ctx, req(&dsecv1.DeleteRequest{})))
	}},
	{"Exec", func(ctx context.Context, c *Clients) error {
		return drain(c.Sandboxes.Exec(ctx, req(&dsecv1.ExecRequest{})))
	}},
	{"Attach", func(ctx context.Context, c *Clients) error {
		return drain(c.Sandboxes.Attach(ctx, req(&dsecv1.AttachRequest{})))
	}},
	{"WriteStdin", func(ctx context.Context, c *Clients) error {
		return unary(c.Sandboxes.WriteStdin(ctx, req(&dsecv1.WriteStdinRequest{})))
	}},
	{"Signal", func(ctx context.Context, c *Clients) error {
		return unary(c.Sandboxes.Signal(ctx, req(&dsecv1.SignalRequest{})))
	}},
	{"ListProcesses", func(ctx context.Context, c *Clients) error {
		return unary(c.Sandboxes.ListProcesses(ctx, req(&dsecv1.ListProcessesRequest{})))
	}},
	{"SessionRun", func(ctx context.Context, c *Clients) error {
		return drain(c.Sandboxes.SessionRun(ctx, req(&dsecv1.SessionRunRequest{})))
	}},
	{"SessionInterrupt", func(ctx context.Context, c *Clients) error {
		return unary(c.Sandboxes.SessionInterrupt(ctx, req(&dsecv1.SessionInterruptRequest{})))
	}},
	{"SessionClose", func(ctx context.Context, c *Clients) error {
		return unary(c.Sandboxes.SessionClose(ctx, req(&dsecv1.SessionCloseRequest{})))
	}},
	{"Shell", shell},
	{"ReadFile", func(ctx context.Context, c *Clients) error {
		return unary(c.Sandboxes.ReadFile(ctx, req(&dsecv1.ReadFileRequest{})))
	}},
	{"WriteFile", func(ctx context.Context, c *Clients) error {
		return unary(c.Sandboxes.WriteFile(ctx, req(&dsecv1.WriteFileRequest{Data: []byte("x")})))
	}},
	{"ListDir", func(ctx context.Context, c *Clients) error {
		return unary(c.Sandboxes.ListDir(ctx, req(&dsecv1.ListDirRequest{})))
	}},
	{"Stat", func(ctx context.Context, c *Clients) error {
		return unary(c.Sandboxes.Stat(ctx, req(&dsecv1.StatRequest{})))
	}},
	{"Remove", func(ctx context.Context, c *Clients) error {
		return unary(c.Sandboxes.Remove(ctx, req(&dsecv1.RemoveRequest{})))
	}},
	{"MakeDir", func(ctx context.Context, c *Clients) error {
		return unary(c.Sandboxes.MakeDir(ctx, req(&dsecv1.MakeDirRequest{})))
	}},
	{"Move", func(ctx context.Context, c *Clients) error {
		return unary(c.Sandboxes.Move(ctx, req(&dsecv1.MoveRequest{})))
	}},
	{"WatchDir", func(ctx context.Context, c *Clients) error {
		return drain(c.Sandboxes.WatchDir(ctx, req(&dsecv1.WatchDirRequest{})))
	}},
	{"Upload", func(ctx context.Context, c *Clients) error {
		return unary(c.Sandboxes.Upload(ctx, req(&dsecv1.UploadRequest{})))
	}},
	{"Download", func(ctx context.Context, c *Clients) error {
		return drain(c.Sandboxes.Download(ctx, req(&dsecv1.DownloadRequest{})))
	}},
	{"SetNetworkRules", func(ctx context.Context, c *Clients) error {
		return unary(c.Sandboxes.SetNetworkRules(ctx, req(&dsecv1.SetNetworkRulesRequest{})))
	}},
	{"NetworkLog", func(ctx context.Context, c *Clients) error {
		return unary(c.Sandboxes.NetworkLog(ctx, req(&dsecv1.NetworkLogRequest{})))
	}},
	{"SetWarmPool", func(ctx context.Context, c *Clients) error {
		return unary(c.Sandboxes.SetWarmPool(ctx, req(&dsecv1.SetWarmPoolRequest{})))
	}},
	{"ListWarmPools", func(ctx context.Context, c *Clients) error {
		return unary(c.Sandboxes.ListWarmPools(ctx, req(&dsecv1.ListWarmPoolsRequest{})))
	}},
	{"ImportLayer", func(ctx context.Context, c *Clients) error {
		return unary(c.Layers.ImportLayer(ctx, req(&dsecv1.ImportLayerRequest{})))
	}},
	{"ListLayers", func(ctx context.Context, c *Clients) error {
		return unary(c.Layers.ListLayers(ctx, req(&dsecv1.ListLayersRequest{})))
	}},
	{"ListEnvironments", func(ctx context.Context, c *Clients) error {
		return unary(c.Layers.ListEnvironments(ctx, req(&dsecv1.ListEnvironmentsRequest{})))
	}},
	{"LayerStats", func(ctx context.Context, c *Clients) error {
		return unary(c.Layers.LayerStats(ctx, req(&dsecv1.LayerStatsRequest{})))
	}},
	{"ImportImage", func(ctx context.Context, c *Clients) error {
		return drain(c.Layers.ImportImage(ctx, req(&dsecv1.ImportImageRequest{})))
	}},
}

// TestFailoverBeforeAServer: the first address refuses connections, so
// every call, the streams and the shell included, goes on to the second.
func TestFailoverBeforeAServer(t *testing.T) {
	noToken(t)
	s := &apiserver{}
	srv := startAPIServer(t, s, false)
	c := dial(t, closedAddr(t)+","+srv.URL, Options{})
	for _, tc := range everyCall {
		t.Run(tc.name, func(t *testing.T) {
			c.Sandboxes.(sandboxClient).p.cur.Store(0) // start each call on the closed address
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

// TestFailoverOnUnavailable: a server that answers Unavailable sends the
// calls that may repeat to the next address, a keyed create with the same
// key; an exec, a write, a create without a key are not sent again.
func TestFailoverOnUnavailable(t *testing.T) {
	noToken(t)
	first, second := &apiserver{}, &apiserver{}
	first.setDown(true, 0)
	s1, s2 := startAPIServer(t, first, false), startAPIServer(t, second, false)
	c := dial(t, s1.URL+","+s2.URL, Options{})
	p := c.Sandboxes.(sandboxClient).p
	ctx := t.Context()
	again := map[string]bool{"Create": true, "Get": true, "List": true, "Delete": true, "Attach": true, "ListProcesses": true,
		"ReadFile": true, "ListDir": true, "Stat": true, "Remove": true, "MakeDir": true, "Download": true, "WatchDir": true,
		"SetNetworkRules": true, "NetworkLog": true, "SetWarmPool": true, "ListWarmPools": true,
		"ListLayers": true, "ListEnvironments": true, "LayerStats": true}
	for _, tc := range everyCall {
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
	if err := unary(c.Sandboxes.Create(ctx, req(&dsecv1.CreateRequest{}))); connect.CodeOf(err) != connect.CodeUnavailable {
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
	pc := dial(t, proxy.URL+","+s2.URL, Options{})
	if err := unary(pc.Layers.ListLayers(ctx, req(&dsecv1.ListLayersRequest{}))); err != nil {
		t.Fatalf("ListLayers behind a 502 proxy: %v", err)
	}
	if err := drain(pc.Sandboxes.Download(ctx, req(&dsecv1.DownloadRequest{}))); err != nil {
		t.Fatalf("Download behind a 502 proxy: %v", err)
	}
}

// TestOneAddressUnchanged: with one address nothing is sent twice.
func TestOneAddressUnchanged(t *testing.T) {
	noToken(t)
	s := &apiserver{}
	s.setDown(true, 0)
	c := dial(t, startAPIServer(t, s, false).URL, Options{})
	if err := unary(c.Sandboxes.Get(t.Context(), req(&dsecv1.GetRequest{}))); connect.CodeOf(err) != connect.CodeUnavailable {
		t.Fatalf("Get: %v", err)
	}
	if calls, _, _ := s.got(); len(calls) != 1 {
		t.Fatalf("calls: %v", calls)
	}
	c = dial(t, closedAddr(t), Options{})
	err := unary(c.Sandboxes.Get(t.Context(), req(&dsecv1.GetRequest{})))
	if connect.CodeOf(err) != connect.CodeUnavailable || !Unreachable(err) || !strings.Contains(err.Error(), "connect: connection refused") {
		t.Fatalf("Get of a closed address: %v", err)
	}
}

// TestToken: the token goes on unary, server-stream and bidi calls and on
// Clients.HTTP, from the option, else $DSEC_TOKEN, else $DSEC_TOKEN_FILE,
// else the node's token file.
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
			c := dial(t, srv.URL, Options{Token: tt.opt})
			before, _, _ := s.got()
			ctx := t.Context()
			if err := unary(c.Sandboxes.Get(ctx, req(&dsecv1.GetRequest{}))); err != nil {
				t.Fatal(err)
			}
			if err := drain(c.Sandboxes.Exec(ctx, req(&dsecv1.ExecRequest{}))); err != nil {
				t.Fatal(err)
			}
			if err := shell(ctx, c); err != nil {
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
		c := dial(t, closedAddr(t)+","+hs.URL, Options{Token: "t0"})
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
		if _, err := Dial(srv.URL); !errors.Is(err, errdefs.ErrInvalidArgument) || !strings.Contains(err.Error(), "DSEC_TOKEN_FILE") {
			t.Fatalf("Dial = %v, want an error naming $DSEC_TOKEN_FILE", err)
		}
	})
	t.Run("bad token", func(t *testing.T) {
		t.Setenv("DSEC_TOKEN", "two words")
		if _, err := Dial(srv.URL); !errors.Is(err, errdefs.ErrInvalidArgument) || strings.Contains(err.Error(), "two words") {
			t.Fatalf("Dial = %v, want an error without the token", err)
		}
	})
}

// TestUnauthenticated: not sent again, not failed over, and the message
// says where the token came from without it.
func TestUnauthenticated(t *testing.T) {
	noToken(t)
	first, second := &apiserver{}, &apiserver{}
	first.setDown(true, connect.CodeUnauthenticated)
	s1, s2 := startAPIServer(t, first, false), startAPIServer(t, second, false)
	for _, tc := range []struct {
		o        Options
		env      string
		nodeFile string // the default root's token file holds this
		want     string
	}{
		{o: Options{Token: "s3cret-flag", TokenName: "--token"}, want: "token from --token"},
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
		c := dial(t, s1.URL+","+s2.URL, tc.o)
		for _, name := range []string{"Get", "Attach", "Shell"} {
			i := slices.IndexFunc(everyCall, func(c struct {
				name string
				call func(ctx context.Context, c *Clients) error
			}) bool {
				return c.name == name
			})
			err := everyCall[i].call(t.Context(), c)
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

// TestHTTPS: https:// addresses are verified with Options.CAFile or
// $DSEC_CA_FILE, over HTTP/1.1 and HTTP/2 (the shell); a failed handshake
// goes on to the next address.
func TestHTTPS(t *testing.T) {
	noToken(t)
	s := &apiserver{}
	srv := startAPIServer(t, s, true)
	ca := filepath.Join(t.TempDir(), "ca.pem")
	os.WriteFile(ca, pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: srv.Certificate().Raw}), 0o644)

	c := dial(t, srv.URL, Options{})
	var uae x509.UnknownAuthorityError
	if err := unary(c.Sandboxes.Get(t.Context(), req(&dsecv1.GetRequest{}))); !errors.As(err, &uae) {
		t.Fatalf("Get without the CA: %v, want an unknown authority", err)
	}
	c = dial(t, srv.URL, Options{CAFile: ca})
	if err := unary(c.Sandboxes.Get(t.Context(), req(&dsecv1.GetRequest{}))); err != nil {
		t.Fatalf("Get with Options.CAFile: %v", err)
	}

	// A plain HTTP server named https:// fails the handshake: on to the next.
	plain := startAPIServer(t, &apiserver{}, false)
	t.Setenv("DSEC_CA_FILE", ca)
	c = dial(t, "https://"+strings.TrimPrefix(plain.URL, "http://")+","+srv.URL, Options{})
	if err := drain(c.Sandboxes.Exec(t.Context(), req(&dsecv1.ExecRequest{}))); err != nil {
		t.Fatalf("Exec after a failed handshake: %v", err)
	}
	c.Sandboxes.(sandboxClient).p.cur.Store(0)
	if err := shell(t.Context(), c); err != nil {
		t.Fatalf("Shell over TLS after a failed handshake: %v", err)
	}

	t.Setenv("DSEC_CA_FILE", filepath.Join(t.TempDir(), "absent.pem"))
	if _, err := Dial(srv.URL); !errors.Is(err, errdefs.ErrInvalidArgument) {
		t.Fatalf("Dial with a missing CA file: %v", err)
	}
}

// TestAddressLists: lists parse, and a bad entry is refused.
func TestAddressLists(t *testing.T) {
	noToken(t)
	c := dial(t, " 127.0.0.1:1 , unix:///run/d.sock,https://h:443/api/ ", Options{})
	var got []string
	for _, ep := range c.Sandboxes.(sandboxClient).p.eps {
		got = append(got, ep.scheme+"://"+ep.host+ep.prefix)
	}
	if want := []string{"http://127.0.0.1:1", "http://dsecd", "https://h:443/api"}; !slices.Equal(got, want) {
		t.Fatalf("endpoints %v, want %v", got, want)
	}
	if c.BaseURL != "http://127.0.0.1:1" {
		t.Fatalf("BaseURL %q", c.BaseURL)
	}
	for _, bad := range []string{"127.0.0.1:1,,127.0.0.1:2", "127.0.0.1:1,ftp://x:1", "a:1,nohost", "unix://"} {
		if _, err := Dial(bad); !errors.Is(err, errdefs.ErrInvalidArgument) {
			t.Errorf("Dial(%q) = %v, want ErrInvalidArgument", bad, err)
		}
	}
}

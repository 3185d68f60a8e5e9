package dsec

import (
	"archive/tar"
	"bytes"
	"context"
	"errors"
	"net"
	"net/http"
	"net/http/httptest"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"connectrpc.com/connect"

	dsecv1 "dsec.dev/dsec/api/gen/dsec/v1"
	"dsec.dev/dsec/api/gen/dsec/v1/dsecv1connect"
)

// fakeService answers the SandboxService calls a test sets; the rest are unimplemented.
type fakeService struct {
	dsecv1connect.UnimplementedSandboxServiceHandler
	create        func(context.Context, *dsecv1.CreateRequest) (*dsecv1.CreateResponse, error)
	get           func(context.Context, *dsecv1.GetRequest) (*dsecv1.Sandbox, error)
	exec          func(context.Context, *dsecv1.ExecRequest, *connect.ServerStream[dsecv1.ExecEvent]) error
	attach        func(context.Context, *dsecv1.AttachRequest, *connect.ServerStream[dsecv1.ExecEvent]) error
	write         func(context.Context, *dsecv1.WriteFileRequest) error
	setWarmPool   func(context.Context, *dsecv1.SetWarmPoolRequest) (*dsecv1.WarmPool, error)
	listWarmPools func(context.Context) (*dsecv1.ListWarmPoolsResponse, error)
	serverInfo    *dsecv1.ServerInfo
	list          func(context.Context, *dsecv1.ListRequest) (*dsecv1.ListResponse, error)
}

func (f *fakeService) Create(ctx context.Context, r *connect.Request[dsecv1.CreateRequest]) (*connect.Response[dsecv1.CreateResponse], error) {
	resp, err := f.create(ctx, r.Msg)
	if err != nil {
		return nil, err
	}
	return connect.NewResponse(resp), nil
}

func (f *fakeService) Get(ctx context.Context, r *connect.Request[dsecv1.GetRequest]) (*connect.Response[dsecv1.Sandbox], error) {
	resp, err := f.get(ctx, r.Msg)
	if err != nil {
		return nil, err
	}
	return connect.NewResponse(resp), nil
}

func (f *fakeService) Exec(ctx context.Context, r *connect.Request[dsecv1.ExecRequest], s *connect.ServerStream[dsecv1.ExecEvent]) error {
	return f.exec(ctx, r.Msg, s)
}

func (f *fakeService) Attach(ctx context.Context, r *connect.Request[dsecv1.AttachRequest], s *connect.ServerStream[dsecv1.ExecEvent]) error {
	return f.attach(ctx, r.Msg, s)
}

func (f *fakeService) WriteFile(ctx context.Context, r *connect.Request[dsecv1.WriteFileRequest]) (*connect.Response[dsecv1.WriteFileResponse], error) {
	if err := f.write(ctx, r.Msg); err != nil {
		return nil, err
	}
	return connect.NewResponse(&dsecv1.WriteFileResponse{Written: int64(len(r.Msg.Data))}), nil
}

func (f *fakeService) List(ctx context.Context, r *connect.Request[dsecv1.ListRequest]) (*connect.Response[dsecv1.ListResponse], error) {
	resp, err := f.list(ctx, r.Msg)
	if err != nil {
		return nil, err
	}
	return connect.NewResponse(resp), nil
}

// TestListPageUnreachable: a page names the nodes the apiserver could not
// reach, whose sandboxes it lacks.
func TestListPageUnreachable(t *testing.T) {
	f := &fakeService{list: func(context.Context, *dsecv1.ListRequest) (*dsecv1.ListResponse, error) {
		return &dsecv1.ListResponse{Sandboxes: []*dsecv1.Sandbox{{Id: "sb-e1-a"}}, Total: 1, UnreachableNodes: []string{"e2"}}, nil
	}}
	_, c := startFake(t, f)
	p, err := c.ListPage(t.Context(), nil, 10, "")
	if err != nil || len(p.Sandboxes) != 1 || p.Total != 1 || len(p.Unreachable) != 1 || p.Unreachable[0] != "e2" {
		t.Fatalf("ListPage = %+v, %v; want sb-e1-a with e2 unreachable", p, err)
	}
}

func startFake(t *testing.T, f *fakeService) (*httptest.Server, *Client) {
	t.Helper()
	mux := http.NewServeMux()
	mux.Handle(dsecv1connect.NewSandboxServiceHandler(f))
	srv := httptest.NewUnstartedServer(mux)
	srv.Config.Protocols = new(http.Protocols)
	srv.Config.Protocols.SetHTTP1(true)
	srv.Config.Protocols.SetUnencryptedHTTP2(true)
	srv.Start()
	t.Cleanup(srv.Close)
	c, err := NewClient(srv.URL, WithTimeout(5*time.Second))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	return srv, c
}

func TestNewClientAddresses(t *testing.T) {
	noToken(t)
	tests := []struct {
		addr, base string
		bad        bool
	}{
		{addr: "unix:///run/d.sock", base: "http://dsecd"},
		{addr: "http://127.0.0.1:8675/", base: "http://127.0.0.1:8675"},
		{addr: "https://x:1", base: "https://x:1"},
		{addr: "127.0.0.1:8675", base: "http://127.0.0.1:8675"},
		{addr: "unix://", bad: true},
		{addr: "ftp://x:1", bad: true},
		{addr: "nohost", bad: true},
	}
	base := func(c *Client) string { ep := c.pool.eps[0]; return ep.scheme + "://" + ep.host + ep.prefix }
	for _, tt := range tests {
		t.Run(tt.addr, func(t *testing.T) {
			c, err := NewClient(tt.addr)
			if tt.bad {
				if !errors.Is(err, ErrInvalidArgument) {
					t.Fatalf("NewClient(%q) = %v, want ErrInvalidArgument", tt.addr, err)
				}
				return
			}
			if err != nil || base(c) != tt.base {
				t.Fatalf("NewClient(%q): %v; want base %q", tt.addr, err, tt.base)
			}
		})
	}
	t.Setenv("DSEC_ADDR", "127.0.0.1:9")
	if c, err := NewClient(""); err != nil || base(c) != "http://127.0.0.1:9" {
		t.Fatalf("NewClient with $DSEC_ADDR: %v", err)
	}
}

func TestCreateRetriesWithSameKey(t *testing.T) {
	var (
		mu   sync.Mutex
		keys []string
		srv  *httptest.Server
	)
	f := &fakeService{create: func(ctx context.Context, r *dsecv1.CreateRequest) (*dsecv1.CreateResponse, error) {
		mu.Lock()
		keys = append(keys, r.GetIdempotencyKey())
		n := len(keys)
		mu.Unlock()
		switch n {
		case 1:
			return nil, connect.NewError(connect.CodeUnavailable, errors.New("restarting"))
		case 2:
			srv.CloseClientConnections() // the connection drops mid-call
			<-ctx.Done()
			return nil, ctx.Err()
		}
		if r.GetSpec().GetEnvironment() != "busybox:test" || r.GetSpec().GetMemoryMb() != 256 || r.GetCount() != 1 {
			t.Errorf("request = %v", r)
		}
		return &dsecv1.CreateResponse{Sandboxes: []*dsecv1.Sandbox{{Id: "sb-n-1", State: dsecv1.State_STATE_RUNNING}}}, nil
	}}
	srv, c := startFake(t, f)
	sb, err := c.Create(t.Context(), "busybox:test", &CreateOptions{MemoryMB: 256, Timeout: 10 * time.Second})
	if err != nil {
		t.Fatal(err)
	}
	if sb.ID != "sb-n-1" || sb.State() != "running" {
		t.Fatalf("sandbox = %s %s", sb.ID, sb.State())
	}
	if len(keys) != 3 || keys[0] == "" || keys[0] != keys[1] || keys[1] != keys[2] {
		t.Fatalf("idempotency keys = %q, want 3 equal ones", keys)
	}
}

func TestErrorKinds(t *testing.T) {
	tests := []struct {
		code    connect.Code
		msg     string
		kinds   []error
		reason  string
		retries bool
	}{
		{code: connect.CodeNotFound, msg: "sandbox sb-n-1: not found", kinds: []error{ErrNotFound}},
		{code: connect.CodeInvalidArgument, msg: "bad", kinds: []error{ErrInvalidArgument}},
		{code: connect.CodeUnauthenticated, msg: "who", kinds: []error{ErrUnauthenticated}},
		{code: connect.CodeResourceExhausted, msg: "full", kinds: []error{ErrOverloaded}},
		{code: connect.CodeFailedPrecondition, msg: "sandbox sb-n-1 is stopped (oom): OOM-killed", kinds: []error{ErrSandboxGone, ErrFailedPrecondition}, reason: "oom"},
		{code: connect.CodeFailedPrecondition, msg: "sandbox sb-n-1 is still being created", kinds: []error{ErrFailedPrecondition}},
		{code: connect.CodeUnavailable, msg: "down", kinds: []error{ErrUnavailable}, retries: true},
	}
	for _, tt := range tests {
		t.Run(tt.code.String(), func(t *testing.T) {
			calls := 0
			f := &fakeService{get: func(context.Context, *dsecv1.GetRequest) (*dsecv1.Sandbox, error) {
				calls++
				return nil, connect.NewError(tt.code, errors.New(tt.msg))
			}}
			_, c := startFake(t, f)
			c.maxRetries = 2
			_, err := c.Get(t.Context(), "sb-n-1")
			for _, k := range tt.kinds {
				if !errors.Is(err, k) {
					t.Errorf("err = %v, want it to match %v", err, k)
				}
			}
			var e *Error
			if !errors.As(err, &e) || e.Message != tt.msg || e.Reason != tt.reason {
				t.Errorf("err = %#v, want message %q reason %q", e, tt.msg, tt.reason)
			}
			if want := map[bool]int{false: 1, true: 3}[tt.retries]; calls != want {
				t.Errorf("calls = %d, want %d", calls, want)
			}
		})
	}
}

func TestDeadline(t *testing.T) {
	f := &fakeService{get: func(ctx context.Context, _ *dsecv1.GetRequest) (*dsecv1.Sandbox, error) {
		<-ctx.Done()
		return nil, ctx.Err()
	}}
	_, c := startFake(t, f)
	c.timeout = 300 * time.Millisecond
	start := time.Now()
	_, err := c.Get(t.Context(), "sb-n-1")
	if !errors.Is(err, ErrTimeout) || !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("err = %v, want ErrTimeout", err)
	}
	if d := time.Since(start); d > 5*time.Second {
		t.Fatalf("the call took %s", d)
	}
}

func exitedEvent(status dsecv1.ExitStatus, code int32) *dsecv1.ExecEvent {
	return &dsecv1.ExecEvent{Event: &dsecv1.ExecEvent_Exited{Exited: &dsecv1.ExecExited{Status: status, ExitCode: code, DurationSeconds: 0.5}}}
}

func TestExec(t *testing.T) {
	var got *dsecv1.ExecRequest
	f := &fakeService{exec: func(ctx context.Context, r *dsecv1.ExecRequest, s *connect.ServerStream[dsecv1.ExecEvent]) error {
		got = r
		for _, ev := range []*dsecv1.ExecEvent{
			{Event: &dsecv1.ExecEvent_Started{Started: &dsecv1.ExecStarted{ProcessId: "p1", Pid: 7}}},
			{Event: &dsecv1.ExecEvent_Keepalive{Keepalive: true}},
			{Event: &dsecv1.ExecEvent_Stdout{Stdout: []byte("hel")}},
			{Event: &dsecv1.ExecEvent_Stderr{Stderr: []byte("warn")}},
			{Event: &dsecv1.ExecEvent_Stdout{Stdout: []byte("lo")}},
			exitedEvent(dsecv1.ExitStatus_EXIT_STATUS_NONZERO, 3),
		} {
			if err := s.Send(ev); err != nil {
				return err
			}
		}
		return nil
	}}
	_, c := startFake(t, f)
	sb := c.Sandbox("sb-n-1")
	var streamed bytes.Buffer
	res, err := sb.Exec(t.Context(), Argv("sh", "-c", "x"), &ExecOptions{Timeout: 9 * time.Second, Cwd: "/w",
		Env: map[string]string{"A": "1"}, Stdin: []byte("in"), OnStdout: func(b []byte) { streamed.Write(b) }})
	if err != nil {
		t.Fatal(err)
	}
	if res.ExitCode != 3 || res.Status != StatusNonzero || string(res.Stdout) != "hello" || string(res.Stderr) != "warn" ||
		res.Truncated || res.Duration != 500*time.Millisecond || res.ProcessID != "p1" || res.PID != 7 {
		t.Fatalf("result = %+v", res)
	}
	if streamed.String() != "hello" {
		t.Fatalf("OnStdout got %q", streamed.String())
	}
	if !errors.Is(res.Err(), ErrCommandFailed) {
		t.Fatalf("Err() = %v", res.Err())
	}
	if got.GetSandboxId() != "sb-n-1" || got.GetTimeoutSeconds() != 9 || got.GetCwd() != "/w" || string(got.GetStdin()) != "in" {
		t.Fatalf("request = %v", got)
	}

	x, err := sb.ExecStream(t.Context(), Sh("x"), nil)
	if err != nil {
		t.Fatal(err)
	}
	var types []string
	for x.Next() {
		types = append(types, string(x.Event().Type))
	}
	if x.Err() != nil || strings.Join(types, ",") != "started,stdout,stderr,stdout,exited" {
		t.Fatalf("events %v, err %v", types, x.Err())
	}
	if _, err := sb.Exec(t.Context(), Command{}, nil); !errors.Is(err, ErrInvalidArgument) {
		t.Fatalf("empty command: %v", err)
	}
}

// TestOutputDropped: a result that lacks output the command wrote comes
// with ErrOutputDropped, from every call that returns one.
func TestOutputDropped(t *testing.T) {
	events := []*dsecv1.ExecEvent{
		{Event: &dsecv1.ExecEvent_Started{Started: &dsecv1.ExecStarted{ProcessId: "p1"}}},
		{Event: &dsecv1.ExecEvent_Stdout{Stdout: []byte("head")}},
		{Event: &dsecv1.ExecEvent_Dropped{Dropped: &dsecv1.ExecDropped{Bytes: 10}}},
		{Event: &dsecv1.ExecEvent_Stdout{Stdout: []byte("tail")}},
		{Event: &dsecv1.ExecEvent_Exited{Exited: &dsecv1.ExecExited{Status: dsecv1.ExitStatus_EXIT_STATUS_OK,
			StdoutTruncated: true, StdoutBytes: 18}}},
	}
	send := func(s *connect.ServerStream[dsecv1.ExecEvent]) error {
		for _, ev := range events {
			if err := s.Send(ev); err != nil {
				return err
			}
		}
		return nil
	}
	f := &fakeService{
		exec: func(ctx context.Context, r *dsecv1.ExecRequest, s *connect.ServerStream[dsecv1.ExecEvent]) error {
			return send(s)
		},
		attach: func(ctx context.Context, r *dsecv1.AttachRequest, s *connect.ServerStream[dsecv1.ExecEvent]) error {
			return send(s)
		},
	}
	_, c := startFake(t, f)
	sb := c.Sandbox("sb-n-1")
	check := func(what string, res *ExecResult, err error) {
		t.Helper()
		if !errors.Is(err, ErrOutputDropped) || !strings.Contains(err.Error(), "10 bytes of stdout") {
			t.Errorf("%s: err = %v, want ErrOutputDropped naming 10 bytes of stdout", what, err)
		}
		if res == nil || string(res.Stdout) != "headtail" || !res.Truncated || res.StdoutDropped != 10 || res.StderrDropped != 0 {
			t.Errorf("%s: result %+v", what, res)
		}
	}
	res, err := sb.Exec(t.Context(), Sh("x"), nil)
	check("Exec", res, err)
	res, err = sb.Job("p1", "").Wait(t.Context())
	check("Job.Wait", res, err)
	res, err = sb.Job("p1", "").Output(t.Context())
	check("Job.Output", res, err)

	x, err := sb.ExecStream(t.Context(), Sh("x"), nil)
	if err != nil {
		t.Fatal(err)
	}
	var types []string
	for x.Next() {
		ev := x.Event()
		types = append(types, string(ev.Type))
		if ev.Type == EventDropped && (ev.Stream != EventStdout || ev.Dropped != 10) {
			t.Errorf("dropped event %+v", ev)
		}
	}
	if strings.Join(types, ",") != "started,stdout,dropped,stdout,exited" || !errors.Is(x.Err(), ErrOutputDropped) {
		t.Errorf("ExecStream: events %v, err %v", types, x.Err())
	}
}

func TestStreamErrorIsTyped(t *testing.T) {
	f := &fakeService{exec: func(ctx context.Context, r *dsecv1.ExecRequest, s *connect.ServerStream[dsecv1.ExecEvent]) error {
		s.Send(&dsecv1.ExecEvent{Event: &dsecv1.ExecEvent_Started{Started: &dsecv1.ExecStarted{ProcessId: "p1"}}})
		return connect.NewError(connect.CodeFailedPrecondition, errors.New("sandbox sb-n-1 is failed (oom): OOM-killed at 32 MiB"))
	}}
	_, c := startFake(t, f)
	_, err := c.Sandbox("sb-n-1").Exec(t.Context(), Sh("x"), nil)
	var e *Error
	if !errors.Is(err, ErrSandboxGone) || !errors.As(err, &e) || e.Reason != "oom" {
		t.Fatalf("err = %v", err)
	}
}

func TestServerKilledMidStream(t *testing.T) {
	var srv *httptest.Server
	calls := 0
	f := &fakeService{exec: func(ctx context.Context, r *dsecv1.ExecRequest, s *connect.ServerStream[dsecv1.ExecEvent]) error {
		calls++
		s.Send(&dsecv1.ExecEvent{Event: &dsecv1.ExecEvent_Started{Started: &dsecv1.ExecStarted{ProcessId: "p1"}}})
		s.Send(&dsecv1.ExecEvent{Event: &dsecv1.ExecEvent_Stdout{Stdout: []byte("partial")}})
		srv.CloseClientConnections()
		<-ctx.Done()
		return nil
	}}
	srv, c := startFake(t, f)
	start := time.Now()
	_, err := c.Sandbox("sb-n-1").Exec(t.Context(), Sh("sleep 100"), &ExecOptions{Timeout: 3 * time.Second})
	if !errors.Is(err, ErrUnavailable) {
		t.Fatalf("err = %v, want ErrUnavailable", err)
	}
	if d := time.Since(start); d > 3*time.Second {
		t.Fatalf("the error took %s", d)
	}
	if calls != 1 {
		t.Fatalf("exec was sent %d times; it must never be retried", calls)
	}
}

func TestWriteNotRetried(t *testing.T) {
	calls := 0
	f := &fakeService{write: func(context.Context, *dsecv1.WriteFileRequest) error {
		calls++
		return connect.NewError(connect.CodeUnavailable, errors.New("agent channel lost"))
	}}
	_, c := startFake(t, f)
	if err := c.Sandbox("sb-n-1").WriteFile(t.Context(), "/x", []byte("1"), 0); !errors.Is(err, ErrUnavailable) {
		t.Fatalf("err = %v", err)
	}
	if calls != 1 {
		t.Fatalf("calls = %d", calls)
	}
}

func TestSpawnAndWait(t *testing.T) {
	attaches := 0
	var srv *httptest.Server
	f := &fakeService{
		exec: func(ctx context.Context, r *dsecv1.ExecRequest, s *connect.ServerStream[dsecv1.ExecEvent]) error {
			if !r.GetBackground() || r.GetTag() != "train" {
				t.Errorf("request = %v", r)
			}
			s.Send(&dsecv1.ExecEvent{Event: &dsecv1.ExecEvent_Started{Started: &dsecv1.ExecStarted{ProcessId: "p9", Pid: 99, Tag: "train"}}})
			<-ctx.Done() // the client hangs up once it runs
			return nil
		},
		attach: func(ctx context.Context, r *dsecv1.AttachRequest, s *connect.ServerStream[dsecv1.ExecEvent]) error {
			attaches++
			if attaches == 1 {
				return connect.NewError(connect.CodeUnavailable, errors.New("daemon restarting"))
			}
			s.Send(&dsecv1.ExecEvent{Event: &dsecv1.ExecEvent_Stdout{Stdout: []byte("done\n")}})
			return s.Send(exitedEvent(dsecv1.ExitStatus_EXIT_STATUS_OK, 0))
		},
	}
	srv, c := startFake(t, f)
	_ = srv
	job, err := c.Sandbox("sb-n-1").Spawn(t.Context(), Sh("python train.py"), &SpawnOptions{Tag: "train"})
	if err != nil {
		t.Fatal(err)
	}
	if job.ProcessID != "p9" || job.PID != 99 || job.Tag != "train" {
		t.Fatalf("job = %+v", job)
	}
	ctx, cancel := context.WithTimeout(t.Context(), 10*time.Second)
	defer cancel()
	res, err := job.Wait(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if string(res.Stdout) != "done\n" || res.Status != StatusOK || attaches != 2 {
		t.Fatalf("result %+v after %d attaches", res, attaches)
	}
}

func TestUnixSocket(t *testing.T) {
	dir, err := os.MkdirTemp("", "dsec-sdk-")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(dir) })
	sock := filepath.Join(dir, "d.sock")
	ln, err := net.Listen("unix", sock)
	if err != nil {
		t.Fatal(err)
	}
	f := &fakeService{get: func(_ context.Context, r *dsecv1.GetRequest) (*dsecv1.Sandbox, error) {
		return &dsecv1.Sandbox{Id: r.GetId(), State: dsecv1.State_STATE_RUNNING}, nil
	}}
	mux := http.NewServeMux()
	mux.Handle(dsecv1connect.NewSandboxServiceHandler(f))
	hs := &http.Server{Handler: mux, Protocols: new(http.Protocols)}
	hs.Protocols.SetHTTP1(true)
	hs.Protocols.SetUnencryptedHTTP2(true)
	go hs.Serve(ln)
	t.Cleanup(func() { hs.Close() })
	c, err := NewClient("unix://" + sock)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	sb, err := c.Get(t.Context(), "sb-n-1")
	if err != nil || sb.ID != "sb-n-1" {
		t.Fatalf("Get over the socket: %v", err)
	}
}

func TestConnectionRefused(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := ln.Addr().String()
	ln.Close()
	c, err := NewClient(addr, WithTimeout(2*time.Second))
	if err != nil {
		t.Fatal(err)
	}
	start := time.Now()
	if _, err := c.Get(t.Context(), "sb-n-1"); !errors.Is(err, ErrUnavailable) {
		t.Fatalf("err = %v, want ErrUnavailable", err)
	}
	if d := time.Since(start); d > 4*time.Second {
		t.Fatalf("took %s", d)
	}
}

func TestExtractTarRefusesEscapes(t *testing.T) {
	tests := []struct {
		name    string
		entries []tar.Header
		bad     bool
	}{
		{name: "plain", entries: []tar.Header{{Name: "d/", Typeflag: tar.TypeDir, Mode: 0o755}, {Name: "d/a", Typeflag: tar.TypeReg, Mode: 0o644}}},
		{name: "dotdot", entries: []tar.Header{{Name: "../x", Typeflag: tar.TypeReg, Mode: 0o644}}, bad: true},
		{name: "abs link", entries: []tar.Header{{Name: "l", Typeflag: tar.TypeSymlink, Linkname: "/etc/passwd"}}, bad: true},
		{name: "link out", entries: []tar.Header{{Name: "l", Typeflag: tar.TypeSymlink, Linkname: "../../x"}}, bad: true},
		{name: "device", entries: []tar.Header{{Name: "dev", Typeflag: tar.TypeChar}}, bad: true},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			var buf bytes.Buffer
			tw := tar.NewWriter(&buf)
			for _, h := range tt.entries {
				h := h
				if h.Typeflag == tar.TypeReg {
					h.Size = 2
				}
				tw.WriteHeader(&h)
				if h.Typeflag == tar.TypeReg {
					tw.Write([]byte("hi"))
				}
			}
			tw.Close()
			dest := filepath.Join(t.TempDir(), "out")
			_, err := ExtractTar(&buf, dest)
			if tt.bad != errors.Is(err, ErrInvalidArgument) {
				t.Fatalf("ExtractTar: %v (want refused: %v)", err, tt.bad)
			}
		})
	}
}

// TestDependencies: the SDK imports the public API, never server code.
func TestDependencies(t *testing.T) {
	if _, err := exec.LookPath("go"); err != nil {
		t.Skip("go is not on PATH")
	}
	out, err := exec.Command("go", "list", "-deps", ".").CombinedOutput()
	if err != nil {
		t.Fatalf("go list: %v\n%s", err, out)
	}
	for _, dep := range strings.Fields(string(out)) {
		if strings.HasPrefix(dep, "dsec.dev/dsec/") && !strings.HasPrefix(dep, "dsec.dev/dsec/api/") && !strings.HasPrefix(dep, "dsec.dev/dsec/sdk/go") {
			t.Errorf("the SDK depends on %s", dep)
		}
	}
}

// TestCreateOptionsIsolation: Isolation names the spec's isolation; unset
// leaves it to the node (container); an unknown one is refused here.
func TestCreateOptionsIsolation(t *testing.T) {
	for _, tc := range []struct {
		in   string
		want dsecv1.Isolation
	}{
		{"", dsecv1.Isolation_ISOLATION_UNSPECIFIED},
		{IsolationContainer, dsecv1.Isolation_ISOLATION_UNSPECIFIED},
		{IsolationGVisor, dsecv1.Isolation_ISOLATION_GVISOR},
		{IsolationMicroVM, dsecv1.Isolation_ISOLATION_MICROVM},
	} {
		spec, err := (&CreateOptions{Isolation: tc.in}).spec("b:1")
		if err != nil || spec.GetIsolation() != tc.want {
			t.Errorf("Isolation %q: spec isolation %v (%v), want %v", tc.in, spec.GetIsolation(), err, tc.want)
		}
	}
	if _, err := (&CreateOptions{Isolation: "firecracker"}).spec("b:1"); !errors.Is(err, ErrInvalidArgument) {
		t.Errorf("Isolation firecracker: %v, want ErrInvalidArgument", err)
	}
}

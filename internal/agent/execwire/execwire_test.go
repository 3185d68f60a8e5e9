package execwire

import (
	"context"
	"encoding/binary"
	"errors"
	"io"
	"log/slog"
	"net"
	"net/http"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"connectrpc.com/connect"

	dsecv1 "dsec.dev/dsec/api/gen/dsec/v1"
	"dsec.dev/dsec/internal/testutil"
)

// agent is a test agent: exec answers framed calls on a split socket whose
// other connections reach an HTTP handler.
type agent struct {
	path   string
	conns  atomic.Int32 // framed connections served
	closed atomic.Int32 // framed connections ended

	mu   sync.Mutex
	open []net.Conn // framed connections, for drop
}

// drop closes the agent's side of every framed connection.
func (a *agent) drop() {
	a.mu.Lock()
	defer a.mu.Unlock()
	for _, c := range a.open {
		c.Close()
	}
	a.open = nil
}

func startAgent(t *testing.T, exec ExecFunc) *agent {
	t.Helper()
	a := &agent{path: filepath.Join(t.TempDir(), "agent.sock")}
	ln, err := net.Listen("unix", a.path)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	log := slog.New(slog.DiscardHandler)
	split := Split(ln, func(c net.Conn) {
		a.conns.Add(1)
		defer a.closed.Add(1)
		a.mu.Lock()
		a.open = append(a.open, c)
		a.mu.Unlock()
		ServeConn(ctx, c, exec, log)
	}, log)
	srv := &http.Server{Handler: http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		io.WriteString(w, "http "+r.URL.Path)
	})}
	go srv.Serve(split)
	t.Cleanup(func() {
		cancel()
		srv.Close()
	})
	return a
}

// echo sends its argv back as stdout, one event each, then exits 0.
func echo(ctx context.Context, req *dsecv1.ExecRequest, send func(*dsecv1.ExecEvent) error) error {
	if err := send(&dsecv1.ExecEvent{Event: &dsecv1.ExecEvent_Started{Started: &dsecv1.ExecStarted{Pid: 7}}}); err != nil {
		return err
	}
	for _, a := range req.GetArgv() {
		if err := send(&dsecv1.ExecEvent{Event: &dsecv1.ExecEvent_Stdout{Stdout: []byte(a)}}); err != nil {
			return err
		}
	}
	return send(&dsecv1.ExecEvent{Event: &dsecv1.ExecEvent_Exited{Exited: &dsecv1.ExecExited{ExitCode: int32(len(req.GetArgv()))}}})
}

// drain reads a stream to its end: the stdout it carried and the exit.
func drain(t *testing.T, s *Stream) (string, *dsecv1.ExecExited, error) {
	t.Helper()
	var out strings.Builder
	var exited *dsecv1.ExecExited
	for s.Receive() {
		out.Write(s.Msg().GetStdout())
		if e := s.Msg().GetExited(); e != nil {
			exited = e
		}
	}
	return out.String(), exited, s.Err()
}

func TestExecAndHTTPShareTheSocket(t *testing.T) {
	a := startAgent(t, echo)
	c := NewClient(a.path)
	defer c.Close()
	for i, argv := range [][]string{{"a", "b", "c"}, {"d"}, {}} {
		s, err := c.Exec(context.Background(), &dsecv1.ExecRequest{Argv: argv})
		if err != nil {
			t.Fatal(err)
		}
		out, exited, err := drain(t, s)
		if err != nil {
			t.Fatalf("call %d: %v", i, err)
		}
		if want := strings.Join(argv, ""); out != want || exited == nil || exited.ExitCode != int32(len(argv)) {
			t.Errorf("call %d: stdout %q exit %v, want %q and exit %d", i, out, exited, want, len(argv))
		}
	}
	if n := a.conns.Load(); n != 1 {
		t.Errorf("three calls in turn made %d connections, want 1", n)
	}

	hc := &http.Client{Transport: &http.Transport{DialContext: func(ctx context.Context, _, _ string) (net.Conn, error) {
		var d net.Dialer
		return d.DialContext(ctx, "unix", a.path)
	}}}
	resp, err := hc.Get("http://agent/ping")
	if err != nil {
		t.Fatal(err)
	}
	body, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if string(body) != "http /ping" {
		t.Errorf("HTTP through the split socket answered %q", body)
	}

	c.Close()
	testutil.WaitFor(t, 10*time.Second, "the agent to see the idle connection close", func() bool { return a.closed.Load() == 1 })
	if _, err := c.Exec(context.Background(), &dsecv1.ExecRequest{}); !errors.Is(err, net.ErrClosed) {
		t.Errorf("exec on a closed client: %v", err)
	}
}

func TestDroppedIdleConnectionIsReplaced(t *testing.T) {
	a := startAgent(t, echo)
	c := NewClient(a.path)
	defer c.Close()
	for i := range 2 {
		s, err := c.Exec(context.Background(), &dsecv1.ExecRequest{Argv: []string{"x"}})
		if err != nil {
			t.Fatalf("call %d: %v", i, err)
		}
		if out, _, err := drain(t, s); err != nil || out != "x" {
			t.Fatalf("call %d: %q %v", i, out, err)
		}
		// The agent drops the connection the client keeps idle.
		a.drop()
		testutil.WaitFor(t, 10*time.Second, "the agent to end the connection", func() bool { return a.closed.Load() == int32(i+1) })
	}
	if n := a.conns.Load(); n != 2 {
		t.Errorf("%d connections, want 2: the second call must have made a new one", n)
	}
}

func TestConcurrentCallsUseTheirOwnConnections(t *testing.T) {
	release := make(chan struct{})
	// Each call starts, then waits for the others: Exec returns once the
	// call's first event is in.
	a := startAgent(t, func(ctx context.Context, req *dsecv1.ExecRequest, send func(*dsecv1.ExecEvent) error) error {
		send(&dsecv1.ExecEvent{Event: &dsecv1.ExecEvent_Keepalive{Keepalive: true}})
		<-release
		return echo(ctx, req, send)
	})
	c := NewClient(a.path)
	defer c.Close()
	const n = 3
	streams := make([]*Stream, n)
	for i := range streams {
		s, err := c.Exec(context.Background(), &dsecv1.ExecRequest{Argv: []string{strings.Repeat("x", i+1)}})
		if err != nil {
			t.Fatal(err)
		}
		streams[i] = s
	}
	close(release)
	for i, s := range streams {
		out, _, err := drain(t, s)
		if err != nil || out != strings.Repeat("x", i+1) {
			t.Errorf("call %d: %q %v", i, out, err)
		}
	}
	if got := a.conns.Load(); got != n {
		t.Errorf("%d concurrent calls used %d connections", n, got)
	}
}

func TestErrorsKeepTheirCode(t *testing.T) {
	a := startAgent(t, func(ctx context.Context, req *dsecv1.ExecRequest, send func(*dsecv1.ExecEvent) error) error {
		if len(req.GetArgv()) == 0 {
			return connect.NewError(connect.CodeInvalidArgument, errors.New("exec needs argv"))
		}
		return errors.New("plain failure")
	})
	c := NewClient(a.path)
	defer c.Close()
	for _, tt := range []struct {
		argv []string
		code connect.Code
		msg  string
	}{
		{nil, connect.CodeInvalidArgument, "exec needs argv"},
		{[]string{"x"}, connect.CodeUnknown, "plain failure"},
	} {
		s, err := c.Exec(context.Background(), &dsecv1.ExecRequest{Argv: tt.argv})
		if err != nil {
			t.Fatal(err)
		}
		_, _, err = drain(t, s)
		var ce *connect.Error
		if !errors.As(err, &ce) || ce.Code() != tt.code || ce.Message() != tt.msg {
			t.Errorf("argv %v: got %v, want %v %q", tt.argv, err, tt.code, tt.msg)
		}
	}
	if n := a.conns.Load(); n != 1 {
		t.Errorf("a failed call should leave its connection usable; %d connections", n)
	}
}

func TestCancelReachesTheAgent(t *testing.T) {
	cancelled := make(chan struct{})
	a := startAgent(t, func(ctx context.Context, req *dsecv1.ExecRequest, send func(*dsecv1.ExecEvent) error) error {
		if len(req.GetArgv()) == 0 || req.GetArgv()[0] != "sleep" {
			return echo(ctx, req, send)
		}
		send(&dsecv1.ExecEvent{Event: &dsecv1.ExecEvent_Started{Started: &dsecv1.ExecStarted{Pid: 1}}})
		<-ctx.Done()
		close(cancelled)
		return ctx.Err()
	})
	c := NewClient(a.path)
	defer c.Close()
	ctx, cancel := context.WithCancel(context.Background())
	s, err := c.Exec(ctx, &dsecv1.ExecRequest{Argv: []string{"sleep"}})
	if err != nil {
		t.Fatal(err)
	}
	if !s.Receive() || s.Msg().GetStarted() == nil {
		t.Fatalf("no started event: %v", s.Err())
	}
	cancel()
	select {
	case <-cancelled:
	case <-time.After(10 * time.Second):
		t.Fatal("the agent's call was not cancelled")
	}
	if s.Receive() || !errors.Is(s.Err(), context.Canceled) {
		t.Errorf("after cancel: %v", s.Err())
	}
	// The cancelled call's connection is gone; the next call makes one.
	s, err = c.Exec(context.Background(), &dsecv1.ExecRequest{Argv: []string{"x"}})
	if err != nil {
		t.Fatal(err)
	}
	s.Close()
	testutil.WaitFor(t, 10*time.Second, "the agent to drop both connections", func() bool { return a.closed.Load() == 2 })
}

func TestProtocolViolationsCloseTheConnection(t *testing.T) {
	a := startAgent(t, echo)
	huge := make([]byte, 5)
	binary.BigEndian.PutUint32(huge[1:], MaxFrame+1)
	for name, msg := range map[string][]byte{
		"frame too large":           huge,
		"end frame from the client": {FlagEnd, 0, 0, 0, 0},
		"not protobuf":              {0, 0, 0, 0, 3, 0xff, 0xff, 0xff},
	} {
		t.Run(name, func(t *testing.T) {
			c, err := net.Dial("unix", a.path)
			if err != nil {
				t.Fatal(err)
			}
			defer c.Close()
			if _, err := c.Write(append([]byte(Preface), msg...)); err != nil {
				t.Fatal(err)
			}
			c.SetReadDeadline(time.Now().Add(10 * time.Second))
			if n, err := c.Read(make([]byte, 64)); err != io.EOF {
				t.Errorf("read %d bytes, %v; want the agent to close the connection", n, err)
			}
		})
	}
}

func TestOldAgentIsDetected(t *testing.T) {
	path := filepath.Join(t.TempDir(), "agent.sock")
	ln, err := net.Listen("unix", path)
	if err != nil {
		t.Fatal(err)
	}
	srv := &http.Server{Handler: http.NotFoundHandler()}
	go srv.Serve(ln)
	defer srv.Close()
	c := NewClient(path)
	defer c.Close()
	if _, err := c.Exec(context.Background(), &dsecv1.ExecRequest{Argv: []string{"true"}}); !errors.Is(err, ErrNotFramed) {
		t.Fatalf("exec on an HTTP-only agent: %v, want ErrNotFramed", err)
	}
}

func TestRequestTooLarge(t *testing.T) {
	c := NewClient(filepath.Join(t.TempDir(), "none.sock"))
	_, err := c.Exec(context.Background(), &dsecv1.ExecRequest{Argv: []string{"cat"}, Stdin: make([]byte, MaxFrame)})
	if !errors.Is(err, errFrameTooLarge) {
		t.Fatalf("got %v, want a frame-too-large error", err)
	}
}

// dyingListener records the connections it accepted, so that a test can
// end them all as an agent's exit does.
type dyingListener struct {
	net.Listener
	mu    sync.Mutex
	conns []net.Conn
}

func (l *dyingListener) Accept() (net.Conn, error) {
	c, err := l.Listener.Accept()
	if err == nil {
		l.mu.Lock()
		l.conns = append(l.conns, c)
		l.mu.Unlock()
	}
	return c, err
}

func (l *dyingListener) accepted() int {
	l.mu.Lock()
	defer l.mu.Unlock()
	return len(l.conns)
}

// die closes the listener and every connection it accepted.
func (l *dyingListener) die() {
	l.Listener.Close()
	l.mu.Lock()
	defer l.mu.Unlock()
	for _, c := range l.conns {
		c.Close()
	}
}

func TestWatchEndsWhenTheAgentDies(t *testing.T) {
	path := filepath.Join(t.TempDir(), "agent.sock")
	inner, err := net.Listen("unix", path)
	if err != nil {
		t.Fatal(err)
	}
	ln := &dyingListener{Listener: inner}
	log := slog.New(slog.DiscardHandler)
	split := Split(ln, func(c net.Conn) { ServeConn(context.Background(), c, echo, log) }, log)
	srv := &http.Server{Handler: http.NotFoundHandler()}
	go srv.Serve(split)
	defer srv.Close()

	dial := func(ctx context.Context) (net.Conn, error) {
		var d net.Dialer
		return d.DialContext(ctx, "unix", path)
	}
	done := make(chan error, 1)
	go func() { done <- Watch(context.Background(), dial) }()
	testutil.WaitFor(t, 10*time.Second, "the agent to accept the watch connection", func() bool { return ln.accepted() == 1 })
	// The agent answers and holds it: exec still works beside it.
	s, err := NewDialClient(dial).Exec(context.Background(), &dsecv1.ExecRequest{Argv: []string{"x"}})
	if err != nil {
		t.Fatal(err)
	}
	if out, _, err := drain(t, s); err != nil || out != "x" {
		t.Fatalf("exec beside a watch: %q %v", out, err)
	}
	select {
	case err := <-done:
		t.Fatalf("watch ended while the agent runs: %v", err)
	default:
	}
	ln.die()
	select {
	case err := <-done:
		if err == nil || errors.Is(err, ErrNotWatched) || errors.Is(err, context.Canceled) {
			t.Fatalf("watch of an agent that died: %v, want the connection's end", err)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("watch did not end when the agent died")
	}
	// A dead agent's socket refuses a new watch.
	if err := Watch(context.Background(), dial); err == nil || errors.Is(err, ErrNotWatched) {
		t.Fatalf("watch of a dead agent: %v", err)
	}
}

func TestWatchEndsWithItsContext(t *testing.T) {
	a := startAgent(t, echo)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() {
		done <- Watch(ctx, func(ctx context.Context) (net.Conn, error) {
			var d net.Dialer
			return d.DialContext(ctx, "unix", a.path)
		})
	}()
	cancel()
	if err := <-done; !errors.Is(err, context.Canceled) {
		t.Fatalf("watch after its context ended: %v, want context.Canceled", err)
	}
}

func TestWatchOfAnOldAgent(t *testing.T) {
	path := filepath.Join(t.TempDir(), "agent.sock")
	ln, err := net.Listen("unix", path)
	if err != nil {
		t.Fatal(err)
	}
	// As the agent's: HTTP/1.1 and HTTP/2 without TLS.
	protocols := new(http.Protocols)
	protocols.SetHTTP1(true)
	protocols.SetUnencryptedHTTP2(true)
	srv := &http.Server{Handler: http.NotFoundHandler(), Protocols: protocols}
	go srv.Serve(ln)
	defer srv.Close()
	err = Watch(context.Background(), func(ctx context.Context) (net.Conn, error) {
		var d net.Dialer
		return d.DialContext(ctx, "unix", path)
	})
	if !errors.Is(err, ErrNotWatched) {
		t.Fatalf("watch of an HTTP-only agent: %v, want ErrNotWatched", err)
	}
}

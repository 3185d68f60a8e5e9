package e2b

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"testing"
	"time"

	"connectrpc.com/connect"

	dsecv1 "dsec.dev/dsec/api/gen/dsec/v1"
	"dsec.dev/dsec/api/gen/dsec/v1/dsecv1connect"
	"dsec.dev/dsec/internal/iam"
)

// fakeDsec is a SandboxService with one running sandbox whose processes
// are simple: "echo ARGS" prints its args and exits 0; anything else is
// cat (it prints its stdin and exits 0 when stdin closes) until signalled.
// A Shell is a terminal that echoes its input, answers a resize with
// "size ROWS COLS" and exits 0 on "exit\n".
type fakeDsec struct {
	dsecv1connect.UnimplementedSandboxServiceHandler

	mu    sync.Mutex
	procs []*fakeProc
	next  int32
	execs []*dsecv1.ExecRequest
}

type fakeProc struct {
	info   *dsecv1.ProcessInfo
	mu     sync.Mutex
	chunks []*dsecv1.ExecEvent
	exited *dsecv1.ExecExited
	notify chan struct{}
	tty    bool
}

func (f *fakeDsec) start(argv []string, tag string, tty bool) *fakeProc {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.next++
	p := &fakeProc{info: &dsecv1.ProcessInfo{ProcessId: fmt.Sprintf("p-%d", f.next), Pid: 100 + f.next, Tag: tag, Argv: argv,
		Running: true, StartedUnixMs: time.Now().UnixMilli()}, notify: make(chan struct{}), tty: tty}
	f.procs = append(f.procs, p)
	return p
}

func (f *fakeDsec) find(id string) (*fakeProc, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	for _, p := range f.procs {
		if p.info.ProcessId == id || (p.info.Tag != "" && p.info.Tag == id) {
			return p, nil
		}
	}
	return nil, connect.NewError(connect.CodeNotFound, fmt.Errorf("process %q not found", id))
}

func (p *fakeProc) out(b []byte) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.exited != nil {
		return
	}
	p.chunks = append(p.chunks, &dsecv1.ExecEvent{Event: &dsecv1.ExecEvent_Stdout{Stdout: b}})
	close(p.notify)
	p.notify = make(chan struct{})
}

func (p *fakeProc) exit(e *dsecv1.ExecExited) bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.exited != nil {
		return false
	}
	e.DurationSeconds = 0.001
	p.exited = e
	p.info.Running = false
	p.info.Exited = e
	close(p.notify)
	p.notify = make(chan struct{})
	return true
}

// follow sends p's events from chunk from on until it exits (or, with
// noFollow, until now).
func (p *fakeProc) follow(ctx context.Context, send func(*dsecv1.ExecEvent) error, noFollow bool) error {
	if err := send(&dsecv1.ExecEvent{Event: &dsecv1.ExecEvent_Started{Started: &dsecv1.ExecStarted{ProcessId: p.info.ProcessId, Pid: p.info.Pid}}}); err != nil {
		return err
	}
	for i := 0; ; {
		p.mu.Lock()
		chunks, exited, notify := p.chunks[i:], p.exited, p.notify
		p.mu.Unlock()
		for _, c := range chunks {
			if err := send(c); err != nil {
				return err
			}
		}
		i += len(chunks)
		if len(chunks) > 0 {
			continue
		}
		if exited != nil {
			return send(&dsecv1.ExecEvent{Event: &dsecv1.ExecEvent_Exited{Exited: exited}})
		}
		if noFollow {
			return nil
		}
		select {
		case <-notify:
		case <-ctx.Done():
			return ctx.Err()
		}
	}
}

func (f *fakeDsec) Get(ctx context.Context, req *connect.Request[dsecv1.GetRequest]) (*connect.Response[dsecv1.Sandbox], error) {
	if req.Msg.GetId() != fakeSandbox {
		return nil, connect.NewError(connect.CodeNotFound, errors.New("no such sandbox"))
	}
	return connect.NewResponse(&dsecv1.Sandbox{Id: fakeSandbox, State: dsecv1.State_STATE_RUNNING}), nil
}

func (f *fakeDsec) Exec(ctx context.Context, req *connect.Request[dsecv1.ExecRequest], stream *connect.ServerStream[dsecv1.ExecEvent]) error {
	f.mu.Lock()
	f.execs = append(f.execs, req.Msg)
	f.mu.Unlock()
	argv := req.Msg.GetArgv()
	p := f.start(argv, req.Msg.GetTag(), false)
	if argv[0] == "echo" {
		p.out([]byte(strings.Join(argv[1:], " ") + "\n"))
		p.exit(&dsecv1.ExecExited{Status: dsecv1.ExitStatus_EXIT_STATUS_OK})
	} else if !req.Msg.GetKeepStdinOpen() {
		p.exit(&dsecv1.ExecExited{Status: dsecv1.ExitStatus_EXIT_STATUS_OK})
	}
	return p.follow(ctx, stream.Send, false)
}

func (f *fakeDsec) Attach(ctx context.Context, req *connect.Request[dsecv1.AttachRequest], stream *connect.ServerStream[dsecv1.ExecEvent]) error {
	p, err := f.find(req.Msg.GetProcessId() + req.Msg.GetTag())
	if err != nil {
		return err
	}
	return p.follow(ctx, stream.Send, req.Msg.GetNoFollow())
}

func (f *fakeDsec) WriteStdin(ctx context.Context, req *connect.Request[dsecv1.WriteStdinRequest]) (*connect.Response[dsecv1.WriteStdinResponse], error) {
	p, err := f.find(req.Msg.GetProcessId())
	if err != nil {
		return nil, err
	}
	if len(req.Msg.GetData()) > 0 {
		p.out(req.Msg.GetData())
	}
	if req.Msg.GetClose() {
		p.exit(&dsecv1.ExecExited{Status: dsecv1.ExitStatus_EXIT_STATUS_OK})
	}
	return connect.NewResponse(&dsecv1.WriteStdinResponse{}), nil
}

func (f *fakeDsec) Signal(ctx context.Context, req *connect.Request[dsecv1.SignalRequest]) (*connect.Response[dsecv1.SignalResponse], error) {
	p, err := f.find(req.Msg.GetProcessId())
	if err != nil {
		return nil, err
	}
	p.exit(&dsecv1.ExecExited{ExitCode: -1, Signal: req.Msg.GetSignal(), Status: dsecv1.ExitStatus_EXIT_STATUS_KILLED})
	return connect.NewResponse(&dsecv1.SignalResponse{}), nil
}

func (f *fakeDsec) ListProcesses(ctx context.Context, req *connect.Request[dsecv1.ListProcessesRequest]) (*connect.Response[dsecv1.ListProcessesResponse], error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	resp := &dsecv1.ListProcessesResponse{}
	for _, p := range f.procs {
		p.mu.Lock()
		resp.Processes = append(resp.Processes, &dsecv1.ProcessInfo{ProcessId: p.info.ProcessId, Pid: p.info.Pid, Tag: p.info.Tag,
			Argv: p.info.Argv, Running: p.info.Running, Exited: p.info.Exited, StartedUnixMs: p.info.StartedUnixMs})
		p.mu.Unlock()
	}
	return connect.NewResponse(resp), nil
}

func (f *fakeDsec) Shell(ctx context.Context, stream *connect.BidiStream[dsecv1.ShellInput, dsecv1.ShellOutput]) error {
	first, err := stream.Receive()
	if err != nil {
		return err
	}
	start := first.GetStart()
	if start.GetCwd() == "/nonexistent" {
		return stream.Send(&dsecv1.ShellOutput{Output: &dsecv1.ShellOutput_Exited{Exited: &dsecv1.ExecExited{
			Status: dsecv1.ExitStatus_EXIT_STATUS_START_ERROR, Message: "chdir /nonexistent: no such file or directory"}}})
	}
	p := f.start(start.GetArgv(), "", true)
	var sendMu sync.Mutex
	send := func(o *dsecv1.ShellOutput) error {
		sendMu.Lock()
		defer sendMu.Unlock()
		return stream.Send(o)
	}
	go func() {
		for {
			in, err := stream.Receive()
			if err != nil {
				p.exit(&dsecv1.ExecExited{ExitCode: -1, Signal: 9, Status: dsecv1.ExitStatus_EXIT_STATUS_KILLED})
				return
			}
			switch {
			case in.GetResize() != nil:
				p.out(fmt.Appendf(nil, "size %d %d\r\n", in.GetResize().GetRows(), in.GetResize().GetCols()))
			case string(in.GetData()) == "exit\n":
				p.exit(&dsecv1.ExecExited{Status: dsecv1.ExitStatus_EXIT_STATUS_OK})
			default:
				p.out(in.GetData())
			}
		}
	}()
	return p.follow(ctx, func(ev *dsecv1.ExecEvent) error {
		switch e := ev.Event.(type) {
		case *dsecv1.ExecEvent_Stdout:
			return send(&dsecv1.ShellOutput{Output: &dsecv1.ShellOutput_Data{Data: e.Stdout}})
		case *dsecv1.ExecEvent_Exited:
			return send(&dsecv1.ShellOutput{Output: &dsecv1.ShellOutput_Exited{Exited: e.Exited}})
		}
		return nil
	}, false)
}

const fakeSandbox = "sb-t1-fake"

type allowAll struct{}

func (allowAll) Authenticate(ctx context.Context, token string) (iam.Authority, error) {
	return iam.Authority{TokenID: "p"}, nil
}

// startFake serves a Handler over a fake dsec, both on loopback, and
// returns the Handler's address and the fake.
func startFake(t *testing.T) (string, *fakeDsec, *Handler) {
	t.Helper()
	fake := &fakeDsec{}
	mux := http.NewServeMux()
	mux.Handle(dsecv1connect.NewSandboxServiceHandler(fake))
	dsec := httptest.NewUnstartedServer(mux)
	dsec.Config.Protocols = new(http.Protocols)
	dsec.Config.Protocols.SetHTTP1(true)
	dsec.Config.Protocols.SetUnencryptedHTTP2(true)
	dsec.Start()
	t.Cleanup(dsec.Close)
	tr := &http.Transport{Protocols: new(http.Protocols)}
	tr.Protocols.SetUnencryptedHTTP2(true)
	t.Cleanup(tr.CloseIdleConnections)
	h, err := NewHandler(Config{API: dsecv1connect.NewSandboxServiceClient(&http.Client{Transport: tr}, dsec.URL),
		Auth: allowAll{}, Signer: NewSigner([]byte(strings.Repeat("s", 32)))})
	if err != nil {
		t.Fatal(err)
	}
	srv := httptest.NewServer(h)
	t.Cleanup(srv.Close)
	return srv.URL, fake, h
}

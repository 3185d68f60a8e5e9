package agent

import (
	"context"
	"errors"
	"net"
	"os"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"connectrpc.com/connect"

	dsecv1 "dsec.dev/dsec/api/gen/dsec/v1"
	"dsec.dev/dsec/internal/errdefs"
)

// fakeConn is a call's connection whose channel the test loses.
type fakeConn struct {
	net.Conn
	lost atomic.Bool
}

func (c *fakeConn) ChannelLost() bool { return c.lost.Load() }

// events collects a stream's events.
type events struct {
	mu     sync.Mutex
	out    strings.Builder
	id     string
	exited *dsecv1.ExecExited
	more   chan struct{}
}

func newEvents() *events { return &events{more: make(chan struct{}, 64)} }

func (e *events) send(ev *dsecv1.ExecEvent) error {
	e.mu.Lock()
	defer e.mu.Unlock()
	if s := ev.GetStarted(); s != nil {
		e.id = s.GetProcessId()
	}
	e.out.Write(ev.GetStdout())
	if x := ev.GetExited(); x != nil {
		e.exited = x
	}
	select {
	case e.more <- struct{}{}:
	default:
	}
	return nil
}

// waitFor waits until the output holds s.
func (e *events) waitFor(t *testing.T, s string) {
	t.Helper()
	deadline := time.After(10 * time.Second)
	for {
		e.mu.Lock()
		got := e.out.String()
		e.mu.Unlock()
		if strings.Contains(got, s) {
			return
		}
		select {
		case <-e.more:
		case <-deadline:
			t.Fatalf("output %q never held %q", got, s)
		}
	}
}

// The tests' in-process handler, one for the whole test binary: its
// process manager reaps every child of the process (wait4(-1), as the
// agent, alone in its sandbox, does), so a second one would reap the
// first's children and leave their commands waiting for an exit forever.
var (
	sharedHandlerOnce sync.Once
	sharedHandler     *handler
	sharedHandlerErr  error
)

func testHandler(t *testing.T) *handler {
	t.Helper()
	if _, err := os.Stat("/bin/sh"); err != nil {
		t.Skip("no /bin/sh")
	}
	sharedHandlerOnce.Do(func() {
		sharedHandler, sharedHandlerErr = newHandler(Config{CgroupFD: -1, MemoryCgroupFD: -1, PidsCgroupFD: -1, CPUCgroupFD: -1,
			Shell: "/bin/sh", OutputLimit: 1 << 20}, "")
	})
	if sharedHandlerErr != nil {
		t.Fatal(sharedHandlerErr)
	}
	return sharedHandler
}

// TestForegroundOrphan: a foreground command whose stream ends with its
// agent channel runs on, and a stream that re-attaches from the offset the
// first reached gets the rest of its output and its exit; one whose
// client closed its stream is killed, as before.
func TestForegroundOrphan(t *testing.T) {
	h := testHandler(t)
	command := "echo one; sleep 0.5; echo two"

	conn := &fakeConn{}
	ctx, cancel := context.WithCancel(withConn(context.Background(), conn))
	first := newEvents()
	ended := make(chan error, 1)
	go func() { ended <- h.exec(ctx, &dsecv1.ExecRequest{Command: command}, first.send) }()
	first.waitFor(t, "one\n")
	conn.lost.Store(true) // the host went away: every stream ends
	cancel()
	<-ended
	p, err := h.procs.Get(first.id)
	if err != nil {
		t.Fatal(err)
	}
	if p.Done() {
		t.Fatalf("the command ended with its stream: %v", p.Exited())
	}

	conn2 := &fakeConn{}
	again := newEvents()
	err = h.attach(withConn(context.Background(), conn2), &dsecv1.AttachRequest{
		ProcessId: first.id, Reattach: true, StdoutOffset: int64(len("one\n"))}, again.send)
	if err != nil {
		t.Fatalf("re-attach: %v", err)
	}
	if got := again.out.String(); got != "two\n" || again.exited.GetExitCode() != 0 || again.exited.GetStdoutTruncated() {
		t.Errorf("the re-attached stream: %q, exit %v; want %q and exit 0", got, again.exited, "two\n")
	}

	// A client that closes its stream kills its command.
	ctx, cancel = context.WithCancel(withConn(context.Background(), &fakeConn{}))
	third := newEvents()
	go func() { ended <- h.exec(ctx, &dsecv1.ExecRequest{Command: command}, third.send) }()
	third.waitFor(t, "one\n")
	cancel()
	<-ended
	p, err = h.procs.Get(third.id)
	if err != nil {
		t.Fatal(err)
	}
	select {
	case <-p.DoneC():
	case <-time.After(10 * time.Second):
		t.Fatal("a command whose client closed its stream runs on")
	}
	if e := p.Exited(); e.GetStatus() != dsecv1.ExitStatus_EXIT_STATUS_KILLED {
		t.Errorf("a command whose client closed its stream: %v, want killed", e)
	}
}

// fakeShell is a shell's stream whose input the test sends, and which
// breaks (its Receive fails) when in is closed.
type fakeShell struct {
	in  chan *dsecv1.ShellInput
	out *events
	id  string
}

func newFakeShell(start *dsecv1.ShellStart) *fakeShell {
	s := &fakeShell{in: make(chan *dsecv1.ShellInput, 8), out: newEvents()}
	s.in <- &dsecv1.ShellInput{Input: &dsecv1.ShellInput_Start{Start: start}}
	return s
}

func (s *fakeShell) Receive() (*dsecv1.ShellInput, error) {
	in, ok := <-s.in
	if !ok {
		return nil, errors.New("the stream broke")
	}
	return in, nil
}

func (s *fakeShell) Send(o *dsecv1.ShellOutput) error {
	s.out.mu.Lock()
	if id := o.GetStarted(); id != "" {
		s.id = id
	}
	s.out.mu.Unlock()
	return s.out.send(&dsecv1.ExecEvent{Event: &dsecv1.ExecEvent_Stdout{Stdout: o.GetData()}})
}

// TestTerminalOrphan: a PTY shell whose stream ends with its agent
// channel runs on (its output meanwhile kept), and a stream re-attaching
// from the offset the first reached gets the rest of its output, takes
// input and gets its exit; a re-attach to no such terminal is NotFound,
// and one whose client closed its stream is killed.
func TestTerminalOrphan(t *testing.T) {
	h := testHandler(t)
	command := "echo one; sleep 0.3; echo away; read x; echo got-$x; exit 3"

	conn := &fakeConn{}
	ctx, cancel := context.WithCancel(withConn(context.Background(), conn))
	first := newFakeShell(&dsecv1.ShellStart{Argv: []string{"/bin/sh", "-c", command}})
	ended := make(chan error, 1)
	go func() { ended <- h.shell(ctx, first) }()
	first.out.waitFor(t, "one")
	conn.lost.Store(true) // the host went away: every stream ends
	cancel()
	close(first.in)
	<-ended
	first.out.mu.Lock()
	id, offset := first.id, int64(first.out.out.Len())
	first.out.mu.Unlock()
	p, err := h.procs.Get(id)
	if err != nil {
		t.Fatal(err)
	}
	if p.Done() {
		t.Fatalf("the shell ended with its stream: %v", p.Exited())
	}
	time.Sleep(500 * time.Millisecond) // the shell prints "away" meanwhile
	term, ok := h.terminals.Load(id)
	if !ok {
		t.Fatalf("the orphaned shell's terminal %s is not kept", id)
	}

	again := newFakeShell(&dsecv1.ShellStart{ReattachId: id, OutputOffset: offset})
	again.in <- &dsecv1.ShellInput{Input: &dsecv1.ShellInput_Data{Data: []byte("hi\n")}}
	if err := h.shell(withConn(context.Background(), &fakeConn{}), again); err != nil {
		t.Fatalf("re-attach: %v", err)
	}
	got := again.out.out.String()
	if again.id != id || strings.Contains(got, "one") || !strings.Contains(got, "away") || !strings.Contains(got, "got-hi") {
		tm := term.(*terminal)
		tm.mu.Lock()
		endErr := tm.endErr
		tm.mu.Unlock()
		// The read error that ended the terminal's output tells a shell
		// whose last write was lost (EIO) from a master closed under it.
		t.Errorf("the re-attached stream (started %q, want %q): %q; want the output after %q, with away and got-hi (the terminal's reads ended with %v)",
			again.id, id, got, first.out.out.String(), endErr)
	}
	if e := p.Exited(); e.GetExitCode() != 3 {
		t.Errorf("the shell's exit: %v, want 3", e)
	}

	gone := newFakeShell(&dsecv1.ShellStart{ReattachId: id})
	if err := h.shell(context.Background(), gone); !errors.Is(err, errdefs.ErrNotFound) && connect.CodeOf(err) != connect.CodeNotFound {
		t.Errorf("a re-attach to a terminal that ended: %v, want not found", err)
	}

	// A client that closes its stream kills its shell.
	ctx, cancel = context.WithCancel(withConn(context.Background(), &fakeConn{}))
	third := newFakeShell(&dsecv1.ShellStart{Argv: []string{"/bin/sh", "-c", "echo one; sleep 30"}})
	go func() { ended <- h.shell(ctx, third) }()
	third.out.waitFor(t, "one")
	cancel()
	close(third.in)
	<-ended
	p, err = h.procs.Get(third.id)
	if err != nil {
		t.Fatal(err)
	}
	select {
	case <-p.DoneC():
	case <-time.After(10 * time.Second):
		t.Fatal("a shell whose client closed its stream runs on")
	}
	if _, ok := h.terminals.Load(third.id); ok {
		t.Error("the terminal of a shell whose client closed its stream is kept")
	}
}

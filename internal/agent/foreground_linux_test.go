package agent

import (
	"context"
	"net"
	"os"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	dsecv1 "dsec.dev/dsec/api/gen/dsec/v1"
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

func testHandler(t *testing.T) *handler {
	t.Helper()
	if _, err := os.Stat("/bin/sh"); err != nil {
		t.Skip("no /bin/sh")
	}
	h, err := newHandler(Config{CgroupFD: -1, MemoryCgroupFD: -1, PidsCgroupFD: -1, CPUCgroupFD: -1,
		Shell: "/bin/sh", OutputLimit: 1 << 20}, "")
	if err != nil {
		t.Fatal(err)
	}
	return h
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

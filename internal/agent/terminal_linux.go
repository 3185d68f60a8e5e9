package agent

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"sync"
	"time"

	"connectrpc.com/connect"
	"github.com/creack/pty"

	dsecv1 "dsec.dev/dsec/api/gen/dsec/v1"
	"dsec.dev/dsec/internal/agent/proc"
	"dsec.dev/dsec/internal/errdefs"
)

// terminalBacklog bounds a terminal's output kept in the agent: what its
// stream has not sent yet (past it the terminal's reads wait, so the shell
// blocks on its writes as on a slow terminal: nothing is dropped), and,
// apart from that, what the stream sent last, for a stream re-attaching
// from an offset its broken one had not reached (the output in flight on
// the channel when it broke is far less).
const terminalBacklog = 1 << 20

// terminalChunk is the most output one message carries.
const terminalChunk = 32 << 10

// exitDrain is how long a terminal's output is read on after its shell
// exited and its process tree was killed: a process that escaped the kill
// and holds the terminal open does not hold the stream open.
const exitDrain = time.Second

// errHangup is a terminal's stream that broke on its input side.
var errHangup = errors.New("the shell's stream broke")

// terminal is a PTY shell: its process, the PTY's master, and its output,
// read from the master into a buffer whatever stream follows it, so the
// shell lives on while no stream does (an orphan of the agent channel, see
// foreground) and a stream re-attaching from an offset misses nothing.
type terminal struct {
	p      *proc.Process
	master *os.File

	mu     sync.Mutex
	more   chan struct{} // closed (and replaced) at new output, the end, or room
	buf    []byte        // output from base on
	base   int64
	sent   int64 // how far the following stream has sent
	ended  bool  // the master's reads ended: buf holds the rest
	endErr error // the read that ended them (EIO once the shell's side closed)
	closed bool  // the master is closed: reads stop
}

// newTerminal starts reading p's terminal, master, until its end.
func newTerminal(p *proc.Process, master *os.File) *terminal {
	t := &terminal{p: p, master: master, more: make(chan struct{})}
	pumped := make(chan struct{})
	go t.pump(pumped)
	go t.reap(pumped)
	return t
}

// wake tells the waiters something changed; t.mu is held.
func (t *terminal) wake() {
	close(t.more)
	t.more = make(chan struct{})
}

func (t *terminal) pump(pumped chan<- struct{}) {
	defer close(pumped)
	buf := make([]byte, terminalChunk)
	for {
		n, err := t.master.Read(buf)
		if n > 0 {
			t.append(buf[:n])
		}
		if err != nil {
			t.mu.Lock()
			t.ended, t.endErr = true, err
			t.wake()
			t.mu.Unlock()
			return
		}
	}
}

// append adds b to the output once the unsent part has room for it.
func (t *terminal) append(b []byte) {
	t.mu.Lock()
	defer t.mu.Unlock()
	for t.base+int64(len(t.buf))-t.sent >= terminalBacklog && !t.closed {
		c := t.more
		t.mu.Unlock()
		<-c
		t.mu.Lock()
	}
	t.buf = append(t.buf, b...)
	t.wake()
}

// reap ends the terminal once its shell exited: the rest of the shell's
// process tree is killed (it would hold the terminal open), its output
// read for up to exitDrain, and the master closed.
func (t *terminal) reap(pumped <-chan struct{}) {
	<-t.p.DoneC()
	t.p.KillTree()
	select {
	case <-pumped:
	case <-time.After(exitDrain):
	}
	t.mu.Lock()
	t.closed = true
	t.wake()
	t.mu.Unlock()
	t.master.Close()
}

// next returns the output from offset from on (at most terminalChunk of
// it), waiting for some; eof once there is no more. It returns early when
// ctx ends or hangup closes.
func (t *terminal) next(ctx context.Context, from int64, hangup <-chan struct{}) (data []byte, eof bool, err error) {
	for {
		t.mu.Lock()
		from = max(from, t.base) // trimmed: what is kept is all there is
		end := t.base + int64(len(t.buf))
		if from < end {
			n := min(end-from, terminalChunk)
			data = append([]byte(nil), t.buf[from-t.base:from-t.base+n]...)
			t.mu.Unlock()
			return data, false, nil
		}
		if t.ended {
			t.mu.Unlock()
			return nil, true, nil
		}
		c := t.more
		t.mu.Unlock()
		select {
		case <-c:
		case <-ctx.Done():
			return nil, false, ctx.Err()
		case <-hangup:
			return nil, false, errHangup
		}
	}
}

// sentTo records that the following stream sent the output up to off: it
// makes room for more, and lets go of what lies terminalBacklog before.
func (t *terminal) sentTo(off int64) {
	t.mu.Lock()
	defer t.mu.Unlock()
	t.sent = off
	// Trim in steps of a backlog, not at every message: a trim copies.
	if drop := off - terminalBacklog - t.base; drop >= terminalBacklog && drop <= int64(len(t.buf)) {
		t.buf = append([]byte(nil), t.buf[drop:]...)
		t.base += drop
	}
	t.wake()
}

// shellStream is the agent's half of a Shell stream.
type shellStream interface {
	Receive() (*dsecv1.ShellInput, error)
	Send(*dsecv1.ShellOutput) error
}

// serve sends the terminal's output from offset from to stream and writes
// the stream's input to the terminal, until the shell's exit is sent, the
// stream breaks or ctx ends. Whoever owns the shell's process (foreground)
// decides at the stream's end whether it dies with it.
func (t *terminal) serve(ctx context.Context, stream shellStream, from int64) error {
	t.sentTo(from)
	hangup := make(chan struct{})
	go func() {
		for {
			in, err := stream.Receive()
			if errors.Is(err, io.EOF) {
				// The client has no more input (a pipe ran dry): end the
				// terminal's input, as ^D would, and let the shell finish.
				t.master.Write([]byte{4})
				return
			}
			if err != nil {
				close(hangup)
				return
			}
			switch {
			case in.GetResize() != nil:
				sz := in.GetResize()
				pty.Setsize(t.master, &pty.Winsize{Rows: uint16(sz.Rows), Cols: uint16(sz.Cols)})
			case in.GetData() != nil:
				if _, err := t.master.Write(in.GetData()); err != nil {
					return
				}
			}
		}
	}()
	for {
		data, eof, err := t.next(ctx, from, hangup)
		if err != nil {
			return err
		}
		if eof {
			break
		}
		if err := stream.Send(&dsecv1.ShellOutput{Output: &dsecv1.ShellOutput_Data{Data: data}}); err != nil {
			return err
		}
		from += int64(len(data))
		t.sentTo(from)
	}
	// The terminal closed: the shell exited, or closed it and runs on.
	select {
	case <-t.p.DoneC():
	case <-ctx.Done():
		return ctx.Err()
	case <-hangup:
		return errHangup
	}
	return stream.Send(&dsecv1.ShellOutput{Output: &dsecv1.ShellOutput_Exited{Exited: t.p.Exited()}})
}

func (h *handler) Shell(ctx context.Context, stream *connect.BidiStream[dsecv1.ShellInput, dsecv1.ShellOutput]) error {
	return h.shell(ctx, stream)
}

// shell starts a PTY shell, or re-attaches to one (ShellStart's
// reattach_id), and serves it on stream: its started message (the
// terminal's process, for a re-attach) and then its output and its exit.
func (h *handler) shell(ctx context.Context, stream shellStream) error {
	first, err := stream.Receive()
	if err != nil {
		return errdefs.ToConnect(fmt.Errorf("start shell: read start message: %w", err))
	}
	start := first.GetStart()
	if start == nil {
		return errdefs.ToConnect(fmt.Errorf("start shell: the first message must be start: %w", errdefs.ErrInvalidArgument))
	}
	var t *terminal
	if start.ReattachId != "" {
		t, err = h.reattachTerminal(ctx, start.ReattachId)
	} else {
		t, err = h.startTerminal(ctx, start)
	}
	if err != nil {
		return errdefs.ToConnect(err)
	}
	defer h.fg.end(ctx, t.p)
	if err := stream.Send(&dsecv1.ShellOutput{Output: &dsecv1.ShellOutput_Started{Started: t.p.ID}}); err != nil {
		return errdefs.ToConnect(err)
	}
	return errdefs.ToConnect(t.serve(ctx, stream, start.OutputOffset))
}

// startTerminal starts a shell on a new PTY, owned by the caller's stream
// (foreground): its terminal is kept for a re-attach while the foreground
// keeps its process.
func (h *handler) startTerminal(ctx context.Context, start *dsecv1.ShellStart) (*terminal, error) {
	argv := start.Argv
	if len(argv) == 0 {
		argv = []string{h.cfg.Shell, "-i"}
	}
	env := map[string]string{"TERM": "xterm-256color"}
	for k, v := range start.Env {
		env[k] = v
	}
	spec, err := h.spec(start.User, start.Cwd, "", env, argv, "")
	if err != nil {
		return nil, err
	}
	master, tty, err := pty.Open()
	if err != nil {
		return nil, fmt.Errorf("start shell: open pty: %w", err)
	}
	if sz := start.Size; sz != nil && sz.Rows > 0 && sz.Cols > 0 {
		pty.Setsize(master, &pty.Winsize{Rows: uint16(sz.Rows), Cols: uint16(sz.Cols)})
	}
	spec.TTY = tty
	p, err := h.procs.Start(context.WithoutCancel(ctx), spec)
	if err != nil {
		master.Close()
		return nil, err
	}
	t := newTerminal(p, master)
	h.terminals.Store(p.ID, t)
	h.fg.own(p, func() { h.terminals.Delete(p.ID) })
	return t, nil
}

// reattachTerminal hands the terminal of process id, orphaned by its
// stream's agent channel, to the caller's stream.
func (h *handler) reattachTerminal(ctx context.Context, id string) (*terminal, error) {
	v, ok := h.terminals.Load(id)
	if !ok {
		return nil, fmt.Errorf("re-attach to terminal %s: no such terminal: %w", id, errdefs.ErrNotFound)
	}
	t := v.(*terminal)
	owns, err := h.fg.adopt(ctx, t.p)
	if err != nil {
		return nil, err
	}
	if !owns {
		return nil, fmt.Errorf("re-attach to terminal %s: it is not waiting for a re-attach: %w", id, errdefs.ErrFailedPrecondition)
	}
	return t, nil
}

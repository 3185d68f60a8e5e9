package agentclient

import (
	"context"
	"errors"
	"fmt"
	"io"
	"sync"

	"connectrpc.com/connect"

	dsecv1 "dsec.dev/dsec/api/gen/dsec/v1"
)

// ShellFunc is the agent's Shell call (Client has it).
type ShellFunc func(context.Context) *connect.BidiStreamForClient[dsecv1.ShellInput, dsecv1.ShellOutput]

// ShellStream is the client half of one PTY shell's stream.
type ShellStream interface {
	Send(*dsecv1.ShellInput) error
	Receive() (*dsecv1.ShellOutput, error)
	CloseRequest() error
	CloseResponse() error
}

// ReattachingShell is a shell's stream, opened through open, that outlives
// its agent channel as an exec's does (Reattaching): when the stream breaks
// (the channel failed under it) after the agent named the terminal (its
// started message, which the stream keeps to itself) and before its exit,
// it opens another whose start re-attaches to the terminal (reattach_id,
// from the bytes of output received so far) and carries on there: the
// output goes on where it stopped, and input sent meanwhile goes to the new
// stream. A microVM paused to disk loses its channel: the re-attach waits
// for the resume, and the agent keeps the terminal for it. Input that ended
// before the break (CloseRequest) is not ended again on the new stream:
// the agent has had its ^D. started, if not nil, is called at the
// started message: from then on the stream carries on across a pause.
func ReattachingShell(ctx context.Context, open ShellFunc, started func()) ShellStream {
	if started == nil {
		started = func() {}
	}
	return &reattachingShell{ctx: ctx, open: open, started: started, cur: open(ctx), changed: make(chan struct{})}
}

type reattachingShell struct {
	ctx     context.Context
	open    ShellFunc
	started func()

	mu         sync.Mutex
	cur        *connect.BidiStreamForClient[dsecv1.ShellInput, dsecv1.ShellOutput]
	changed    chan struct{} // closed when cur is replaced, or at the end
	ended      bool          // no stream follows: the shell's end, or a break not re-attached
	start      *dsecv1.ShellStart
	inputEnded bool
	named      bool // the started message came: a break is re-attached

	// The receiving side's own.
	id      string // the terminal's process, from its started message
	out     int64  // bytes of output received
	exited  bool
	resumed bool // cur is a re-attach whose started message is still to come
}

// Send sends in on the current stream; one that broke under it is sent
// again on the stream re-attaching, if there is one.
func (r *reattachingShell) Send(in *dsecv1.ShellInput) error {
	for {
		r.mu.Lock()
		if s := in.GetStart(); s != nil && r.start == nil {
			r.start = s
		}
		cur, changed, ended, named := r.cur, r.changed, r.ended, r.named
		r.mu.Unlock()
		err := cur.Send(in)
		if err == nil || ended || !named {
			return err // no terminal to re-attach to (yet): Receive has the why
		}
		select {
		case <-changed:
		case <-r.ctx.Done():
			return err
		}
		r.mu.Lock()
		ended = r.ended
		r.mu.Unlock()
		if ended {
			return err
		}
	}
}

func (r *reattachingShell) CloseRequest() error {
	r.mu.Lock()
	r.inputEnded = true
	cur := r.cur
	r.mu.Unlock()
	return cur.CloseRequest()
}

func (r *reattachingShell) CloseResponse() error {
	r.mu.Lock()
	cur := r.cur
	r.mu.Unlock()
	return cur.CloseResponse()
}

func (r *reattachingShell) Receive() (*dsecv1.ShellOutput, error) {
	for {
		r.mu.Lock()
		cur := r.cur
		r.mu.Unlock()
		msg, err := cur.Receive()
		if err == nil {
			switch o := msg.GetOutput().(type) {
			case *dsecv1.ShellOutput_Started:
				if !r.resumed {
					r.id = o.Started
					r.started()
					r.mu.Lock()
					r.named = true
					r.mu.Unlock()
				}
				r.resumed = false
				continue // the edge's own: the client has nothing to do with it
			case *dsecv1.ShellOutput_Data:
				r.out += int64(len(o.Data))
			case *dsecv1.ShellOutput_Exited:
				r.exited = true
			}
			return msg, nil
		}
		if r.resumed {
			// A re-attach that broke before its started message made no
			// progress: no second try.
			return nil, r.end(fmt.Errorf("re-attach to terminal %s: %w", r.id, err))
		}
		if errors.Is(err, io.EOF) || r.id == "" || r.exited || !broken(r.ctx, err) {
			return nil, r.end(err)
		}
		r.reattach()
	}
}

// reattach opens the stream that takes over the terminal.
func (r *reattachingShell) reattach() {
	next := r.open(r.ctx)
	r.mu.Lock()
	start := &dsecv1.ShellStart{ReattachId: r.id, OutputOffset: r.out}
	if r.start != nil {
		start.SandboxId = r.start.SandboxId
	}
	r.mu.Unlock()
	// An error here shows in next's Receive.
	next.Send(&dsecv1.ShellInput{Input: &dsecv1.ShellInput_Start{Start: start}})
	r.mu.Lock()
	old := r.cur
	r.cur, r.resumed = next, true
	close(r.changed)
	r.changed = make(chan struct{})
	r.mu.Unlock()
	old.CloseResponse()
}

// end marks the stream ended for the sending side and returns err.
func (r *reattachingShell) end(err error) error {
	r.mu.Lock()
	defer r.mu.Unlock()
	if !r.ended {
		r.ended = true
		close(r.changed)
	}
	return err
}

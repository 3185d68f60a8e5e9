package agentclient

import (
	"context"
	"errors"
	"fmt"
	"strings"

	"connectrpc.com/connect"

	dsecv1 "dsec.dev/dsec/api/gen/dsec/v1"
)

// AttachFunc is the agent's Attach call (Client has it).
type AttachFunc func(context.Context, *connect.Request[dsecv1.AttachRequest]) (*connect.ServerStreamForClient[dsecv1.ExecEvent], error)

// Reattaching wraps s, the stream of one command (an Exec or a
// SessionRun), so that it outlives its agent channel: when s breaks (the
// channel failed under it, not the agent's verdict) after the command
// started and before its exit, it re-attaches to the command through
// attach (reattach, from the bytes of each output stream received so
// far) and reads on from there, as often as that happens. A microVM
// paused to disk loses its channel: the re-attach's dial waits for the
// resume (channel.Dialer.Suspend), and the agent keeps the command for it.
// A re-attach that fails (the sandbox is gone, the agent does not know
// the command) ends the stream with the break's error and the re-attach's.
func Reattaching(ctx context.Context, attach AttachFunc, s ExecStream) ExecStream {
	return &reattaching{ctx: ctx, attach: attach, cur: s}
}

type reattaching struct {
	ctx    context.Context
	attach AttachFunc
	cur    ExecStream

	id          string // the command's, from its started event
	out, errOut int64  // bytes of stdout and stderr received, gaps included
	exited      bool   // its exit came
	resumed     bool   // cur is a re-attach whose started event is still to come
	msg         *dsecv1.ExecEvent
	err         error
}

func (r *reattaching) Receive() bool {
	for {
		if r.cur.Receive() {
			m := r.cur.Msg()
			switch ev := m.GetEvent().(type) {
			case *dsecv1.ExecEvent_Started:
				if r.resumed {
					r.resumed = false
					continue // the client has it from the first stream
				}
				r.id = ev.Started.GetProcessId()
			case *dsecv1.ExecEvent_Stdout:
				r.out += int64(len(ev.Stdout))
			case *dsecv1.ExecEvent_Stderr:
				r.errOut += int64(len(ev.Stderr))
			case *dsecv1.ExecEvent_Dropped:
				if ev.Dropped.GetStderr() {
					r.errOut += ev.Dropped.GetBytes()
				} else {
					r.out += ev.Dropped.GetBytes()
				}
			case *dsecv1.ExecEvent_Exited:
				r.exited = true
			}
			r.msg = m
			return true
		}
		err := r.cur.Err()
		r.msg = nil
		if r.resumed && err != nil {
			// A re-attach that broke before its started event made no
			// progress: no second try.
			r.err = fmt.Errorf("re-attach to %s: %w", r.id, err)
			return false
		}
		if err == nil || r.id == "" || r.exited || !broken(r.ctx, err) {
			r.err = err
			return false
		}
		next, aerr := r.attach(r.ctx, connect.NewRequest(&dsecv1.AttachRequest{
			ProcessId: r.id, Reattach: true, StdoutOffset: r.out, StderrOffset: r.errOut,
		}))
		if aerr != nil {
			r.err = fmt.Errorf("%w (re-attach to %s: %v)", err, r.id, aerr)
			return false
		}
		r.cur.Close()
		r.cur, r.resumed = next, true
	}
}

// broken reports whether err, a stream's end, is its channel failing (a
// connection that broke, which a re-attach may outlive) rather than the
// agent's answer or the caller's context ending.
func broken(ctx context.Context, err error) bool {
	if ctx.Err() != nil {
		return false
	}
	var ce *connect.Error
	if errors.As(err, &ce) {
		switch ce.Code() {
		case connect.CodeUnavailable, connect.CodeUnknown, connect.CodeInternal:
			return true
		}
		// A Connect stream cut mid-message says so as a protocol error
		// ("incomplete envelope"), whatever its code.
		return strings.Contains(ce.Message(), "protocol error")
	}
	return true
}

func (r *reattaching) Msg() *dsecv1.ExecEvent { return r.msg }

func (r *reattaching) Err() error { return r.err }

func (r *reattaching) Close() error { return r.cur.Close() }

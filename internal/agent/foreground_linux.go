package agent

import (
	"context"
	"fmt"
	"log/slog"
	"net"
	"sync"
	"time"

	"dsec.dev/dsec/internal/agent/proc"
	"dsec.dev/dsec/internal/errdefs"
	"dsec.dev/dsec/internal/vm/channel"
)

// orphanGrace is how long a foreground command whose stream ended with
// its agent channel waits for a stream to re-attach (AttachRequest's
// reattach) once the host is back, before it is killed as if its client
// had gone. While the host is away (a microVM paused to disk, an edge
// restarting) it waits on: the guest's clock stands still through a pause.
const orphanGrace = 30 * time.Second

// adoptWait bounds how long a re-attach waits for the stream it replaces
// to end: the agent may see the new stream before the old one's end.
const adoptWait = 10 * time.Second

// connKey carries the connection a call came on in its context.
type connKey struct{}

// withConn returns ctx carrying c, the connection of the calls under it.
func withConn(ctx context.Context, c net.Conn) context.Context {
	return context.WithValue(ctx, connKey{}, c)
}

// channelLost reports whether the connection of ctx's call ended with its
// whole agent channel (package channel: the host went away), rather than
// the client closing it.
func channelLost(ctx context.Context) bool {
	c, _ := ctx.Value(connKey{}).(net.Conn)
	return c != nil && channel.Lost(c)
}

// foreground holds the foreground commands (Exec, SessionRun) running,
// each owned by the stream that follows it: the command dies with its
// stream, except when the stream ended with the agent channel (a microVM
// paused to disk loses its channel at the resume). Such a command is kept,
// orphaned, for a stream to re-attach and take it over (Attach with
// reattach, from the offsets the broken stream had reached), and killed
// if none does within orphanGrace of the host's return.
type foreground struct {
	log *slog.Logger
	// hostSince reports whether the host is connected, since when; nil
	// where the channel is no microVM's (the host never goes away).
	hostSince func() (time.Time, bool)

	mu sync.Mutex
	m  map[string]*owned // by process ID
}

type owned struct {
	p        *proc.Process
	gone     func()        // run once fg lets p go (nil: nothing to run)
	orphaned chan struct{} // closed when its stream ended with the channel
	timer    *time.Timer   // the grace of an orphan
}

func newForeground(ln net.Listener, log *slog.Logger) *foreground {
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	fg := &foreground{log: log, m: map[string]*owned{}}
	if h, ok := ln.(interface{ HostSince() (time.Time, bool) }); ok {
		fg.hostSince = h.HostSince
	}
	return fg
}

// own registers p, a foreground command a stream follows from its start;
// gone, if given, runs once p is let go (killed, released), as its owner's
// own cleanup: a terminal's, whose output lives outside p, so it is kept
// for a re-attach even once p has exited (the rest of its output and its
// exit are still to be sent).
func (fg *foreground) own(p *proc.Process, gone ...func()) {
	fg.mu.Lock()
	defer fg.mu.Unlock()
	o := &owned{p: p, orphaned: make(chan struct{})}
	if len(gone) > 0 {
		o.gone = gone[0]
	}
	fg.m[p.ID] = o
}

// end is the end of the stream that owns p, whose call's context is ctx:
// p is killed if it runs, and its output released, unless the stream
// ended with the agent channel while p runs: then p is orphaned.
func (fg *foreground) end(ctx context.Context, p *proc.Process) {
	fg.mu.Lock()
	o := fg.m[p.ID]
	if o != nil && (!p.Done() || o.gone != nil) && channelLost(ctx) {
		close(o.orphaned)
		o.timer = time.AfterFunc(orphanGrace, func() { fg.expire(o) })
		fg.mu.Unlock()
		fg.log.Info("foreground command's channel lost: kept for its stream to re-attach", "process", p.ID)
		return
	}
	delete(fg.m, p.ID)
	fg.mu.Unlock()
	if !p.Done() {
		p.KillTree()
	}
	p.Release()
	if o != nil && o.gone != nil {
		o.gone()
	}
}

// expire ends an orphan nobody re-attached to, once the host has been
// back for orphanGrace.
func (fg *foreground) expire(o *owned) {
	fg.mu.Lock()
	if fg.m[o.p.ID] != o || o.timer == nil {
		fg.mu.Unlock()
		return // re-attached meanwhile
	}
	if fg.hostSince != nil {
		since, ok := fg.hostSince()
		if left := orphanGrace - time.Since(since); !ok || left > 0 {
			if !ok {
				left = orphanGrace
			}
			o.timer = time.AfterFunc(left, func() { fg.expire(o) })
			fg.mu.Unlock()
			return
		}
	}
	delete(fg.m, o.p.ID)
	fg.mu.Unlock()
	fg.log.Info("orphaned foreground command killed: no stream re-attached", "process", o.p.ID)
	o.p.KillTree()
	o.p.Release()
	if o.gone != nil {
		o.gone()
	}
}

// adopt hands orphan p to the stream re-attaching to it, once the stream
// it replaces has ended; the caller then owns it (end). It reports false
// for a command that is no orphan: a background one, or one already
// ended, which is followed without being owned.
func (fg *foreground) adopt(ctx context.Context, p *proc.Process) (bool, error) {
	fg.mu.Lock()
	o := fg.m[p.ID]
	fg.mu.Unlock()
	if o == nil {
		return false, nil
	}
	t := time.NewTimer(adoptWait)
	defer t.Stop()
	done := p.DoneC()
	if o.gone != nil {
		done = nil // a terminal is kept once exited too: wait for its stream's end
	}
	select {
	case <-o.orphaned:
	case <-done:
	case <-ctx.Done():
		return false, ctx.Err()
	case <-t.C:
		return false, fmt.Errorf("re-attach to %s: another stream follows it: %w", p.ID, errdefs.ErrFailedPrecondition)
	}
	fg.mu.Lock()
	defer fg.mu.Unlock()
	if fg.m[p.ID] != o || o.timer == nil {
		return false, nil // killed at its grace's end, or ended with its stream
	}
	o.timer.Stop()
	o.timer = nil
	o.orphaned = make(chan struct{})
	return true, nil
}

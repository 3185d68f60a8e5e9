package e2b

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"time"

	"connectrpc.com/connect"

	dsecv1 "dsec.dev/dsec/api/gen/dsec/v1"
	processpb "dsec.dev/dsec/api/gen/e2b/process"
)

// ptySession is a command in a terminal: dsec's Shell stream, which this
// apiserver holds, in memory, for the command's life (its stream ends when
// the command exits or its Connect-Timeout-Ms passes, and the command with
// it). The procTable keeps it by pid, so only the apiserver that started a
// terminal reaches it: fine on one node, and a cluster's E2B traffic for a
// sandbox goes to one apiserver as long as its clients keep to one
// address. Every Start or Connect stream subscribes to its output from
// then on, as envd's do.
type ptySession struct {
	shell  *connect.BidiStreamForClient[dsecv1.ShellInput, dsecv1.ShellOutput]
	cancel context.CancelFunc // ends the stream, and the command

	sendMu sync.Mutex // one Send at a time on shell

	mu   sync.Mutex
	subs map[*ptySub]struct{}
	exit *dsecv1.ExecExited // how the command ended, once done
	err  error              // or why its stream broke
	done chan struct{}      // closed when it ended; subscribers get no more
}

// ptySub is one stream's subscription to a terminal's output.
type ptySub struct {
	ch   chan []byte
	gone chan struct{} // closed when the subscriber left
}

func newPTYSession(shell *connect.BidiStreamForClient[dsecv1.ShellInput, dsecv1.ShellOutput], cancel context.CancelFunc) *ptySession {
	return &ptySession{shell: shell, cancel: cancel, subs: map[*ptySub]struct{}{}, done: make(chan struct{})}
}

// send writes in to the terminal's stream.
func (p *ptySession) send(in *dsecv1.ShellInput) error {
	if p.ended() {
		return connect.NewError(connect.CodeNotFound, errors.New("the terminal's process has exited"))
	}
	p.sendMu.Lock()
	defer p.sendMu.Unlock()
	if err := p.shell.Send(in); err != nil {
		return connect.NewError(connect.CodeUnavailable, fmt.Errorf("write to the terminal: %w", err))
	}
	return nil
}

// subscribe gets the terminal's output from now on; leave ends that.
func (p *ptySession) subscribe() (sub *ptySub, leave func()) {
	sub = &ptySub{ch: make(chan []byte, 64), gone: make(chan struct{})}
	p.mu.Lock()
	p.subs[sub] = struct{}{}
	p.mu.Unlock()
	return sub, func() {
		p.mu.Lock()
		delete(p.subs, sub)
		p.mu.Unlock()
		close(sub.gone)
	}
}

// ended reports whether the terminal's command has ended.
func (p *ptySession) ended() bool {
	select {
	case <-p.done:
		return true
	default:
		return false
	}
}

// run reads the terminal until it ends, handing its output to every
// subscriber (a slow one holds the others up, as with envd).
func (p *ptySession) run() {
	defer p.cancel()
	for {
		out, err := p.shell.Receive()
		if err != nil {
			p.finish(nil, err)
			return
		}
		switch o := out.Output.(type) {
		case *dsecv1.ShellOutput_Data:
			p.mu.Lock()
			subs := make([]*ptySub, 0, len(p.subs))
			for s := range p.subs {
				subs = append(subs, s)
			}
			p.mu.Unlock()
			for _, s := range subs {
				select {
				case s.ch <- o.Data:
				case <-s.gone:
				}
			}
		case *dsecv1.ShellOutput_Exited:
			p.finish(o.Exited, nil)
			return
		}
	}
}

func (p *ptySession) finish(exit *dsecv1.ExecExited, err error) {
	p.mu.Lock()
	p.exit, p.err = exit, err
	p.mu.Unlock()
	close(p.done)
	p.sendMu.Lock()
	p.shell.CloseRequest()
	p.sendMu.Unlock()
	p.shell.CloseResponse()
}

// end is the terminal's end event, once it ended.
func (p *ptySession) end() *processpb.ProcessEvent {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.exit != nil {
		return endEvent(p.exit)
	}
	msg := "the terminal's stream ended before its command"
	if p.err != nil {
		msg = "the terminal's stream broke: " + messageOf(p.err)
	}
	return &processpb.ProcessEvent{Event: &processpb.ProcessEvent_End{End: &processpb.ProcessEvent_EndEvent{
		ExitCode: -1, Status: "signal: killed", Error: &msg}}}
}

// follow sends a subscriber's output as pty data, keepalives while it is
// quiet, and the end, until the terminal ends or ctx does.
func (p *ptySession) follow(ctx context.Context, sub *ptySub, send func(*processpb.ProcessEvent) error) error {
	tick := time.NewTicker(ptyKeepalive)
	defer tick.Stop()
	for {
		select {
		case b := <-sub.ch:
			if err := send(ptyData(b)); err != nil {
				return err
			}
			tick.Reset(ptyKeepalive)
		case <-p.done:
			// Every output was handed over before done closed.
			for {
				select {
				case b := <-sub.ch:
					if err := send(ptyData(b)); err != nil {
						return err
					}
				default:
					return send(p.end())
				}
			}
		case <-tick.C:
			if err := send(keepaliveEvent()); err != nil {
				return err
			}
		case <-ctx.Done():
			return ctx.Err()
		}
	}
}

// ptyKeepalive is how long a quiet terminal's streams wait before a
// keepalive (dsec's agent sends its own for commands at this pace).
const ptyKeepalive = 15 * time.Second

func ptyData(b []byte) *processpb.ProcessEvent {
	return &processpb.ProcessEvent{Event: &processpb.ProcessEvent_Data{Data: &processpb.ProcessEvent_DataEvent{
		Output: &processpb.ProcessEvent_DataEvent_Pty{Pty: b}}}}
}

package backendtest

import (
	"context"
	"fmt"
	"strings"
	"testing"
	"time"

	"connectrpc.com/connect"

	dsecv1 "dsec.dev/dsec/api/gen/dsec/v1"
	"dsec.dev/dsec/internal/agent/agentclient"
	"dsec.dev/dsec/internal/edge/backend"
)

// commandWithin bounds one command the suite runs in a sandbox. Commands
// are short; the bound is for a sandbox that hangs.
const commandWithin = 2 * time.Minute

// sandbox is a started sandbox the checks run commands in.
type sandbox struct {
	n    *node
	spec backend.Spec
	dial backend.Dialer
	c    agentclient.Client
}

// startSandbox starts s and waits for its agent to answer.
func (n *node) startSandbox(s backend.Spec) *sandbox {
	n.t.Helper()
	dial := n.start(s)
	return &sandbox{n: n, spec: s, dial: dial, c: n.answers(s.ID, dial)}
}

// result is what a command did.
type result struct {
	stdout, stderr string
	exited         *dsecv1.ExecExited // nil when the stream ended without an exit
	err            error              // the stream's error
}

func (r result) String() string {
	return fmt.Sprintf("exit %v, stdout %q, stderr %q, stream error %v", r.exited, r.stdout, r.stderr, r.err)
}

// ok reports whether the command exited 0.
func (r result) ok() bool { return r.err == nil && r.exited != nil && r.exited.ExitCode == 0 }

// exec runs line under /bin/sh -c and collects what it did.
func (sb *sandbox) exec(line string) result {
	ctx, cancel := context.WithTimeout(context.Background(), commandWithin)
	defer cancel()
	return collect(sb.c.ExecEvents(ctx, &dsecv1.ExecRequest{Argv: []string{"/bin/sh", "-c", line}}))
}

func collect(s agentclient.ExecStream, err error) result {
	if err != nil {
		return result{err: err}
	}
	defer s.Close()
	var r result
	var out, errb strings.Builder
	for s.Receive() {
		out.Write(s.Msg().GetStdout())
		errb.Write(s.Msg().GetStderr())
		if e := s.Msg().GetExited(); e != nil {
			r.exited = e
		}
	}
	r.stdout, r.stderr, r.err = out.String(), errb.String(), s.Err()
	return r
}

// must runs line, fails t unless it exits 0, and returns its stdout
// trimmed.
func (sb *sandbox) must(t *testing.T, line string) string {
	t.Helper()
	r := sb.exec(line)
	if !r.ok() {
		t.Fatalf("%s: %q: %s", sb.spec.ID, line, r)
	}
	return strings.TrimSpace(r.stdout)
}

// background is a command started in the background, followed by a
// stream that delivers its output.
type background struct {
	id     string // the agent's process ID
	stream agentclient.ExecStream
	cancel context.CancelFunc
}

// startBackground starts line in the background with stdin kept open.
func (sb *sandbox) startBackground(t *testing.T, line string) *background {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), commandWithin)
	s, err := sb.c.ExecEvents(ctx, &dsecv1.ExecRequest{Argv: []string{"/bin/sh", "-c", line},
		Background: true, KeepStdinOpen: true})
	if err != nil {
		cancel()
		t.Fatalf("%s: start %q: %v", sb.spec.ID, line, err)
	}
	if !s.Receive() || s.Msg().GetStarted() == nil {
		cancel()
		s.Close()
		t.Fatalf("%s: %q did not start: %v", sb.spec.ID, line, s.Err())
	}
	b := &background{id: s.Msg().GetStarted().ProcessId, stream: s, cancel: cancel}
	t.Cleanup(func() { b.stream.Close(); b.cancel() })
	return b
}

// readLine reads the background command's stdout up to the first line
// that starts with prefix and returns that line; ok is false once the
// stream ended first.
func (b *background) readLine(prefix string) (line string, ok bool, all string) {
	var out strings.Builder
	for b.stream.Receive() {
		out.Write(b.stream.Msg().GetStdout())
		out.Write(b.stream.Msg().GetStderr())
		for l := range strings.Lines(out.String()) {
			if strings.HasPrefix(l, prefix) && strings.HasSuffix(l, "\n") {
				return strings.TrimSpace(l), true, out.String()
			}
		}
	}
	return "", false, out.String()
}

// kill SIGKILLs the background command's whole tree.
func (sb *sandbox) kill(t *testing.T, b *background) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), commandWithin)
	defer cancel()
	if _, err := sb.c.Signal(ctx, connect.NewRequest(&dsecv1.SignalRequest{ProcessId: b.id})); err != nil {
		t.Errorf("%s: kill process %s: %v", sb.spec.ID, b.id, err)
	}
}

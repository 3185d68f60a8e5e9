package microvm_test

import (
	"context"
	"fmt"
	"strings"
	"testing"
	"time"

	"connectrpc.com/connect"

	dsecv1 "dsec.dev/dsec/api/gen/dsec/v1"
	"dsec.dev/dsec/internal/agent/agentclient"
)

// inflight is a command whose stream is read in the background while the
// test pauses and resumes its VM.
type inflight struct {
	what    string
	started chan struct{} // closed at its first line of output
	done    chan struct{}
	out     string
	exited  *dsecv1.ExecExited
	err     error
}

// countingCommand prints 1 to n, one line every 0.2 s.
func countingCommand(n int) string {
	return fmt.Sprintf("for i in $(seq 1 %d); do echo $i; sleep 0.2; done", n)
}

// countingLines is what countingCommand(n) prints.
func countingLines(n int) string {
	var b strings.Builder
	for i := 1; i <= n; i++ {
		fmt.Fprintf(&b, "%d\n", i)
	}
	return b.String()
}

// startExec runs command in the background through an exec stream (the
// framed path); session, when not "", runs it in that shell session
// instead (a Connect stream), wrapped as the edge wraps it.
func startInflight(t *testing.T, c agentclient.Client, session, command string) *inflight {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	var s agentclient.ExecStream
	var err error
	what := "exec"
	if session == "" {
		s, err = c.ExecEvents(ctx, &dsecv1.ExecRequest{Argv: []string{"sh", "-c", command}})
	} else {
		what = "session run"
		var in *connect.ServerStreamForClient[dsecv1.ExecEvent]
		in, err = c.SessionRun(ctx, connect.NewRequest(&dsecv1.SessionRunRequest{Session: session, Command: command}))
		if err == nil {
			s = agentclient.Reattaching(ctx, c.Attach, in)
		}
	}
	if err != nil {
		cancel()
		t.Fatalf("%s %q: %v", what, command, err)
	}
	f := &inflight{what: what, started: make(chan struct{}), done: make(chan struct{})}
	go func() {
		defer close(f.done)
		defer cancel()
		defer s.Close()
		var out strings.Builder
		for s.Receive() {
			out.Write(s.Msg().GetStdout())
			out.Write(s.Msg().GetStderr())
			if out.Len() > 0 && !isClosed(f.started) {
				close(f.started)
			}
			if e := s.Msg().GetExited(); e != nil {
				f.exited = e
			}
		}
		f.out, f.err = out.String(), s.Err()
	}()
	select {
	case <-f.started:
	case <-f.done:
		t.Fatalf("%s %q ended before its first line: %q, %v", what, command, f.out, f.err)
	}
	return f
}

func isClosed(c chan struct{}) bool {
	select {
	case <-c:
		return true
	default:
		return false
	}
}

// wait returns once the command's stream ended.
func (f *inflight) wait(t *testing.T) {
	t.Helper()
	select {
	case <-f.done:
	case <-time.After(3 * time.Minute):
		t.Fatalf("%s: its stream did not end", f.what)
	}
}

// checkAll: the stream carried every line of countingCommand(n) and the
// exit 0.
func (f *inflight) checkAll(t *testing.T, n int, when string) {
	t.Helper()
	f.wait(t)
	if f.err != nil || f.out != countingLines(n) || f.exited.GetExitCode() != 0 || f.exited.GetStatus() != dsecv1.ExitStatus_EXIT_STATUS_OK {
		t.Errorf("%s across %s: output %q, exit %v, err %v; want 1 to %d, exit 0", f.what, when, f.out, f.exited, f.err, n)
	}
}

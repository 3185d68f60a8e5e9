package root

import (
	"context"
	"fmt"
	"os/exec"
	"strings"
	"testing"
	"time"

	"connectrpc.com/connect"

	dsecv1 "dsec.dev/dsec/api/gen/dsec/v1"
	"dsec.dev/dsec/internal/testutil"
)

// TestMicroVMPause: a microVM sandbox paused through the API (with its
// memory released) has no QEMU left and at least 90 % of QEMU's memory
// released; it stays paused across a restart of dsecd, and the next exec
// resumes it with a file in /dev/shm (guest RAM) and a session's shell
// variable (a process's memory) intact. It logs pause -> exec's time.
// Commands in flight through the API, an exec and a session's run, go on
// across a pause to disk and a resume with every line and their exit;
// one in flight when its paused VM is deleted ends with an error that
// says the sandbox was deleted.
func TestMicroVMPause(t *testing.T) {
	allInOneOnly(t)
	d := startDaemon(t, "--vm-kernel-dir", testutil.VMKernelDir(t))
	id := create(t, d, &dsecv1.SandboxSpec{Isolation: dsecv1.Isolation_ISOLATION_MICROVM, MemoryMb: 256}).GetId()
	sum := mustSh(t, d, id, "head -c 8388608 /dev/urandom > /dev/shm/f && md5sum /dev/shm/f")
	session(t, d, id, "export MARK=kept-by-the-shell")

	p := pause(t, d, id, false)
	st := p.GetSandbox().GetLastPause()
	t.Logf("pause: frozen in %d µs, saved and released in %d ms, QEMU's resident %d MiB, released %d MiB, kept %d KiB",
		st.GetFrozenUs(), st.GetReclaimMs(), st.GetResidentBytes()>>20, st.GetReleasedBytes()>>20, st.GetKeptBytes()>>10)
	if p.GetSandbox().GetState() != dsecv1.State_STATE_PAUSED {
		t.Fatalf("pause answered %v", p)
	}
	if st.GetResidentBytes() <= 0 || st.GetReleasedBytes()*10 < st.GetResidentBytes()*9 {
		t.Errorf("released %d of %d resident bytes, want at least 90 %%", st.GetReleasedBytes(), st.GetResidentBytes())
	}
	if out, _ := exec.Command("pgrep", "-f", "dsec-"+id).Output(); len(out) > 0 {
		t.Errorf("QEMU of the paused %s runs: %s", id, out)
	}

	d.Kill()
	d.Start()
	if got := state(t, d, id); got.GetState() != dsecv1.State_STATE_PAUSED {
		t.Fatalf("after a restart of dsecd: %s, want paused", got.GetState())
	}
	// Any call resumes it.
	t0 := time.Now()
	if got := mustSh(t, d, id, "md5sum /dev/shm/f"); got != sum {
		t.Errorf("/dev/shm changed across the pause and restart: %q, was %q", got, sum)
	}
	t.Logf("paused microVM: exec (resume first) %s", time.Since(t0).Round(time.Millisecond))
	if got := session(t, d, id, "echo $MARK"); got != "kept-by-the-shell\n" {
		t.Errorf("the session's variable after the resume: %q", got)
	}
	if got := state(t, d, id); got.GetState() != dsecv1.State_STATE_RUNNING {
		t.Errorf("after an exec: %s, want running", got.GetState())
	}
	// A running VM paused without releasing its memory is frozen in place.
	pause(t, d, id, true)
	if got := strings.TrimSpace(mustSh(t, d, id, "echo thawed")); got != "thawed" {
		t.Errorf("exec after a pause keeping memory: %q", got)
	}

	const lines = 15
	counting := fmt.Sprintf("for i in $(seq 1 %d); do echo $i; sleep 0.2; done", lines)
	var want strings.Builder
	for i := 1; i <= lines; i++ {
		fmt.Fprintf(&want, "%d\n", i)
	}
	ex := apiInflight(t, d, id, "", counting)
	run := apiInflight(t, d, id, "s", counting)
	pause(t, d, id, false)
	resume(t, d, id)
	for _, f := range []*apiStream{ex, run} {
		out, exited, err := f.wait(t)
		if err != nil || out != want.String() || exited.GetExitCode() != 0 {
			t.Errorf("%s in flight across a pause to disk: %q, exit %v, %v; want 1 to %d and exit 0", f.what, out, exited, err, lines)
		}
	}

	gone := apiInflight(t, d, id, "", "while :; do echo x; sleep 0.2; done")
	pause(t, d, id, false)
	if _, err := d.Clients.Sandboxes.Delete(context.Background(), connect.NewRequest(&dsecv1.DeleteRequest{Id: id})); err != nil {
		t.Fatal(err)
	}
	if _, _, err := gone.wait(t); err == nil || !strings.Contains(err.Error(), "deleted") {
		t.Errorf("an exec in flight when its paused sandbox was deleted ended with %v, want an error saying it was deleted", err)
	}
}

// apiStream is an exec or a session run read in the background.
type apiStream struct {
	what    string
	started chan struct{}
	done    chan struct{}
	out     strings.Builder
	exited  *dsecv1.ExecExited
	err     error
}

// apiInflight starts command in sandbox id through the API, in session
// when not "", and returns once its first output came.
func apiInflight(t *testing.T, d *testutil.Daemon, id, session, command string) *apiStream {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	type stream interface {
		Receive() bool
		Msg() *dsecv1.ExecEvent
		Err() error
		Close() error
	}
	var s stream
	var err error
	f := &apiStream{what: "exec", started: make(chan struct{}), done: make(chan struct{})}
	if session == "" {
		s, err = d.Clients.Sandboxes.Exec(ctx, connect.NewRequest(&dsecv1.ExecRequest{SandboxId: id, Command: command}))
	} else {
		f.what = "session run"
		s, err = d.Clients.Sandboxes.SessionRun(ctx, connect.NewRequest(&dsecv1.SessionRunRequest{SandboxId: id, Session: session, Command: command}))
	}
	if err != nil {
		cancel()
		t.Fatalf("%s %q: %v", f.what, command, err)
	}
	go func() {
		defer close(f.done)
		defer cancel()
		defer s.Close()
		seen := false
		for s.Receive() {
			f.out.Write(s.Msg().GetStdout())
			if !seen && f.out.Len() > 0 {
				seen = true
				close(f.started)
			}
			if e := s.Msg().GetExited(); e != nil {
				f.exited = e
			}
		}
		f.err = s.Err()
	}()
	select {
	case <-f.started:
	case <-f.done:
		t.Fatalf("%s %q ended before its first line: %q, %v", f.what, command, f.out.String(), f.err)
	}
	return f
}

// wait returns what the stream carried once it ended.
func (f *apiStream) wait(t *testing.T) (string, *dsecv1.ExecExited, error) {
	t.Helper()
	select {
	case <-f.done:
	case <-time.After(3 * time.Minute):
		t.Fatalf("%s: its stream did not end", f.what)
	}
	return f.out.String(), f.exited, f.err
}

// session runs command in sandbox id's session "s" and returns its output.
func session(t *testing.T, d *testutil.Daemon, id, command string) string {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	stream, err := d.Clients.Sandboxes.SessionRun(ctx, connect.NewRequest(&dsecv1.SessionRunRequest{SandboxId: id, Session: "s", Command: command}))
	if err != nil {
		t.Fatal(err)
	}
	defer stream.Close()
	var out strings.Builder
	for stream.Receive() {
		out.Write(stream.Msg().GetStdout())
		out.Write(stream.Msg().GetStderr())
	}
	if err := stream.Err(); err != nil {
		t.Fatalf("session run %q in %s: %v", command, id, err)
	}
	return out.String()
}

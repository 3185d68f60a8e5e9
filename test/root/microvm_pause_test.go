package root

import (
	"context"
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

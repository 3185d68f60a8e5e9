package backendtest

import (
	"context"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"strings"
	"testing"

	dsecv1 "dsec.dev/dsec/api/gen/dsec/v1"
	"dsec.dev/dsec/internal/agent/agentclient"
	"dsec.dev/dsec/internal/edge/backend"
	"dsec.dev/dsec/internal/errdefs"
)

// state is what a pause must keep of a sandbox: a process's memory (the
// agent's hold-memory mode, which checks its own bytes on SIGUSR1) and a
// file in /dev/shm (a tmpfs: memory, not disk).
type state struct {
	sb       *sandbox
	memSum   string // the SHA-256 hold-memory wrote of its memory
	shmSum   string // md5sum of /dev/shm/state
	noChecks bool   // the agent runs no commands: nothing to check
}

// holdState starts a process holding 32 MiB and writes 4 MiB to /dev/shm.
func holdState(t *testing.T, sb *sandbox) *state {
	t.Helper()
	if sb.n.o.NoCommands {
		return &state{sb: sb, noChecks: true}
	}
	sb.must(t, sb.n.o.agentPath()+" hold-memory 32 /tmp >/dev/null 2>&1 &")
	st := &state{sb: sb, memSum: waitFile(t, sb, "/tmp/memhog.sum")}
	st.shmSum = sb.must(t, "dd if=/dev/urandom of=/dev/shm/state bs=1M count=4 2>/dev/null && md5sum /dev/shm/state")
	return st
}

// check checks that the memory and the /dev/shm file are what they were.
func (st *state) check(t *testing.T, when string) {
	t.Helper()
	if st.noChecks {
		return
	}
	sb := st.sb
	sb.must(t, "rm -f /tmp/memhog.check; kill -USR1 $(cat /tmp/memhog.pid)")
	if got, _, _ := strings.Cut(waitFile(t, sb, "/tmp/memhog.check"), " "); got != st.memSum {
		t.Errorf("%s: a process's memory changed %s: checksum %s, was %s", sb.spec.ID, when, got, st.memSum)
	}
	if got := sb.must(t, "md5sum /dev/shm/state"); got != st.shmSum {
		t.Errorf("%s: /dev/shm/state changed %s: %s, was %s", sb.spec.ID, when, got, st.shmSum)
	}
}

// waitFile waits for a file in the sandbox to hold a line and returns it.
func waitFile(t *testing.T, sb *sandbox, path string) string {
	t.Helper()
	var last result
	if !waitFor(commandWithin, func() bool {
		last = sb.exec("cat " + path + " 2>/dev/null")
		return last.ok() && strings.TrimSpace(last.stdout) != ""
	}) {
		t.Fatalf("%s: %s did not appear within %s: %s", sb.spec.ID, path, commandWithin, last)
	}
	return strings.TrimSpace(last.stdout)
}

// inflightLines is how many lines an inflight command prints, one every
// 0.2 s: long enough to run on across a pause started at its first line.
const inflightLines = 15

// inflight starts a command printing 1 to inflightLines, waits for its
// first line and returns a wait for the rest of its stream, read
// meanwhile: what a training loop's command does while its sandbox is
// paused and resumed.
func (sb *sandbox) inflight(t *testing.T) (wait func() result) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 2*commandWithin)
	s, err := sb.c.ExecEvents(ctx, &dsecv1.ExecRequest{Argv: []string{"/bin/sh", "-c",
		fmt.Sprintf("for i in $(seq 1 %d); do echo $i; sleep 0.2; done", inflightLines)}})
	if err != nil {
		cancel()
		t.Fatalf("%s: start a command: %v", sb.spec.ID, err)
	}
	first := make(chan struct{})
	done := make(chan result, 1)
	go func() {
		defer cancel()
		done <- collect(&firstOutput{ExecStream: s, first: first}, nil)
	}()
	select {
	case <-first:
	case r := <-done:
		t.Fatalf("%s: a command ended before its first line: %s", sb.spec.ID, r)
	}
	return func() result { return <-done }
}

// firstOutput closes first at the stream's first output.
type firstOutput struct {
	agentclient.ExecStream
	first chan struct{}
	seen  bool
}

func (f *firstOutput) Receive() bool {
	ok := f.ExecStream.Receive()
	if ok && !f.seen && len(f.Msg().GetStdout()) > 0 {
		f.seen = true
		close(f.first)
	}
	return ok
}

// checkInflight checks an inflight command's stream carried every line
// and the exit 0.
func checkInflight(t *testing.T, id, when string, r result) {
	t.Helper()
	var want strings.Builder
	for i := 1; i <= inflightLines; i++ {
		fmt.Fprintf(&want, "%d\n", i)
	}
	if !r.ok() || r.stdout != want.String() {
		t.Errorf("%s: a command in flight %s: %s; want 1 to %d and exit 0", id, when, r, inflightLines)
	}
}

// testPause: where Features say Pause, a frozen sandbox's agent does not
// answer until thawed; a pause with reclaim and one without keep a
// process's memory and a /dev/shm file, Frozen says so, commands run
// after Resume, and a command in flight goes on across the pause, its
// stream open, with all its output and its exit (a microVM paused to disk
// loses its agent channel: the stream re-attaches to the command), as do a
// PTY shell (its output whole, input sent after the resume read), a
// download (resumed from its offset) and a directory watch (set again); a
// paused sandbox stays paused across a restart, and is deleted like any
// other.
func testPause(t *testing.T, n *node) {
	p := n.pauser()
	if p == nil {
		t.Skipf("%T cannot pause (Features)", n.rt)
	}
	ctx := context.Background()
	s := n.spec("pause")
	sb := n.startSandbox(s)
	st := holdState(t, sb)

	t.Run("FreezeThaw", func(t *testing.T) {
		if err := p.Freeze(ctx, s.ID); err != nil {
			t.Fatalf("Freeze: %v", err)
		}
		n.frozen(t, s.ID, true)
		n.silent(s.ID, "while frozen", sb.dial)
		if err := p.Freeze(ctx, s.ID); err != nil {
			t.Errorf("a second Freeze: %v", err)
		}
		if err := p.Thaw(ctx, s.ID); err != nil {
			t.Fatalf("Thaw: %v", err)
		}
		n.frozen(t, s.ID, false)
		n.answers(s.ID, sb.dial)
		st.check(t, "across a freeze")
	})

	for _, reclaim := range []bool{true, false} {
		name := map[bool]string{true: "PauseReclaim", false: "PauseKeep"}[reclaim]
		t.Run(name, func(t *testing.T) {
			var wait func() result
			var streams *inflightStreams
			if !n.o.NoCommands {
				wait = sb.inflight(t)
				streams = sb.startStreams(t)
			}
			if _, err := p.Pause(ctx, s.ID, reclaim); err != nil {
				t.Fatalf("Pause (reclaim %v): %v", reclaim, err)
			}
			n.frozen(t, s.ID, true)
			n.running(s.ID)
			n.silent(s.ID, "while paused", sb.dial)
			if _, err := p.Resume(ctx, s.ID, reclaim); err != nil {
				t.Fatalf("Resume (prefetch %v): %v", reclaim, err)
			}
			n.frozen(t, s.ID, false)
			n.answers(s.ID, sb.dial)
			st.check(t, "across a pause")
			if wait != nil {
				checkInflight(t, s.ID, "across a pause", wait())
				streams.check(t, "across a pause", st.shmSum)
			}
		})
	}

	t.Run("AcrossRestart", func(t *testing.T) {
		if _, err := p.Pause(ctx, s.ID, true); err != nil {
			t.Fatalf("Pause: %v", err)
		}
		n.rt = n.open()
		p = n.pauser()
		n.frozen(t, s.ID, true)
		n.running(s.ID)
		dial, err := n.rt.Channel(s.ID)
		if err != nil {
			t.Fatalf("Channel after a restart: %v", err)
		}
		if _, err := p.Resume(ctx, s.ID, true); err != nil {
			t.Fatalf("Resume after a restart: %v", err)
		}
		n.frozen(t, s.ID, false)
		sb.dial, sb.c = dial, n.answers(s.ID, dial)
		st.check(t, "across a pause and a restart")
	})

	t.Run("DeletePaused", func(t *testing.T) {
		if _, err := p.Pause(ctx, s.ID, false); err != nil {
			t.Fatalf("Pause: %v", err)
		}
		n.delete(s.ID)
		n.gone(s.ID)
		if err := p.Freeze(ctx, s.ID); !errors.Is(err, errdefs.ErrNotFound) {
			t.Errorf("Freeze of a deleted sandbox: %v, want not found", err)
		}
	})
}

// testCapture: where Features say Snapshot, a frozen sandbox's writable
// layer is captured into a directory of its own in the form of an
// overlayfs upper dir (a file the sandbox wrote, a lower file it deleted
// as a whiteout), which Remove deletes; a second capture of a name in use
// is refused (AlreadyExists) and leaves the first alone; an unknown sandbox
// is NotFound and a bad name InvalidArgument; a capture an earlier
// instance left is gone once a new one is Init'ed; the sandbox answers
// again once thawed.
func testCapture(t *testing.T, n *node) {
	if !n.rt.Features().Snapshot {
		t.Skipf("%T has no snapshots (Features)", n.rt)
	}
	ctx := context.Background()
	p, sn := n.rt.(backend.Pauser), n.rt.(backend.Snapshotter)
	s := n.spec("capture")
	sb := n.startSandbox(s)
	if !n.o.NoCommands {
		// Closed and synced: what the capture holds is what reached the
		// writable layer.
		sb.must(t, "mkdir -p /root/dir && echo captured > /root/dir/file && rm /etc/passwd && sync")
	}

	if err := p.Freeze(ctx, s.ID); err != nil {
		t.Fatalf("Freeze: %v", err)
	}
	tree, err := sn.Capture(ctx, s.ID, "one")
	if err != nil {
		t.Fatalf("Capture of a frozen sandbox: %v", err)
	}
	if fi, err := os.Stat(tree.Dir); err != nil || !fi.IsDir() {
		t.Errorf("the capture's dir %s: %v, want a directory", tree.Dir, err)
	}
	if !n.o.NoCommands {
		b, err := os.ReadFile(filepath.Join(tree.Dir, "root", "dir", "file"))
		if err != nil || string(b) != "captured\n" {
			t.Errorf("root/dir/file in the capture: %q, %v; want %q", b, err, "captured\n")
		}
		if ok, why := whiteout(filepath.Join(tree.Dir, "etc", "passwd")); !ok {
			t.Errorf("etc/passwd, deleted in the sandbox, in the capture: %s; want a whiteout (a 0/0 character device)", why)
		}
	}
	if _, err := sn.Capture(ctx, s.ID, "one"); !errors.Is(err, errdefs.ErrAlreadyExists) {
		t.Errorf("Capture of a name in use: %v, want already exists", err)
	}
	if _, err := os.Stat(tree.Dir); err != nil {
		t.Errorf("the first capture after a refused second: %v", err)
	}
	left, err := sn.Capture(ctx, s.ID, "left")
	if err != nil {
		t.Fatalf("Capture under a second name: %v", err)
	}
	if err := p.Thaw(ctx, s.ID); err != nil {
		t.Fatalf("Thaw: %v", err)
	}
	n.answers(s.ID, sb.dial)
	if err := tree.Remove(); err != nil {
		t.Errorf("Remove the capture: %v", err)
	}
	if _, err := os.Stat(tree.Dir); !errors.Is(err, fs.ErrNotExist) {
		t.Errorf("the capture's dir after Remove: %v, want not found", err)
	}
	if _, err := sn.Capture(ctx, "rtt-unknown", "one"); !errors.Is(err, errdefs.ErrNotFound) {
		t.Errorf("Capture of an unknown sandbox: %v, want not found", err)
	}
	if _, err := sn.Capture(ctx, s.ID, "../x"); !errors.Is(err, errdefs.ErrInvalidArgument) {
		t.Errorf("Capture named ../x: %v, want invalid argument", err)
	}

	n.rt = n.open()
	if _, err := os.Stat(left.Dir); !errors.Is(err, fs.ErrNotExist) {
		t.Errorf("a capture an earlier instance left, after Init: %v, want gone", err)
	}
	n.running(s.ID)
	n.delete(s.ID)
	n.gone(s.ID)
}

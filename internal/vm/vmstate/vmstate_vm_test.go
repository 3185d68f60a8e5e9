package vmstate_test

import (
	"bytes"
	"context"
	"crypto/rand"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"connectrpc.com/connect"

	agentv1 "dsec.dev/dsec/api/gen/dsec/agent/v1"
	dsecv1 "dsec.dev/dsec/api/gen/dsec/v1"
	"dsec.dev/dsec/internal/vm/qemu"
	"dsec.dev/dsec/internal/vm/qmp"
	"dsec.dev/dsec/internal/vm/vmstate"
	"dsec.dev/dsec/internal/vm/vmtest"
)

// TestPauseResumeFork boots one real guest (TCG here) with its RAM in a
// file, pauses it (QEMU ends, its RAM leaves the host's memory), resumes
// it with a guest process's memory, a session and /dev/shm intact and the
// agent answering through the same channel socket, pauses it again and
// forks two children from that state, each given its own identity.
// Figures for people are logged, not checked.
func TestPauseResumeFork(t *testing.T) {
	top := t
	dir := t.TempDir()
	cfg := vmtest.Config(t, dir)
	state := filepath.Join(dir, "state")
	if err := os.MkdirAll(state, 0o700); err != nil {
		t.Fatal(err)
	}
	cfg.MemoryFile = filepath.Join(state, "memory")
	stateFile := filepath.Join(state, "vmstate")
	log := slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelWarn}))
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()

	var procs []*qemu.Process // every QEMU the test started, all gone at its end
	t0 := time.Now()
	g := vmtest.Start(t, cfg, log)
	procs = append(procs, g.P)
	g.WaitBoot(t)
	g.MustExec(t, "true")
	cold := time.Since(t0)

	// State that must survive: a file in /dev/shm (guest RAM), a process
	// whose environment (its memory) carries a mark, a session's variable
	// (its shell's memory), a file on the writable disk.
	g.MustExec(t, "sh", "-c", "echo in shared memory > /dev/shm/mark")
	g.MustExec(t, "sh", "-c", "echo on the disk > /root-mark && mkdir -p /etc && echo 0123456789abcdef0123456789abcdef > /etc/machine-id")
	g.MustExec(t, "sh", "-c", "MARK=kept-in-memory sleep 100000 >/dev/null 2>&1 & echo $! > /dev/shm/sleeper")
	sleeper := strings.TrimSpace(g.MustExec(t, "cat", "/dev/shm/sleeper"))
	session(t, g, "export SESSION_MARK=kept-by-the-shell")

	check := func(t *testing.T, g *vmtest.Guest) {
		t.Helper()
		if out := g.MustExec(t, "cat", "/dev/shm/mark", "/root-mark"); out != "in shared memory\non the disk\n" {
			t.Errorf("/dev/shm/mark and /root-mark after the restore: %q", out)
		}
		if out := g.MustExec(t, "cat", "/proc/"+sleeper+"/environ"); !strings.Contains(out, "MARK=kept-in-memory") {
			t.Errorf("the sleeping process %s's environment after the restore: %q", sleeper, out)
		}
		if out := session(t, g, "echo $SESSION_MARK"); out != "kept-by-the-shell\n" {
			t.Errorf("the session's variable after the restore: %q", out)
		}
	}

	pause := func(t *testing.T, g *vmtest.Guest) vmstate.PauseStats {
		t.Helper()
		q, err := qmp.Dial(ctx, g.P.QMPPath())
		if err != nil {
			t.Fatal(err)
		}
		defer q.Close()
		st, err := vmstate.Pause(ctx, g.P, q, stateFile, log)
		if err != nil {
			t.Fatal(err)
		}
		if err := syscall.Kill(g.P.Pid(), 0); err != syscall.ESRCH {
			t.Errorf("QEMU %d is still there after the pause: %v", g.P.Pid(), err)
		}
		if !vmstate.Saved(stateFile) {
			t.Errorf("Saved(%s) is false after Pause", stateFile)
		}
		if st.Resident <= 0 || st.Released <= 0 || st.StateBytes <= 0 {
			t.Errorf("pause stats %+v: nothing resident, released or saved", st)
		}
		t.Logf("pause: stop %s, save %s (%d KiB of device state), exit %s, release %s; QEMU resident %d MiB, released %d MiB (%.1f%%), kept %d KiB; RAM file %d MiB on disk",
			st.Stop, st.Save, st.StateBytes>>10, st.Exit, st.Release, st.Resident>>20, st.Released>>20,
			100*float64(st.Released)/float64(st.Resident), st.Kept>>10, st.MemoryFileBytes>>20)
		return st
	}

	t.Run("PauseResume", func(t *testing.T) {
		pause(t, g)
		t0 := time.Now()
		p, rs, err := vmstate.Resume(ctx, cfg, stateFile, vmstate.ResumeOptions{}, log)
		if err != nil {
			t.Fatal(err)
		}
		procs = append(procs, p)
		top.Cleanup(func() { p.Kill(); <-p.Done() })
		// The old dialer reaches the new QEMU by the same socket path.
		g.P = p
		if err := g.Ping(ctx); err != nil {
			t.Fatalf("the agent after the resume: %v", err)
		}
		g.MustExec(t, "true")
		took := time.Since(t0)
		t.Logf("resume: QEMU start %s, state load %s, cont %s, the agent's port closed %s; resume to first exec %s (cold boot to first exec %s, %.1fx)",
			rs.Start, rs.Load, rs.Cont, rs.Channel, took, cold, float64(cold)/float64(took))
		check(t, g)
	})
	if t.Failed() {
		return
	}

	t.Run("Fork", func(t *testing.T) {
		pause(t, g)
		var children []*vmtest.Guest
		for i := range 2 {
			child, err := vmstate.Fork(cfg, filepath.Join(dir, "child", string(rune('a'+i))))
			if err != nil {
				t.Fatal(err)
			}
			t0 := time.Now()
			var started *qemu.Process
			p, rs, err := vmstate.Resume(ctx, child, stateFile, vmstate.ResumeOptions{
				Prefetch: true,
				Started:  func(p *qemu.Process) error { started = p; return nil },
			}, log)
			if err != nil {
				t.Fatal(err)
			}
			procs = append(procs, p)
			if started != p {
				t.Errorf("ResumeOptions.Started was called with %v, not the resumed QEMU", started)
			}
			c := vmtest.Adopt(t, p, log)
			c.MustExec(t, "true")
			t.Logf("child %d: restore to first exec %s (%d MiB of its RAM file read ahead)", i, time.Since(t0), rs.PrefetchSize>>20)
			children = append(children, c)
		}
		for _, c := range children {
			check(t, c)
		}
		// The children's writable disks are their own.
		children[0].MustExec(t, "sh", "-c", "echo child 0 > /root-mark && sync")
		if out := children[1].MustExec(t, "cat", "/root-mark"); out != "on the disk\n" {
			t.Errorf("child 1 sees child 0's write: %q", out)
		}
		urandom := func(c *vmtest.Guest) string {
			return c.MustExec(t, "sh", "-c", "head -c 32 /dev/urandom | od -An -tx1 | tr -d ' \\n'")
		}
		t.Logf("before Reidentify the children read %s and %s from /dev/urandom", urandom(children[0]), urandom(children[1]))

		// Each child gets its own identity: its streams and names then
		// differ from its sibling's.
		for i, c := range children {
			entropy := make([]byte, 64)
			if _, err := rand.Read(entropy); err != nil {
				t.Fatal(err)
			}
			id := fmt.Sprintf("%032x", entropy[:16])
			if _, err := c.Agent.Reidentify(ctx, connect.NewRequest(&agentv1.ReidentifyRequest{
				Hostname: fmt.Sprintf("child-%d", i), MachineId: id, Entropy: entropy})); err != nil {
				t.Fatalf("reidentify child %d: %v", i, err)
			}
			if out := c.MustExec(t, "cat", "/etc/machine-id"); out != id+"\n" {
				t.Errorf("child %d's /etc/machine-id: %q, want %s", i, out, id)
			}
			if out := c.MustExec(t, "hostname"); out != fmt.Sprintf("child-%d\n", i) {
				t.Errorf("child %d's host name: %q", i, out)
			}
		}
		a, b := urandom(children[0]), urandom(children[1])
		if len(a) != 64 || a == b {
			t.Errorf("the children read %q and %q from /dev/urandom after Reidentify", a, b)
		}
	})

	// Nothing is left once the VMs are ended: no process runs with the
	// test's directory on its command line.
	for _, p := range procs {
		p.Kill()
		<-p.Done()
	}
	if left := processesNaming(dir); len(left) > 0 {
		t.Errorf("processes left naming %s: %v", dir, left)
	}
}

// processesNaming lists the processes whose command line holds s.
func processesNaming(s string) []string {
	var found []string
	entries, _ := os.ReadDir("/proc")
	for _, e := range entries {
		b, err := os.ReadFile(filepath.Join("/proc", e.Name(), "cmdline"))
		if err == nil && bytes.Contains(b, []byte(s)) {
			found = append(found, e.Name()+": "+strings.ReplaceAll(string(b[:min(len(b), 200)]), "\x00", " "))
		}
	}
	return found
}

// session runs command in the guest's session "s" and returns its output.
func session(t *testing.T, g *vmtest.Guest, command string) string {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	s, err := g.Agent.SessionRun(ctx, connect.NewRequest(&dsecv1.SessionRunRequest{Session: "s", Command: command}))
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	var out bytes.Buffer
	for s.Receive() {
		out.Write(s.Msg().GetStdout())
		out.Write(s.Msg().GetStderr())
	}
	if err := s.Err(); err != nil {
		t.Fatalf("session run %q: %v", command, err)
	}
	return out.String()
}

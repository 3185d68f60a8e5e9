package cgroups

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"sync"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"dsec.dev/dsec/internal/testutil"
)

// TestFreezeThaw freezes a real cgroup holding a busy process and a
// sleeping one, checks the kernel reports it frozen and that the busy one
// stops using CPU, thaws it, and checks that a freeze that cannot finish
// (a task in an uninterruptible sleep) fails when its ctx ends and leaves
// the tree thawed.
func TestFreezeThaw(t *testing.T) {
	testutil.RequireRoot(t)
	l, err := Detect()
	if err != nil {
		t.Fatal(err)
	}
	rel := fmt.Sprintf("dsec-test-freeze-%d", os.Getpid())
	if _, _, err := l.Create(rel); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		_ = l.Kill(context.Background(), rel)
		if err := l.Remove(context.Background(), rel); err != nil {
			t.Errorf("remove cgroup %s: %v", rel, err)
		}
	})
	busy, sleeper := start(t, l, rel, "while :; do :; done"), start(t, l, rel, "sleep 600")
	_ = sleeper
	// The cleanups run last first: thaw before the processes are killed
	// and waited for (a frozen task dies only when thawed), should a
	// check fail with the tree frozen.
	thaw := func() { _ = l.Thaw(context.Background(), rel) }
	t.Cleanup(thaw)

	ctx := context.Background()
	if err := l.Freeze(ctx, rel); err != nil {
		t.Fatal(err)
	}
	if frozen, err := l.Frozen(rel); err != nil || !frozen {
		t.Fatalf("after Freeze: frozen %v (%v), want frozen", frozen, err)
	}
	before := cpuTicks(t, busy)
	time.Sleep(50 * time.Millisecond)
	if after := cpuTicks(t, busy); after != before {
		t.Errorf("a frozen busy process ran: %d ticks, then %d", before, after)
	}
	if err := l.Thaw(ctx, rel); err != nil {
		t.Fatal(err)
	}
	// Thawing clears the state at once on v2; v1 may report THAWED later.
	waitState(t, l, rel, false)

	// A freeze that cannot finish thaws the tree again. A task waiting
	// for a directory's lock, held by a call to a FUSE server that never
	// answers, sleeps uninterruptibly, which no freezer can stop: the
	// freeze stays under way until its ctx ends, whatever the timing.
	stuck := startStuck(t, l, rel)
	t.Cleanup(thaw)
	for _, tc := range []struct {
		name string
		ctx  func() (context.Context, context.CancelFunc)
		want error
	}{
		{"cancelled before", func() (context.Context, context.CancelFunc) {
			c, cancel := context.WithCancel(ctx)
			cancel()
			return c, cancel
		}, context.Canceled},
		{"deadline while freezing", func() (context.Context, context.CancelFunc) {
			return context.WithTimeout(ctx, 20*time.Millisecond)
		}, context.DeadlineExceeded},
	} {
		c, cancel := tc.ctx()
		err := l.Freeze(c, rel)
		cancel()
		if !errors.Is(err, tc.want) {
			t.Fatalf("%s: Freeze of a tree with task %d in an uninterruptible sleep: %v, want an error wrapping %v", tc.name, stuck, err, tc.want)
		}
		waitState(t, l, rel, false)
		// Thawed, the busy process runs again.
		before := cpuTicks(t, busy)
		for i := 0; cpuTicks(t, busy) == before; i++ {
			if i == 400 {
				t.Fatalf("%s: the busy process did not run in 2 s after the failed freeze", tc.name)
			}
			time.Sleep(5 * time.Millisecond)
		}
	}
}

// startStuck runs a process in rel's cgroup that sleeps uninterruptibly,
// where no freezer can stop it, until the test ends, and returns its pid
// once it sleeps (state D). On a FUSE mount whose server never answers, a
// mkdir outside the cgroup holds the root directory's lock while its
// lookup waits for the server (a wait the kernel could freeze); the
// process in the cgroup looks up another name there and waits for that
// lock, in a sleep nothing but the lock's release ends. The mount's
// connection is closed (ending both waits) and the mount detached when
// the test ends.
func startStuck(t *testing.T, l *Layout, rel string) int {
	t.Helper()
	fd, err := unix.Open("/dev/fuse", unix.O_RDWR|unix.O_CLOEXEC, 0)
	if err != nil {
		t.Fatalf("open /dev/fuse: %v", err)
	}
	closeConn := sync.OnceFunc(func() { unix.Close(fd) })
	mnt := t.TempDir()
	opts := fmt.Sprintf("fd=%d,rootmode=40000,user_id=0,group_id=0", fd)
	if err := unix.Mount("dsec-test-stuck", mnt, "fuse", unix.MS_NOSUID|unix.MS_NODEV, opts); err != nil {
		closeConn()
		t.Fatalf("mount a FUSE file system on %s: %v", mnt, err)
	}
	// The cleanups run last first: the connection is closed (ending every
	// wait on the mount), the processes killed, the mount detached.
	t.Cleanup(func() {
		closeConn()
		if err := unix.Unmount(mnt, unix.MNT_DETACH); err != nil {
			t.Errorf("unmount %s: %v", mnt, err)
		}
	})
	holder := start(t, nil, "", "exec mkdir "+mnt+"/held")
	waitD(t, holder)
	pid := start(t, l, rel, "exec cat "+mnt+"/never")
	t.Cleanup(closeConn)
	waitD(t, pid)
	return pid
}

// waitD waits until pid sleeps uninterruptibly (state D).
func waitD(t *testing.T, pid int) {
	t.Helper()
	for i := 0; procState(t, pid) != 'D'; i++ {
		if i == 400 {
			t.Fatalf("process %d is in state %c after 2 s, want D", pid, procState(t, pid))
		}
		time.Sleep(5 * time.Millisecond)
	}
}

// procState is pid's state letter in /proc/PID/stat (R, S, D…).
func procState(t testing.TB, pid int) byte {
	t.Helper()
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		t.Fatal(err)
	}
	i := bytes.LastIndexByte(b, ')')
	if i < 0 || i+2 >= len(b) {
		t.Fatalf("parse /proc/%d/stat: %q", pid, b)
	}
	return b[i+2]
}

// start runs sh -c script in rel's cgroup (nil l: in the test's own) and
// returns its pid; the process is killed when the test ends.
func start(t testing.TB, l *Layout, rel, script string) int {
	t.Helper()
	cmd := exec.Command("sh", "-c", script)
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = cmd.Process.Kill(); _ = cmd.Wait() })
	if l == nil {
		return cmd.Process.Pid
	}
	procs := filepath.Join(l.Dir("freezer", rel), "cgroup.procs")
	if err := os.WriteFile(procs, []byte(strconv.Itoa(cmd.Process.Pid)), 0); err != nil {
		t.Fatalf("move %d into %s: %v", cmd.Process.Pid, procs, err)
	}
	return cmd.Process.Pid
}

// cpuTicks is pid's user and system CPU time so far, in clock ticks.
func cpuTicks(t testing.TB, pid int) int64 {
	t.Helper()
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		t.Fatal(err)
	}
	// The fields after the command's closing parenthesis: utime and stime
	// are the 12th and 13th of them.
	i := len(b) - 1
	for i > 0 && b[i] != ')' {
		i--
	}
	var f [13]string
	if _, err := fmt.Sscan(string(b[i+2:]), &f[0], &f[1], &f[2], &f[3], &f[4], &f[5], &f[6], &f[7], &f[8], &f[9], &f[10], &f[11], &f[12]); err != nil {
		t.Fatalf("parse /proc/%d/stat: %v", pid, err)
	}
	u, _ := strconv.ParseInt(f[11], 10, 64)
	s, _ := strconv.ParseInt(f[12], 10, 64)
	return u + s
}

func waitState(t *testing.T, l *Layout, rel string, want bool) {
	t.Helper()
	for range 200 {
		frozen, err := l.Frozen(rel)
		if err != nil {
			t.Fatal(err)
		}
		if frozen == want {
			return
		}
		time.Sleep(5 * time.Millisecond)
	}
	t.Fatalf("cgroup %s: frozen is not %v after a second", rel, want)
}

// BenchmarkFreeze freezes and thaws a cgroup of a busy process and a
// sleeping one, in turns in one run, each way of waiting for the kernel's
// word: polling backing off to 5 ms (before) and to 1 ms (now), and on v2
// a watch on cgroup.events. What is timed is freeze → frozen seen → thaw.
//
//	go test -run '^$' -bench Freeze ./internal/edge/backend/cgroups   # as root
func BenchmarkFreeze(b *testing.B) {
	testutil.RequireRoot(b)
	l, err := Detect()
	if err != nil {
		b.Fatal(err)
	}
	rel := fmt.Sprintf("dsec-bench-freeze-%d", os.Getpid())
	if _, _, err := l.Create(rel); err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() {
		_ = l.Kill(context.Background(), rel)
		_ = l.Remove(context.Background(), rel)
	})
	if os.Getenv("DSEC_BENCH_IDLE") == "1" {
		start(b, l, rel, "exec chrt -i 0 sh -c 'while :; do :; done'")
		start(b, l, rel, "exec chrt -i 0 sleep 600")
	} else {
		start(b, l, rel, "while :; do :; done")
		start(b, l, rel, "sleep 600")
	}
	ctx := context.Background()
	type way struct {
		name   string
		freeze func() error
	}
	ways := []way{
		{"poll-5ms", func() error { return l.freezePoll(ctx, rel, 5*time.Millisecond) }},
		{"poll-1ms", func() error { return l.freezePoll(ctx, rel, freezePollMax) }},
	}
	if l.V2() {
		ways = append(ways, way{"watch", func() error {
			w, err := watchEvents(l.Dir("", rel))
			if err != nil {
				return err
			}
			defer w.close()
			return l.freezeV2(ctx, rel, w)
		}})
	}
	for _, w := range ways {
		b.Run(w.name, func(b *testing.B) {
			for b.Loop() {
				if err := w.freeze(); err != nil {
					b.Fatal(err)
				}
				if err := l.Thaw(ctx, rel); err != nil {
					b.Fatal(err)
				}
				b.StopTimer()
				time.Sleep(time.Millisecond) // let the busy process run again
				b.StartTimer()
			}
		})
	}
}

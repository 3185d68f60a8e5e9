package cgroups

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"testing"
	"time"

	"dsec.dev/dsec/internal/testutil"
)

// TestFreezeThaw freezes a real cgroup holding a busy process and a
// sleeping one, checks the kernel reports it frozen and that the busy one
// stops using CPU, thaws it, and checks a freeze whose ctx has ended
// leaves the tree thawed.
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

	// A freeze that cannot finish in time thaws the tree again.
	done, cancel := context.WithCancel(ctx)
	cancel()
	if err := l.Freeze(done, rel); err == nil {
		// The kernel may have frozen it before the first look: that is a
		// freeze, not a failure. Thaw for the check below.
		_ = l.Thaw(ctx, rel)
	}
	waitState(t, l, rel, false)
}

// start runs sh -c script in rel's cgroup and returns its pid; the
// process is killed with the cgroup.
func start(t testing.TB, l *Layout, rel, script string) int {
	t.Helper()
	cmd := exec.Command("sh", "-c", script)
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = cmd.Process.Kill(); _ = cmd.Wait() })
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

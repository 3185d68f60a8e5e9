package qos

import (
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"

	"dsec.dev/dsec/internal/edge/backend/cgroups"
	"dsec.dev/dsec/internal/testutil"
)

// TestCoreScheduling checks the node's report against the kernel's own SMT
// report: available only where SMT siblings run, a reason whenever not.
func TestCoreScheduling(t *testing.T) {
	cs := CoreScheduling()
	b, err := os.ReadFile(smtActive)
	smt := err == nil && strings.TrimSpace(string(b)) == "1"
	if !smt && cs.Available {
		t.Fatalf("core scheduling reported available without SMT: %+v", cs)
	}
	if !cs.Available && cs.Reason == "" {
		t.Fatal("core scheduling unavailable without a reason")
	}
	if cs.Available && cs.Reason != "" {
		t.Fatalf("available with a reason: %+v", cs)
	}
	t.Logf("core scheduling: %+v", cs)
}

// testCgroup makes a cpu cgroup for the test and removes it afterwards.
func testCgroup(t *testing.T, l *cgroups.Layout, name string) string {
	t.Helper()
	rel := fmt.Sprintf("dsec-qos-test-%d/%s", os.Getpid(), name)
	dir := l.Dir("cpu", rel)
	if err := os.MkdirAll(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		os.Remove(dir)
		os.Remove(filepath.Dir(dir))
	})
	return dir
}

func layout(t *testing.T) *cgroups.Layout {
	testutil.RequireRoot(t)
	l, err := cgroups.Detect()
	if err != nil {
		t.Fatal(err)
	}
	if l.V2() {
		// Sub-cgroups need the cpu controller enabled below the root.
		os.WriteFile(filepath.Join(cgroups.Root, "cgroup.subtree_control"), []byte("+cpu"), 0o644)
	}
	return l
}

func TestSetIdle(t *testing.T) {
	l := layout(t)
	be, lat := testCgroup(t, l, "be"), testCgroup(t, l, "lat")
	if err := SetIdle(be, BestEffort.Idle()); err != nil {
		t.Fatal(err)
	}
	if err := SetIdle(lat, Latency.Idle()); err != nil {
		t.Fatal(err)
	}
	for dir, want := range map[string]bool{be: true, lat: false} {
		got, err := Idle(dir)
		if err != nil || got != want {
			t.Errorf("Idle(%s) = %v, %v; want %v", dir, got, err, want)
		}
	}
	if err := SetIdle(be, false); err != nil {
		t.Fatal(err)
	}
	if got, _ := Idle(be); got {
		t.Error("cpu.idle still set after SetIdle(false)")
	}
}

// TestIdleYields runs a burner in an idle cgroup and one in a normal cgroup
// on the same CPU for a while, then compares the CPU time each consumed (not
// wall time): the idle one must get a small share. SCHED_IDLE's weight is 3
// against a normal group's 1024, so the normal burner should take >99 %;
// the test asks for 90 % to leave room for others' load on the CPU.
func TestIdleYields(t *testing.T) {
	l := layout(t)
	be, lat := testCgroup(t, l, "be"), testCgroup(t, l, "lat")
	if err := SetIdle(be, true); err != nil {
		t.Fatal(err)
	}
	var cpu0 unix.CPUSet
	cpu0.Set(0)
	start := func(dir string) *exec.Cmd {
		cmd := exec.Command("sh", "-c", "while :; do :; done")
		if err := cmd.Start(); err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { cmd.Process.Kill(); cmd.Wait() })
		if err := unix.SchedSetaffinity(cmd.Process.Pid, &cpu0); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(filepath.Join(dir, "cgroup.procs"), []byte(fmt.Sprint(cmd.Process.Pid)), 0o644); err != nil {
			t.Fatal(err)
		}
		return cmd
	}
	beCmd, latCmd := start(be), start(lat)
	time.Sleep(3 * time.Second)
	cpuTime := func(cmd *exec.Cmd) time.Duration {
		cmd.Process.Kill()
		cmd.Wait()
		ru := cmd.ProcessState.SysUsage().(*syscall.Rusage)
		return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
	}
	beT, latT := cpuTime(beCmd), cpuTime(latCmd)
	share := float64(latT) / float64(latT+beT)
	t.Logf("on one CPU: latency %v, best_effort %v, latency's share %.1f %%", latT, beT, 100*share)
	if latT+beT == 0 || share < 0.90 {
		t.Fatalf("latency burner's share %.1f %% (latency %v, best_effort %v), want >= 90 %%", 100*share, latT, beT)
	}
	// The control: without cpu.idle the two share the CPU about evenly, so
	// the share above comes from cpu.idle and not from the order they started.
	if err := SetIdle(be, false); err != nil {
		t.Fatal(err)
	}
	beCmd, latCmd = start(be), start(lat)
	time.Sleep(3 * time.Second)
	beT, latT = cpuTime(beCmd), cpuTime(latCmd)
	even := float64(latT) / float64(latT+beT)
	t.Logf("control, both normal: latency %v, other %v, share %.1f %%", latT, beT, 100*even)
	if even > 0.75 {
		t.Fatalf("without cpu.idle the first burner still took %.1f %%: the measurement does not show cpu.idle's effect", 100*even)
	}
}

// TestShareCookie: a process given a cookie has one (PR_SCHED_CORE_GET),
// and a child it starts later inherits it. Without SMT a cookie changes no
// scheduling (no core has a sibling to keep apart), so what is tested is
// that the cookie lands; that it keeps another sandbox off the sibling is
// untested here. Skips on a kernel without CONFIG_SCHED_CORE.
func TestShareCookie(t *testing.T) {
	// The shell starts its child only once told, after the cookie.
	cmd := exec.Command("sh", "-c", "read go; sleep 30 & wait")
	stdin, err := cmd.StdinPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		exec.Command("pkill", "-P", fmt.Sprint(cmd.Process.Pid)).Run()
		cmd.Process.Kill()
		cmd.Wait()
	})
	if err := ShareCookie(cmd.Process.Pid); err != nil {
		if errors.Is(err, unix.EINVAL) || errors.Is(err, unix.ENODEV) {
			t.Skipf("the kernel gives no cookies: %v", err)
		}
		t.Fatal(err)
	}
	cookie := func(pid int) uint64 {
		t.Helper()
		var c uint64
		if err := unix.Prctl(unix.PR_SCHED_CORE, unix.PR_SCHED_CORE_GET, uintptr(pid), unix.PR_SCHED_CORE_SCOPE_THREAD, uintptr(unsafe.Pointer(&c))); err != nil {
			t.Fatalf("get the cookie of %d: %v", pid, err)
		}
		return c
	}
	own := cookie(cmd.Process.Pid)
	if own == 0 {
		t.Fatal("the process has no cookie after ShareCookie")
	}
	if cookie(os.Getpid()) == own {
		t.Error("the test process shares the sandbox's cookie")
	}
	// The sleep the shell starts now is its child: it inherits the cookie.
	if _, err := io.WriteString(stdin, "go\n"); err != nil {
		t.Fatal(err)
	}
	var child int
	for range 100 {
		b, _ := os.ReadFile(fmt.Sprintf("/proc/%d/task/%d/children", cmd.Process.Pid, cmd.Process.Pid))
		if _, err := fmt.Sscan(string(b), &child); err == nil {
			break
		}
		time.Sleep(10 * time.Millisecond)
	}
	if child == 0 {
		t.Fatal("the shell started no child")
	}
	if got := cookie(child); got != own {
		t.Errorf("the child's cookie = %#x, want its parent's %#x", got, own)
	}
}

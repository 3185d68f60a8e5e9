package qos

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"unsafe"

	"golang.org/x/sys/unix"

	"dsec.dev/dsec/internal/errdefs"
)

// smtActive is the kernel's report of whether SMT siblings run.
const smtActive = "/sys/devices/system/cpu/smt/active"

// SetIdle marks the cpu cgroup dir idle (SCHED_IDLE for the group) or not,
// through its cpu.idle file: cgroup v2 and v1's cpu controller (Linux 5.15+)
// both have it. A kernel without the file fails with ErrNotSupported.
func SetIdle(dir string, idle bool) error {
	v := "0"
	if idle {
		v = "1"
	}
	err := os.WriteFile(filepath.Join(dir, "cpu.idle"), []byte(v), 0o644)
	if errors.Is(err, os.ErrNotExist) {
		return fmt.Errorf("set cpu.idle of %s: %w (kernel before 5.15?)", dir, errdefs.ErrNotSupported)
	}
	if err != nil {
		return fmt.Errorf("set cpu.idle of %s: %w", dir, err)
	}
	return nil
}

// Idle reads whether the cpu cgroup dir is idle.
func Idle(dir string) (bool, error) {
	b, err := os.ReadFile(filepath.Join(dir, "cpu.idle"))
	if err != nil {
		return false, fmt.Errorf("read cpu.idle of %s: %w", dir, err)
	}
	return strings.TrimSpace(string(b)) == "1", nil
}

// CoreScheduling reports whether latency sandboxes can get a core-scheduling
// cookie on this node, and why not.
func CoreScheduling() CoreSched {
	b, err := os.ReadFile(smtActive)
	if err != nil {
		return CoreSched{Reason: fmt.Sprintf("no SMT report (%v)", err)}
	}
	if strings.TrimSpace(string(b)) != "1" {
		ctl, _ := os.ReadFile("/sys/devices/system/cpu/smt/control")
		return CoreSched{Reason: fmt.Sprintf("the CPU runs no SMT siblings (smt/control: %s), so no core is shared to protect", strings.TrimSpace(string(ctl)))}
	}
	var cookie uint64
	if err := unix.Prctl(unix.PR_SCHED_CORE, unix.PR_SCHED_CORE_GET, 0, unix.PR_SCHED_CORE_SCOPE_THREAD, uintptr(unsafe.Pointer(&cookie))); err != nil {
		return CoreSched{Reason: fmt.Sprintf("the kernel gives no core-scheduling cookies (prctl PR_SCHED_CORE: %v; CONFIG_SCHED_CORE off?)", err)}
	}
	return CoreSched{Available: true}
}

// ShareCookie gives pid's whole thread group a new core-scheduling cookie, so
// no other sandbox's task runs on its core's SMT sibling at the same time;
// processes it starts later inherit it.
func ShareCookie(pid int) error {
	if err := unix.Prctl(unix.PR_SCHED_CORE, unix.PR_SCHED_CORE_CREATE, uintptr(pid), unix.PR_SCHED_CORE_SCOPE_THREAD_GROUP, 0); err != nil {
		return fmt.Errorf("create core-scheduling cookie for pid %d: %w", pid, err)
	}
	return nil
}

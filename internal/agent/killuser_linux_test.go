package agent

import (
	"os"
	"slices"
	"strconv"
	"strings"
	"testing"
)

// TestStatusUID: a /proc/PID/status's uids and whether it runs as a
// process kill can stop; a zombie does not, nor does a kernel thread (no
// address space: no Vm lines; "Kthread: 1" on kernels from 6.10), which
// a microVM's /proc shows beside the sandbox's processes. killUser itself
// runs in sandboxes (edgetest's Inside, an exec's after steps): on the
// host it would kill other sandboxes' nobody.
func TestStatusUID(t *testing.T) {
	for _, c := range []struct {
		status  string
		uids    [4]uint32
		running bool
	}{
		{"Name:\tsleep\nState:\tS (sleeping)\nUid:\t65534\t65534\t65534\t65534\nGid:\t65534\nVmSize:\t   8004 kB\n", [4]uint32{65534, 65534, 65534, 65534}, true},
		{"Name:\tsh\nState:\tZ (zombie)\nUid:\t1000\t0\t1000\t0\n", [4]uint32{1000, 0, 1000, 0}, false},
		// A 6.1 kernel's kthreadd: no Vm lines, no Kthread line.
		{"Name:\tkthreadd\nUmask:\t0000\nState:\tS (sleeping)\nPPid:\t0\nUid:\t0\t0\t0\t0\nThreads:\t1\n", [4]uint32{}, false},
		{"Name:\tkworker/0:1\nState:\tI (idle)\nKthread:\t1\nUid:\t0\t0\t0\t0\n", [4]uint32{}, false},
	} {
		uids, running := statusUID([]byte(c.status))
		if uids != c.uids || running != c.running {
			t.Errorf("statusUID(%q) = %v %v, want %v %v", c.status, uids, running, c.uids, c.running)
		}
	}
}

// TestUserPidsNoKernelThreads: root's processes as this host's /proc
// lists them (read only: nothing is killed) hold no kernel thread, which
// SIGKILL never stops: killUser of uid 0 in a microVM scanned them again
// and again and gave up.
func TestUserPidsNoKernelThreads(t *testing.T) {
	pids, err := userPids(0, os.Getpid())
	if err != nil {
		t.Fatal(err)
	}
	for _, pid := range pids {
		b, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/status")
		if err != nil {
			continue // it ended
		}
		// A kernel thread has no address space and is kthreadd's child (or
		// kthreadd); a process exiting since it was listed has lost its
		// address space too, but not its parent.
		st := string(b)
		kernel := strings.Contains(st, "\nKthread:\t1") || strings.Contains(st, "\nPPid:\t2\n") || pid == 2
		if !strings.Contains(st, "\nVmSize:") && kernel {
			name, _, _ := strings.Cut(st, "\n")
			t.Errorf("userPids(0) lists pid %d (%s), which has no address space: a kernel thread", pid, name)
		}
	}
	if b, err := os.ReadFile("/proc/2/status"); err == nil && strings.Contains(string(b), "kthreadd") && slices.Contains(pids, 2) {
		t.Error("userPids(0) lists kthreadd")
	}
}

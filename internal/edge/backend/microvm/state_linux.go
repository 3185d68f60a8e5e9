package microvm

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"time"

	"golang.org/x/sys/unix"
)

// The files of a VM's run dir beside QEMU's own.
const (
	stateFile = "vm.json"
	exitFile  = "exit"
)

// state is what a VM's run dir records for any later instance: which
// process is its QEMU and what the VM was given.
type state struct {
	Pid int `json:"pid"`
	// StartTicks is QEMU's start time (/proc/PID/stat's starttime), so a
	// pid the kernel gave to another process since is not taken for it.
	StartTicks uint64 `json:"start_ticks"`
	Accel      string `json:"accel"`
	MemoryMiB  int    `json:"memory_mib"`
	VCPUs      int    `json:"vcpus"`
	DiskBytes  int64  `json:"disk_bytes"`
}

// writeState writes st into dir whole (a temporary file renamed).
func writeState(dir string, st state) error {
	b, err := json.Marshal(st)
	if err != nil {
		return fmt.Errorf("write vm state: %w", err)
	}
	tmp := filepath.Join(dir, stateFile+".tmp")
	if err := os.WriteFile(tmp, b, 0o600); err != nil {
		return fmt.Errorf("write vm state: %w", err)
	}
	if err := os.Rename(tmp, filepath.Join(dir, stateFile)); err != nil {
		return fmt.Errorf("write vm state: %w", err)
	}
	return nil
}

func readState(dir string) (state, error) {
	var st state
	b, err := os.ReadFile(filepath.Join(dir, stateFile))
	if err != nil {
		return st, err
	}
	if err := json.Unmarshal(b, &st); err != nil {
		return st, fmt.Errorf("read vm state %s: %w", dir, err)
	}
	return st, nil
}

// procStat reads process pid's state letter and start time.
func procStat(pid int) (byte, uint64, error) {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return 0, 0, err
	}
	// The fields after the command's name, which is in parentheses.
	i := bytes.LastIndexByte(b, ')')
	if i < 0 {
		return 0, 0, fmt.Errorf("parse /proc/%d/stat", pid)
	}
	f := strings.Fields(string(b[i+1:]))
	if len(f) < 20 {
		return 0, 0, fmt.Errorf("parse /proc/%d/stat", pid)
	}
	ticks, err := strconv.ParseUint(f[19], 10, 64) // field 22, starttime
	if err != nil {
		return 0, 0, fmt.Errorf("parse /proc/%d/stat: %w", pid, err)
	}
	return f[0][0], ticks, nil
}

func startTicks(pid int) (uint64, error) {
	_, t, err := procStat(pid)
	if err != nil {
		return 0, fmt.Errorf("read qemu's start time: %w", err)
	}
	return t, nil
}

// alive reports whether pid is still the process that started at ticks,
// and not a zombie.
func alive(pid int, ticks uint64) bool {
	if pid <= 0 {
		return false
	}
	st, t, err := procStat(pid)
	return err == nil && t == ticks && st != 'Z' && st != 'X'
}

// killWait SIGKILLs pid, when it is still the process that started at
// ticks, and waits until it is gone (reaped by whoever is its parent).
func killWait(ctx context.Context, pid int, ticks uint64) error {
	delay := time.Millisecond
	for alive(pid, ticks) {
		if err := unix.Kill(pid, unix.SIGKILL); err != nil && !errors.Is(err, unix.ESRCH) {
			return fmt.Errorf("kill qemu %d: %w", pid, err)
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("kill qemu %d: still there: %w", pid, ctx.Err())
		case <-time.After(delay):
		}
		delay = min(delay*2, 50*time.Millisecond)
	}
	return nil
}

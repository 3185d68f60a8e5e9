package agent

import (
	"bufio"
	"bytes"
	"errors"
	"fmt"
	"os"
	"strconv"
	"strings"

	"golang.org/x/sys/unix"
)

// killUser kills with SIGKILL every process of uid that the agent sees
// but the agent itself and pid 1: what `kill -9 -1` run as uid kills (a
// process whose real or saved uid is uid), without starting a process to
// run it. It scans again until a scan finds none left running, so a
// process forked while it scanned is found by the next; zombies are
// already dead and are left to their reapers.
func killUser(uid uint32) error {
	self := os.Getpid()
	for range maxKillScans {
		pids, err := userPids(uid, self)
		if err != nil {
			return err
		}
		if len(pids) == 0 {
			return nil
		}
		for _, pid := range pids {
			if err := unix.Kill(pid, unix.SIGKILL); err != nil && !errors.Is(err, unix.ESRCH) {
				return fmt.Errorf("kill pid %d of uid %d: %w", pid, uid, err)
			}
		}
	}
	return fmt.Errorf("kill the processes of uid %d: still some after %d scans", uid, maxKillScans)
}

// maxKillScans bounds killUser's scans: each kills all it found, so only
// a process that forks faster than the scans outlives them (the sandbox's
// pids limit bounds how many it can have).
const maxKillScans = 64

// userPids lists the running processes of uid (real or saved uid) but
// self and pid 1.
func userPids(uid uint32, self int) ([]int, error) {
	entries, err := os.ReadDir("/proc")
	if err != nil {
		return nil, fmt.Errorf("list processes: %w", err)
	}
	var pids []int
	for _, e := range entries {
		pid, err := strconv.Atoi(e.Name())
		if err != nil || pid == self || pid == 1 {
			continue
		}
		b, err := os.ReadFile("/proc/" + e.Name() + "/status")
		if err != nil {
			continue // it ended
		}
		if of, running := statusUID(b); running && (of[0] == uid || of[2] == uid) {
			pids = append(pids, pid)
		}
	}
	return pids, nil
}

// statusUID reads the real, effective, saved and file system uids of a
// /proc/PID/status, and whether the process runs as one SIGKILL stops: not
// a zombie, and not a kernel thread, which has no address space (no Vm
// lines; "Kthread: 1" from Linux 6.10) and ignores the signal. A
// microVM's /proc shows its kernel's threads, all of uid 0.
func statusUID(b []byte) (uids [4]uint32, running bool) {
	running = true
	mapped := false
	sc := bufio.NewScanner(bytes.NewReader(b))
	for sc.Scan() {
		k, v, ok := strings.Cut(sc.Text(), ":")
		if !ok {
			continue
		}
		v = strings.TrimSpace(v)
		switch k {
		case "State":
			running = running && !strings.HasPrefix(v, "Z") && !strings.HasPrefix(v, "X")
		case "Kthread":
			running = running && v != "1"
		case "VmSize":
			mapped = true
		case "Uid":
			for i, f := range strings.Fields(v) {
				if i < len(uids) {
					n, _ := strconv.ParseUint(f, 10, 32)
					uids[i] = uint32(n)
				}
			}
		}
	}
	return uids, running && mapped
}

package container

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"strconv"
	"strings"

	"dsec.dev/dsec/internal/edge/backend"
	"dsec.dev/dsec/internal/errdefs"
)

// Upper returns sandbox id's overlay upper dir (backend.Inspector).
func (r *Container) Upper(id string) (string, error) {
	upper := filepath.Join(r.upperDir(id), "upper")
	if _, err := os.Lstat(upper); errors.Is(err, fs.ErrNotExist) {
		return "", fmt.Errorf("writable layer of %s: %w", id, errdefs.ErrNotFound)
	}
	return upper, nil
}

// Root returns /proc/PID/root of sandbox id's agent, the container's
// init (backend.Inspector). Under gVisor the sandbox's files are the
// sentry's, which the host's root of no process shows: ErrNotSupported.
func (r *Container) Root(ctx context.Context, id string) (string, int, error) {
	if r.gvisor() {
		return "", 0, fmt.Errorf("root file system of %s: gVisor's sentry serves it: %w", id, errdefs.ErrNotSupported)
	}
	// The init is found in the container's cgroup without running the
	// runtime (runc state takes 10-40 ms on a loaded node; a grade asks
	// for the root of its clean room on its critical path).
	if pid := r.initPid(id); pid > 0 {
		return "/proc/" + strconv.Itoa(pid) + "/root", pid, nil
	}
	rs, err := r.runtimeState(ctx, id)
	if err != nil {
		return "", 0, err
	}
	if rs.Pid <= 0 {
		return "", 0, fmt.Errorf("root file system of %s: no init process (%s): %w", id, rs.Status, errdefs.ErrFailedPrecondition)
	}
	return "/proc/" + strconv.Itoa(rs.Pid) + "/root", rs.Pid, nil
}

// initPid is the host pid of sandbox id's init, the process of its
// cgroup that is pid 1 of a pid namespace one level below the edge's own
// (a process of a namespace the sandbox made itself is deeper); 0 when
// none is found.
func (r *Container) initPid(id string) int {
	pids, err := r.layout.Procs(r.cgroupRel(id))
	if err != nil {
		return 0
	}
	self := nsPids("self")
	if len(self) == 0 {
		return 0
	}
	for _, pid := range pids {
		ns := nsPids(strconv.Itoa(pid))
		if len(ns) == len(self)+1 && ns[len(ns)-1] == "1" {
			return pid
		}
	}
	return 0
}

// nsPids is the NSpid line of /proc/PROC/status: the process's pid in
// each pid namespace it is in, outermost first.
func nsPids(proc string) []string {
	b, err := os.ReadFile("/proc/" + proc + "/status")
	if err != nil {
		return nil
	}
	for _, line := range strings.Split(string(b), "\n") {
		if f, ok := strings.CutPrefix(line, "NSpid:"); ok {
			return strings.Fields(f)
		}
	}
	return nil
}

// Processes lists sandbox id's processes but its agent (backend.Inspector):
// under runc or crun every process of the container's cgroup tree, read
// from the cgroup files (what runc ps lists, without running it: a grade
// asks as it starts), the agent being the one that is pid 1 in the
// sandbox; under gVisor runsc ps lists the sentry's tasks by sandbox pid.
func (r *Container) Processes(ctx context.Context, id string) ([]backend.Process, error) {
	if r.gvisor() {
		out, err := r.runtimeStdout(ctx, "ps", "--format", "json", id)
		if err != nil {
			return nil, fmt.Errorf("list processes of %s: %w", id, err)
		}
		var tasks []struct {
			PID int    `json:"PID"`
			Cmd string `json:"Cmd"`
		}
		if err := json.Unmarshal(out, &tasks); err != nil {
			return nil, fmt.Errorf("list processes of %s: decode runsc ps: %w", id, err)
		}
		var ps []backend.Process
		for _, t := range tasks {
			if t.PID != 1 {
				ps = append(ps, backend.Process{Pid: t.PID, Command: t.Cmd})
			}
		}
		return ps, nil
	}
	pids, err := r.layout.Procs(r.cgroupRel(id))
	if err != nil {
		return nil, fmt.Errorf("list processes of %s: %w", id, err)
	}
	var ps []backend.Process
	for _, pid := range pids {
		comm, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/comm")
		if err != nil {
			continue // gone meanwhile
		}
		if n := nsPid(pid); n != 1 {
			ps = append(ps, backend.Process{Pid: n, Command: strings.TrimSpace(string(comm))})
		}
	}
	return ps, nil
}

// nsPid is host pid's pid in its own (innermost) pid namespace, or pid
// where /proc does not say.
func nsPid(pid int) int {
	b, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/status")
	if err != nil {
		return pid
	}
	for _, line := range strings.Split(string(b), "\n") {
		if f, ok := strings.CutPrefix(line, "NSpid:"); ok {
			fs := strings.Fields(f)
			if n, err := strconv.Atoi(fs[len(fs)-1]); err == nil {
				return n
			}
		}
	}
	return pid
}

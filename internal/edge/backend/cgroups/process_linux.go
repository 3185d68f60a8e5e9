package cgroups

import (
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"strconv"
)

// Limits bound a process cgroup (Place); a zero limit is none.
type Limits struct {
	MemoryBytes int64 // memory, page cache included; no swap either way
	Pids        int64
	// CPUQuotaUsec of every CPUPeriodUsec (CFS bandwidth).
	CPUQuotaUsec, CPUPeriodUsec int64
}

// processControllers are the v1 controllers a process cgroup is made in.
var processControllers = []string{"memory", "pids", "cpu", "cpuacct", "freezer"}

// Place makes rel's cgroup with limits lim and moves process pid into it:
// a sandbox that is one host process with no runtime of its own to make
// its cgroups (a microVM's QEMU). On v1 rel is made under the memory,
// pids, cpu, cpuacct and freezer controllers, on v2 once. The parent must
// exist (EnsureParent).
func (l *Layout) Place(rel string, pid int, lim Limits) error {
	var dirs []string
	if l.v2 {
		dirs = []string{l.Dir("", rel)}
	} else {
		seen := map[string]bool{}
		for _, c := range processControllers {
			if l.controllers[c] == "" || seen[l.controllers[c]] {
				continue
			}
			seen[l.controllers[c]] = true
			dirs = append(dirs, l.Dir(c, rel))
		}
	}
	for _, d := range dirs {
		if err := os.Mkdir(d, 0o755); err != nil && !errors.Is(err, fs.ErrExist) {
			return fmt.Errorf("make cgroup %s: %w", d, err)
		}
	}
	if err := l.limit(rel, lim); err != nil {
		return err
	}
	if !l.v2 {
		// v1 leaves what a process allocated before its move charged to
		// its old cgroup unless told to move it: QEMU may have loaded
		// the guest's kernel by the time it is placed. (Deprecated in
		// recent kernels, so a refusal is no error.)
		_ = os.WriteFile(filepath.Join(l.Dir("memory", rel), "memory.move_charge_at_immigrate"), []byte("1"), 0)
	}
	for _, d := range dirs {
		if err := os.WriteFile(filepath.Join(d, "cgroup.procs"), []byte(strconv.Itoa(pid)), 0); err != nil {
			return fmt.Errorf("move process %d into cgroup %s: %w", pid, d, err)
		}
	}
	return nil
}

// limit writes lim into rel's cgroup files.
func (l *Layout) limit(rel string, lim Limits) error {
	type file struct{ dir, name, value string }
	var files []file
	i := func(n int64) string { return strconv.FormatInt(n, 10) }
	if l.v2 {
		d := l.Dir("", rel)
		if lim.MemoryBytes > 0 {
			files = append(files, file{d, "memory.max", i(lim.MemoryBytes)}, file{d, "memory.swap.max", "0"})
		}
		if lim.Pids > 0 {
			files = append(files, file{d, "pids.max", i(lim.Pids)})
		}
		if lim.CPUQuotaUsec > 0 {
			files = append(files, file{d, "cpu.max", i(lim.CPUQuotaUsec) + " " + i(lim.CPUPeriodUsec)})
		}
	} else {
		if lim.MemoryBytes > 0 {
			files = append(files, file{l.Dir("memory", rel), "memory.limit_in_bytes", i(lim.MemoryBytes)})
			if _, err := os.Stat(filepath.Join(l.Dir("memory", rel), "memory.memsw.limit_in_bytes")); err == nil {
				files = append(files, file{l.Dir("memory", rel), "memory.memsw.limit_in_bytes", i(lim.MemoryBytes)})
			}
		}
		if lim.Pids > 0 {
			files = append(files, file{l.Dir("pids", rel), "pids.max", i(lim.Pids)})
		}
		if lim.CPUQuotaUsec > 0 {
			cpu := l.Dir("cpu", rel)
			files = append(files, file{cpu, "cpu.cfs_period_us", i(lim.CPUPeriodUsec)}, file{cpu, "cpu.cfs_quota_us", i(lim.CPUQuotaUsec)})
		}
	}
	for _, f := range files {
		// Swap files a kernel lacks (no swap accounting) are skipped.
		err := os.WriteFile(filepath.Join(f.dir, f.name), []byte(f.value), 0)
		if err != nil && !(errors.Is(err, fs.ErrNotExist) && f.name == "memory.swap.max") {
			return fmt.Errorf("limit cgroup %s: %s = %s: %w", f.dir, f.name, f.value, err)
		}
	}
	return nil
}

package call

import (
	"errors"
	"fmt"
	"math"
	"strconv"
	"strings"
	"time"

	"golang.org/x/sys/unix"

	"dsec.dev/dsec/internal/agent/proc"
	"dsec.dev/dsec/internal/errdefs"
)

// callCgroup is the name of the calls' cgroup under each of the sandbox's.
const callCgroup = "fncall"

// cgroup is one of the call's cgroup v1 directories.
type cgroup struct {
	dir   int // O_DIRECTORY fd
	tasks int // its tasks file, open for writing
	back  int // the tasks file of the cgroup a forking agent thread returns to; -1 = none
}

// cgroups are the call's cgroups: every process of a call is in all of
// them from its first instruction.
type cgroups struct {
	freezer *cgroup // only zygote runs join it: their kill freezes it
	memory  *cgroup
	cpu     *cgroup // nil without the sandbox's cpu cgroup
	pids    *cgroup // nil without the commands' pids cgroup
	memsw   bool    // memory.memsw.* exist (swap accounted)
	oom     int     // memory.oom_control, for its oom_kill count; -1 = none

	// The limits last written (only the agent writes them): a call with
	// the same limits as the last writes nothing.
	lastMem, lastQuota, lastPids string
}

func makeCgroups(cfg Config) (*cgroups, error) {
	if cfg.MemoryFD < 0 || cfg.FreezerFD < 0 {
		return nil, fmt.Errorf("run call: the agent was given no memory or freezer cgroup (a fncall container needs both): %w", errdefs.ErrFailedPrecondition)
	}
	c := &cgroups{oom: -1}
	var err error
	if c.freezer, err = makeCgroup(cfg.FreezerFD, "", false); err != nil {
		return nil, err
	}
	if c.memory, err = makeCgroup(cfg.MemoryFD, "tasks", true); err != nil {
		return nil, err
	}
	if cfg.CPUFD >= 0 {
		if c.cpu, err = makeCgroup(cfg.CPUFD, "tasks", true); err != nil {
			return nil, err
		}
	}
	if cfg.PidsFD >= 0 {
		// The agent itself is in the parent of the commands' pids cgroup.
		if c.pids, err = makeCgroup(cfg.PidsFD, "../tasks", true); err != nil {
			return nil, err
		}
	}
	c.memsw = unix.Faccessat(c.memory.dir, "memory.memsw.limit_in_bytes", unix.F_OK, 0) == nil
	if fd, err := unix.Openat(c.memory.dir, "memory.oom_control", unix.O_RDONLY|unix.O_CLOEXEC, 0); err == nil {
		c.oom = fd
	}
	return c, nil
}

// makeCgroup makes (or finds) the call cgroup under parent; back names
// the parent-relative tasks file a forking thread returns through.
func makeCgroup(parent int, back string, wantBack bool) (*cgroup, error) {
	if err := unix.Mkdirat(parent, callCgroup, 0o755); err != nil && !errors.Is(err, unix.EEXIST) {
		return nil, fmt.Errorf("make the call cgroup: %w", err)
	}
	dir, err := unix.Openat(parent, callCgroup, unix.O_DIRECTORY|unix.O_RDONLY|unix.O_CLOEXEC, 0)
	if err != nil {
		return nil, fmt.Errorf("open the call cgroup: %w", err)
	}
	tasks, err := unix.Openat(dir, "tasks", unix.O_WRONLY|unix.O_CLOEXEC, 0)
	if err != nil {
		unix.Close(dir)
		return nil, fmt.Errorf("open the call cgroup's tasks: %w", err)
	}
	c := &cgroup{dir: dir, tasks: tasks, back: -1}
	if wantBack {
		if c.back, err = unix.Openat(parent, back, unix.O_WRONLY|unix.O_CLOEXEC, 0); err != nil {
			return nil, fmt.Errorf("open the tasks file agent threads return to: %w", err)
		}
	}
	return c, nil
}

// joins are the cgroups a step the agent forks itself starts in (its own
// freezer cgroup is proc's).
func (c *cgroups) joins() []proc.Join {
	j := []proc.Join{{Enter: c.memory.tasks, Back: c.memory.back}}
	for _, g := range []*cgroup{c.cpu, c.pids} {
		if g != nil {
			j = append(j, proc.Join{Enter: g.tasks, Back: g.back})
		}
	}
	return j
}

// zygoteTasks are the tasks files a zygote run writes itself into.
func (c *cgroups) zygoteTasks() []int {
	t := []int{c.freezer.tasks, c.memory.tasks}
	for _, g := range []*cgroup{c.cpu, c.pids} {
		if g != nil {
			t = append(t, g.tasks)
		}
	}
	return t
}

func write(dir int, file, value string) error {
	fd, err := unix.Openat(dir, file, unix.O_WRONLY|unix.O_CLOEXEC, 0)
	if err != nil {
		return err
	}
	defer unix.Close(fd)
	_, err = unix.Write(fd, []byte(value))
	return err
}

func read(dir int, file string) string {
	fd, err := unix.Openat(dir, file, unix.O_RDONLY|unix.O_CLOEXEC, 0)
	if err != nil {
		return ""
	}
	defer unix.Close(fd)
	var buf [8192]byte
	n, _ := unix.Read(fd, buf[:])
	return string(buf[:max(n, 0)])
}

// setLimits writes the call's limits (0 = unlimited, up to the sandbox's).
func (c *cgroups) setLimits(req interface {
	GetMemoryBytes() int64
	GetCpus() float64
	GetPids() int64
}) error {
	mem := "-1"
	if b := req.GetMemoryBytes(); b > 0 {
		if b < 4<<20 {
			return fmt.Errorf("run call: a memory limit of %d bytes is below the 4 MiB a process needs: %w", b, errdefs.ErrInvalidArgument)
		}
		mem = strconv.FormatInt(b, 10)
	}
	if mem != c.lastMem {
		if err := c.setMemory(mem); err != nil {
			return err
		}
		c.lastMem = mem
	}
	if c.cpu != nil {
		quota := "-1"
		if cpus := req.GetCpus(); cpus > 0 {
			quota = strconv.FormatInt(max(int64(math.Ceil(cpus*cfsPeriod)), 1000), 10)
		}
		if quota != c.lastQuota {
			if err := write(c.cpu.dir, "cpu.cfs_period_us", strconv.Itoa(cfsPeriod)); err != nil {
				return fmt.Errorf("set the call's CPU limit: %w", err)
			}
			if err := write(c.cpu.dir, "cpu.cfs_quota_us", quota); err != nil {
				return fmt.Errorf("set the call's CPU limit: %w", err)
			}
			c.lastQuota = quota
		}
	}
	if c.pids != nil {
		pids := req.GetPids()
		if pids <= 0 {
			pids = DefaultPids
		}
		if p := strconv.FormatInt(pids, 10); p != c.lastPids {
			if err := write(c.pids.dir, "pids.max", p); err != nil {
				return fmt.Errorf("set the call's pids limit: %w", err)
			}
			c.lastPids = p
		}
	}
	return nil
}

// setMemory sets the memory limit, swap included: memsw must stay at or
// above the limit, so it is lifted, the limit set, then memsw brought down
// to the limit (no swap).
func (c *cgroups) setMemory(mem string) error {
	if c.memsw {
		if err := write(c.memory.dir, "memory.memsw.limit_in_bytes", "-1"); err != nil {
			return fmt.Errorf("set the call's memory limit: %w", err)
		}
	}
	if err := write(c.memory.dir, "memory.limit_in_bytes", mem); err != nil {
		return fmt.Errorf("set the call's memory limit: %w", err)
	}
	if c.memsw {
		if err := write(c.memory.dir, "memory.memsw.limit_in_bytes", mem); err != nil {
			return fmt.Errorf("set the call's memory limit: %w", err)
		}
	}
	return nil
}

// oomKills is the call memory cgroup's count of OOM kills so far.
func (c *cgroups) oomKills() int64 { return proc.OOMKills(c.oom) }

func (c *cgroups) procs() []int {
	var pids []int
	for _, f := range strings.Fields(read(c.memory.dir, "cgroup.procs")) {
		if p, err := strconv.Atoi(f); err == nil {
			pids = append(pids, p)
		}
	}
	return pids
}

// killZygoteRuns SIGKILLs every process in the zygote runs' freezer
// cgroup, frozen first so nothing forks between the read and the kills.
func (c *cgroups) killZygoteRuns() {
	for range 100 {
		pids := strings.Fields(read(c.freezer.dir, "cgroup.procs"))
		if len(pids) == 0 {
			return
		}
		c.freezeKill(pids)
	}
}

func (c *cgroups) freezeKill(pids []string) {
	frozen := write(c.freezer.dir, "freezer.state", "FROZEN") == nil
	if frozen {
		for range 100 {
			if strings.TrimSpace(read(c.freezer.dir, "freezer.state")) == "FROZEN" {
				break
			}
			time.Sleep(100 * time.Microsecond)
		}
		pids = strings.Fields(read(c.freezer.dir, "cgroup.procs"))
	}
	for _, f := range pids {
		if p, err := strconv.Atoi(f); err == nil {
			unix.Kill(p, unix.SIGKILL)
		}
	}
	if frozen {
		write(c.freezer.dir, "freezer.state", "THAWED")
	}
}

// killAll SIGKILLs every process of the call (all are in its memory
// cgroup) until none is left, for up to about a second, and returns how
// many remain.
func (c *cgroups) killAll() int {
	c.killZygoteRuns()
	delay := 100 * time.Microsecond
	for range 60 {
		pids := c.procs()
		if len(pids) == 0 {
			return 0
		}
		for _, p := range pids {
			unix.Kill(p, unix.SIGKILL)
		}
		time.Sleep(delay)
		delay = min(delay*2, 20*time.Millisecond)
	}
	return len(c.procs())
}

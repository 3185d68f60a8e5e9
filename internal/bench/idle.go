package bench

import (
	"context"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"time"

	"connectrpc.com/connect"

	dsecv1 "dsec.dev/dsec/api/gen/dsec/v1"
	dsec "dsec.dev/dsec/sdk/go"
)

// The idle targets: an idle sandbox costs at most idleCPUTarget percent of
// one core (its agent and its share of dsecd), and a node holding
// thousands of them still creates at createRateTarget times its rate when
// empty. They are what makes 10,000 sandboxes on a node reachable.
const (
	idleCPUTarget    = 0.005
	createRateTarget = 0.8
)

// idleBatch is how many sandboxes one create call of the idle set asks for.
const idleBatch = 50

// IdleCPU is what a node's idle sandboxes cost in CPU over a window, read
// from /proc on the node (so the bench must run there): the CPU time of
// their agents (each found by its cgroup, which names the sandbox) and of
// every dsecd process, whatever else the machine runs meanwhile.
type IdleCPU struct {
	Sandboxes int     `json:"sandboxes"` // agents of the idle set found in /proc
	WindowS   float64 `json:"window_s"`
	// PerSandboxPct is agents' and dsecd's CPU together, divided by the
	// count, in percent of one core; TargetRatio is it over the target.
	PerSandboxPct float64 `json:"per_sandbox_pct_of_a_core"`
	TargetPct     float64 `json:"target_pct_of_a_core"`
	TargetRatio   float64 `json:"per_sandbox_over_target"`
	AgentsPct     float64 `json:"agents_pct_of_a_core"` // all of the set's agents together
	DaemonPct     float64 `json:"dsecd_pct_of_a_core"`
	// WakeupsPerSandbox is how often, per second, an idle sandbox's agent
	// threads and its share of dsecd's were scheduled in.
	WakeupsPerSandbox float64 `json:"wakeups_per_sandbox_per_s"`
	// MachineBusyPct is the whole machine's busy time (everything but idle
	// and iowait), for context: other work on the machine counts there.
	MachineBusyPct float64 `json:"machine_busy_pct_of_a_core"`
	LoadAvg        string  `json:"loadavg"`
	Method         string  `json:"method"`
}

// CreateRate is how fast the idle set's creates went on an empty node and
// with the whole set live, in the same run, and what CPU each took: a
// wall-clock rate moves with whatever else the machine runs, the CPU a
// create costs far less.
type CreateRate struct {
	N          int     `json:"n"`           // sandboxes timed each time
	Live       int     `json:"live"`        // sandboxes live during the second
	EmptyPerS  float64 `json:"empty_per_s"` // creates per second on the empty node
	FullPerS   float64 `json:"full_per_s"`
	Ratio      float64 `json:"full_over_empty"`
	Target     float64 `json:"target_ratio"`
	EmptyLoad  string  `json:"empty_loadavg"`
	FullLoad   string  `json:"full_loadavg"`
	BatchCalls int     `json:"batch_size"` // sandboxes per create call
	// EmptyCPUMs and FullCPUMs are the CPU time of one create: dsecd's,
	// the OCI runtime processes' it ran, and the new agent's so far.
	EmptyCPUMs float64 `json:"empty_cpu_ms_per_create"`
	FullCPUMs  float64 `json:"full_cpu_ms_per_create"`
}

const idleCPUMethod = "CPU time (sum_exec_runtime of every thread, /proc/PID/task/*/schedstat) of the idle set's " +
	"agents, found by the sandbox ID in their cgroup, and of every dsecd, over the window, in percent of one core"

// createIdleSet creates n sandboxes of spec, idleBatch per call as a
// trainer filling a node would, and returns their IDs and the rate. On an
// error it returns the IDs made so far.
func createIdleSet(ctx context.Context, c *dsec.Conn, spec *dsecv1.SandboxSpec, n int, progress func(made int, rate float64)) ([]string, float64, error) {
	var ids []string
	t0 := time.Now()
	for len(ids) < n {
		k := min(idleBatch, n-len(ids))
		tb := time.Now()
		resp, err := c.Sandboxes.Create(ctx, connect.NewRequest(&dsecv1.CreateRequest{Spec: spec, Count: int32(k), WaitSeconds: 300}))
		if err != nil {
			return ids, 0, fmt.Errorf("create idle sandboxes after %d: %w", len(ids), err)
		}
		for _, sb := range resp.Msg.GetSandboxes() {
			ids = append(ids, sb.GetId())
		}
		if progress != nil {
			progress(len(ids), float64(k)/time.Since(tb).Seconds())
		}
	}
	if n == 0 {
		return nil, 0, nil
	}
	return ids, float64(n) / time.Since(t0).Seconds(), nil
}

// timedCreates creates n sandboxes of spec as createIdleSet does, and
// returns their IDs, the rate, and the CPU time of one create in ms: what
// every dsecd and the children it waited for (the OCI runtime's runs) used
// meanwhile, and the new agents' time so far (their start: namespaces,
// mounts, exec), over n.
func timedCreates(ctx context.Context, c *dsec.Conn, spec *dsecv1.SandboxSpec, n int, progress func(made int, rate float64)) ([]string, float64, float64, error) {
	before := daemonCPU()
	ids, rate, err := createIdleSet(ctx, c, spec, n, progress)
	if err != nil || n == 0 {
		return ids, rate, 0, err
	}
	used := daemonCPU() - before
	set := make(map[string]bool, len(ids))
	for _, id := range ids {
		set[id] = true
	}
	used += readCPU(set).agents.ns
	return ids, rate, float64(used) / 1e6 / float64(n), nil
}

// daemonCPU is the CPU time, in ns, of every dsecd and of the children
// each waited for, from /proc/PID/stat.
func daemonCPU() int64 {
	var ticks int64
	ents, _ := os.ReadDir("/proc")
	for _, e := range ents {
		pid := e.Name()
		if _, err := strconv.Atoi(pid); err != nil {
			continue
		}
		b, err := os.ReadFile(filepath.Join("/proc", pid, "stat"))
		if err != nil {
			continue
		}
		ticks += daemonTicks(string(b))
	}
	return ticks * (1e9 / clockTicks)
}

// daemonTicks is utime+stime+cutime+cstime of a /proc/PID/stat line whose
// command is dsecd, else 0.
func daemonTicks(stat string) int64 {
	open, end := strings.IndexByte(stat, '('), strings.LastIndexByte(stat, ')')
	if open < 0 || end < open || stat[open+1:end] != "dsecd" {
		return 0
	}
	f := strings.Fields(stat[end+1:])
	if len(f) < 15 {
		return 0
	}
	var sum int64
	for _, v := range f[11:15] { // utime stime cutime cstime
		n, _ := strconv.ParseInt(v, 10, 64)
		sum += n
	}
	return sum
}

// measureIdleCPU reads what the agents of the sandboxes ids and dsecd use
// over window.
func measureIdleCPU(ctx context.Context, ids []string, window time.Duration) (IdleCPU, error) {
	set := make(map[string]bool, len(ids))
	for _, id := range ids {
		set[id] = true
	}
	r := IdleCPU{TargetPct: idleCPUTarget, Method: idleCPUMethod}
	before := readCPU(set)
	select {
	case <-ctx.Done():
		return r, ctx.Err()
	case <-time.After(window):
	}
	after := readCPU(set)
	wall := after.at.Sub(before.at).Seconds()
	r.WindowS = wall
	r.LoadAvg = loadAvg()
	pct := func(ns int64) float64 { return float64(ns) / 1e9 / wall * 100 }
	agents := after.agents.minus(before.agents)
	daemon := after.daemon.minus(before.daemon)
	r.Sandboxes = agents.procs
	r.AgentsPct, r.DaemonPct = pct(agents.ns), pct(daemon.ns)
	if r.Sandboxes > 0 {
		r.PerSandboxPct = (r.AgentsPct + r.DaemonPct) / float64(r.Sandboxes)
		r.TargetRatio = r.PerSandboxPct / idleCPUTarget
		r.WakeupsPerSandbox = float64(agents.runs+daemon.runs) / wall / float64(r.Sandboxes)
	}
	if after.busyTicks > 0 {
		r.MachineBusyPct = float64(after.busyTicks-before.busyTicks) / clockTicks / wall * 100
	}
	return r, nil
}

// clockTicks is USER_HZ, the unit of /proc/stat's times on Linux.
const clockTicks = 100

// cpuUse is the CPU time of some processes' threads and how often they
// were scheduled in, keyed by process.
type cpuUse struct {
	procs int
	ns    int64
	runs  int64
	per   map[string][2]int64 // pid: ns, runs
}

func (u *cpuUse) add(pid string, ns, runs int64) {
	if u.per == nil {
		u.per = map[string][2]int64{}
	}
	u.procs++
	u.ns += ns
	u.runs += runs
	u.per[pid] = [2]int64{ns, runs}
}

// minus is what the processes of u that were there at earlier too used
// since earlier.
func (u cpuUse) minus(earlier cpuUse) cpuUse {
	var d cpuUse
	for pid, now := range u.per {
		if then, ok := earlier.per[pid]; ok {
			d.add(pid, now[0]-then[0], now[1]-then[1])
		}
	}
	return d
}

type cpuReading struct {
	at        time.Time
	agents    cpuUse
	daemon    cpuUse
	busyTicks int64
}

// readCPU reads the CPU use of every agent of a sandbox in set and of every
// dsecd, and the machine's busy time.
func readCPU(set map[string]bool) cpuReading {
	r := cpuReading{busyTicks: machineBusyTicks()}
	ents, _ := os.ReadDir("/proc")
	for _, e := range ents {
		pid := e.Name()
		if _, err := strconv.Atoi(pid); err != nil {
			continue
		}
		comm, err := os.ReadFile(filepath.Join("/proc", pid, "comm"))
		if err != nil {
			continue
		}
		switch strings.TrimSpace(string(comm)) {
		case "dsec-agent":
			cg, err := os.ReadFile(filepath.Join("/proc", pid, "cgroup"))
			if err != nil || !set[sandboxOfCgroup(string(cg))] {
				continue
			}
			ns, runs := threadsCPU(pid)
			r.agents.add(pid, ns, runs)
		case "dsecd":
			ns, runs := threadsCPU(pid)
			r.daemon.add(pid, ns, runs)
		}
	}
	r.at = time.Now()
	return r
}

// sandboxOfCgroup is the sandbox ID a process's /proc/PID/cgroup names: the
// last element of the first path that looks like one ("sb-...").
func sandboxOfCgroup(cgroup string) string {
	for _, line := range strings.Split(cgroup, "\n") {
		_, path, ok := strings.Cut(line, ":")
		if !ok {
			continue
		}
		_, path, _ = strings.Cut(path, ":")
		if base := filepath.Base(path); strings.HasPrefix(base, "sb-") {
			return base
		}
	}
	return ""
}

// threadsCPU sums the CPU time (ns) and the times scheduled in of every
// thread of process pid.
func threadsCPU(pid string) (ns, runs int64) {
	tasks, _ := os.ReadDir(filepath.Join("/proc", pid, "task"))
	for _, t := range tasks {
		b, err := os.ReadFile(filepath.Join("/proc", pid, "task", t.Name(), "schedstat"))
		if err != nil {
			continue
		}
		f := strings.Fields(string(b))
		if len(f) < 3 {
			continue
		}
		run, _ := strconv.ParseInt(f[0], 10, 64)
		slots, _ := strconv.ParseInt(f[2], 10, 64)
		ns += run
		runs += slots
	}
	return ns, runs
}

// machineBusyTicks is the machine's busy time from /proc/stat: everything
// but idle and iowait, in clock ticks.
func machineBusyTicks() int64 {
	b, err := os.ReadFile("/proc/stat")
	if err != nil {
		return 0
	}
	line, _, _ := strings.Cut(string(b), "\n")
	f := strings.Fields(line)
	if len(f) < 8 || f[0] != "cpu" {
		return 0
	}
	var busy int64
	for i, v := range f[1:] {
		n, _ := strconv.ParseInt(v, 10, 64)
		if i == 3 || i == 4 || i >= 7 { // idle, iowait; guest times are in user already
			continue
		}
		busy += n
	}
	return busy
}

func loadAvg() string {
	b, err := os.ReadFile("/proc/loadavg")
	if err != nil {
		return ""
	}
	f := strings.Fields(string(b))
	if len(f) < 3 {
		return ""
	}
	return strings.Join(f[:3], " ")
}

// printIdle writes the idle CPU and create rate lines of a report.
func printIdle(w io.Writer, cpu *IdleCPU, rate *CreateRate) {
	if cpu != nil {
		fmt.Fprintf(w, "idle CPU: %d idle sandboxes over %.0f s: %.4f %% of a core each (target ≤ %.3f %%: %.2f× it); "+
			"agents %.2f %%, dsecd %.2f %% of a core in all; %.3f wake-ups/s each; machine busy %.0f %% of a core, load average %s\n",
			cpu.Sandboxes, cpu.WindowS, cpu.PerSandboxPct, cpu.TargetPct, cpu.TargetRatio,
			cpu.AgentsPct, cpu.DaemonPct, cpu.WakeupsPerSandbox, cpu.MachineBusyPct, cpu.LoadAvg)
	}
	if rate != nil {
		fmt.Fprintf(w, "create rate (%d sandboxes, %d a call): %.2f/s on an empty node (load %s), %.2f/s with %d live (load %s): %.2f× (target ≥ %.1f×); "+
			"CPU per create (dsecd, the OCI runtime it ran, the new agent) %.1f ms empty, %.1f ms with %d live\n",
			rate.N, rate.BatchCalls, rate.EmptyPerS, rate.EmptyLoad, rate.FullPerS, rate.Live, rate.FullLoad, rate.Ratio, rate.Target,
			rate.EmptyCPUMs, rate.FullCPUMs, rate.Live)
	}
}

package cluster

import (
	"fmt"
	"io"
	"os"
	"strconv"
	"strings"
	"time"

	"dsec.dev/dsec/internal/testutil"
)

// cpuMeter charges the CPU time the processes of a comparison use to the
// side whose round is running: BenchmarkClusterOps freezes the other
// cluster, so what its own processes, PostgreSQL (which both share) and
// the benchmark's callers use between two switches is that side's.
type cpuMeter struct {
	parts  map[string]func() time.Duration // part name → its CPU time so far
	order  []string
	side   string
	last   map[string]time.Duration
	charge map[string]map[string]time.Duration // side → part → CPU time
}

func newCPUMeter() *cpuMeter {
	return &cpuMeter{parts: map[string]func() time.Duration{}, last: map[string]time.Duration{}, charge: map[string]map[string]time.Duration{}}
}

// addCluster adds cluster c's apiservers and its edges as two parts (each
// the sum of its processes), named after side.
func (m *cpuMeter) addCluster(side string, c *testutil.Cluster) {
	m.add(side+" apiservers", func() time.Duration { return sumProcs(c.APIServers) })
	m.add(side+" edges", func() time.Duration { return sumProcs(c.Edges) })
}

func sumProcs(ps []*testutil.Proc) time.Duration {
	var d time.Duration
	for _, p := range ps {
		d += procCPU(p.Pid(), false)
	}
	return d
}

func (m *cpuMeter) add(name string, f func() time.Duration) {
	m.parts[name] = f
	m.order = append(m.order, name)
}

// switchTo charges what was used since the last switch to the side that
// ran, and starts counting for side ("": none).
func (m *cpuMeter) switchTo(side string) {
	for _, name := range m.order {
		now := m.parts[name]()
		if m.side != "" {
			if m.charge[m.side] == nil {
				m.charge[m.side] = map[string]time.Duration{}
			}
			m.charge[m.side][name] += now - m.last[name]
		}
		m.last[name] = now
	}
	m.side = side
}

// print writes each side's CPU seconds by part, and all of them over the
// sandboxes each side made: the machine is shared, so this is steadier
// than the rate, which other work on it moves.
func (m *cpuMeter) print(w io.Writer, sides [2]string, made [2]int64) {
	fmt.Fprintf(w, "CPU seconds used during each side's rounds:\n%-28s %12s %12s\n", "", sides[0], sides[1])
	for _, name := range m.order {
		fmt.Fprintf(w, "%-28s %12.1f %12.1f\n", name, m.charge[sides[0]][name].Seconds(), m.charge[sides[1]][name].Seconds())
	}
	var tot [2]time.Duration
	for i, s := range sides {
		for _, d := range m.charge[s] {
			tot[i] += d
		}
	}
	fmt.Fprintf(w, "%-28s %12.1f %12.1f\n", "all", tot[0].Seconds(), tot[1].Seconds())
	var per [2]float64
	for i := range per {
		per[i] = float64(tot[i].Microseconds()) / float64(max(made[i], 1))
	}
	fmt.Fprintf(w, "%-28s %12.0f %12.0f\n", "all, µs a sandbox", per[0], per[1])
	fmt.Fprintf(w, "\n%s ÷ %s CPU a sandbox: %.3f×\n", sides[0], sides[1], per[0]/per[1])
}

// procCPU is the user and system CPU time process pid used (all its
// threads), with its reaped children's when children is set; 0 when it
// is gone.
func procCPU(pid int, children bool) time.Duration {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return 0
	}
	// The fields after the command's closing parenthesis, from the state
	// (field 3): utime is field 14, stime 15, cutime 16, cstime 17.
	i := strings.LastIndexByte(string(b), ')')
	f := strings.Fields(string(b[i+1:]))
	if len(f) < 15 {
		return 0
	}
	var ticks int64
	n := 2
	if children {
		n = 4
	}
	for _, s := range f[11 : 11+n] {
		v, _ := strconv.ParseInt(s, 10, 64)
		ticks += v
	}
	return time.Duration(ticks) * time.Second / 100 // USER_HZ
}

// treeCPU is procCPU of pid and of its living children (a PostgreSQL
// server: the postmaster and its sessions; the ended sessions' is in the
// postmaster's children's time).
func treeCPU(pid int) time.Duration {
	if pid <= 0 {
		return 0
	}
	d := procCPU(pid, true)
	ents, _ := os.ReadDir("/proc")
	for _, e := range ents {
		child, err := strconv.Atoi(e.Name())
		if err != nil {
			continue
		}
		b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", child))
		if err != nil {
			continue
		}
		i := strings.LastIndexByte(string(b), ')')
		f := strings.Fields(string(b[i+1:]))
		if len(f) > 1 && f[1] == strconv.Itoa(pid) {
			d += procCPU(child, false)
		}
	}
	return d
}

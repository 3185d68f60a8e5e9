package cluster

import (
	"fmt"
	"io"
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
		d += testutil.ProcCPU(p.Pid(), false)
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

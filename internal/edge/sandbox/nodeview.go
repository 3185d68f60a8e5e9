package sandbox

import (
	"strings"

	dsecv1 "dsec.dev/dsec/api/gen/dsec/v1"
	"dsec.dev/dsec/internal/iam"
	"dsec.dev/dsec/internal/metrics"
)

// MetricsView is the node's state now for its gauges (metrics.NodeView):
// its sandboxes (tombstones included, warm pool members not) by state,
// backend, isolation and project, its warm pools, and its capacity and
// what its live sandboxes asked of it. /metrics reads it at each scrape.
func (m *Manager) MetricsView() metrics.NodeView {
	v := metrics.NodeView{MaxSandboxes: m.cfg.Limits.MaxSandboxes, CPUs: float64(m.hostCPU.CPUs()), MemoryAvailableBytes: -1}
	if total, err := MemTotalMB(); err == nil {
		v.MemoryBytes = total << 20
	}
	if avail, err := memAvailableMB(); err == nil {
		v.MemoryAvailableBytes = avail << 20
	}
	// Grouped by the state's and the kind's numbers under the lock, named
	// once a group after it: a scrape holds the manager's lock for as long
	// as the walk.
	type groupKey struct {
		state   dsecv1.State
		kind    Kind
		project string
	}
	groups := map[groupKey]int{}
	live := 0
	m.mu.Lock()
	for _, sb := range m.sandboxes {
		alive := sb.gone.IsZero()
		pooled := sb.pool != ""
		sb.mu.Lock()
		spec := sb.rec.GetSpec()
		if alive {
			v.CPUsRequested += float64(spec.GetCpus())
			v.MemoryRequestedBytes += spec.GetMemoryMb() << 20
		}
		if !pooled {
			groups[groupKey{sb.rec.GetState(), KindOf(spec), spec.GetLabels()[iam.ProjectLabel]}]++
		}
		sb.mu.Unlock()
		if alive && !pooled {
			live++
		}
	}
	m.mu.Unlock()
	for g, n := range groups {
		v.Sandboxes = append(v.Sandboxes, metrics.SandboxGroup{State: strings.ToLower(strings.TrimPrefix(g.state.String(), "STATE_")),
			Backend: BackendName(g.kind.Profile), Isolation: IsolationName(g.kind.Isolation), Project: g.project, Count: n})
	}
	avail := int64(-1)
	if v.MemoryAvailableBytes >= 0 {
		avail = v.MemoryAvailableBytes >> 20
	}
	v.Refusing = m.admission(live, avail) != nil
	pools, _ := m.WarmPools(m.life)
	for _, p := range pools {
		v.Pools = append(v.Pools, metrics.PoolGroup{Environment: p.GetSpec().GetEnvironment(),
			Size: int(p.GetSize()), Ready: int(p.GetReady()), Starting: int(p.GetStarting())})
	}
	return v
}

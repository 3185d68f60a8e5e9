package sandbox

import (
	"strings"

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
	groups := map[metrics.SandboxGroup]int{}
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
			kind := KindOf(spec)
			groups[metrics.SandboxGroup{
				State:     strings.ToLower(strings.TrimPrefix(sb.rec.GetState().String(), "STATE_")),
				Backend:   BackendName(kind.Profile),
				Isolation: IsolationName(kind.Isolation),
				Project:   spec.GetLabels()[iam.ProjectLabel],
			}]++
		}
		sb.mu.Unlock()
		if alive && !pooled {
			live++
		}
	}
	m.mu.Unlock()
	for g, n := range groups {
		g.Count = n
		v.Sandboxes = append(v.Sandboxes, g)
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

package metrics

import (
	"cmp"
	"slices"

	"github.com/prometheus/client_golang/prometheus"
)

// OtherProject is the project label of the sandboxes of every project past
// the cap (Registry.Node's projects), summed.
const OtherProject = "other"

// RootProject is the project label of the root project's sandboxes (its
// path is "") and of sandboxes that carry no project label.
const RootProject = "/"

// DefaultProjects is how many projects, the largest by sandboxes, the
// sandbox gauge names by default; the rest are summed under OtherProject.
const DefaultProjects = 20

// NodeView is a node's state at one scrape: its sandboxes, warm pools and
// capacity now. The edge makes it when /metrics is read, so recording it
// costs nothing between scrapes.
type NodeView struct {
	Sandboxes []SandboxGroup
	Pools     []PoolGroup
	// MaxSandboxes is the node's admission cap (0: none); CPUs and
	// MemoryBytes its capacity for sandboxes; the requested ones what its
	// live sandboxes (pool members included) asked for; MemoryAvailable
	// the host's available memory now (<0: not known).
	MaxSandboxes         int
	CPUs                 float64
	CPUsRequested        float64
	MemoryBytes          int64
	MemoryRequestedBytes int64
	MemoryAvailableBytes int64
	Refusing             bool // admission refuses creates now
}

// SandboxGroup counts a node's sandboxes of one state, backend, isolation
// and project. Project is the project label's value ("" for the root).
type SandboxGroup struct {
	State, Backend, Isolation, Project string
	Count                              int
}

// PoolGroup is the warm pools of one environment on a node, summed: the
// members they should hold, hold ready, and are starting.
type PoolGroup struct {
	Environment           string
	Size, Ready, Starting int
}

var (
	sandboxesDesc = prometheus.NewDesc("dsec_sandboxes",
		"Sandboxes on this node now by state, backend, isolation and project (the largest projects by name, the rest under \"other\"); warm pool members not included.",
		[]string{"state", "backend", "isolation", "project"}, nil)
	poolSizeDesc = prometheus.NewDesc("dsec_pool_size",
		"Members the warm pools of an environment should hold.", []string{"environment"}, nil)
	poolMembersDesc = prometheus.NewDesc("dsec_pool_members",
		"Members the warm pools of an environment hold by state (ready, starting).", []string{"environment", "state"}, nil)
	nodeMaxSandboxesDesc = prometheus.NewDesc("dsec_node_max_sandboxes",
		"The node's cap on live sandboxes (0: none).", nil, nil)
	nodeCPUsDesc = prometheus.NewDesc("dsec_node_cpus",
		"CPUs of this node for sandboxes (capacity) and asked for by its live sandboxes (requested).", []string{"kind"}, nil)
	nodeMemoryDesc = prometheus.NewDesc("dsec_node_memory_bytes",
		"Memory of this node for sandboxes (capacity), asked for by its live sandboxes (requested), and available on the host now (available).", []string{"kind"}, nil)
	nodeCPUUsedDesc = prometheus.NewDesc("dsec_node_cpu_used_seconds_total",
		"CPU time the node's host has spent busy since it booted, over every CPU (from /proc/stat: user, nice, system, irq, softirq, steal).", nil, nil)
	nodeRefusingDesc = prometheus.NewDesc("dsec_node_refusing",
		"1 while the node's admission refuses creates (full, or short of memory), else 0.", nil, nil)
)

// nodeCollector reads a NodeView at each scrape.
type nodeCollector struct {
	view     func() NodeView
	projects int
}

// Node has every scrape of r read view for the node's gauges. projects
// caps the projects the sandbox gauge names: the largest that many by
// sandboxes, the rest summed under "other" (0 names none). Call it once
// per registry; a nil r does nothing.
func (r *Registry) Node(view func() NodeView, projects int) {
	if r == nil {
		return
	}
	r.reg.MustRegister(&nodeCollector{view: view, projects: projects})
}

func (c *nodeCollector) Describe(ch chan<- *prometheus.Desc) {
	for _, d := range []*prometheus.Desc{sandboxesDesc, poolSizeDesc, poolMembersDesc, nodeMaxSandboxesDesc, nodeCPUsDesc, nodeMemoryDesc, nodeCPUUsedDesc, nodeRefusingDesc} {
		ch <- d
	}
}

func (c *nodeCollector) Collect(ch chan<- prometheus.Metric) {
	v := c.view()
	gauge := func(d *prometheus.Desc, x float64, labels ...string) {
		ch <- prometheus.MustNewConstMetric(d, prometheus.GaugeValue, x, labels...)
	}
	for key, n := range CapProjects(v.Sandboxes, c.projects) {
		gauge(sandboxesDesc, float64(n), key.State, key.Backend, key.Isolation, key.Project)
	}
	pools := map[string]PoolGroup{}
	for _, p := range v.Pools {
		sum := pools[p.Environment]
		sum.Size += p.Size
		sum.Ready += p.Ready
		sum.Starting += p.Starting
		pools[p.Environment] = sum
	}
	for env, p := range pools {
		gauge(poolSizeDesc, float64(p.Size), env)
		gauge(poolMembersDesc, float64(p.Ready), env, "ready")
		gauge(poolMembersDesc, float64(p.Starting), env, "starting")
	}
	gauge(nodeMaxSandboxesDesc, float64(v.MaxSandboxes))
	gauge(nodeCPUsDesc, v.CPUs, "capacity")
	gauge(nodeCPUsDesc, v.CPUsRequested, "requested")
	gauge(nodeMemoryDesc, float64(v.MemoryBytes), "capacity")
	gauge(nodeMemoryDesc, float64(v.MemoryRequestedBytes), "requested")
	if v.MemoryAvailableBytes >= 0 {
		gauge(nodeMemoryDesc, float64(v.MemoryAvailableBytes), "available")
	}
	if used, err := CPUUsed(); err == nil {
		ch <- prometheus.MustNewConstMetric(nodeCPUUsedDesc, prometheus.CounterValue, used)
	}
	refusing := 0.0
	if v.Refusing {
		refusing = 1
	}
	gauge(nodeRefusingDesc, refusing)
}

// SandboxKey is one series of the sandbox gauge.
type SandboxKey struct{ State, Backend, Isolation, Project string }

// CapProjects sums groups by state, backend, isolation and project, naming
// the largest projects by sandboxes (at most projects of them; ties go to
// the name first in order) and summing the rest under OtherProject.
// The root's sandboxes count under RootProject, which is named like any
// other project.
func CapProjects(groups []SandboxGroup, projects int) map[SandboxKey]int {
	total := map[string]int{}
	for _, g := range groups {
		total[projectName(g.Project)] += g.Count
	}
	names := make([]string, 0, len(total))
	for p := range total {
		names = append(names, p)
	}
	slices.SortFunc(names, func(a, b string) int {
		return cmp.Or(cmp.Compare(total[b], total[a]), cmp.Compare(a, b))
	})
	named := map[string]bool{}
	for i, p := range names {
		if i >= projects {
			break
		}
		named[p] = true
	}
	out := map[SandboxKey]int{}
	for _, g := range groups {
		p := projectName(g.Project)
		if !named[p] {
			p = OtherProject
		}
		out[SandboxKey{g.State, g.Backend, g.Isolation, p}] += g.Count
	}
	return out
}

func projectName(p string) string {
	if p == "" {
		return RootProject
	}
	return p
}

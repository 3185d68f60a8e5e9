package metrics

import (
	"testing"
	"time"

	"dsec.dev/dsec/internal/testutil"
)

// TestNode: the node's gauges read its view at each scrape, pools summed
// by environment, projects past the cap under "other".
func TestNode(t *testing.T) {
	r := New()
	view := NodeView{
		Sandboxes: []SandboxGroup{
			{State: "running", Backend: "container", Isolation: "container", Project: "/a", Count: 3},
			{State: "running", Backend: "container", Isolation: "gvisor", Project: "/b", Count: 2},
			{State: "paused", Backend: "container", Isolation: "container", Project: "/c", Count: 1},
			{State: "running", Backend: "container", Isolation: "container", Project: "/d", Count: 1},
			{State: "running", Backend: "container", Isolation: "container", Count: 4},
		},
		Pools:        []PoolGroup{{Environment: "python", Size: 2, Ready: 1, Starting: 1}, {Environment: "python", Size: 1, Ready: 1}},
		MaxSandboxes: 10, CPUs: 2, CPUsRequested: 5.5, MemoryBytes: 1 << 30, MemoryRequestedBytes: 1 << 29, MemoryAvailableBytes: 1 << 28,
	}
	r.Node(func() NodeView { return view }, 2)
	fams := scrape(t, r)
	sb := func(state, iso, project string) map[string]string {
		return map[string]string{"state": state, "backend": "container", "isolation": iso, "project": project}
	}
	for _, c := range []struct {
		name   string
		labels map[string]string
		want   float64
	}{
		{"dsec_sandboxes", sb("running", "container", RootProject), 4},
		{"dsec_sandboxes", sb("running", "container", "/a"), 3},
		{"dsec_sandboxes", sb("running", "gvisor", OtherProject), 2},
		{"dsec_sandboxes", sb("paused", "container", OtherProject), 1},
		{"dsec_sandboxes", sb("running", "container", OtherProject), 1},
		{"dsec_pool_size", map[string]string{"environment": "python"}, 3},
		{"dsec_pool_members", map[string]string{"environment": "python", "state": "ready"}, 2},
		{"dsec_pool_members", map[string]string{"environment": "python", "state": "starting"}, 1},
		{"dsec_node_max_sandboxes", map[string]string{}, 10},
		{"dsec_node_cpus", map[string]string{"kind": "requested"}, 5.5},
		{"dsec_node_memory_bytes", map[string]string{"kind": "available"}, 1 << 28},
		{"dsec_node_refusing", map[string]string{}, 0},
	} {
		if got := testutil.MetricValue(fams, c.name, c.labels); got != c.want {
			t.Errorf("%s%v = %v, want %v", c.name, c.labels, got, c.want)
		}
	}
	if n := len(fams["dsec_sandboxes"].GetMetric()); n != 5 {
		t.Errorf("dsec_sandboxes has %d series, want 5 (none for /b, /c, /d)", n)
	}
	// The view is read at each scrape: a sandbox more shows at once.
	view.Sandboxes[0].Count = 5
	if got := testutil.MetricValue(scrape(t, r), "dsec_sandboxes", sb("running", "container", "/a")); got != 5 {
		t.Errorf("after the view changed: %v, want 5", got)
	}
}

// TestCapProjects: ties go to the name first in order; a cap of 0 names
// none.
func TestCapProjects(t *testing.T) {
	groups := []SandboxGroup{
		{State: "running", Project: "/b", Count: 2},
		{State: "running", Project: "/a", Count: 2},
		{State: "running", Project: "/c", Count: 1},
	}
	got := CapProjects(groups, 1)
	if got[SandboxKey{State: "running", Project: "/a"}] != 2 || got[SandboxKey{State: "running", Project: OtherProject}] != 3 || len(got) != 2 {
		t.Errorf("cap 1: %v", got)
	}
	got = CapProjects(groups, 0)
	if got[SandboxKey{State: "running", Project: OtherProject}] != 5 || len(got) != 1 {
		t.Errorf("cap 0: %v", got)
	}
}

// TestFnCall: calls and their latency by language and status; the queue
// and containers read from the load at each scrape.
func TestFnCall(t *testing.T) {
	r := New()
	f := r.FnCall(func() (int, int, int) { return 2, 7, 1 })
	f.Call("python", "success", 10*time.Millisecond)
	f.Call("python", "compile_error", 10*time.Millisecond)
	f.Call("cpp", "success", time.Second)
	fams := scrape(t, r)
	for _, c := range []struct {
		name   string
		labels map[string]string
		want   float64
	}{
		{"dsec_fncall_calls_total", map[string]string{"language": "python", "status": "success"}, 1},
		{"dsec_fncall_calls_total", map[string]string{"language": "python", "status": "compile_error"}, 1},
		{"dsec_fncall_call_seconds", map[string]string{"language": "python"}, 2},
		{"dsec_fncall_call_seconds", map[string]string{"language": "cpp"}, 1},
		{"dsec_fncall_queue", map[string]string{}, 7},
		{"dsec_fncall_running", map[string]string{}, 2},
		{"dsec_fncall_idle_containers", map[string]string{}, 1},
	} {
		if got := testutil.MetricValue(fams, c.name, c.labels); got != c.want {
			t.Errorf("%s%v = %v, want %v", c.name, c.labels, got, c.want)
		}
	}
}

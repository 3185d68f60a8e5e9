package metrics

import (
	"encoding/json"
	"errors"
	"fmt"
	"net/http/httptest"
	"os"
	"regexp"
	"strings"
	"testing"
	"time"

	dto "github.com/prometheus/client_model/go"

	"dsec.dev/dsec/internal/errdefs"
	"dsec.dev/dsec/internal/testutil"
)

// scrape reads what r's handler serves, parsed with Prometheus' own text
// parser.
func scrape(t *testing.T, r *Registry) map[string]*dto.MetricFamily {
	t.Helper()
	rec := httptest.NewRecorder()
	r.Handler().ServeHTTP(rec, httptest.NewRequest("GET", "/metrics", nil))
	if rec.Code != 200 {
		t.Fatalf("GET /metrics: %d %s", rec.Code, rec.Body)
	}
	fams := testutil.ParseMetrics(t, rec.Body)
	return fams
}

func TestEdge(t *testing.T) {
	r := New()
	e := r.Edge()
	e.Create("container", "container", nil, 10*time.Millisecond)
	e.Create("container", "container", nil, 20*time.Millisecond)
	full := fmt.Errorf("node n holds its maximum: %w", errdefs.ErrResourceExhausted)
	e.Create("container", "gvisor", full, time.Millisecond)
	e.Create("container", "container", errors.New("bad spec"), time.Millisecond)
	e.Delete("container", "container", nil, time.Millisecond)
	e.Pause("pause", nil, time.Millisecond)
	e.Pause("resume", nil, time.Millisecond)
	e.Pool(true)
	e.Pool(false)
	e.Pool(false)
	e.Refused("max_sandboxes")
	e.Exec("container", nil, time.Millisecond)
	e.Exec("container", nil, time.Millisecond)
	e.Network("connect", "deny")
	e.Network("dns", "allow")
	e.Network("dns", "allow")

	fams := scrape(t, r)
	for _, c := range []struct {
		name   string
		labels map[string]string
		want   float64
	}{
		{"dsec_sandbox_creates_total", map[string]string{"backend": "container", "isolation": "container", "outcome": "ok"}, 2},
		{"dsec_sandbox_create_seconds", map[string]string{"backend": "container", "isolation": "container", "outcome": "ok"}, 2},
		{"dsec_sandbox_creates_total", map[string]string{"backend": "container", "isolation": "gvisor", "outcome": "admission_refused"}, 1},
		{"dsec_sandbox_creates_total", map[string]string{"backend": "container", "isolation": "container", "outcome": "error"}, 1},
		{"dsec_sandbox_deletes_total", map[string]string{"backend": "container", "isolation": "container", "outcome": "ok"}, 1},
		{"dsec_sandbox_pauses_total", map[string]string{"op": "pause", "outcome": "ok"}, 1},
		{"dsec_sandbox_pause_seconds", map[string]string{"op": "resume"}, 1},
		{"dsec_pool_hits_total", map[string]string{}, 1},
		{"dsec_pool_misses_total", map[string]string{}, 2},
		{"dsec_admission_refusals_total", map[string]string{"reason": "max_sandboxes"}, 1},
		{"dsec_exec_seconds", map[string]string{"isolation": "container", "outcome": "ok"}, 2},
		{"dsec_network_events_total", map[string]string{"kind": "connect", "verdict": "deny"}, 1},
		{"dsec_network_events_total", map[string]string{"kind": "dns", "verdict": "allow"}, 2},
	} {
		if got := testutil.MetricValue(fams, c.name, c.labels); got != c.want {
			t.Errorf("%s%v = %v, want %v", c.name, c.labels, got, c.want)
		}
	}
	if fams["go_goroutines"] == nil || fams["process_cpu_seconds_total"] == nil {
		t.Errorf("the Go and process collectors are missing")
	}
}

// TestNilEdge: a manager without metrics records nothing and does not
// panic.
func TestNilEdge(t *testing.T) {
	var e *Edge
	e.Create("container", "container", nil, time.Second)
	e.Delete("container", "container", nil, time.Second)
	e.Pause("pause", nil, time.Second)
	e.Pool(true)
	e.Refused("max_sandboxes")
	e.Exec("container", nil, time.Second)
	e.Network("dns", "deny")
	var f *FnCall
	f.Call("python", "success", time.Second)
	var a *API
	a.Request("/p", "ok", time.Second)
	a.Placement("placed")
	var r *Registry
	r.Node(func() NodeView { return NodeView{} }, 1)
	r.Layers(nil)
	r.Counters(Func{})
	if r.StoreErrors().Of("sqlite") != nil || r.BlobErrors().Of("dir") != nil || r.API(nil) != nil {
		t.Fatal("a nil registry made metrics")
	}
	if r.FnCall(nil) != nil || r.Edge() != nil {
		t.Fatal("a nil registry made metrics")
	}
}

// TestRegistriesApart: two processes' registries (two edges of a hollow
// fleet in one process) count apart.
func TestRegistriesApart(t *testing.T) {
	a, b := New(), New()
	a.Edge().Pool(true)
	b.Edge()
	if got := testutil.MetricValue(scrape(t, b), "dsec_pool_hits_total", map[string]string{}); got != 0 {
		t.Fatalf("b's pool hits = %v, want 0", got)
	}
	if got := testutil.MetricValue(scrape(t, a), "dsec_pool_hits_total", map[string]string{}); got != 1 {
		t.Fatalf("a's pool hits = %v, want 1", got)
	}
}

// dashboardQueries is each dsec metric the shipped Grafana dashboard
// queries (histograms by their family's name), with a panel that does.
func dashboardQueries(t *testing.T) map[string]string {
	t.Helper()
	raw, err := os.ReadFile("../../docs/grafana/dsec.json")
	if err != nil {
		t.Fatal(err)
	}
	var dash struct {
		Panels []struct {
			Title   string
			Targets []struct{ Expr string }
		}
	}
	if err := json.Unmarshal(raw, &dash); err != nil {
		t.Fatalf("parse the dashboard: %v", err)
	}
	name := regexp.MustCompile(`\bdsec_[a-z_]+`)
	out := map[string]string{}
	for _, p := range dash.Panels {
		for _, q := range p.Targets {
			for _, n := range name.FindAllString(q.Expr, -1) {
				out[strings.TrimSuffix(strings.TrimSuffix(strings.TrimSuffix(n, "_bucket"), "_count"), "_sum")] = p.Title
			}
		}
	}
	if len(out) == 0 {
		t.Fatal("the dashboard queries no dsec metric")
	}
	return out
}

// TestDashboardOnDayOne: a node and an apiserver that have only created,
// run and deleted sandboxes serve every metric the dashboard queries, the
// rare events' at 0 (refusals, pauses, network verdicts, blob errors), but
// those whose labels are known only when something happens (a language's
// first FnCall call, a pool's environment, the metadata store's method
// that failed): an operator loading the dashboard on a cluster's first
// day found eleven panels with "No data" where those were 0.
func TestDashboardOnDayOne(t *testing.T) {
	bornWithTheirLabels := map[string]bool{
		"dsec_fncall_calls_total": true, "dsec_fncall_call_seconds": true,
		"dsec_pool_members": true, "dsec_pool_size": true,
		"dsec_store_errors_total": true,
	}
	r := New()
	e := r.Edge()
	e.Create("container", "container", nil, time.Millisecond)
	e.Exec("container", nil, time.Millisecond)
	e.Delete("container", "container", nil, time.Millisecond)
	r.Node(func() NodeView {
		return NodeView{Sandboxes: []SandboxGroup{{State: "running", Backend: "container", Isolation: "container", Count: 1}}, CPUs: 2}
	}, DefaultProjects)
	r.FnCall(func() (int, int, int) { return 0, 0, 0 })
	a := r.API(func() (int, int) { return 1, 1 })
	a.Request("/dsec.v1.SandboxService/Create", "ok", time.Millisecond)
	a.Placement("placed")
	r.Layers(func() (LayerTotals, bool) { return LayerTotals{}, true })
	r.StoreErrors().Of("postgres")
	r.BlobErrors().Of("s3")
	fams := scrape(t, r)
	for n, panel := range dashboardQueries(t) {
		if fams[n] == nil && !bornWithTheirLabels[n] {
			t.Errorf("panel %q queries %s, which a fresh node's /metrics does not serve", panel, n)
		}
	}
}

// TestDashboard: every dsec metric the shipped Grafana dashboard queries
// is served after a small workload touched each.
func TestDashboard(t *testing.T) {
	r := New()
	e := r.Edge()
	e.Create("container", "container", nil, time.Millisecond)
	e.Delete("container", "container", nil, time.Millisecond)
	e.Pause("pause", nil, time.Millisecond)
	e.Pool(true)
	e.Pool(false)
	e.Refused("max_sandboxes")
	e.Exec("container", nil, time.Millisecond)
	e.Network("connect", "allow")
	r.Node(func() NodeView {
		return NodeView{Sandboxes: []SandboxGroup{{State: "running", Backend: "container", Isolation: "container", Count: 1}},
			Pools: []PoolGroup{{Environment: "python", Size: 1, Ready: 1}}, CPUs: 2}
	}, DefaultProjects)
	r.FnCall(func() (int, int, int) { return 0, 0, 0 }).Call("python", "success", time.Millisecond)
	a := r.API(func() (int, int) { return 1, 1 })
	a.Request("/dsec.v1.SandboxService/Create", "ok", time.Millisecond)
	a.Placement("placed")
	r.Layers(func() (LayerTotals, bool) { return LayerTotals{BytesRead: 1}, true })
	r.StoreErrors().Of("sqlite")("Nodes")
	r.BlobErrors().Of("dir")("get")
	fams := scrape(t, r)
	for n, panel := range dashboardQueries(t) {
		if fams[n] == nil {
			t.Errorf("panel %q queries %s, which /metrics does not serve", panel, n)
		}
	}
}

// BenchmarkExecRecord is what recording one exec costs, against an exec's
// p50 through the edge (about 1.7 ms on this machine: docs/iam.md's
// exec-hop figures): docs/operations.md has the ratio.
func BenchmarkExecRecord(b *testing.B) {
	e := New().Edge()
	b.RunParallel(func(pb *testing.PB) {
		for pb.Next() {
			e.Exec("container", nil, time.Millisecond)
		}
	})
}

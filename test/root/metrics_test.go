package root

import (
	"context"
	"net/http"
	"testing"

	"connectrpc.com/connect"
	dto "github.com/prometheus/client_model/go"
	"github.com/prometheus/common/expfmt"
	"github.com/prometheus/common/model"

	dsecv1 "dsec.dev/dsec/api/gen/dsec/v1"
	"dsec.dev/dsec/internal/testutil"
)

// scrapeMetrics reads the daemon's /metrics on its API port, parsed with
// Prometheus' text parser.
func scrapeMetrics(t *testing.T, d *testutil.Daemon) map[string]*dto.MetricFamily {
	t.Helper()
	resp, err := http.Get("http://" + d.Addr + "/metrics")
	if err != nil {
		t.Fatalf("scrape: %v", err)
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		t.Fatalf("scrape: %s", resp.Status)
	}
	p := expfmt.NewTextParser(model.UTF8Validation)
	fams, err := p.TextToMetricFamilies(resp.Body)
	if err != nil {
		t.Fatalf("parse /metrics: %v", err)
	}
	return fams
}

// metricValue is the counter (or histogram count) of family name whose
// labels are exactly labels; 0 when there is none.
func metricValue(fams map[string]*dto.MetricFamily, name string, labels map[string]string) float64 {
next:
	for _, m := range fams[name].GetMetric() {
		if len(m.GetLabel()) != len(labels) {
			continue
		}
		for _, l := range m.GetLabel() {
			if labels[l.GetName()] != l.GetValue() {
				continue next
			}
		}
		if m.Histogram != nil {
			return float64(m.GetHistogram().GetSampleCount())
		}
		return m.GetCounter().GetValue()
	}
	return 0
}

// TestMetrics: a real dsecd's /metrics counts what a small workload did:
// creates (one from a warm pool), a refused create, a pause and a resume,
// a delete.
func TestMetrics(t *testing.T) {
	allInOneOnly(t)
	d := startDaemon(t, "--max-sandboxes", "3")
	ctx := context.Background()
	before := scrapeMetrics(t, d)

	shape := &dsecv1.SandboxSpec{Environment: env, Cpus: 0.5, MemoryMb: 96, DiskMb: 64}
	if _, err := d.Clients.Sandboxes.SetWarmPool(ctx, connect.NewRequest(&dsecv1.SetWarmPoolRequest{Spec: shape, Size: 1})); err != nil {
		t.Fatal(err)
	}
	waitWarm(t, d, 1)
	a := create(t, d, nil)
	b := create(t, d, &dsecv1.SandboxSpec{Environment: env, Cpus: 0.5, MemoryMb: 96, DiskMb: 64})
	if !b.GetFromWarmPool() {
		t.Fatalf("create of the pool's shape did not take a member")
	}
	if _, err := d.Clients.Sandboxes.SetWarmPool(ctx, connect.NewRequest(&dsecv1.SetWarmPoolRequest{Spec: shape, Size: 0})); err != nil {
		t.Fatal(err)
	}
	waitWarm(t, d, 0)
	create(t, d, nil)
	_, err := d.Clients.Sandboxes.Create(ctx, connect.NewRequest(&dsecv1.CreateRequest{Spec: &dsecv1.SandboxSpec{Environment: env}}))
	if connect.CodeOf(err) != connect.CodeResourceExhausted {
		t.Fatalf("fourth create on a node of 3: %v, want resource exhausted", err)
	}
	mustSh(t, d, a.GetId(), "true")
	pause(t, d, a.GetId(), false)
	resume(t, d, a.GetId())
	if _, err := d.Clients.Sandboxes.Delete(ctx, connect.NewRequest(&dsecv1.DeleteRequest{Id: b.GetId()})); err != nil {
		t.Fatal(err)
	}

	after := scrapeMetrics(t, d)
	kind := func(outcome string) map[string]string {
		return map[string]string{"backend": "container", "isolation": "container", "outcome": outcome}
	}
	for _, c := range []struct {
		name   string
		labels map[string]string
		want   float64
	}{
		{"dsec_sandbox_creates_total", kind("ok"), 3},
		{"dsec_sandbox_create_seconds", kind("ok"), 3},
		{"dsec_sandbox_creates_total", kind("admission_refused"), 1},
		{"dsec_admission_refusals_total", map[string]string{"reason": "max_sandboxes"}, 1},
		{"dsec_pool_hits_total", map[string]string{}, 1},
		{"dsec_pool_misses_total", map[string]string{}, 3},
		{"dsec_sandbox_pauses_total", map[string]string{"op": "pause", "outcome": "ok"}, 1},
		{"dsec_sandbox_pauses_total", map[string]string{"op": "resume", "outcome": "ok"}, 1},
		{"dsec_sandbox_pause_seconds", map[string]string{"op": "pause"}, 1},
		{"dsec_sandbox_deletes_total", kind("ok"), 1},
		{"dsec_sandbox_delete_seconds", kind("ok"), 1},
		{"dsec_exec_seconds", map[string]string{"outcome": "ok"}, 1},
	} {
		if got := metricValue(after, c.name, c.labels) - metricValue(before, c.name, c.labels); got != c.want {
			t.Errorf("%s%v moved by %v, want %v", c.name, c.labels, got, c.want)
		}
	}
}

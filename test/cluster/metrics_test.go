package cluster

import (
	"context"
	"net"
	"net/http"
	"testing"
	"time"

	"connectrpc.com/connect"
	dto "github.com/prometheus/client_model/go"

	dsecv1 "dsec.dev/dsec/api/gen/dsec/v1"
	"dsec.dev/dsec/internal/testutil"
)

// scrape reads and parses the /metrics served at addr (host:port).
func scrape(t *testing.T, addr string) map[string]*dto.MetricFamily {
	t.Helper()
	resp, err := http.Get("http://" + addr + "/metrics")
	if err != nil {
		t.Fatalf("scrape %s: %v", addr, err)
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		t.Fatalf("scrape %s: %s", addr, resp.Status)
	}
	return testutil.ParseMetrics(t, resp.Body)
}

// TestClusterMetrics: after a create of two sandboxes, an exec (which a
// hollow edge refuses: it runs nothing), a pause, a resume and a delete
// through an apiserver, the series docs/operations.md lists moved by as
// much on the apiserver's /metrics (its API port) and on the edge's
// (--metrics-listen).
func TestClusterMetrics(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	edgeMetrics := ln.Addr().String()
	ln.Close()
	c := testutil.StartCluster(t, testutil.ClusterOptions{APIServers: 1, Edges: 1,
		EdgeArgs: append(append([]string{}, hollow...), "--metrics-listen", edgeMetrics)})
	api := c.APIServers[0].Addr
	apiBefore, edgeBefore := scrape(t, api), scrape(t, edgeMetrics)

	ctx, cancel := context.WithTimeout(t.Context(), time.Minute)
	defer cancel()
	sbs, err := c.Create(0, &dsecv1.SandboxSpec{Environment: "base:1"}, 2)
	if err != nil {
		t.Fatal(err)
	}
	cl := c.Client(0)
	id := sbs[0].GetId()
	stream, err := cl.Sandboxes.Exec(ctx, connect.NewRequest(&dsecv1.ExecRequest{SandboxId: id, Command: "true"}))
	if err != nil {
		t.Fatal(err)
	}
	for stream.Receive() {
	}
	if connect.CodeOf(stream.Err()) != connect.CodeUnimplemented {
		t.Fatalf("exec in a hollow sandbox: %v, want unimplemented (it runs nothing)", stream.Err())
	}
	stream.Close()
	if _, err := cl.Sandboxes.Pause(ctx, connect.NewRequest(&dsecv1.PauseRequest{SandboxId: id})); err != nil {
		t.Fatal(err)
	}
	if _, err := cl.Sandboxes.Resume(ctx, connect.NewRequest(&dsecv1.ResumeRequest{SandboxId: id})); err != nil {
		t.Fatal(err)
	}
	if _, err := cl.Sandboxes.Delete(ctx, connect.NewRequest(&dsecv1.DeleteRequest{Id: id})); err != nil {
		t.Fatal(err)
	}

	apiAfter, edgeAfter := scrape(t, api), scrape(t, edgeMetrics)
	kind := map[string]string{"backend": "container", "isolation": "container", "outcome": "ok"}
	for _, m := range []struct {
		where         string
		before, after map[string]*dto.MetricFamily
		name          string
		labels        map[string]string
		want          float64
	}{
		{"apiserver", apiBefore, apiAfter, "dsec_api_request_seconds", map[string]string{"procedure": "/dsec.v1.SandboxService/Create", "code": "ok"}, 1},
		{"apiserver", apiBefore, apiAfter, "dsec_api_request_seconds", map[string]string{"procedure": "/dsec.v1.SandboxService/Exec", "code": "unimplemented"}, 1},
		{"apiserver", apiBefore, apiAfter, "dsec_api_request_seconds", map[string]string{"procedure": "/dsec.v1.SandboxService/Delete", "code": "ok"}, 1},
		{"apiserver", apiBefore, apiAfter, "dsec_placement_decisions_total", map[string]string{"outcome": "placed"}, 1},
		{"edge", edgeBefore, edgeAfter, "dsec_sandbox_creates_total", kind, 2},
		{"edge", edgeBefore, edgeAfter, "dsec_sandbox_create_seconds", kind, 2},
		{"edge", edgeBefore, edgeAfter, "dsec_exec_seconds", map[string]string{"isolation": "container", "outcome": "error"}, 1},
		{"edge", edgeBefore, edgeAfter, "dsec_sandbox_pauses_total", map[string]string{"op": "pause", "outcome": "ok"}, 1},
		{"edge", edgeBefore, edgeAfter, "dsec_sandbox_pauses_total", map[string]string{"op": "resume", "outcome": "ok"}, 1},
		{"edge", edgeBefore, edgeAfter, "dsec_sandbox_deletes_total", kind, 1},
		{"edge", edgeBefore, edgeAfter, "dsec_sandbox_delete_seconds", kind, 1},
	} {
		if got := testutil.MetricValue(m.after, m.name, m.labels) - testutil.MetricValue(m.before, m.name, m.labels); got != m.want {
			t.Errorf("the %s's %s%v moved by %v, want %v", m.where, m.name, m.labels, got, m.want)
		}
	}
	if got := testutil.MetricValue(apiAfter, "dsec_placement_nodes", map[string]string{"state": "healthy"}); got != 1 {
		t.Errorf("the apiserver's healthy nodes = %v, want 1", got)
	}
}

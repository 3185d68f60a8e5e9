package root

import (
	"context"
	"fmt"
	"net/http"
	"testing"
	"time"

	"connectrpc.com/connect"
	dto "github.com/prometheus/client_model/go"
	"google.golang.org/protobuf/encoding/protojson"

	dsecv1 "dsec.dev/dsec/api/gen/dsec/v1"
	"dsec.dev/dsec/internal/iam"
	"dsec.dev/dsec/internal/testutil"
	dsec "dsec.dev/dsec/sdk/go"
)

// scrapeMetrics reads the node's /metrics (the all-in-one's API port, a
// cluster's edge's --metrics-listen), parsed with Prometheus' text parser.
func scrapeMetrics(t *testing.T, d *testutil.Daemon) map[string]*dto.MetricFamily {
	t.Helper()
	return scrapeAt(t, d.MetricsAddr)
}

// scrapeAt reads and parses the /metrics served at addr (host:port): a
// node's, or an apiserver's API port (the all-in-one's serves both).
func scrapeAt(t *testing.T, addr string) map[string]*dto.MetricFamily {
	t.Helper()
	resp, err := http.Get("http://" + addr + "/metrics")
	if err != nil {
		t.Fatalf("scrape: %v", err)
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		t.Fatalf("scrape: %s", resp.Status)
	}
	fams := testutil.ParseMetrics(t, resp.Body)
	return fams
}

// TestMetrics: a real node's /metrics counts what a small workload did:
// creates (one from a warm pool), a refused create (all-in-one: a
// cluster's apiserver may refuse it before the edge sees it), a pause and
// a resume, an exec, a delete; and its gauges show the sandboxes by state
// and project, the warm pool, and the node's capacity and requests. Then
// a sandbox's own samples show its CPU and memory (checkSandboxHistory).
func TestMetrics(t *testing.T) {
	d := startDaemon(t, "--max-sandboxes", "3", "--ledger-interval", "500ms")
	ctx := context.Background()
	before := scrapeMetrics(t, d)
	apiBefore := scrapeAt(t, d.Addr)

	shape := &dsecv1.SandboxSpec{Environment: env, Cpus: 0.5, MemoryMb: 96, DiskMb: 64}
	if _, err := d.Clients.Sandboxes.SetWarmPool(ctx, connect.NewRequest(&dsecv1.SetWarmPoolRequest{Spec: shape, Size: 1})); err != nil {
		t.Fatal(err)
	}
	waitWarm(t, d, 1)
	pooled := scrapeMetrics(t, d)
	for _, c := range []struct {
		name   string
		labels map[string]string
		want   float64
	}{
		{"dsec_pool_size", map[string]string{"environment": env}, 1},
		{"dsec_pool_members", map[string]string{"environment": env, "state": "ready"}, 1},
		{"dsec_pool_members", map[string]string{"environment": env, "state": "starting"}, 0},
	} {
		if got := testutil.MetricValue(pooled, c.name, c.labels); got != c.want {
			t.Errorf("with a pool of 1 ready: %s%v = %v, want %v", c.name, c.labels, got, c.want)
		}
	}
	a := create(t, d, nil)
	b := create(t, d, &dsecv1.SandboxSpec{Environment: env, Cpus: 0.5, MemoryMb: 96, DiskMb: 64})
	if !b.GetFromWarmPool() {
		t.Fatalf("create of the pool's shape did not take a member")
	}
	if _, err := d.Clients.Sandboxes.SetWarmPool(ctx, connect.NewRequest(&dsecv1.SetWarmPoolRequest{Spec: shape, Size: 0})); err != nil {
		t.Fatal(err)
	}
	waitWarm(t, d, 0)
	c := create(t, d, nil)
	if !testutil.ClusterMode() {
		_, err := d.Clients.Sandboxes.Create(ctx, connect.NewRequest(&dsecv1.CreateRequest{Spec: &dsecv1.SandboxSpec{Environment: env}}))
		if connect.CodeOf(err) != connect.CodeResourceExhausted {
			t.Fatalf("fourth create on a node of 3: %v, want resource exhausted", err)
		}
	}
	mustSh(t, d, a.GetId(), "true")
	pause(t, d, a.GetId(), false)
	resume(t, d, a.GetId())
	if _, err := d.Clients.Sandboxes.Delete(ctx, connect.NewRequest(&dsecv1.DeleteRequest{Id: b.GetId()})); err != nil {
		t.Fatal(err)
	}

	after := scrapeMetrics(t, d)
	apiAfter := scrapeAt(t, d.Addr)
	kind := func(outcome string) map[string]string {
		return map[string]string{"backend": "container", "isolation": "container", "outcome": outcome}
	}
	refused := 1.0
	if testutil.ClusterMode() {
		refused = 0
	}
	for _, c := range []struct {
		name   string
		labels map[string]string
		want   float64
	}{
		{"dsec_sandbox_creates_total", kind("ok"), 3},
		{"dsec_sandbox_create_seconds", kind("ok"), 3},
		{"dsec_sandbox_creates_total", kind("admission_refused"), refused},
		{"dsec_admission_refusals_total", map[string]string{"reason": "max_sandboxes"}, refused},
		{"dsec_pool_hits_total", map[string]string{}, 1},
		{"dsec_pool_misses_total", map[string]string{}, 2 + refused},
		{"dsec_sandbox_pauses_total", map[string]string{"op": "pause", "outcome": "ok"}, 1},
		{"dsec_sandbox_pauses_total", map[string]string{"op": "resume", "outcome": "ok"}, 1},
		{"dsec_sandbox_pause_seconds", map[string]string{"op": "pause"}, 1},
		{"dsec_sandbox_deletes_total", kind("ok"), 1},
		{"dsec_sandbox_delete_seconds", kind("ok"), 1},
		{"dsec_exec_seconds", map[string]string{"isolation": "container", "outcome": "ok"}, 1},
	} {
		if got := testutil.MetricValue(after, c.name, c.labels) - testutil.MetricValue(before, c.name, c.labels); got != c.want {
			t.Errorf("%s%v moved by %v, want %v", c.name, c.labels, got, c.want)
		}
	}

	// The gauges: a and c running, b's tombstone stopped, all of a's
	// project; the node's capacity and what a and c asked of it.
	project := a.GetSpec().GetLabels()[iam.ProjectLabel]
	if project == "" {
		project = "/"
	}
	state := func(s string) map[string]string {
		return map[string]string{"state": s, "backend": "container", "isolation": "container", "project": project}
	}
	for _, g := range []struct {
		name   string
		labels map[string]string
		want   float64
	}{
		{"dsec_sandboxes", state("running"), 2},
		{"dsec_sandboxes", state("stopped"), 1},
		{"dsec_node_max_sandboxes", map[string]string{}, 3},
		{"dsec_node_cpus", map[string]string{"kind": "requested"}, float64(a.GetSpec().GetCpus() + c.GetSpec().GetCpus())},
		{"dsec_node_memory_bytes", map[string]string{"kind": "requested"}, float64((a.GetSpec().GetMemoryMb() + c.GetSpec().GetMemoryMb()) << 20)},
		{"dsec_node_refusing", map[string]string{}, 0},
	} {
		if got := testutil.MetricValue(after, g.name, g.labels); got != g.want {
			t.Errorf("%s%v = %v, want %v", g.name, g.labels, got, g.want)
		}
	}
	// The apiserver's requests and placements (the all-in-one's API port
	// serves them with the node's; a cluster's apiserver its own): three
	// creates placed and answered, the fourth placed and refused by the
	// node (all-in-one) or refused by placement (a cluster's apiserver).
	moved := func(name string, labels map[string]string) float64 {
		return testutil.MetricValue(apiAfter, name, labels) - testutil.MetricValue(apiBefore, name, labels)
	}
	if got := moved("dsec_api_request_seconds", map[string]string{"procedure": "/dsec.v1.SandboxService/Create", "code": "ok"}); got != 3 {
		t.Errorf("the apiserver's Create ok moved by %v, want 3", got)
	}
	if got := moved("dsec_api_request_seconds", map[string]string{"procedure": "/dsec.v1.SandboxService/Create", "code": "resource_exhausted"}); got != refused {
		t.Errorf("the apiserver's Create resource_exhausted moved by %v, want %v", got, refused)
	}
	if got := moved("dsec_placement_decisions_total", map[string]string{"outcome": "placed"}); got < 3 {
		t.Errorf("placements moved by %v, want at least 3", got)
	}
	if got := testutil.MetricValue(apiAfter, "dsec_placement_nodes", map[string]string{"state": "healthy"}); got != 1 {
		t.Errorf("healthy nodes = %v, want 1", got)
	}
	// The node's CPU used, and the lazy loader's reads of the sandboxes'
	// layers (a fresh node's: every layer byte its sandboxes read came
	// through it).
	if testutil.MetricValue(after, "dsec_node_cpu_used_seconds_total", map[string]string{}) <= testutil.MetricValue(before, "dsec_node_cpu_used_seconds_total", map[string]string{}) {
		t.Errorf("the node's CPU used did not move: %v", after["dsec_node_cpu_used_seconds_total"])
	}
	if testutil.MetricValue(after, "dsec_layer_read_bytes_total", map[string]string{}) <= 0 ||
		testutil.MetricValue(after, "dsec_layer_cache_bytes", map[string]string{"tier": "memory"})+testutil.MetricValue(after, "dsec_layer_cache_bytes", map[string]string{"tier": "disk"}) <= 0 {
		t.Errorf("the lazy loader's reads and cache are missing: %v %v", after["dsec_layer_read_bytes_total"], after["dsec_layer_cache_bytes"])
	}
	if testutil.MetricValue(after, "dsec_node_cpus", map[string]string{"kind": "capacity"}) < 1 ||
		testutil.MetricValue(after, "dsec_node_memory_bytes", map[string]string{"kind": "capacity"}) <= 0 {
		t.Errorf("the node's capacity is missing: %v %v", after["dsec_node_cpus"], after["dsec_node_memory_bytes"])
	}
	checkSandboxHistory(t, d, c.GetId())
}

// checkSandboxHistory has sandbox id hold 48 MB in a shell variable while
// the shell counts to a million (its own CPU time, which it then reports
// from /proc), and reads the samples its node kept (every 500 ms:
// TestMetrics' --ledger-interval) through the Go SDK and dsec metrics
// --json: the samples from the command's start to the first after its
// end show the memory held, and CPU time that grew by at least the loop's,
// at a peak rate of at least half the loop's average.
func checkSandboxHistory(t *testing.T, d *testutil.Daemon, id string) {
	ctx, cancel := context.WithTimeout(t.Context(), 2*time.Minute)
	defer cancel()
	c := sdkClient(t, d.Addr, d.Token())
	// samplesUntil reads the samples kept until one is taken after t.
	samplesUntil := func(t0 time.Time) []dsec.MetricsSample {
		for {
			samples, err := c.MetricsSince(ctx, id, time.UnixMilli(1))
			if err != nil {
				t.Fatalf("MetricsSince: %v", err)
			}
			if len(samples) > 0 && samples[len(samples)-1].At.After(t0) {
				return samples
			}
			select {
			case <-ctx.Done():
				t.Fatalf("no sample of %s after %v: %+v", id, t0, samples)
			case <-time.After(100 * time.Millisecond):
			}
		}
	}
	samplesUntil(time.Time{}) // one before the command, as a base
	const held = 48_000_000
	start := time.Now()
	out := mustSh(t, d, id, fmt.Sprintf(`busybox sh -c 'x=$(busybox yes | busybox head -c %d); i=0; while [ $i -lt 1000000 ]; do i=$((i+1)); done; echo ${#x} $(busybox cut -d" " -f14,15 /proc/$$/stat)'`, held))
	end := time.Now()
	var n, ut, st int64
	if _, err := fmt.Sscan(out, &n, &ut, &st); err != nil || n < held/2 {
		t.Fatalf("the command printed %q (%v): want the variable's length and the shell's CPU ticks", out, err)
	}
	loop := time.Duration(ut+st) * 10 * time.Millisecond
	// The samples from the last before the command to the first after.
	samples := samplesUntil(end)
	for i := len(samples) - 1; i > 0; i-- {
		if samples[i].At.Before(start) {
			samples = samples[i:]
			break
		}
	}
	first, last := samples[0], samples[len(samples)-1]
	if !first.At.Before(start) {
		t.Fatalf("no sample of %s kept from before its command: %+v", id, samples)
	}
	var peakCores float64
	var peakMem int64
	for _, s := range samples[1:] {
		peakCores = max(peakCores, s.CPUCores)
		peakMem = max(peakMem, s.MemoryBytes)
	}
	t.Logf("%s: the loop used %v of CPU in %v; %d samples from %v to %v, peak %.2f cores, %d bytes of memory",
		id, loop, end.Sub(start), len(samples), first.At.Sub(start), last.At.Sub(start), peakCores, peakMem)
	if loop < 100*time.Millisecond {
		t.Fatalf("the loop used %v of CPU: too little to check the samples against", loop)
	}
	if grew := last.CPUTime - first.CPUTime; grew < loop-20*time.Millisecond {
		t.Errorf("the samples' CPU time grew by %v, the loop used %v", grew, loop)
	}
	if avg := loop.Seconds() / last.At.Sub(first.At).Seconds(); peakCores < avg/2 {
		t.Errorf("peak %.2f cores, want at least half the loop's average over the samples, %.2f", peakCores, avg)
	}
	if peakMem < held || last.MemoryLimitBytes < peakMem {
		t.Errorf("peak memory %d bytes of %d, want at least the %d held", peakMem, last.MemoryLimitBytes, held)
	}
	// dsec metrics --json: the reading now and the same samples.
	stdout, stderr, code := d.CLI("", "--json", "metrics", id, "--since", first.At.Add(-time.Second).Format(time.RFC3339))
	var m dsecv1.SandboxMetrics
	if code != 0 {
		t.Fatalf("dsec metrics --json: %s %s", stdout, stderr)
	}
	if err := protojson.Unmarshal([]byte(stdout), &m); err != nil {
		t.Fatalf("dsec metrics --json printed %q: %v", stdout, err)
	}
	if len(m.GetSamples()) < len(samples) || m.GetTimeUnixMs() < last.At.UnixMilli() {
		t.Errorf("dsec metrics --json: %d samples, the reading at %d; want at least the SDK's %d, and a reading after them", len(m.GetSamples()), m.GetTimeUnixMs(), len(samples))
	}
}

package root

import (
	"context"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"dsec.dev/dsec/internal/bench"
	"dsec.dev/dsec/internal/testutil"
)

// TestBench runs a small `dsec bench` end to end, runc column included,
// and checks that every figure was measured and nothing is left behind.
// The runc column (bare runc on the host, and runc exec into the node's
// containers) is the all-in-one pass's only: nothing of it goes through
// the apiserver, so the cluster pass would measure it again unchanged.
func TestBench(t *testing.T) {
	d := startDaemon(t)
	baseline := !testutil.ClusterMode()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	rep, err := bench.Run(ctx, d.Clients, bench.Options{Env: env, Seq: 2, Burst: 3, Execs: 60, Idle: 2, IdleWindow: time.Second, RateProbe: 1,
		// No memory figure is checked: a wait of a second at most for the
		// host's memory to settle, not 30 (five of them, on a machine
		// whose memory other tests keep moving).
		Warm: 1, Baseline: baseline, Settle: time.Second})
	if err != nil {
		t.Fatal(err)
	}
	if len(rep.Notes) > 0 {
		t.Fatalf("notes: %v", rep.Notes)
	}
	ds, rc := rep.Dsec, rep.Baseline
	if baseline && rc == nil {
		t.Fatal("no runc column")
	}
	if ds.CreateToExec.N != 2 || ds.WarmCreateToExec.N != 2 || ds.BurstCreateExec.N != 3 || ds.BurstErrors != 0 ||
		ds.WarmExec.N != 60 || ds.IdleAnswering != 2 {
		t.Errorf("dsec column incomplete: %+v", ds)
	}
	// The idle sandboxes' agents were found and measured, and the create
	// rate taken on the empty node and with them live.
	if cpu := ds.IdleCPU; cpu == nil || cpu.Sandboxes != 2 || cpu.WindowS <= 0 || cpu.TargetPct <= 0 {
		t.Errorf("idle CPU not measured: %+v", cpu)
	}
	if r := ds.CreateRate; r == nil || r.N != 1 || r.Live != 2 || r.EmptyPerS <= 0 || r.FullPerS <= 0 || r.Ratio <= 0 {
		t.Errorf("create rate not measured: %+v", r)
	}
	latencies := map[string]bench.Latency{"dsec exec": ds.WarmExec, "dsec create": ds.CreateToExec}
	if rc != nil {
		if rc.CreateToExec.N != 2 || rc.BurstCreateExec.N != 3 || rc.BurstErrors != 0 || rc.WarmExec.N != 60 || rc.IdleCount != 2 {
			t.Errorf("runc column incomplete: %+v", rc)
		}
		latencies["runc exec"] = rc.WarmExec
	}
	for name, l := range latencies {
		if l.P50 <= 0 || l.P99 < l.P50 || l.Max < l.P99 {
			t.Errorf("%s latency not a distribution: %+v", name, l)
		}
	}
	// The baseline's containers and their cgroups are gone.
	for _, ctrl := range []string{"freezer", "memory", "pids", "cpu"} {
		left, _ := filepath.Glob(filepath.Join("/sys/fs/cgroup", ctrl, "bench-*"))
		if len(left) > 0 {
			t.Errorf("runc baseline left cgroups: %v", left)
		}
	}
	tmp, _ := os.ReadDir(os.TempDir())
	for _, e := range tmp {
		if strings.HasPrefix(e.Name(), "dsec-bench-runc-") {
			t.Errorf("runc baseline left %s", filepath.Join(os.TempDir(), e.Name()))
		}
	}
}

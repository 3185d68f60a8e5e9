package root

import (
	"context"
	"os"
	"path/filepath"
	"slices"
	"testing"
	"time"

	"connectrpc.com/connect"

	dsecv1 "dsec.dev/dsec/api/gen/dsec/v1"
	"dsec.dev/dsec/internal/bench"
	"dsec.dev/dsec/internal/testutil"
)

// TestBenchVM runs `dsec bench vm` at its smallest end to end (one round of
// each part but the heavy ones: the shared layer and the idle set) on a
// node offering microvm and gvisor, and checks that every figure was
// measured, every target line has a verdict, the cold and warm lines a
// floor (one floor VM booted), and nothing is left behind.
func TestBenchVM(t *testing.T) {
	allInOneOnly(t)
	d := startDaemon(t, "--vm-kernel-dir", testutil.VMKernelDir(t), "--runsc", testutil.Runsc(t))
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	rep, err := bench.RunVM(ctx, d.Clients, bench.VMOptions{Env: env, Parts: []string{"cold", "warm", "pause", "gvisor"},
		Rounds: 1, Execs: 5, WarmPool: 1, Pauses: 1, MemoryMiB: 256, Parallel: 2, KernelDir: testutil.VMKernelDir(t)})
	if err != nil {
		t.Fatal(err)
	}
	if !slices.Contains([]string{"tcg", "kvm"}, rep.Accelerator) || rep.GVisorPlatform == "" || rep.Cores <= 0 || rep.HostMemGiB <= 0 {
		t.Errorf("header: accelerator %q, gvisor %q, %d cores, %.1f GiB", rep.Accelerator, rep.GVisorPlatform, rep.Cores, rep.HostMemGiB)
	}
	for name, l := range map[string]bench.VMLatency{"microvm cold": rep.MicroVMCold, "warm": rep.Warm, "gvisor cold": rep.GVisorCold,
		"floor": rep.Floor, "floor uptime": rep.FloorUptime} {
		if l.N != 1 || l.P50 <= 0 {
			t.Errorf("%s not measured: %+v", name, l)
		}
	}
	if rep.RuncCold.N != 2 || rep.RuncExec.N != 10 || rep.MicroVMExec.N != 5 || rep.GVisorExec.N != 5 {
		t.Errorf("runc %+v / %+v, microvm exec %+v, gvisor exec %+v", rep.RuncCold, rep.RuncExec, rep.MicroVMExec, rep.GVisorExec)
	}
	if rep.WarmHits != 1 {
		t.Errorf("the warm create did not come from the pool")
	}
	if p := rep.Pause; p == nil || p.ResumeExec.N != 1 || p.ResidentMiB <= 0 || p.RestoreFaster <= 0 {
		t.Errorf("pause not measured: %+v", p)
	}
	if len(rep.Checks) != 5 {
		t.Errorf("%d target lines, want 5 (cold, warm, restore, released, resume): %+v", len(rep.Checks), rep.Checks)
	}
	for i, c := range rep.Checks {
		if !slices.Contains([]string{"PASS", "MISS", "FLOOR"}, c.Verdict) {
			t.Errorf("%s: verdict %q", c.Name, c.Verdict)
		}
		if (i < 2) != (c.Floor != "") { // cold and warm have floors, the pause part's lines none
			t.Errorf("%s: floor %q", c.Name, c.Floor)
		}
	}
	if left, _ := filepath.Glob(filepath.Join(os.TempDir(), "dsec-bench-floor-*")); len(left) > 0 {
		t.Errorf("floor VMs' directories left: %v", left)
	}
	for _, pattern := range []string{"/sys/fs/cgroup/dsec-bench-floor", "/sys/fs/cgroup/*/dsec-bench-floor"} { // v2's, v1's
		if left, _ := filepath.Glob(pattern); len(left) > 0 {
			t.Errorf("floor VMs' cgroups left: %v", left)
		}
	}
	left, err := d.Clients.Sandboxes.List(ctx, connect.NewRequest(&dsecv1.ListRequest{}))
	if err != nil {
		t.Fatal(err)
	}
	if n := len(left.Msg.GetSandboxes()); n > 0 {
		t.Errorf("%d sandboxes left: %v", n, left.Msg.GetSandboxes())
	}
	pools, err := d.Clients.Sandboxes.ListWarmPools(ctx, connect.NewRequest(&dsecv1.ListWarmPoolsRequest{}))
	if err != nil {
		t.Fatal(err)
	}
	if n := len(pools.Msg.GetPools()); n > 0 {
		t.Errorf("warm pools left: %v", pools.Msg.GetPools())
	}
}

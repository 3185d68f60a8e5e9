package root

import (
	"context"
	"os"
	"strings"
	"testing"
	"time"

	"connectrpc.com/connect"

	dsecv1 "dsec.dev/dsec/api/gen/dsec/v1"
	"dsec.dev/dsec/internal/testutil"
)

// otherIsolations are the isolations besides runc's containers that the
// end-to-end surfaces run on (TestOtherIsolations).
var otherIsolations = []struct {
	name string
	iso  dsecv1.Isolation
}{
	{"gvisor", dsecv1.Isolation_ISOLATION_GVISOR},
	{"microvm", dsecv1.Isolation_ISOLATION_MICROVM},
}

// TestOtherIsolations runs every API surface once in gVisor sandboxes and
// microVMs, on one dsecd offering both beside containers: the checks the
// container suites run (checkExec, checkTimeoutKillsTree,
// checkFilesSessionsAndBackground, checkPTYShell), signals, metrics,
// network rules, OOM, a warm pool, idle and TTL. Each isolation boots two
// sandboxes (a warm pool's member, taken and reaped as idle, then one
// sandbox every other surface shares), one after the other, so at most
// two microVMs run at once (a pool's refill beside its taken member).
func TestOtherIsolations(t *testing.T) {
	allInOneOnly(t)
	runsc := testutil.Runsc(t)
	kernelDir := testutil.VMKernelDir(t)
	e := setupNetwork(t, "--runsc", runsc, "--vm-kernel-dir", kernelDir)
	for _, iso := range otherIsolations {
		t.Run(iso.name, func(t *testing.T) {
			start := time.Now()
			pooledAndIdle(t, e.d, iso.iso)
			surfaces(t, e, iso.iso)
			t.Logf("%s: every surface in %s", iso.name, time.Since(start).Round(time.Millisecond))
		})
	}
}

// waitPool waits for the node's one warm pool to hold ready sandboxes
// with none starting.
func waitPool(t *testing.T, d *testutil.Daemon, ready int32) {
	t.Helper()
	deadline := time.Now().Add(90 * time.Second)
	for {
		resp, err := d.Clients.Sandboxes.ListWarmPools(context.Background(), connect.NewRequest(&dsecv1.ListWarmPoolsRequest{}))
		if err != nil {
			t.Fatal(err)
		}
		ps := resp.Msg.GetPools()
		if len(ps) == 1 && ps[0].GetReady() == ready && ps[0].GetStarting() == 0 {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("warm pools %v; want one with %d ready", ps, ready)
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// waitEnded waits for sandbox id to reach state for reason.
func waitEnded(t *testing.T, d *testutil.Daemon, id string, state dsecv1.State, reason dsecv1.Reason, within time.Duration) *dsecv1.Sandbox {
	t.Helper()
	deadline := time.Now().Add(within)
	for {
		got, err := d.Clients.Sandboxes.Get(context.Background(), connect.NewRequest(&dsecv1.GetRequest{Id: id}))
		if err == nil && got.Msg.GetState() == state {
			if got.Msg.GetReason() != reason {
				t.Fatalf("%s %s for %s (%s), want %s", id, state, got.Msg.GetReason(), got.Msg.GetMessage(), reason)
			}
			return got.Msg
		}
		if time.Now().After(deadline) {
			t.Fatalf("%s did not reach %s for %s within %s: %v %v", id, state, reason, within, got.Msg, err)
		}
		time.Sleep(200 * time.Millisecond)
	}
}

// pooledAndIdle: a warm pool of isolation iso keeps a sandbox ready, a
// create of its shape takes it, and the taken sandbox, once no command
// runs in it any more (a background sleep keeps it busy until then), is
// stopped as idle.
func pooledAndIdle(t *testing.T, d *testutil.Daemon, iso dsecv1.Isolation) {
	ctx := context.Background()
	shape := &dsecv1.SandboxSpec{Environment: env, Isolation: iso, MemoryMb: 192, DiskMb: 64}
	setPool := func(size int32) {
		if _, err := d.Clients.Sandboxes.SetWarmPool(ctx, connect.NewRequest(&dsecv1.SetWarmPoolRequest{Spec: shape, Size: size})); err != nil {
			t.Fatal(err)
		}
	}
	setPool(1)
	t.Cleanup(func() { setPool(0) })
	waitPool(t, d, 1)
	sb := create(t, d, &dsecv1.SandboxSpec{Environment: env, Isolation: iso, MemoryMb: 192, DiskMb: 64, IdleTimeoutSeconds: 3})
	setPool(0)
	if !sb.GetFromWarmPool() || sb.GetSpec().GetIsolation() != iso {
		t.Fatalf("create of the pool's shape: from the pool %v, isolation %s", sb.GetFromWarmPool(), sb.GetSpec().GetIsolation())
	}
	if out := mustSh(t, d, sb.GetId(), "echo pooled"); out != "pooled\n" {
		t.Fatalf("the taken sandbox: %q", out)
	}
	// A command running counts as activity: not idle while it runs.
	background(t, d, sb.GetId(), "sleep 6")
	time.Sleep(5 * time.Second)
	got, err := d.Clients.Sandboxes.Get(ctx, connect.NewRequest(&dsecv1.GetRequest{Id: sb.GetId()}))
	if err != nil || got.Msg.GetState() != dsecv1.State_STATE_RUNNING {
		t.Fatalf("a sandbox with a command running was ended as idle: %v %v", got.Msg, err)
	}
	waitEnded(t, d, sb.GetId(), dsecv1.State_STATE_STOPPED, dsecv1.Reason_REASON_IDLE, 30*time.Second)
}

// surfaces runs every other surface in one sandbox of isolation iso.
func surfaces(t *testing.T, e *netEnv, iso dsecv1.Isolation) {
	d := e.d
	ctx := context.Background()
	sb := create(t, d, &dsecv1.SandboxSpec{Isolation: iso, MemoryMb: 256, DiskMb: 128,
		Env: map[string]string{"GREETING": "hi"}, NetworkRules: map[string]bool{"pypi": true}})
	id := sb.GetId()
	run := func(name string, f func(t *testing.T)) {
		t.Run(name, func(t *testing.T) {
			start := time.Now()
			f(t)
			t.Logf("%s", time.Since(start).Round(time.Millisecond))
		})
	}
	run("exec", func(t *testing.T) { checkExec(t, d, id) })
	run("timeout kills the tree", func(t *testing.T) { checkTimeoutKillsTree(t, d, id) })
	run("signal", func(t *testing.T) {
		st, err := d.Clients.Sandboxes.Exec(ctx, connect.NewRequest(&dsecv1.ExecRequest{SandboxId: id, Command: "exec sleep 100", Background: true, Tag: "sleeper"}))
		if err != nil {
			t.Fatal(err)
		}
		if !st.Receive() || st.Msg().GetStarted() == nil {
			t.Fatalf("background sleep did not start: %v", st.Err())
		}
		pid := st.Msg().GetStarted().GetProcessId()
		st.Close()
		if _, err := d.Clients.Sandboxes.Signal(ctx, connect.NewRequest(&dsecv1.SignalRequest{SandboxId: id, ProcessId: pid, Signal: 15})); err != nil {
			t.Fatal(err)
		}
		at, err := d.Clients.Sandboxes.Attach(ctx, connect.NewRequest(&dsecv1.AttachRequest{SandboxId: id, Tag: "sleeper"}))
		if err != nil {
			t.Fatal(err)
		}
		var exit *dsecv1.ExecExited
		for at.Receive() {
			if x := at.Msg().GetExited(); x != nil {
				exit = x
			}
		}
		if exit.GetSignal() != 15 || exit.GetStatus() == dsecv1.ExitStatus_EXIT_STATUS_OK {
			t.Fatalf("sleep signalled with SIGTERM ended %v (%v)", exit, at.Err())
		}
	})
	run("files, sessions, background", func(t *testing.T) { checkFilesSessionsAndBackground(t, d, id) })
	run("pty shell", func(t *testing.T) { checkPTYShell(t, d, id) })
	run("metrics", func(t *testing.T) {
		mustSh(t, d, id, "head -c 8m /dev/urandom > /blob && sync")
		m, err := d.Clients.Sandboxes.Metrics(ctx, connect.NewRequest(&dsecv1.MetricsRequest{SandboxId: id}))
		if err != nil {
			t.Fatal(err)
		}
		mm := m.Msg
		t.Logf("metrics: cpu %.1f%% of %.1f, %d us; memory %d of %d; disk %d of %d", mm.GetCpuUsedPct(), mm.GetCpuCount(),
			mm.GetCpuUsedUsec(), mm.GetMemoryUsedBytes(), mm.GetMemoryLimitBytes(), mm.GetDiskUsedBytes(), mm.GetDiskLimitBytes())
		if mm.GetCpuUsedUsec() <= 0 || mm.GetMemoryUsedBytes() <= 0 || mm.GetMemoryLimitBytes() != 256<<20 {
			t.Errorf("metrics %v: want CPU time used, memory used, and the 256 MiB limit", mm)
		}
		if mm.GetDiskUsedBytes() < 8<<20 || mm.GetDiskLimitBytes() < 100<<20 || mm.GetDiskLimitBytes() > 140<<20 {
			t.Errorf("metrics %v: want the 8 MiB written counted against the 128 MiB disk", mm)
		}
	})
	run("network rules", func(t *testing.T) {
		probe, err := os.ReadFile(e.probe)
		if err != nil {
			t.Fatal(err)
		}
		if _, err := d.Clients.Sandboxes.WriteFile(ctx, connect.NewRequest(&dsecv1.WriteFileRequest{
			SandboxId: id, Path: "/usr/local/bin/netprobe", Data: probe, Mode: 0o755, MakeParents: true})); err != nil {
			t.Fatal(err)
		}
		e.probeFails(t, id, "get http://"+e.other.addr+"/")
		if out := e.probeOK(t, id, "get http://pypi.test/"); !strings.Contains(out, "hello from pypi.test") {
			t.Errorf("an allowed host over HTTP: %q", out)
		}
		e.probeFails(t, id, "resolve other.test")
	})
	run("oom", func(t *testing.T) {
		if iso == dsecv1.Isolation_ISOLATION_GVISOR {
			t.Skip("gVisor: a hog past the memory limit ends the exec's agent channel (unexpected EOF) rather than an OOM exit (docs/gvisor.md)")
		}
		// A string doubled until it outgrows the memory: a hog that grows
		// a little at a time (head -c 600m /dev/zero | tail) thrashed a
		// TCG guest's page cache until its 60 s timeout.
		r := execReq(t, d, &dsecv1.ExecRequest{SandboxId: id, Command: `awk 'BEGIN { s = "x"; while (1) s = s s }'`, TimeoutSeconds: 60})
		if r.exit.GetStatus() != dsecv1.ExitStatus_EXIT_STATUS_OOM {
			t.Errorf("a string doubled past 256 MiB: %s, want OOM", r)
		}
		mustSh(t, d, id, "true") // the sandbox and its agent live on
	})
	run("ttl", func(t *testing.T) {
		if _, err := d.Clients.Sandboxes.SetTimeout(ctx, connect.NewRequest(&dsecv1.SetTimeoutRequest{SandboxId: id, TimeoutSeconds: 1})); err != nil {
			t.Fatal(err)
		}
		waitEnded(t, d, id, dsecv1.State_STATE_STOPPED, dsecv1.Reason_REASON_TTL, 30*time.Second)
	})
}

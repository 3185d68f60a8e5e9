package root

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"connectrpc.com/connect"

	dsecv1 "dsec.dev/dsec/api/gen/dsec/v1"
	"dsec.dev/dsec/internal/testutil"
)

// waitWarm waits until the daemon's only warm pool holds ready sandboxes
// with none starting, and returns the IDs of the runtime's containers.
func waitWarm(t *testing.T, d *testutil.Daemon, ready int32) []string {
	t.Helper()
	ctx := context.Background()
	deadline := time.Now().Add(60 * time.Second)
	for {
		resp, err := d.Clients.Sandboxes.ListWarmPools(ctx, connect.NewRequest(&dsecv1.ListWarmPoolsRequest{}))
		if err != nil {
			t.Fatal(err)
		}
		ps := resp.Msg.GetPools()
		if ready == 0 && len(ps) == 0 || len(ps) == 1 && ps[0].GetReady() == ready && ps[0].GetStarting() == 0 {
			return runtimeContainers(t, d)
		}
		if time.Now().After(deadline) {
			t.Fatalf("warm pools %v; want one with %d ready", ps, ready)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

func runtimeContainers(t *testing.T, d *testutil.Daemon) []string {
	t.Helper()
	des, err := os.ReadDir(filepath.Join(d.Root, "runtime", "bundles"))
	if err != nil && !os.IsNotExist(err) {
		t.Fatal(err)
	}
	var ids []string
	for _, de := range des {
		ids = append(ids, de.Name())
	}
	return ids
}

// A warm pool keeps real containers ready; a matching create takes one, with
// the caller's labels and limits in force, its own clean writable layer and
// a working agent; removing the pool leaves nothing of its members.
func TestWarmPool(t *testing.T) {
	d := startDaemon(t)
	ctx := context.Background()
	shape := &dsecv1.SandboxSpec{Environment: env, Cpus: 0.5, MemoryMb: 96, DiskMb: 64}
	if _, err := d.Clients.Sandboxes.SetWarmPool(ctx, connect.NewRequest(&dsecv1.SetWarmPoolRequest{Spec: shape, Size: 2})); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		d.Clients.Sandboxes.SetWarmPool(context.Background(), connect.NewRequest(&dsecv1.SetWarmPoolRequest{Spec: shape, Size: 0}))
	})
	members := waitWarm(t, d, 2)
	if len(members) != 2 {
		t.Fatalf("runtime holds %v, want the 2 pool members", members)
	}
	list, err := d.Clients.Sandboxes.List(ctx, connect.NewRequest(&dsecv1.ListRequest{}))
	if err != nil || len(list.Msg.GetSandboxes()) != 0 {
		t.Fatalf("List shows %v (%v); pool members are nobody's yet", list.Msg.GetSandboxes(), err)
	}
	stream, err := d.Clients.Sandboxes.Exec(ctx, connect.NewRequest(&dsecv1.ExecRequest{SandboxId: members[0], Argv: []string{"true"}}))
	if err == nil {
		for stream.Receive() {
		}
		err = stream.Err()
		stream.Close()
	}
	if connect.CodeOf(err) != connect.CodeNotFound {
		t.Fatalf("exec in a pool member by its ID: %v, want not found", err)
	}

	sb := create(t, d, &dsecv1.SandboxSpec{Environment: env, Cpus: 0.5, MemoryMb: 96, DiskMb: 64,
		TtlSeconds: 120, Labels: map[string]string{"task": "warm"}})
	if !sb.GetFromWarmPool() || !slices.Contains(members, sb.GetId()) {
		t.Fatalf("create got %s (from pool %v); members %v", sb.GetId(), sb.GetFromWarmPool(), members)
	}
	if got := mustSh(t, d, sb.GetId(), "hostname; cat /sys/fs/cgroup/memory/memory.limit_in_bytes 2>/dev/null || true; ls /tmp | wc -l"); got == "" {
		t.Fatal("no output from the taken sandbox")
	}
	mustSh(t, d, sb.GetId(), "echo mine > /tmp/owner")
	if out := strings.TrimSpace(mustSh(t, d, sb.GetId(), "cat /tmp/owner")); out != "mine" {
		t.Fatalf("taken sandbox reads %q", out)
	}
	list, err = d.Clients.Sandboxes.List(ctx, connect.NewRequest(&dsecv1.ListRequest{Labels: map[string]string{"task": "warm"}}))
	if err != nil || len(list.Msg.GetSandboxes()) != 1 {
		t.Fatalf("List by the caller's label: %v %v", list.Msg.GetSandboxes(), err)
	}
	if exp := list.Msg.GetSandboxes()[0].GetExpiresUnixMs(); time.Until(time.UnixMilli(exp)) > 121*time.Second || time.Until(time.UnixMilli(exp)) < 100*time.Second {
		t.Errorf("expires in %s, want about the asked 120 s", time.Until(time.UnixMilli(exp)))
	}
	// The limits of the shape hold in the taken sandbox: a memory hog is
	// OOM-killed at 96 MiB.
	r := execReq(t, d, &dsecv1.ExecRequest{SandboxId: sb.GetId(), Command: "head -c 200m /dev/zero | tail > /dev/null"})
	if r.exit.GetStatus() != dsecv1.ExitStatus_EXIT_STATUS_OOM {
		t.Errorf("memory hog in a taken sandbox: %v, want OOM", r.exit)
	}

	refilled := waitWarm(t, d, 2)
	if len(refilled) != 3 {
		t.Fatalf("after the take the runtime holds %v, want the taken one and 2 members", refilled)
	}
	if _, err := d.Clients.Sandboxes.SetWarmPool(ctx, connect.NewRequest(&dsecv1.SetWarmPoolRequest{Spec: shape, Size: 0})); err != nil {
		t.Fatal(err)
	}
	// Members are removed in the background: the runtime lets go of a
	// member's container before the edge removes its record directory, so
	// wait for both.
	leftDirs := func() []string {
		var dirs []string
		for _, id := range refilled {
			if id == sb.GetId() {
				continue
			}
			for _, dir := range []string{filepath.Join(d.Root, "upper", id), filepath.Join(d.Root, "sandboxes", id), "/sys/fs/cgroup/memory/dsec/" + id} {
				if _, err := os.Stat(dir); !os.IsNotExist(err) {
					dirs = append(dirs, fmt.Sprintf("%s (%v)", dir, err))
				}
			}
		}
		return dirs
	}
	left, dirs := waitWarm(t, d, 0), leftDirs()
	deadline := time.Now().Add(30 * time.Second)
	for (len(left) != 1 || len(dirs) > 0) && time.Now().Before(deadline) {
		time.Sleep(50 * time.Millisecond)
		left, dirs = runtimeContainers(t, d), leftDirs()
	}
	if len(left) != 1 || left[0] != sb.GetId() {
		t.Fatalf("after removing the pool the runtime holds %v, want only %s", left, sb.GetId())
	}
	for _, dir := range dirs {
		t.Errorf("a removed member left %s", dir)
	}
}

// Members waiting in a pool when the daemon dies are removed when it comes
// back; the sandboxes taken from the pool are re-adopted.
func TestWarmPoolAcrossRestart(t *testing.T) {
	d := startDaemon(t)
	ctx := context.Background()
	shape := &dsecv1.SandboxSpec{Environment: env}
	if _, err := d.Clients.Sandboxes.SetWarmPool(ctx, connect.NewRequest(&dsecv1.SetWarmPoolRequest{Spec: shape, Size: 2})); err != nil {
		t.Fatal(err)
	}
	waitWarm(t, d, 2)
	sb := create(t, d, &dsecv1.SandboxSpec{Environment: env})
	if !sb.GetFromWarmPool() {
		t.Fatal("create did not take from the pool")
	}
	waitWarm(t, d, 2)
	d.Kill()
	d.Start()
	deadline := time.Now().Add(30 * time.Second)
	for {
		ids := runtimeContainers(t, d)
		if len(ids) == 1 && ids[0] == sb.GetId() {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("after the restart the runtime holds %v, want only %s", ids, sb.GetId())
		}
		time.Sleep(50 * time.Millisecond)
	}
	if out := strings.TrimSpace(mustSh(t, d, sb.GetId(), "echo alive")); out != "alive" {
		t.Fatalf("taken sandbox after restart: %q", out)
	}
	if resp, err := d.Clients.Sandboxes.ListWarmPools(ctx, connect.NewRequest(&dsecv1.ListWarmPoolsRequest{})); err != nil || len(resp.Msg.GetPools()) != 0 {
		t.Fatalf("pools after restart: %v %v, want none until set again", resp.Msg.GetPools(), err)
	}
}

// `dsecd teardown` after a kill -9 removes everything: sandboxes left
// running on a node with networking (they have none to detach), a warm
// pool's members, and members being deleted when the daemon died.
func TestTeardownAfterKill(t *testing.T) {
	d := startDaemon(t)
	ctx := context.Background()
	for range 2 {
		if _, err := d.Clients.Sandboxes.Create(ctx, connect.NewRequest(&dsecv1.CreateRequest{Spec: &dsecv1.SandboxSpec{Environment: env}})); err != nil {
			t.Fatal(err)
		}
	}
	shape := &dsecv1.SandboxSpec{Environment: env}
	if _, err := d.Clients.Sandboxes.SetWarmPool(ctx, connect.NewRequest(&dsecv1.SetWarmPoolRequest{Spec: shape, Size: 3})); err != nil {
		t.Fatal(err)
	}
	if got := waitWarm(t, d, 3); len(got) != 5 {
		t.Fatalf("runtime holds %v, want 2 sandboxes and 3 pool members", got)
	}
	if _, err := d.Clients.Sandboxes.SetWarmPool(ctx, connect.NewRequest(&dsecv1.SetWarmPoolRequest{Spec: shape, Size: 0})); err != nil {
		t.Fatal(err)
	}
	d.Kill()
	out, err := exec.Command(filepath.Join(d.Bin, "dsecd"), "teardown", "--root", d.Root).CombinedOutput()
	if err != nil {
		t.Fatalf("dsecd teardown: %v\n%s", err, out)
	}
	if left := runtimeContainers(t, d); len(left) != 0 {
		t.Fatalf("teardown left containers %v", left)
	}
	if mounts := testutil.Mounts(d.Root); len(mounts) != 0 {
		t.Fatalf("teardown left mounts %v", mounts)
	}
}

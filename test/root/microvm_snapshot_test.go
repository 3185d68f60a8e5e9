package root

import (
	"context"
	"strings"
	"testing"
	"time"

	"connectrpc.com/connect"

	dsecv1 "dsec.dev/dsec/api/gen/dsec/v1"
	"dsec.dev/dsec/internal/testutil"
)

// TestMicroVMSnapshot: a snapshot of a microVM sandbox (its writable disk
// cloned and mounted on the host, packed into a layer) holds a file the
// guest wrote without a sync and a lower file it deleted; a container
// created from the snapshot's environment reads the file and lacks the
// deleted one, and the VM runs on. One VM.
func TestMicroVMSnapshot(t *testing.T) {
	allInOneOnly(t)
	allInOneOnly(t)
	d := startDaemon(t, "--vm-kernel-dir", testutil.VMKernelDir(t))
	id := create(t, d, &dsecv1.SandboxSpec{Isolation: dsecv1.Isolation_ISOLATION_MICROVM, MemoryMb: 256}).GetId()
	mustSh(t, d, id, "mkdir -p /work && echo written in the vm > /work/vm.txt && rm /bin/vi")
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	resp, err := d.Clients.Sandboxes.Snapshot(ctx, connect.NewRequest(&dsecv1.SnapshotRequest{SandboxId: id, Name: "vm1"}))
	if err != nil {
		t.Fatalf("snapshot of a microVM: %v", err)
	}
	info := resp.Msg
	t.Logf("microVM snapshot: frozen %d µs (%s), packed in %d ms, %d bytes", info.GetFrozenUs(), info.GetCaptureMethod(), info.GetPackMs(), info.GetSize())
	if got := strings.TrimSpace(mustSh(t, d, id, "cat /work/vm.txt")); got != "written in the vm" {
		t.Errorf("the microVM after its snapshot: %q", got)
	}
	c := create(t, d, &dsecv1.SandboxSpec{Environment: info.GetEnvironment()}).GetId()
	if got := mustSh(t, d, c, "cat /work/vm.txt; ls /bin | grep -cx vi || true"); got != "written in the vm\n0\n" {
		t.Errorf("a container from the microVM's snapshot: %q, want the file and no /bin/vi", got)
	}
}

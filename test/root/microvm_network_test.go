package root

import (
	"context"
	"os/exec"
	"strconv"
	"strings"
	"testing"

	"connectrpc.com/connect"

	dsecv1 "dsec.dev/dsec/api/gen/dsec/v1"
	"dsec.dev/dsec/internal/testutil"
	"dsec.dev/dsec/internal/vm/kernel"
)

// TestMicroVMNetwork: a microVM sandbox with network rules gets the edge's
// network as a container does (its tap in the sandbox's namespace, package
// vmnet): its host name is its address, an allowed service answers by name
// through the edge's resolver (over UDP and TCP), a denied one neither
// resolves nor connects, an upload keeps to the egress cap, the audit log
// has it all, a live rule update applies at once after a kill -9 and
// restart of dsecd (checkNetworkRules), and its delete leaves no QEMU.
func TestMicroVMNetwork(t *testing.T) {
	allInOneOnly(t)
	kernelDir := testutil.VMKernelDir(t)
	k, err := kernel.Load(kernelDir)
	if err != nil {
		t.Fatal(err)
	}
	e := setupNetwork(t, "--vm-kernel-dir", kernelDir, "--sandbox-egress-bytes", strconv.Itoa(netCheckEgress))
	vm := e.sandboxOf(t, &dsecv1.SandboxSpec{
		Isolation: dsecv1.Isolation_ISOLATION_MICROVM, MemoryMb: 256,
		NetworkRules: map[string]bool{"pypi": true, "npm": false},
	})
	id := vm.GetId()
	if got := strings.TrimSpace(mustSh(t, e.d, id, "uname -r")); got != k.Version {
		t.Fatalf("uname -r %q, want the guest kernel's %s: not a microVM", got, k.Version)
	}
	checkNetworkRules(t, e, vm, "microVM")

	ctx := context.Background()
	if _, err := e.d.Clients.Sandboxes.Delete(ctx, connect.NewRequest(&dsecv1.DeleteRequest{Id: id})); err != nil {
		t.Fatal(err)
	}
	if out, _ := exec.Command("pgrep", "-f", "dsec-"+id).Output(); len(out) > 0 {
		t.Errorf("QEMU of %s still runs after its delete: %s", id, out)
	}
}

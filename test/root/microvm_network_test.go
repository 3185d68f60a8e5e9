package root

import (
	"context"
	"os/exec"
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
// through the edge's resolver, a denied one neither resolves nor connects,
// the audit log has it all, a live rule update applies at once, and all of
// it survives a kill -9 and restart of dsecd.
func TestMicroVMNetwork(t *testing.T) {
	allInOneOnly(t)
	kernelDir := testutil.VMKernelDir(t)
	k, err := kernel.Load(kernelDir)
	if err != nil {
		t.Fatal(err)
	}
	e := setupNetwork(t, "--vm-kernel-dir", kernelDir)
	vm := e.sandboxOf(t, &dsecv1.SandboxSpec{
		Isolation: dsecv1.Isolation_ISOLATION_MICROVM, MemoryMb: 256,
		NetworkRules: map[string]bool{"pypi": true, "npm": false},
	})
	id := vm.GetId()
	if got := strings.TrimSpace(mustSh(t, e.d, id, "uname -r")); got != k.Version {
		t.Fatalf("uname -r %q, want the guest kernel's %s: not a microVM", got, k.Version)
	}
	if vm.GetAddress() == "" {
		t.Fatal("the networked microVM has no address")
	}
	if out := strings.TrimSpace(e.probeOK(t, id, "resolve "+id)); out != vm.GetAddress() {
		t.Errorf("the microVM's host name resolves to %q, want its address %s", out, vm.GetAddress())
	}
	if out := e.probeOK(t, id, "get http://pypi.test/"); !strings.Contains(out, "hello from pypi.test") {
		t.Errorf("pypi from the microVM: %q", out)
	}
	e.probeFails(t, id, "resolve npm.test")
	e.probeFails(t, id, "connect "+e.npm.addr+":80")
	e.probeFails(t, id, "connect "+e.meta.addr+":80")

	logOut, errOut, code := e.d.CLI("", "net", "log", id, "--json")
	if code != 0 {
		t.Fatalf("dsec net log: %s", errOut)
	}
	for _, want := range []string{`"pypi.test"`, `"npm.test"`, `"` + e.pypi.addr + `"`, `"` + e.npm.addr + `"`} {
		if !strings.Contains(logOut, want) {
			t.Errorf("the microVM's audit log lacks %s:\n%s", want, logOut)
		}
	}

	e.d.Kill()
	e.d.Start()
	e.probeOK(t, id, "get http://pypi.test/")
	if _, errOut, code := e.d.CLI("", "net", "set", id, `{"npm": true}`); code != 0 {
		t.Fatalf("net set after the restart: %s", errOut)
	}
	if out := e.probeOK(t, id, "get http://npm.test/"); !strings.Contains(out, "hello from npm.test") {
		t.Errorf("npm from the microVM after net set: %q", out)
	}
	e.probeFails(t, id, "get http://pypi.test/")

	ctx := context.Background()
	if _, err := e.d.Clients.Sandboxes.Delete(ctx, connect.NewRequest(&dsecv1.DeleteRequest{Id: id})); err != nil {
		t.Fatal(err)
	}
	if out, _ := exec.Command("pgrep", "-f", "dsec-"+id).Output(); len(out) > 0 {
		t.Errorf("QEMU of %s still runs after its delete: %s", id, out)
	}
}

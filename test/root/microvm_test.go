package root

import (
	"context"
	"os/exec"
	"slices"
	"strings"
	"testing"
	"time"

	"connectrpc.com/connect"

	dsecv1 "dsec.dev/dsec/api/gen/dsec/v1"
	"dsec.dev/dsec/internal/testutil"
	"dsec.dev/dsec/internal/vm/kernel"
)

// TestMicroVMSandbox: a dsecd whose node has QEMU and the guest kernel
// offers the microvm isolation, with its accelerator; a sandbox created
// with isolation microvm runs on the guest's own kernel, where root may
// mount a file system (which a container refuses), gets its environment,
// lives on across a daemon restart (re-adopted), and fails saying why when
// its QEMU is killed; dsec run --isolation microvm works from the CLI.
func TestMicroVMSandbox(t *testing.T) {
	kernelDir := testutil.VMKernelDir(t)
	k, err := kernel.Load(kernelDir)
	if err != nil {
		t.Fatal(err)
	}
	d := startDaemon(t, "--vm-kernel-dir", kernelDir)
	ctx := context.Background()

	info, err := d.Clients.Sandboxes.GetServerInfo(ctx, connect.NewRequest(&dsecv1.GetServerInfoRequest{}))
	if err != nil {
		t.Fatal(err)
	}
	var accel string
	for _, kind := range info.Msg.GetNodes()[0].GetKinds() {
		if kind.GetIsolation() == dsecv1.Isolation_ISOLATION_MICROVM {
			accel = kind.GetAccelerator()
		}
	}
	if !slices.Contains([]string{"tcg", "kvm"}, accel) {
		t.Fatalf("the node offers %v, want microvm with its accelerator (missing: %v)", info.Msg.GetNodes()[0].GetKinds(), info.Msg.GetNodes()[0].GetMissing())
	}

	start := time.Now()
	vm := create(t, d, &dsecv1.SandboxSpec{Isolation: dsecv1.Isolation_ISOLATION_MICROVM, MemoryMb: 256, Env: map[string]string{"GREETING": "hi"}})
	took := time.Since(start)
	ctr := create(t, d, nil)
	if got := vm.GetSpec().GetIsolation(); got != dsecv1.Isolation_ISOLATION_MICROVM {
		t.Errorf("the sandbox is recorded with isolation %s", got)
	}
	check := func(when string) {
		t.Helper()
		if got := strings.TrimSpace(mustSh(t, d, vm.GetId(), "uname -r")); got != k.Version {
			t.Errorf("%s: uname -r in the microVM %q, want the guest kernel's %s", when, got, k.Version)
		}
		if got := mustSh(t, d, vm.GetId(), "echo $GREETING"); got != "hi\n" {
			t.Errorf("%s: the microVM's environment: %q", when, got)
		}
	}
	check("started")
	t.Logf("%s microVM: create to running %s", accel, took.Round(time.Millisecond))
	mount := "mkdir -p /tmp/m && mount -t tmpfs none /tmp/m && echo mounted"
	if got := mustSh(t, d, vm.GetId(), mount); got != "mounted\n" {
		t.Errorf("mount in the microVM: %q", got)
	}
	if r := sh(t, d, ctr.GetId(), mount); r.exit.GetExitCode() == 0 {
		t.Errorf("a container mounted a tmpfs: %q", r.stdout)
	}

	d.Kill()
	d.Start()
	check("after a restart")
	// The restarted dsecd follows the re-adopted VM's console: what the
	// guest prints now is quoted when it fails.
	mustSh(t, d, vm.GetId(), "echo '<3>dsec-console-marker' > /dev/kmsg")

	// QEMU killed under the sandbox: it fails, saying QEMU is gone.
	out, err := exec.Command("pgrep", "-f", "dsec-"+vm.GetId()).Output()
	if err != nil {
		t.Fatalf("find QEMU of %s: %v", vm.GetId(), err)
	}
	if err := exec.Command("kill", "-9", strings.Fields(string(out))[0]).Run(); err != nil {
		t.Fatal(err)
	}
	var got *dsecv1.Sandbox
	for deadline := time.Now().Add(30 * time.Second); time.Now().Before(deadline); time.Sleep(100 * time.Millisecond) {
		resp, err := d.Clients.Sandboxes.Get(ctx, connect.NewRequest(&dsecv1.GetRequest{Id: vm.GetId()}))
		if err != nil {
			t.Fatal(err)
		}
		if got = resp.Msg; got.GetState() == dsecv1.State_STATE_FAILED {
			break
		}
	}
	// Re-adopted, QEMU is not this dsecd's child: its exit status went to
	// the dsecd that started it, so the reason says it was killed (nothing
	// on the console or in QEMU's log says otherwise), with the console.
	if got.GetState() != dsecv1.State_STATE_FAILED || !strings.Contains(got.GetMessage(), "qemu was killed") ||
		!strings.Contains(got.GetMessage(), "dsec-console-marker") {
		t.Errorf("after kill -9 of its QEMU the sandbox is %s: %q", got.GetState(), got.GetMessage())
	}
	t.Logf("after kill -9 of QEMU: %s, %s", got.GetState(), firstLine(got.GetMessage()))
	if out, _ := exec.Command("pgrep", "-f", "dsec-"+vm.GetId()).Output(); len(out) > 0 {
		t.Errorf("QEMU of %s still runs after it failed: %s", vm.GetId(), out)
	}

	if out, errOut, code := d.CLI("", "run", "--isolation", "microvm", env, "--", "uname", "-r"); code != 0 || strings.TrimSpace(out) != k.Version {
		t.Errorf("dsec run --isolation microvm uname -r: exit %d, %q %s", code, out, errOut)
	}
}

func firstLine(s string) string {
	line, _, _ := strings.Cut(s, "\n")
	return line
}

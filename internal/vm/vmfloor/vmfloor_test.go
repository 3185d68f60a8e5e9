package vmfloor

import (
	"context"
	"os"
	"testing"
	"time"

	"dsec.dev/dsec/internal/testutil"
	"dsec.dev/dsec/internal/vm/qemu"
)

// TestFloor boots one floor VM: its init's line comes with the guest's
// uptime, its cgroup holds memory and counts CPU, and Close leaves no cgroup or run
// directory.
func TestFloor(t *testing.T) {
	testutil.RequireRoot(t)
	accel, _ := qemu.DetectAccel()
	dir := t.TempDir()
	f, err := New(Config{KernelDir: testutil.VMKernelDir(t), Accel: accel, MemoryMiB: 256, TCGBufferMiB: 32,
		Dir: dir, CgroupParent: "dsec-test-floor"})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	vm, err := f.Boot(ctx)
	if err != nil {
		f.Close()
		t.Fatal(err)
	}
	u, err := vm.Usage()
	t.Logf("QEMU start → init's line %s, the guest's uptime then %s, host memory %d MiB, CPU %d ms", vm.Ready, vm.Uptime, u.MemoryBytes>>20, u.CPUUsec/1000)
	if err != nil || u.MemoryBytes <= 0 || u.CPUUsec <= 0 {
		t.Errorf("usage %+v: %v", u, err)
	}
	if vm.Uptime <= 0 || vm.Uptime >= vm.Ready {
		t.Errorf("uptime %s of a boot of %s", vm.Uptime, vm.Ready)
	}
	rel, run := vm.rel, vm.dir
	if err := vm.Close(); err != nil {
		t.Error(err)
	}
	if f.layout.Exists(rel) {
		t.Errorf("cgroup %s left", rel)
	}
	if _, err := os.Stat(run); !os.IsNotExist(err) {
		t.Errorf("run directory %s left: %v", run, err)
	}
	if err := f.Close(); err != nil {
		t.Error(err)
	}
}

package testutil

import (
	"os"
	"path/filepath"
	"testing"
)

// VMKernelDir is the microVM guest kernel directory the tests boot
// ($DSEC_VM_KERNEL_DIR, made by scripts/build-vm-kernel.sh), with QEMU
// installed; without either the test skips, or fails under Strict.
func VMKernelDir(t testing.TB) string {
	t.Helper()
	dir := os.Getenv("DSEC_VM_KERNEL_DIR")
	Require(t, dir != "", "DSEC_VM_KERNEL_DIR is not set (scripts/build-vm-kernel.sh makes the directory)")
	_, err := os.Stat(filepath.Join(dir, "manifest"))
	Require(t, err == nil, "no guest kernel in DSEC_VM_KERNEL_DIR="+dir+" (run scripts/build-vm-kernel.sh)")
	RequireCommand(t, "qemu-system-x86_64")
	return dir
}

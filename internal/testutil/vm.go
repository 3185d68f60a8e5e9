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

// VMModulesDir is the tree of the guest kernel's modules that
// scripts/build-vm-modules.sh makes ($DSEC_VM_MODULES_DIR), for a layer
// microVM sandboxes load modules from; it skips (fails under
// DSEC_TEST_ROOT=1) without it, or without the guest kernel and QEMU.
func VMModulesDir(t testing.TB) string {
	t.Helper()
	VMKernelDir(t)
	dir := os.Getenv("DSEC_VM_MODULES_DIR")
	Require(t, dir != "", "DSEC_VM_MODULES_DIR is not set (scripts/build-vm-modules.sh makes the directory)")
	marks, _ := filepath.Glob(filepath.Join(dir, "usr", "lib", "modules", "*", "dsec-vm-modules"))
	Require(t, len(marks) > 0, "no guest modules in DSEC_VM_MODULES_DIR="+dir+" (run scripts/build-vm-modules.sh)")
	return dir
}

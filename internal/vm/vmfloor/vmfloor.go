// Package vmfloor boots floor VMs: QEMU with a node's accelerator,
// machine, memory and guest kernel, as the microvm backend starts it, whose
// init is a static busybox that prints one line and then sleeps. Nothing of
// dsec runs in them (no modules, no disks, no agent), so the time one takes
// to print its line is the floor under a microVM's create → first exec,
// and the host memory an idle one holds the floor under an idle microVM's:
// what the unchanged kernel and QEMU cost by themselves. `dsec bench vm`
// prints its targets beside these floors measured in the same run.
package vmfloor

import (
	"bytes"
	"context"
	"debug/elf"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"time"

	"dsec.dev/dsec/internal/edge/backend/cgroups"
	"dsec.dev/dsec/internal/errdefs"
	"dsec.dev/dsec/internal/vm/initramfs"
	"dsec.dev/dsec/internal/vm/kernel"
	"dsec.dev/dsec/internal/vm/qemu"
)

// Ready is what a floor VM's init prints first, followed by the guest's
// uptime in seconds (the time since its kernel started).
const Ready = "dsec-floor-ready uptime="

// initScript is the floor VM's /init: /proc for the uptime, the line, and
// then nothing until QEMU is killed.
const initScript = `#!/bin/busybox sh
/bin/busybox mount -t proc proc /proc
read up idle < /proc/uptime
echo "` + Ready + `$up"
exec /bin/busybox sleep 2147483647
`

// Config is what floor VMs share with the node's microVMs.
type Config struct {
	QEMU         string     // "" = qemu.DefaultBinary
	KernelDir    string     // the guest kernel's directory (scripts/build-vm-kernel.sh)
	Busybox      string     // a static busybox ("" = the one on PATH)
	Accel        qemu.Accel // the node's
	MemoryMiB    int        // each VM's memory
	TCGBufferMiB int        // TCG's code buffer, as the backend caps it
	// Dir is a scratch directory the floor owns: its initramfs and one
	// run directory per VM (RAM files among them, so on a disk).
	Dir string
	// CgroupParent is the cgroup the VMs' own go under, so their host
	// memory is read as a sandbox's is.
	CgroupParent string
	BootTimeout  time.Duration // 0 = 2 minutes
}

// Floor boots floor VMs of one Config.
type Floor struct {
	cfg    Config
	kernel *kernel.Kernel
	initrd string
	layout *cgroups.Layout
	n      int
}

// New checks cfg's parts and writes the floor's initramfs.
func New(cfg Config) (*Floor, error) {
	if cfg.BootTimeout == 0 {
		cfg.BootTimeout = 2 * time.Minute
	}
	k, err := kernel.Load(cfg.KernelDir)
	if err != nil {
		return nil, fmt.Errorf("floor vm: %w", err)
	}
	if cfg.Busybox == "" {
		if cfg.Busybox, err = exec.LookPath("busybox"); err != nil {
			return nil, fmt.Errorf("floor vm: no busybox (Debian's busybox-static): %w", errdefs.ErrFailedPrecondition)
		}
	}
	if err := checkStatic(cfg.Busybox); err != nil {
		return nil, fmt.Errorf("floor vm: %w", err)
	}
	layout, err := cgroups.Detect()
	if err != nil {
		return nil, fmt.Errorf("floor vm: %w", err)
	}
	if err := layout.EnsureParent(cfg.CgroupParent); err != nil {
		return nil, fmt.Errorf("floor vm: %w", err)
	}
	if err := os.MkdirAll(cfg.Dir, 0o700); err != nil {
		return nil, fmt.Errorf("floor vm: %w", err)
	}
	init := filepath.Join(cfg.Dir, "init")
	if err := os.WriteFile(init, []byte(initScript), 0o755); err != nil {
		return nil, fmt.Errorf("floor vm: %w", err)
	}
	initrd := filepath.Join(cfg.Dir, "initrd")
	var buf bytes.Buffer
	err = initramfs.Build(&buf, initramfs.Image{Init: init,
		Files: []initramfs.File{{Name: "/bin/busybox", Source: cfg.Busybox, Mode: 0o755}}})
	if err == nil {
		err = os.WriteFile(initrd, buf.Bytes(), 0o600)
	}
	if err != nil {
		return nil, fmt.Errorf("floor vm: %w", err)
	}
	return &Floor{cfg: cfg, kernel: k, initrd: initrd, layout: layout}, nil
}

// checkStatic fails for a dynamically linked binary: the initramfs has no
// libraries.
func checkStatic(path string) error {
	f, err := elf.Open(path)
	if err != nil {
		return fmt.Errorf("read %s: %w", path, err)
	}
	defer f.Close()
	for _, p := range f.Progs {
		if p.Type == elf.PT_INTERP {
			return fmt.Errorf("%s is linked dynamically (install busybox-static): %w", path, errdefs.ErrFailedPrecondition)
		}
	}
	return nil
}

// Close removes the floor's cgroup parent and scratch directory; its VMs
// must be closed first.
func (f *Floor) Close() error {
	return errors.Join(f.layout.RemoveParent(f.cfg.CgroupParent), os.RemoveAll(f.cfg.Dir))
}

// VM is one running floor VM.
type VM struct {
	// Ready is the time from QEMU's start to the init's line on the
	// console; Uptime the guest's own clock at that line.
	Ready, Uptime time.Duration

	f   *Floor
	p   *qemu.Process
	rel string
	dir string
}

// Boot starts a floor VM and returns once its init printed its line. The
// VM stays up, its init asleep, until Close.
func (f *Floor) Boot(ctx context.Context) (vm *VM, err error) {
	f.n++
	name := fmt.Sprintf("floor-%d", f.n)
	dir := filepath.Join(f.cfg.Dir, name)
	cfg := qemu.Config{Binary: f.cfg.QEMU, Dir: dir, Kernel: f.kernel.Vmlinux(), Initrd: f.initrd,
		MemoryFile: filepath.Join(dir, "memory"), MemoryMiB: f.cfg.MemoryMiB, VCPUs: 1, Accel: f.cfg.Accel,
		TCGBufferMiB: f.cfg.TCGBufferMiB, FreePageReporting: true}
	t0 := time.Now()
	p, err := qemu.Start(ctx, cfg, nil)
	if err != nil {
		return nil, fmt.Errorf("boot floor vm: %w", err)
	}
	vm = &VM{f: f, p: p, rel: filepath.Join(f.cfg.CgroupParent, name), dir: dir}
	defer func() {
		if err != nil {
			vm.Close()
			vm = nil
		}
	}()
	// As the backend does, right after the start.
	if err := f.layout.Place(vm.rel, p.Pid(), cgroups.Limits{}); err != nil {
		return vm, fmt.Errorf("boot floor vm: %w", err)
	}
	up, err := waitReady(ctx, p, filepath.Join(dir, qemu.ConsoleLog), f.cfg.BootTimeout)
	if err != nil {
		return vm, fmt.Errorf("boot floor vm: %w", err)
	}
	vm.Ready, vm.Uptime = time.Since(t0), up
	return vm, nil
}

// waitReady polls the console's log for the init's line and returns the
// uptime it gives.
func waitReady(ctx context.Context, p *qemu.Process, log string, timeout time.Duration) (time.Duration, error) {
	deadline := time.Now().Add(timeout)
	tick := time.NewTicker(2 * time.Millisecond)
	defer tick.Stop()
	for {
		if b, _ := os.ReadFile(log); len(b) > 0 {
			if _, rest, ok := bytes.Cut(b, []byte(Ready)); ok {
				if line, _, ok := bytes.Cut(rest, []byte("\n")); ok {
					s, err := strconv.ParseFloat(strings.TrimSpace(string(line)), 64)
					if err != nil {
						return 0, fmt.Errorf("the init's line: %q: %w", line, err)
					}
					return time.Duration(s * float64(time.Second)), nil
				}
			}
		}
		if time.Now().After(deadline) {
			return 0, fmt.Errorf("no line from the init in %s: %s", timeout, p.ConsoleTail(20))
		}
		select {
		case <-ctx.Done():
			return 0, ctx.Err()
		case <-p.Done():
			return 0, fmt.Errorf("qemu exited before the init's line: %v: %s", p.Err(), p.ConsoleTail(20))
		case <-tick.C:
		}
	}
}

// Usage is what the VM's cgroup holds and used, read as a sandbox's is:
// its memory (the guest RAM QEMU touched, QEMU's own, the page cache it
// charged) and its CPU time so far.
type Usage struct {
	MemoryBytes int64
	CPUUsec     int64
}

// Usage reads the VM's cgroup.
func (vm *VM) Usage() (Usage, error) {
	u, err := vm.f.layout.Usage(vm.rel)
	if err != nil {
		return Usage{}, fmt.Errorf("floor vm's usage: %w", err)
	}
	return Usage{MemoryBytes: u.MemoryBytes, CPUUsec: u.CPUUsec}, nil
}

// Close kills the VM's QEMU and removes its cgroup and run directory.
func (vm *VM) Close() error {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	var errs []error
	if err := vm.p.Kill(); err != nil {
		errs = append(errs, err)
	}
	if err := vm.p.Wait(ctx); err != nil && ctx.Err() != nil {
		errs = append(errs, fmt.Errorf("close floor vm: %w", err))
	}
	if vm.f.layout.Exists(vm.rel) {
		errs = append(errs, vm.f.layout.Remove(ctx, vm.rel))
	}
	errs = append(errs, os.RemoveAll(vm.dir))
	return errors.Join(errs...)
}

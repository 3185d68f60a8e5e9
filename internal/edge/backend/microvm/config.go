package microvm

import (
	"log/slog"
	"time"

	"dsec.dev/dsec/internal/vm/qemu"
)

// Config configures a Runtime. Zero values get the defaults described.
type Config struct {
	// StateDir holds the VMs' run directories and the initramfs, e.g.
	// /var/lib/dsec/microvm. Required.
	StateDir string
	// KernelDir is the guest kernel's directory, as scripts/build-vm-kernel.sh
	// makes it (dsecd's DSEC_VM_KERNEL_DIR). Required.
	KernelDir string
	// QEMU is the QEMU binary (default qemu-system-x86_64 on PATH).
	QEMU string
	// AgentDir holds dsec-agent (the guest's init) and sh, a static shell
	// the guest binds in at /.dsec/bin/sh, as the container backend's.
	AgentDir string
	// CgroupParent is the parent cgroup of the QEMU processes (default
	// "dsec-microvm").
	CgroupParent string
	// Accel is the accelerator ("" = KVM where /dev/kvm runs a stock
	// kernel, else TCG).
	Accel qemu.Accel
	// BootTimeout bounds a boot: from QEMU's start to the agent's first
	// answer (default 60 s; a TCG boot takes about 3 s on an idle host).
	BootTimeout time.Duration
	// PmemLayers attaches each layer whose file is a multiple of 2 MiB
	// (the layer store pads its files so) as a virtio-pmem device the
	// guest mounts with DAX, in place of a virtio-blk disk: the node's
	// guests then read a layer from one copy in the host's page cache
	// rather than each caching it in its own RAM (docs/microvm.md).
	// Such a VM is a q35 machine, whose boot takes about 0.3 to 0.5 s
	// longer under TCG; off, every VM is a microvm machine.
	PmemLayers bool
	// GuestArgs are more flags of the guest's agent, after the runtime's
	// (e.g. --log-level debug).
	GuestArgs []string
	// Channels are the agent channels, shared by the instances of one
	// process (nil = the instance's own; see Channels).
	Channels *Channels
	Log      *slog.Logger
}

const (
	defaultCgroupParent = "dsec-microvm"
	defaultBootTimeout  = 60 * time.Second
	// defaultMemory is a guest's memory when the spec sets none;
	// minMemory the least a guest gets (the kernel, the initramfs and the
	// agent need about 100 MiB).
	defaultMemory = 256 << 20
	minMemory     = 128 << 20
	// defaultDisk is the writable disk's size when the spec sets no limit
	// (a sparse file: blocks cost only once written).
	defaultDisk = 4 << 30
	minDisk     = 64 << 20
	// TCGBufferMiB caps TCG's translated code; overhead is what QEMU's
	// cgroup holds beyond the guest's memory: that buffer, QEMU's own heap
	// and the device state. A boot fills the buffer and it stays
	// resident: at 64 MiB an idle VM's QEMU held 81-89 MiB of anonymous
	// memory, at 32 MiB 48-52 MiB with execs as fast; at 16 MiB 28-37 MiB,
	// but a run of short commands took twice as long, the buffer flushed
	// and its code translated again (docs/microvm.md, "Idle memory").
	TCGBufferMiB = 32
	overheadTCG  = 192 << 20
	overheadKVM  = 96 << 20
	// qemuPids bounds QEMU's threads: vCPUs, I/O workers (at most 64), its
	// main loop and helpers.
	qemuPids = 256
	// defaultPids caps a guest's commands when the spec sets no limit
	// (backend.Spec.Pids).
	defaultPids = 4096
	cfsPeriod   = 100000
	// maxLayers: microvm has 24 virtio-mmio slots; the writable disk and
	// the virtio-serial port take two.
	maxLayers = 20
)

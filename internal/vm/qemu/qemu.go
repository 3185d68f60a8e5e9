// Package qemu runs one microVM: the QEMU command line of a `microvm`
// machine, the QEMU process's lifetime (start, a boot watchdog, kill,
// wait), its serial console kept in a size-capped log, and the paths of the
// sockets through which the host reaches it: the QMP monitor (package qmp)
// and the agent's virtio-serial port, channel.PortName in the guest
// (package channel).
//
// Each VM has a run directory (Config.Dir) that holds its sockets and logs.
// The sockets are bound by Start and handed to QEMU as listening file
// descriptors, so they exist before QEMU runs and the host never polls for
// them; QEMU keeps serving them after the process that started it exits,
// so a restarted edge reaches a running VM by the same paths.
//
// The accelerator is KVM where /dev/kvm can run a stock guest kernel
// (DetectAccel), else TCG, QEMU's emulator, with the host's TSC frequency
// given to the guest (tsc_early_khz): without it a TCG guest on a loaded
// host can spend minutes failing to calibrate its clock.
package qemu

import (
	"fmt"
	"net"
	"os"
	"path/filepath"
	"strconv"
	"strings"

	"dsec.dev/dsec/internal/errdefs"
	"dsec.dev/dsec/internal/vm/channel"
)

// Accel is how QEMU runs the guest's CPUs.
type Accel string

const (
	// KVM runs the guest on the host's CPU (-accel kvm -cpu host).
	KVM Accel = "kvm"
	// TCG emulates the guest's CPU (-accel tcg -cpu max).
	TCG Accel = "tcg"
)

// DefaultBinary is the QEMU that Config.Binary defaults to (Debian's
// qemu-system-x86 package).
const DefaultBinary = "qemu-system-x86_64"

// The files of a VM's run directory.
const (
	QMPSocket     = "qmp.sock"     // the QMP monitor
	ChannelSocket = "agent.sock"   // the agent's virtio-serial port
	ConsoleSocket = "console.sock" // the serial console, read by Start's copier
	ConsoleLog    = "console.log"  // what the console printed (and console.log.1)
	QEMULog       = "qemu.log"     // QEMU's own standard error
)

// ChannelPortID is the QEMU device ID of the agent's virtio-serial port,
// and ChannelChardev its chardev's: QMP's VSERPORT_CHANGE events name the
// port when the guest opens or closes it, and query-chardev says whether
// the host is connected to its socket.
const (
	ChannelPortID  = "agent-port"
	ChannelChardev = "agent"
)

// The descriptors QEMU inherits for its sockets (exec.Cmd.ExtraFiles).
const (
	qmpFD     = 3
	channelFD = 4
	consoleFD = 5
	nicFD     = 6 // Config.NIC's tap, when there is one
)

// Config is one VM's QEMU configuration.
type Config struct {
	Binary    string // QEMU ("" = DefaultBinary, found on PATH)
	Dir       string // the VM's run directory, created by Start
	Kernel    string // the uncompressed PVH kernel (vmlinux)
	Initrd    string // the initramfs
	Cmdline   string // appended to the kernel command line; after "--" it is init's arguments
	MemoryMiB int    // guest memory (0 = 256)
	VCPUs     int    // guest CPUs (0 = 1)
	Accel     Accel  // "" = DetectAccel's
	Paused    bool   // start with the vCPUs stopped (-S), for QMP's cont to run
	// MemoryFile, when set, backs the guest's RAM with this file, mapped
	// shared (memory-backend-file, share=on): what the guest writes is
	// the file's, so a pause saves only the devices' state (migration's
	// x-ignore-shared) and the host's page cache can drop the RAM once
	// QEMU is gone (package vmstate). It must be on a disk's file
	// system, not tmpfs: the host has no swap, and a tmpfs file never
	// leaves RAM. A file that exists keeps its contents (a restore).
	MemoryFile string
	// Incoming starts QEMU waiting for a migration stream (-incoming
	// defer) in place of booting the guest: QMP's migrate-incoming loads
	// a saved state into it (package vmstate). The rest of the config
	// must be the saved VM's.
	Incoming bool
	// TSCkHz is the host's TSC frequency, given to a TCG guest
	// (0 = HostTSCkHz's).
	TSCkHz int64
	// TCGBufferMiB caps TCG's translated-code buffer (tb-size; 0 =
	// QEMU's default, up to 1 GiB of host memory as it fills): a VM whose
	// QEMU runs under a memory limit needs it bounded.
	TCGBufferMiB int
	// Drives are the guest's disks, virtio-blk devices in this order.
	Drives []Drive
	// NIC is the guest's network card; nil = none.
	NIC *NIC
	// ConsoleLimit caps the console's log on disk, in bytes: the log is
	// kept in two files of half as much each (0 = 1 MiB).
	ConsoleLimit int64
}

// Drive is one disk of the guest: a raw image file on the host. The guest
// finds it by its serial (/sys/block/vdX/serial), not by its order: the
// kernel's order of virtio-mmio devices is not the command line's.
type Drive struct {
	Path     string
	Serial   string // at most 20 bytes of [A-Za-z0-9_-]
	ReadOnly bool
}

// NIC is a virtio-net card on an open tap device (package vmnet makes one
// in the sandbox's network namespace). QEMU inherits the tap; the caller
// still owns Tap and closes it once Start returns.
type NIC struct {
	Tap *os.File
	MAC net.HardwareAddr
}

func (c *Config) fill() error {
	if c.Binary == "" {
		c.Binary = DefaultBinary
	}
	if c.MemoryMiB == 0 {
		c.MemoryMiB = 256
	}
	if c.VCPUs == 0 {
		c.VCPUs = 1
	}
	if c.ConsoleLimit == 0 {
		c.ConsoleLimit = 1 << 20
	}
	if c.Accel == "" {
		c.Accel, _ = DetectAccel()
	}
	if c.Accel == TCG && c.TSCkHz == 0 {
		khz, err := HostTSCkHz()
		if err != nil {
			return fmt.Errorf("configure TCG guest: %w", err)
		}
		c.TSCkHz = khz
	}
	return c.check()
}

func (c *Config) check() error {
	var missing []string
	for _, f := range []struct{ name, value string }{{"Dir", c.Dir}, {"Kernel", c.Kernel}, {"Initrd", c.Initrd}} {
		if f.value == "" {
			missing = append(missing, f.name)
		}
	}
	if len(missing) > 0 {
		return fmt.Errorf("check vm config: %s required: %w", strings.Join(missing, ", "), errdefs.ErrInvalidArgument)
	}
	if c.MemoryMiB < 64 || c.VCPUs < 1 {
		return fmt.Errorf("check vm config: %d MiB and %d vCPUs: at least 64 MiB and 1 vCPU: %w", c.MemoryMiB, c.VCPUs, errdefs.ErrInvalidArgument)
	}
	switch c.Accel {
	case KVM:
	case TCG:
		if c.TSCkHz <= 0 {
			return fmt.Errorf("check vm config: a TCG guest needs the host's TSC frequency: %w", errdefs.ErrInvalidArgument)
		}
	default:
		return fmt.Errorf("check vm config: accelerator %q: %w", c.Accel, errdefs.ErrInvalidArgument)
	}
	if strings.Contains(c.MemoryFile, ",") {
		return fmt.Errorf("check vm config: memory file %q: a path without commas: %w", c.MemoryFile, errdefs.ErrInvalidArgument)
	}
	if c.Incoming && c.MemoryFile == "" {
		return fmt.Errorf("check vm config: an incoming VM needs the saved VM's memory file: %w", errdefs.ErrInvalidArgument)
	}
	for _, d := range c.Drives {
		if d.Path == "" || strings.Contains(d.Path, ",") || !validSerial(d.Serial) {
			return fmt.Errorf("check vm config: drive %q (serial %q): a path without commas and a serial of 1 to 20 letters, digits, - or _: %w",
				d.Path, d.Serial, errdefs.ErrInvalidArgument)
		}
	}
	if c.NIC != nil && (c.NIC.Tap == nil || len(c.NIC.MAC) != 6) {
		return fmt.Errorf("check vm config: a NIC needs an open tap and a 6-byte MAC: %w", errdefs.ErrInvalidArgument)
	}
	if strings.ContainsAny(c.Cmdline, "\n\x00") {
		return fmt.Errorf("check vm config: the kernel command line has a newline or NUL: %w", errdefs.ErrInvalidArgument)
	}
	return nil
}

// KernelCmdline is the guest kernel's command line: its console on the
// serial port, a panic or reboot that ends QEMU at once (with -no-reboot),
// and under TCG the TSC frequency.
func (c *Config) KernelCmdline() string {
	parts := []string{"console=ttyS0", "quiet", "reboot=t", "panic=-1"}
	if c.Accel == TCG {
		parts = append(parts, "tsc_early_khz="+strconv.FormatInt(c.TSCkHz, 10))
	}
	if c.Cmdline != "" {
		parts = append(parts, c.Cmdline)
	}
	return strings.Join(parts, " ")
}

// Args is QEMU's command line (without the binary) for a filled-in
// config. The sockets are the inherited descriptors qmpFD, channelFD and
// consoleFD; QEMU waits for the console's client before it starts the
// guest, so no output is lost.
func (c *Config) Args() []string {
	accel := string(c.Accel)
	if c.Accel == TCG && c.TCGBufferMiB > 0 {
		accel += ",tb-size=" + strconv.Itoa(c.TCGBufferMiB)
	}
	args := []string{
		"-name", "dsec-" + filepath.Base(c.Dir),
		"-M", "microvm",
		"-accel", accel,
	}
	if c.Accel == KVM {
		args = append(args, "-cpu", "host")
	} else {
		args = append(args, "-cpu", "max")
	}
	if c.Paused {
		args = append(args, "-S")
	}
	if c.MemoryFile != "" {
		args = append(args,
			"-object", fmt.Sprintf("memory-backend-file,id=mem,share=on,mem-path=%s,size=%dM", c.MemoryFile, c.MemoryMiB),
			"-machine", "memory-backend=mem")
	}
	if c.Incoming {
		args = append(args, "-incoming", "defer")
	}
	args = append(args,
		"-m", strconv.Itoa(c.MemoryMiB),
		"-smp", strconv.Itoa(c.VCPUs),
		"-nodefaults", "-no-user-config", "-display", "none", "-no-reboot",
		"-kernel", c.Kernel,
		"-initrd", c.Initrd,
		"-append", c.KernelCmdline(),
		"-chardev", fmt.Sprintf("socket,id=console,fd=%d,server=on,wait=on", consoleFD),
		"-serial", "chardev:console",
		"-chardev", fmt.Sprintf("socket,id=qmp,fd=%d,server=on,wait=off", qmpFD),
		"-mon", "chardev=qmp,mode=control",
		"-device", "virtio-serial-device",
		"-chardev", fmt.Sprintf("socket,id=%s,fd=%d,server=on,wait=off", ChannelChardev, channelFD),
		"-device", fmt.Sprintf("virtserialport,chardev=%s,name=%s,id=%s", ChannelChardev, channel.PortName, ChannelPortID),
	)
	for i, d := range c.Drives {
		drive := fmt.Sprintf("file=%s,format=raw,if=none,id=disk%d", d.Path, i)
		if d.ReadOnly {
			drive += ",readonly=on"
		}
		args = append(args, "-drive", drive,
			"-device", fmt.Sprintf("virtio-blk-device,drive=disk%d,serial=%s", i, d.Serial))
	}
	if c.NIC != nil {
		args = append(args, "-netdev", fmt.Sprintf("tap,id=net0,fd=%d", nicFD),
			"-device", "virtio-net-device,netdev=net0,mac="+c.NIC.MAC.String())
	}
	return args
}

func validSerial(s string) bool {
	if s == "" || len(s) > 20 {
		return false
	}
	for _, r := range s {
		if !(r >= 'a' && r <= 'z' || r >= 'A' && r <= 'Z' || r >= '0' && r <= '9' || r == '-' || r == '_') {
			return false
		}
	}
	return true
}

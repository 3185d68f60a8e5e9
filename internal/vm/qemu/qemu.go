// Package qemu runs one microVM: the QEMU command line of a `microvm`
// machine (or a q35 one, for a VM with pmem layers), the QEMU process's
// lifetime (start, a boot watchdog, kill, wait), its serial console kept in
// a size-capped log, and the paths of the sockets through which the host
// reaches it: the QMP monitor (package qmp) and the agent's virtio-serial
// port, channel.PortName in the guest (package channel).
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
//
// Read-only layers may be pmem drives (Drive.Pmem): QEMU maps the file
// shared and the guest mounts it with DAX, so the guests of a node read
// one copy in the host's page cache instead of each caching the layer in
// its own RAM. virtio-pmem needs a machine with a device memory region,
// which microvm lacks (it places no memory devices: the guest sees the
// device at address 0), so a VM with pmem drives is a q35 machine. With
// FreePageReporting the guest hands the pages it frees back to the host
// (virtio-balloon's free page reporting).
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
	// TCG emulates the guest's CPU (-accel tcg -cpu max, less the fast
	// string flags: TCGCPU).
	TCG Accel = "tcg"
)

// Machine is QEMU's machine type.
type Machine string

const (
	// Microvm is QEMU's minimal machine: virtio-mmio devices, no PCI, no
	// firmware to speak of; the quickest boot.
	Microvm Machine = "microvm"
	// Q35 is the PC machine with PCIe, whose memory map has room for
	// memory devices: virtio-pmem works there. Its boot takes about
	// 0.3 s more wall time under TCG (docs/microvm.md).
	Q35 Machine = "q35"
)

// PmemAlign is what a pmem drive's file size must be a multiple of: Linux
// maps device memory in sections of 2 MiB, and QEMU does not grow a
// read-only file.
const PmemAlign = 2 << 20

// MaxPmem is how many pmem drives a VM takes: one PCI slot each, from
// pmemSlot0 up to the slot below the chipset's (0x1f).
const (
	pmemSlot0 = 0x10
	MaxPmem   = 0x1f - pmemSlot0
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
	// Machine is QEMU's machine type ("" = Q35 when a drive is a pmem
	// drive, else Microvm).
	Machine Machine
	Paused  bool // start with the vCPUs stopped (-S), for QMP's cont to run
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
	// Drives are the guest's disks, virtio-blk (or virtio-pmem) devices
	// in this order.
	Drives []Drive
	// FreePageReporting adds a virtio-balloon device whose free page
	// reporting hands the pages the guest frees back to the host, in
	// blocks of 2 MiB, a few seconds after they are freed.
	FreePageReporting bool
	// NIC is the guest's network card; nil = none.
	NIC *NIC
	// ConsoleLimit caps the console's log on disk, in bytes: the log is
	// kept in two files of half as much each (0 = 1 MiB).
	ConsoleLimit int64
}

// Drive is one disk of the guest: a raw image file on the host. The guest
// finds it by its serial (/sys/block/vdX/serial), not by its order: the
// kernel's order of virtio-mmio devices is not the command line's; a pmem
// drive, which has no serial, by its PCI address (Config.GuestRef).
type Drive struct {
	Path     string
	Serial   string // at most 20 bytes of [A-Za-z0-9_-]
	ReadOnly bool
	// Pmem attaches the file as a read-only virtio-pmem device in place
	// of a virtio-blk disk: QEMU maps it shared (memory-backend-file,
	// share=on, readonly=on), so what the guest reads through DAX is the
	// host's page cache of the file, one copy for every VM of the node.
	// The file's size must be a multiple of PmemAlign (QEMU never writes
	// to it), and a file served by FUSE must allow a shared mmap. A VM
	// with pmem drives is a Q35 machine.
	Pmem bool

	size int64 // the file's, for a pmem drive (set by fill)
}

// PmemRefPrefix starts Config.GuestRef's name of a pmem drive: the rest
// is the device's PCI address, which guest mode matches against the
// device path of /sys/block/pmemN.
const PmemRefPrefix = "pmem@"

// GuestRef is how the guest finds drive i: its serial for a virtio-blk
// disk, PmemRefPrefix and its PCI address for a pmem drive (the n-th
// pmem drive sits in slot 0x10+n of bus 0). Guest mode's --layer takes
// either.
func (c *Config) GuestRef(i int) string {
	if !c.Drives[i].Pmem {
		return c.Drives[i].Serial
	}
	return fmt.Sprintf("%s0000:00:%02x.0", PmemRefPrefix, c.pmemSlot(i))
}

// pmemSlot is the PCI slot of drive i, a pmem drive: the n-th sits in
// slot pmemSlot0+n.
func (c *Config) pmemSlot(i int) int {
	n := 0
	for _, d := range c.Drives[:i] {
		if d.Pmem {
			n++
		}
	}
	return pmemSlot0 + n
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
	if c.Machine == "" {
		c.Machine = Microvm
		if c.pmemDrives() > 0 {
			c.Machine = Q35
		}
	}
	for i := range c.Drives {
		d := &c.Drives[i]
		if !d.Pmem || d.Path == "" {
			continue
		}
		fi, err := os.Stat(d.Path)
		if err != nil {
			return fmt.Errorf("check vm config: pmem drive %s: %w", d.Serial, err)
		}
		d.size = fi.Size()
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
	if c.Machine != Microvm && c.Machine != Q35 {
		return fmt.Errorf("check vm config: machine %q: %w", c.Machine, errdefs.ErrInvalidArgument)
	}
	for _, d := range c.Drives {
		if d.Path == "" || strings.Contains(d.Path, ",") || !validSerial(d.Serial) {
			return fmt.Errorf("check vm config: drive %q (serial %q): a path without commas and a serial of 1 to 20 letters, digits, - or _: %w",
				d.Path, d.Serial, errdefs.ErrInvalidArgument)
		}
		if !d.Pmem {
			continue
		}
		switch {
		case c.Machine != Q35:
			return fmt.Errorf("check vm config: pmem drive %s: virtio-pmem needs a q35 machine (microvm places no memory devices): %w", d.Serial, errdefs.ErrInvalidArgument)
		case !d.ReadOnly:
			return fmt.Errorf("check vm config: pmem drive %s: only read-only files are attached as pmem: %w", d.Serial, errdefs.ErrInvalidArgument)
		case d.size <= 0 || d.size%PmemAlign != 0:
			return fmt.Errorf("check vm config: pmem drive %s: %s is %d bytes, not a multiple of %d (Linux maps device memory in 2 MiB sections): %w",
				d.Serial, d.Path, d.size, PmemAlign, errdefs.ErrInvalidArgument)
		}
	}
	if n := c.pmemDrives(); n > MaxPmem {
		return fmt.Errorf("check vm config: %d pmem drives, at most %d: %w", n, MaxPmem, errdefs.ErrInvalidArgument)
	}
	if c.NIC != nil && (c.NIC.Tap == nil || len(c.NIC.MAC) != 6) {
		return fmt.Errorf("check vm config: a NIC needs an open tap and a 6-byte MAC: %w", errdefs.ErrInvalidArgument)
	}
	if strings.ContainsAny(c.Cmdline, "\n\x00") {
		return fmt.Errorf("check vm config: the kernel command line has a newline or NUL: %w", errdefs.ErrInvalidArgument)
	}
	return nil
}

// TCGCPU is the CPU model of a TCG guest: every feature TCG has (max) but
// ERMS and FSRM, the flags that tell the guest "rep movsb" and "rep stosb"
// are the fastest copies. They are on a real CPU, and the guest kernel
// (memcpy, copy_user, clear_page) and Go's runtime then copy and zero a
// byte per iteration; TCG (QEMU 7.2) runs each iteration of a rep string
// instruction as one pass through its translated block, so byte loops
// cost it eight times the word loops the guest picks without the flags.
// Measured in a boot's copies (the initramfs unpacked, the modules loaded,
// pages zeroed): the guest's uptime at /init ~0.15 s sooner and its modules
// and root ~0.1 s (docs/microvm.md, "Boot timeline").
const TCGCPU = "max,-erms,-fsrm"

// KernelCmdline is the guest kernel's command line: its console on the
// serial port, a panic or reboot that ends QEMU at once (with -no-reboot),
// no crypto self-tests, and under TCG the TSC frequency.
func (c *Config) KernelCmdline() string {
	// cryptomgr.notests: Debian's kernel tests every crypto algorithm it
	// registers at boot (crypto_algapi_init), 236 ms of a TCG boot's ~1.5 s
	// to /init; the tests check the kernel's own implementations, which
	// Debian tested, and guard nothing of a sandbox's.
	parts := []string{"console=ttyS0", "quiet", "reboot=t", "panic=-1", "cryptomgr.notests"}
	if c.Accel == TCG {
		parts = append(parts, "tsc_early_khz="+strconv.FormatInt(c.TSCkHz, 10))
	}
	if c.Machine == Q35 && c.pmemDrives() > 0 {
		// The pmem devices sit above 4 GiB, so the kernel would set up
		// 64 MiB of zeroed DMA bounce buffers, which our virtio devices
		// (no DMA API without VIRTIO_F_ACCESS_PLATFORM) never use.
		parts = append(parts, "swiotlb=noforce")
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
	machine := string(c.Machine)
	if c.Machine == Q35 {
		// What a guest of ours does not use: its boot is a little quicker.
		machine += ",sata=off,smbus=off,usb=off,vmport=off,i8042=off,hpet=off"
	}
	args := []string{
		"-name", "dsec-" + filepath.Base(c.Dir),
		"-M", machine,
		"-accel", accel,
	}
	if c.Accel == KVM {
		args = append(args, "-cpu", "host")
	} else {
		args = append(args, "-cpu", TCGCPU)
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
	memory := strconv.Itoa(c.MemoryMiB)
	if pmem := c.pmemBytes(); pmem > 0 {
		// Room for the pmem devices beside the RAM.
		memory += fmt.Sprintf(",maxmem=%dM", c.MemoryMiB+int(pmem>>20))
	}
	args = append(args,
		"-m", memory,
		"-smp", strconv.Itoa(c.VCPUs),
		"-nodefaults", "-no-user-config", "-display", "none", "-no-reboot",
		"-kernel", c.Kernel,
		"-initrd", c.Initrd,
		"-append", c.KernelCmdline(),
		"-chardev", fmt.Sprintf("socket,id=console,fd=%d,server=on,wait=on", consoleFD),
		"-serial", "chardev:console",
		"-chardev", fmt.Sprintf("socket,id=qmp,fd=%d,server=on,wait=off", qmpFD),
		"-mon", "chardev=qmp,mode=control",
		"-device", c.virtio("serial"),
		"-chardev", fmt.Sprintf("socket,id=%s,fd=%d,server=on,wait=off", ChannelChardev, channelFD),
		"-device", fmt.Sprintf("virtserialport,chardev=%s,name=%s,id=%s", ChannelChardev, channel.PortName, ChannelPortID),
	)
	for i, d := range c.Drives {
		if d.Pmem {
			// align: every device's address stays on a 2 MiB boundary.
			args = append(args,
				"-object", fmt.Sprintf("memory-backend-file,id=pmem%d,mem-path=%s,size=%d,share=on,readonly=on,align=%d", i, d.Path, d.size, PmemAlign),
				"-device", fmt.Sprintf("virtio-pmem-pci,memdev=pmem%d,id=disk%d,addr=0x%02x.0", i, i, c.pmemSlot(i)))
			continue
		}
		drive := fmt.Sprintf("file=%s,format=raw,if=none,id=disk%d", d.Path, i)
		if d.ReadOnly {
			drive += ",readonly=on"
		}
		args = append(args, "-drive", drive,
			"-device", fmt.Sprintf("%s,drive=disk%d,serial=%s", c.virtio("blk"), i, d.Serial))
	}
	if c.FreePageReporting {
		args = append(args, "-device", c.virtio("balloon")+",free-page-reporting=on")
	}
	if c.NIC != nil {
		args = append(args, "-netdev", fmt.Sprintf("tap,id=net0,fd=%d", nicFD),
			"-device", c.virtio("net")+",netdev=net0,mac="+c.NIC.MAC.String())
	}
	return args
}

// virtio is the name of the virtio device kind on c's machine: on the
// virtio-mmio transport on microvm, on PCI on q35.
func (c *Config) virtio(kind string) string {
	if c.Machine == Q35 {
		return "virtio-" + kind + "-pci"
	}
	return "virtio-" + kind + "-device"
}

func (c *Config) pmemDrives() int {
	n := 0
	for _, d := range c.Drives {
		if d.Pmem {
			n++
		}
	}
	return n
}

func (c *Config) pmemBytes() int64 {
	var n int64
	for _, d := range c.Drives {
		if d.Pmem {
			n += d.size
		}
	}
	return n
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

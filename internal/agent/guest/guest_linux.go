// Package guest is dsec-agent's guest mode: pid 1 of a microVM, run by the
// kernel as the initramfs's /init. It mounts /proc, /sys and /dev, loads the
// kernel's modules in the order of the manifest the host packed beside them
// (package kernel), finds the virtio-serial port named dsec.0 and serves
// the agent on it, one yamux stream per connection of the edge's (package
// channel). When the agent stops, the guest powers off, so QEMU exits.
package guest

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"time"

	"golang.org/x/sys/unix"

	"dsec.dev/dsec/internal/agent"
	"dsec.dev/dsec/internal/vm/channel"
	"dsec.dev/dsec/internal/vm/guestcfg"
	"dsec.dev/dsec/internal/vm/kernel"
)

// Config is guest mode's configuration.
type Config struct {
	Agent     agent.Config  // the agent's (its ListenFD is not used)
	KernelDir string        // the modules and their manifest ("" = kernel.GuestDir)
	Port      string        // the agent's port's name ("" = channel.PortName)
	PortWait  time.Duration // how long the port may take to appear (0 = 30 s)
	// Layers are the read-only EROFS disks of the root, lowest first:
	// each a virtio-blk disk's serial, or "pmem@" and the PCI address of
	// a virtio-pmem device (qemu.Config.GuestRef), mounted with DAX; none
	// keeps the initramfs as the root.
	Layers []string
	// Upper is the serial of the writable ext4 disk the root's changes go
	// to ("" = a tmpfs).
	Upper string
	// Network configures the guest's network card and the root's
	// /etc/resolv.conf; nil = loopback only.
	Network *Network
}

// Run prepares the guest and serves the agent until ctx ends or the agent
// stops.
func Run(ctx context.Context, cfg Config) error {
	log := cfg.Agent.Log
	if log == nil {
		log = slog.New(slog.DiscardHandler)
		cfg.Agent.Log = log
	}
	cfg.Agent.Guest = true
	if cfg.KernelDir == "" {
		cfg.KernelDir = kernel.GuestDir
	}
	if cfg.Port == "" {
		cfg.Port = channel.PortName
	}
	if cfg.PortWait == 0 {
		cfg.PortWait = 30 * time.Second
	}
	start := time.Now()
	upInit := uptime()
	if err := mountAll(); err != nil {
		return err
	}
	k, err := kernel.Load(cfg.KernelDir)
	if err != nil {
		return err
	}
	loaded, failed, slowest := loadModules(k, log, present)
	modulesTook, upModules := time.Since(start), uptime()
	if cfg.KernelDir == kernel.GuestDir {
		// The initramfs is RAM the guest keeps for as long as it runs:
		// its module files are of no use once loaded.
		if err := os.RemoveAll(kernel.GuestDir); err != nil {
			log.Warn("remove the loaded modules", "err", err)
		}
	}
	if err := upLoopback(); err != nil {
		return err
	}
	if cfg.Network != nil {
		iface, err := cfg.Network.configure(10 * time.Second)
		if err != nil {
			return err
		}
		log.Info("guest network", "iface", iface, "addr", cfg.Network.Addr, "gateway", cfg.Network.Gateway, "mtu", cfg.Network.MTU)
	}
	given, err := enterRoot(cfg.Layers, cfg.Upper, log)
	if err != nil {
		return err
	}
	upRoot := uptime()
	if given != nil {
		apply(&cfg.Agent, *given)
		if err := sandboxCgroup(&cfg.Agent, given.Pids); err != nil {
			return err
		}
	}
	if cfg.Network != nil {
		if err := cfg.Network.writeResolvConf(); err != nil {
			return err
		}
	}
	if len(cfg.Layers) > 0 {
		// The initramfs's /init is out of the root's reach; its bind is not.
		cfg.Agent.AgentPath = guestAgentPath
	}
	dev, err := findPort(ctx, cfg.Port, cfg.PortWait)
	if err != nil {
		if len(failed) > 0 {
			err = fmt.Errorf("%w (modules that did not load: %s)", err, strings.Join(failed, ", "))
		}
		return err
	}
	// The boot's timeline on the guest's clock (since its kernel
	// started): init ran, the modules loaded, the root made, the port
	// found (the agent serves from here). docs/microvm.md, "Boot timeline".
	log.Info("guest ready", "kernel", k.Version, "modules", loaded, "modules_took", modulesTook.Round(time.Millisecond),
		"port", dev, "took", time.Since(start).Round(time.Millisecond),
		"up_init", upInit, "up_modules", upModules, "up_root", upRoot, "up_port", uptime(), "slowest_modules", slowest)
	return agent.ServeListener(ctx, cfg.Agent, channel.Listen(dev, log))
}

// apply sets what the host's configuration gives over the flags'.
func apply(a *agent.Config, g guestcfg.Agent) {
	for _, f := range []struct {
		dst *string
		v   string
	}{{&a.User, g.User}, {&a.Workdir, g.Workdir}, {&a.Hostname, g.Hostname}, {&a.Address, g.Address}} {
		if f.v != "" {
			*f.dst = f.v
		}
	}
	a.Env = append(a.Env, g.Env...)
	if g.OutputLimit > 0 {
		a.OutputLimit = g.OutputLimit
	}
}

// sandboxCgroup is the guest's cgroup of the sandbox's commands,
// /sys/fs/cgroup/sandbox, with the pids limit (pids > 0), under which the
// agent makes each command's cgroup as it does in a container on cgroup
// v2; the agent itself stays in the root. Its memory.events tells the
// agent a command the guest's OOM killer ended (the guest's memory is the
// sandbox's limit).
func sandboxCgroup(a *agent.Config, pids int64) error {
	const root = "/sys/fs/cgroup"
	for _, c := range []string{"+memory", "+pids"} {
		if err := os.WriteFile(filepath.Join(root, "cgroup.subtree_control"), []byte(c), 0); err != nil {
			return fmt.Errorf("enable the %s controller: %w", c[1:], err)
		}
	}
	dir := filepath.Join(root, "sandbox")
	if err := os.Mkdir(dir, 0o755); err != nil && !errors.Is(err, os.ErrExist) {
		return fmt.Errorf("make the sandbox's cgroup: %w", err)
	}
	if pids > 0 {
		if err := os.WriteFile(filepath.Join(dir, "pids.max"), []byte(fmt.Sprint(pids)), 0); err != nil {
			return fmt.Errorf("limit the sandbox to %d pids: %w", pids, err)
		}
	}
	// The guest's memory less a reserve for the kernel and the agent: a
	// command that outgrows it meets the cgroup's OOM killer at once,
	// where the guest's own would first thrash the page cache (the
	// root's files, read again from disk) for minutes.
	total, err := memTotal()
	if err != nil {
		return err
	}
	limit := max(total-memoryReserve, total/2)
	if err := os.WriteFile(filepath.Join(dir, "memory.max"), []byte(fmt.Sprint(limit)), 0); err != nil {
		return fmt.Errorf("limit the sandbox to %d bytes: %w", limit, err)
	}
	fd, err := unix.Open(dir, unix.O_DIRECTORY|unix.O_RDONLY, 0)
	if err != nil {
		return fmt.Errorf("open the sandbox's cgroup: %w", err)
	}
	a.CgroupFD, a.MemoryCgroupFD = fd, fd
	return nil
}

// memoryReserve is what of the guest's memory the sandbox's commands
// leave to the kernel and the agent.
const memoryReserve = 64 << 20

// memTotal is the guest's memory, from /proc/meminfo.
func memTotal() (int64, error) {
	b, err := os.ReadFile("/proc/meminfo")
	if err != nil {
		return 0, fmt.Errorf("read the guest's memory: %w", err)
	}
	for _, line := range strings.Split(string(b), "\n") {
		if v, ok := strings.CutPrefix(line, "MemTotal:"); ok {
			var kb int64
			if _, err := fmt.Sscanf(strings.TrimSpace(v), "%d kB", &kb); err != nil {
				return 0, fmt.Errorf("read the guest's memory: %q: %w", line, err)
			}
			return kb << 10, nil
		}
	}
	return 0, fmt.Errorf("read the guest's memory: no MemTotal in /proc/meminfo")
}

// PowerOff ends the VM: QEMU exits when its guest powers off.
func PowerOff() error {
	unix.Sync()
	return unix.Reboot(unix.LINUX_REBOOT_CMD_POWER_OFF)
}

// mount is one mount init makes.
type mount struct {
	source, target, fstype string
	flags                  uintptr
	data                   string
}

// mounts are the file systems every guest has, in order.
var mounts = []mount{
	// hidepid=ptraceable, as a container's /proc: the agent (pid 1) is
	// non-dumpable and no command holds CAP_SYS_PTRACE, so root in the
	// guest does not even see it.
	{"proc", "/proc", "proc", unix.MS_NOSUID | unix.MS_NODEV | unix.MS_NOEXEC, "hidepid=ptraceable"},
	{"sysfs", "/sys", "sysfs", unix.MS_NOSUID | unix.MS_NODEV | unix.MS_NOEXEC, ""},
	{"devtmpfs", "/dev", "devtmpfs", unix.MS_NOSUID, "mode=0755"},
	{"devpts", "/dev/pts", "devpts", unix.MS_NOSUID | unix.MS_NOEXEC, "mode=0620,ptmxmode=0666"},
	{"tmpfs", "/dev/shm", "tmpfs", unix.MS_NOSUID | unix.MS_NODEV, "mode=1777"},
	{"tmpfs", "/run", "tmpfs", unix.MS_NOSUID | unix.MS_NODEV, "mode=0755"},
	{"cgroup2", "/sys/fs/cgroup", "cgroup2", unix.MS_NOSUID | unix.MS_NODEV | unix.MS_NOEXEC, ""},
}

func mountAll() error {
	for _, m := range mounts {
		if err := os.MkdirAll(m.target, 0o755); err != nil {
			return fmt.Errorf("mount %s: %w", m.target, err)
		}
		err := unix.Mount(m.source, m.target, m.fstype, m.flags, m.data)
		if err != nil && !errors.Is(err, unix.EBUSY) {
			return fmt.Errorf("mount %s on %s: %w", m.fstype, m.target, err)
		}
	}
	return nil
}

// deviceModules are the modules of the kernel directory that serve only
// a device a VM may not have, by the device: a virtio device's ID
// (/sys/bus/virtio/devices/*/device), or "pci" for the virtio PCI
// transport (a q35 VM's). Such a module is loaded only when the device is
// there: on a microvm machine without a network card or pmem layers, the
// PCI, vsock, network and pmem modules cost a TCG boot ~100 ms for nothing.
var deviceModules = map[string]string{
	"virtio_pci_legacy_dev": "pci", "virtio_pci_modern_dev": "pci", "virtio_pci": "pci",
	"vsock": virtioVsock, "vmw_vsock_virtio_transport_common": virtioVsock, "vmw_vsock_virtio_transport": virtioVsock,
	"failover": virtioNet, "net_failover": virtioNet, "virtio_net": virtioNet,
	"libnvdimm": virtioPmem, "nd_virtio": virtioPmem, "virtio_pmem": virtioPmem, "nd_btt": virtioPmem, "nd_pmem": virtioPmem,
}

// The virtio device IDs of deviceModules, as sysfs writes them.
const (
	virtioNet   = "0x0001"
	virtioVsock = "0x0013"
	virtioPmem  = "0x001b"
)

// present reports whether the guest has device (deviceModules' key),
// true when it cannot tell. Virtio devices are on the bus once their
// transport's module is loaded, which the load order puts first.
func present(device string) bool {
	if device == "pci" {
		return anyFileHolds("/sys/bus/pci/devices/*/vendor", "0x1af4")
	}
	return anyFileHolds("/sys/bus/virtio/devices/*/device", device)
}

// anyFileHolds reports whether a file matching pattern holds value (true
// when the files cannot be read).
func anyFileHolds(pattern, value string) bool {
	paths, err := filepath.Glob(pattern)
	if err != nil {
		return true
	}
	for _, p := range paths {
		b, err := os.ReadFile(p)
		if err != nil || strings.TrimSpace(string(b)) == value {
			return true
		}
	}
	return false
}

// loadModules loads k's modules in order, but those of deviceModules whose
// device is not present, and returns how many it loaded
// and the names of those that failed (each logged). A module the kernel
// already has is loaded.
func loadModules(k *kernel.Kernel, log *slog.Logger, present func(device string) bool) (int, []string, string) {
	var failed []string
	type took struct {
		name string
		d    time.Duration
	}
	var tooks []took
	n := 0
	has := map[string]bool{}
	for _, name := range k.Modules {
		if dev, ok := deviceModules[name]; ok {
			if _, seen := has[dev]; !seen {
				has[dev] = present(dev)
			}
			if !has[dev] {
				continue
			}
		}
		t := time.Now()
		if err := loadModule(k.ModulePath(name)); err != nil {
			log.Warn("load module", "module", name, "err", err)
			failed = append(failed, name)
			continue
		}
		tooks = append(tooks, took{name, time.Since(t)})
		n++
	}
	slices.SortFunc(tooks, func(a, b took) int { return cmp.Compare(b.d, a.d) })
	var slowest []string
	for _, t := range tooks[:min(5, len(tooks))] {
		slowest = append(slowest, fmt.Sprintf("%s:%dms", t.name, t.d.Milliseconds()))
	}
	return n, failed, strings.Join(slowest, ",")
}

// uptime is the guest's clock since its kernel started (CLOCK_BOOTTIME),
// to the millisecond.
func uptime() time.Duration {
	var ts unix.Timespec
	if err := unix.ClockGettime(unix.CLOCK_BOOTTIME, &ts); err != nil {
		return 0
	}
	return time.Duration(ts.Nano()).Round(time.Millisecond)
}

func loadModule(path string) error {
	f, err := os.Open(path)
	if err != nil {
		return err
	}
	defer f.Close()
	// Debian signs its modules but does not enforce signatures: the plain
	// load works.
	if err := unix.FinitModule(int(f.Fd()), "", 0); err != nil && !errors.Is(err, unix.EEXIST) {
		return fmt.Errorf("finit_module %s: %w", path, err)
	}
	return nil
}

// Where enterRoot mounts the root's parts, in the initramfs, and where the
// agent is in the root.
const (
	guestAgentPath = "/.dsec/bin/dsec-agent"
	rootDir        = "/.dsec/root"
	layersDir      = "/.dsec/layers"
	upperDir       = "/.dsec/upper"
)

// enterRoot makes the sandbox's root and makes it the agent's: the layers'
// EROFS disks stacked with overlayfs over the writable disk (or a tmpfs),
// the agent and its shell bound in read-only at /.dsec/bin, /dev, /proc,
// /sys and /run moved in, then the root moved over the initramfs's and
// chrooted into (the initramfs cannot be pivoted away). It returns the
// agent configuration the host left at the writable disk's root, nil when
// there is none.
func enterRoot(layers []string, upper string, log *slog.Logger) (*guestcfg.Agent, error) {
	if len(layers) == 0 {
		return nil, nil
	}
	var given *guestcfg.Agent
	var lowers []string
	for i, ref := range layers {
		dir := filepath.Join(layersDir, fmt.Sprint(i))
		if err := mountLayer(ref, dir, log); err != nil {
			return nil, err
		}
		lowers = append([]string{dir}, lowers...) // overlayfs lists the top first
	}
	if upper != "" {
		dev, err := diskBySerial(upper, 10*time.Second)
		if err != nil {
			return nil, err
		}
		// noinit_itable: the host made the file system with its inode
		// tables left unwritten on a sparse file (they read as zeros), so
		// the guest need not spend CPU zeroing them, nor the host's disk
		// blocks holding the zeros.
		if err := mountAt(dev, upperDir, "ext4", unix.MS_NODEV, "noinit_itable"); err != nil {
			return nil, err
		}
		if _, err := os.Stat(filepath.Join(upperDir, guestcfg.FileName)); err == nil {
			g, err := guestcfg.Read(filepath.Join(upperDir, guestcfg.FileName))
			if err != nil {
				return nil, err
			}
			given = &g
		}
	} else if err := mountAt("tmpfs", upperDir, "tmpfs", unix.MS_NODEV, "mode=0755"); err != nil {
		return nil, err
	}
	for _, d := range []string{"upper", "work"} {
		if err := os.MkdirAll(filepath.Join(upperDir, d), 0o755); err != nil {
			return nil, fmt.Errorf("make the root: %w", err)
		}
	}
	opts := fmt.Sprintf("lowerdir=%s,upperdir=%s/upper,workdir=%s/work", strings.Join(lowers, ":"), upperDir, upperDir)
	if err := mountAt("overlay", rootDir, "overlay", 0, opts); err != nil {
		return nil, err
	}
	for src, dst := range map[string]string{"/init": guestAgentPath, agent.DefaultShell: agent.DefaultShell} {
		if err := bindFile(src, filepath.Join(rootDir, dst)); err != nil {
			return nil, err
		}
	}
	for _, m := range []string{"/dev", "/proc", "/sys", "/run"} {
		if err := os.MkdirAll(rootDir+m, 0o755); err != nil {
			return nil, fmt.Errorf("make the root: %w", err)
		}
		if err := unix.Mount(m, rootDir+m, "", unix.MS_MOVE, ""); err != nil {
			return nil, fmt.Errorf("move %s into the root: %w", m, err)
		}
	}
	if err := unix.Chdir(rootDir); err != nil {
		return nil, fmt.Errorf("enter the root: %w", err)
	}
	if err := unix.Mount(rootDir, "/", "", unix.MS_MOVE, ""); err != nil {
		return nil, fmt.Errorf("move the root over /: %w", err)
	}
	if err := unix.Chroot("."); err != nil {
		return nil, fmt.Errorf("enter the root: %w", err)
	}
	if err := unix.Chdir("/"); err != nil {
		return nil, fmt.Errorf("enter the root: %w", err)
	}
	return given, nil
}

func mountAt(source, target, fstype string, flags uintptr, data string) error {
	if err := os.MkdirAll(target, 0o755); err != nil {
		return fmt.Errorf("mount %s: %w", target, err)
	}
	if err := unix.Mount(source, target, fstype, flags, data); err != nil {
		return fmt.Errorf("mount %s %s on %s: %w", fstype, source, target, err)
	}
	return nil
}

// bindFile binds the file src read-only at dst, making dst (in the
// overlay's upper layer) first. A src the initramfs lacks is skipped.
func bindFile(src, dst string) error {
	if _, err := os.Stat(src); err != nil {
		return nil
	}
	if err := os.MkdirAll(filepath.Dir(dst), 0o755); err != nil {
		return fmt.Errorf("bind %s: %w", dst, err)
	}
	f, err := os.OpenFile(dst, os.O_WRONLY|os.O_CREATE, 0o755)
	if err != nil {
		return fmt.Errorf("bind %s: %w", dst, err)
	}
	f.Close()
	if err := unix.Mount(src, dst, "", unix.MS_BIND, ""); err != nil {
		return fmt.Errorf("bind %s at %s: %w", src, dst, err)
	}
	if err := unix.Mount("", dst, "", unix.MS_BIND|unix.MS_REMOUNT|unix.MS_RDONLY|unix.MS_NOSUID|unix.MS_NODEV, ""); err != nil {
		return fmt.Errorf("bind %s read-only: %w", dst, err)
	}
	return nil
}

// pmemRefPrefix starts a layer's name that is a virtio-pmem device's PCI
// address (the host's qemu.PmemRefPrefix).
const pmemRefPrefix = "pmem@"

// mountLayer mounts the read-only EROFS layer ref at dir. A pmem layer is
// mounted with dax=always: its files' pages are the host's, mapped into
// the guest, not copies in the guest's page cache. EROFS gives DAX to the
// files it stores flat and uncompressed (the store builds layers so) and
// reads the rest through the page cache; a kernel that refuses the option
// gets the layer mounted without it.
func mountLayer(ref, dir string, log *slog.Logger) error {
	const flags = unix.MS_RDONLY | unix.MS_NODEV
	addr, pmem := strings.CutPrefix(ref, pmemRefPrefix)
	if !pmem {
		dev, err := diskBySerial(ref, 10*time.Second)
		if err != nil {
			return err
		}
		return mountAt(dev, dir, "erofs", flags, "")
	}
	dev, err := pmemByAddr(addr, 10*time.Second)
	if err != nil {
		return err
	}
	err = mountAt(dev, dir, "erofs", flags, "dax=always")
	if errors.Is(err, unix.EINVAL) || errors.Is(err, unix.EOPNOTSUPP) {
		log.Warn("mount pmem layer without DAX", "dev", dev, "err", err)
		err = mountAt(dev, dir, "erofs", flags, "")
	}
	if err != nil {
		return err
	}
	log.Info("pmem layer", "dev", dev, "pci", addr, "dax", hasMountOption(dir, "dax=always"))
	return nil
}

// hasMountOption says whether the mount at dir has option opt, as
// /proc/self/mounts lists it (EROFS drops dax=always on a device without
// DAX).
func hasMountOption(dir, opt string) bool {
	b, err := os.ReadFile("/proc/self/mounts")
	if err != nil {
		return false
	}
	for _, line := range strings.Split(string(b), "\n") {
		f := strings.Fields(line)
		if len(f) >= 4 && f[1] == dir {
			return slices.Contains(strings.Split(f[3], ","), opt)
		}
	}
	return false
}

// pmemByAddr waits for the pmem block device of the virtio-pmem device at
// PCI address addr (e.g. 0000:00:10.0) and returns it: /sys/block/pmemN
// links to a path through the PCI device, its namespace and region.
func pmemByAddr(addr string, wait time.Duration) (string, error) {
	deadline := time.Now().Add(wait)
	for {
		entries, _ := os.ReadDir("/sys/block")
		for _, e := range entries {
			if !strings.HasPrefix(e.Name(), "pmem") {
				continue
			}
			target, err := filepath.EvalSymlinks(filepath.Join("/sys/block", e.Name()))
			if err != nil || !strings.Contains(target, "/"+addr+"/") {
				continue
			}
			dev := filepath.Join("/dev", e.Name())
			if _, err := os.Stat(dev); err == nil {
				return dev, nil
			}
		}
		if time.Now().After(deadline) {
			return "", fmt.Errorf("find pmem layer %s: no pmem device under that PCI address after %s", addr, wait)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// diskBySerial waits for the virtio-blk disk whose serial is serial and
// returns its device.
func diskBySerial(serial string, wait time.Duration) (string, error) {
	deadline := time.Now().Add(wait)
	for {
		entries, _ := os.ReadDir("/sys/block")
		for _, e := range entries {
			b, err := os.ReadFile(filepath.Join("/sys/block", e.Name(), "serial"))
			if err == nil && strings.TrimSpace(string(b)) == serial {
				dev := filepath.Join("/dev", e.Name())
				if _, err := os.Stat(dev); err == nil {
					return dev, nil
				}
			}
		}
		if time.Now().After(deadline) {
			return "", fmt.Errorf("find disk %s: no virtio-blk disk has that serial after %s", serial, wait)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// portsDir lists the guest's virtio-serial ports, each with its name.
const portsDir = "/sys/class/virtio-ports"

// findPort waits for the virtio-serial port called name and returns its
// device. Ports appear after the driver loads, as the host announces them.
func findPort(ctx context.Context, name string, wait time.Duration) (string, error) {
	deadline := time.Now().Add(wait)
	for {
		entries, _ := os.ReadDir(portsDir)
		for _, e := range entries {
			b, err := os.ReadFile(filepath.Join(portsDir, e.Name(), "name"))
			if err != nil || strings.TrimSpace(string(b)) != name {
				continue
			}
			dev := filepath.Join("/dev", e.Name())
			if _, err := os.Stat(dev); err == nil {
				return dev, nil
			}
		}
		if time.Now().After(deadline) {
			return "", fmt.Errorf("find virtio-serial port %s: none in %s after %s (%d ports)", name, portsDir, wait, len(entries))
		}
		select {
		case <-ctx.Done():
			return "", fmt.Errorf("find virtio-serial port %s: %w", name, ctx.Err())
		case <-time.After(10 * time.Millisecond):
		}
	}
}

package microvm

import (
	"context"
	"errors"
	"fmt"
	"io/fs"
	"log/slog"
	"maps"
	"math"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"

	"connectrpc.com/connect"
	"golang.org/x/sys/unix"

	agentv1 "dsec.dev/dsec/api/gen/dsec/agent/v1"
	"dsec.dev/dsec/internal/agent/agentclient"
	"dsec.dev/dsec/internal/edge/backend"
	"dsec.dev/dsec/internal/edge/backend/cgroups"
	"dsec.dev/dsec/internal/errdefs"
	"dsec.dev/dsec/internal/qos"
	"dsec.dev/dsec/internal/vm/guestcfg"
	"dsec.dev/dsec/internal/vm/initramfs"
	"dsec.dev/dsec/internal/vm/kernel"
	"dsec.dev/dsec/internal/vm/qemu"
	"dsec.dev/dsec/internal/vm/vmnet"
	"dsec.dev/dsec/internal/vm/vmstate"
)

// Runtime runs microVM sandboxes: a backend.Runtime and a backend.Meter.
type Runtime struct {
	cfg      Config
	log      *slog.Logger
	channels *Channels

	// Set by Init.
	qemu   string
	kernel *kernel.Kernel
	accel  qemu.Accel
	layout *cgroups.Layout

	buildMu sync.Mutex
	initrd  string // built by the first Start (initramfs)

	mu  sync.Mutex
	vms map[string]*vm // the VMs this instance started, while they run
	// consoles follow the consoles of running VMs an earlier instance
	// started (Init), so their logs go on.
	consoles map[string]*qemu.Console
	// guestOOM is the last OOM kill count each running VM's agent
	// reported (Status), for when it cannot answer; frozen the VMs Freeze
	// stopped, whose agents cannot.
	guestOOM map[string]int64
	frozen   map[string]bool
}

// vm is a VM this instance started.
type vm struct {
	p       *qemu.Process
	watched chan struct{} // closed once its exit is recorded
}

// New returns a runtime for cfg. It checks nothing on the host: Init does.
func New(cfg Config) (*Runtime, error) {
	if cfg.StateDir == "" || cfg.KernelDir == "" || cfg.AgentDir == "" {
		return nil, fmt.Errorf("make microvm runtime: StateDir, KernelDir and AgentDir are required: %w", errdefs.ErrInvalidArgument)
	}
	if cfg.QEMU == "" {
		cfg.QEMU = qemu.DefaultBinary
	}
	if cfg.CgroupParent == "" {
		cfg.CgroupParent = defaultCgroupParent
	}
	if cfg.BootTimeout == 0 {
		cfg.BootTimeout = defaultBootTimeout
	}
	if cfg.Log == nil {
		cfg.Log = slog.New(slog.DiscardHandler)
	}
	if cfg.Channels == nil {
		cfg.Channels = NewChannels(cfg.Log)
	}
	if cfg.Accel == "" {
		cfg.Accel, _ = qemu.DetectAccel()
	}
	return &Runtime{cfg: cfg, log: cfg.Log, channels: cfg.Channels, vms: map[string]*vm{}, consoles: map[string]*qemu.Console{},
		guestOOM: map[string]int64{}, frozen: map[string]bool{}}, nil
}

// Features: network (a tap in the edge's namespace, package vmnet),
// pause (Pauser), snapshots (Snapshotter: the writable disk cloned) and
// the accelerator.
func (r *Runtime) Features() backend.Features {
	return backend.Features{Network: true, Pause: true, Snapshot: true, Accelerator: string(r.cfg.Accel)}
}

// Init checks that the node can run VMs (QEMU, the guest kernel, the
// agent) and prepares the state dir and the cgroup parent. A node that
// lacks a part is refused with ErrNotSupported naming what to install. The
// guest's initramfs is built by the first Start, so a node that never
// starts a VM does not pay for it.
func (r *Runtime) Init(ctx context.Context) error {
	bin, err := exec.LookPath(r.cfg.QEMU)
	if err != nil {
		return fmt.Errorf("init microvm runtime: QEMU %s is not installed (apt-get install qemu-system-x86): %w", r.cfg.QEMU, errdefs.ErrNotSupported)
	}
	k, err := kernel.Load(r.cfg.KernelDir)
	if err == nil {
		_, err = os.Stat(k.Vmlinux())
	}
	if err != nil {
		return fmt.Errorf("init microvm runtime: no guest kernel in %s (scripts/build-vm-kernel.sh %s makes it): %v: %w",
			r.cfg.KernelDir, r.cfg.KernelDir, err, errdefs.ErrNotSupported)
	}
	for _, f := range []string{"dsec-agent", "sh"} {
		if _, err := os.Stat(filepath.Join(r.cfg.AgentDir, f)); err != nil {
			return fmt.Errorf("init microvm runtime: the guest's agent and shell: %w", err)
		}
	}
	layout, err := cgroups.Detect()
	if err != nil {
		return fmt.Errorf("init microvm runtime: %w", err)
	}
	if err := layout.EnsureParent(r.cfg.CgroupParent); err != nil {
		return fmt.Errorf("init microvm runtime: %w", err)
	}
	if err := os.MkdirAll(r.vmsDir(), 0o700); err != nil {
		return fmt.Errorf("init microvm runtime: %w", err)
	}
	if err := r.clearCaptures(); err != nil {
		return fmt.Errorf("init microvm runtime: %w", err)
	}
	if err := r.clearForks(); err != nil {
		return fmt.Errorf("init microvm runtime: %w", err)
	}
	r.qemu, r.kernel, r.accel, r.layout = bin, k, r.cfg.Accel, layout
	r.followConsoles(ctx)
	r.log.Info("microvm runtime ready", "qemu", bin, "kernel", k.Version, "accel", r.cfg.Accel)
	return nil
}

// followConsoles follows the console of every running VM this instance
// did not start: a restarted edge's log of a re-adopted VM goes on, and a
// later failure quotes what it printed since.
func (r *Runtime) followConsoles(ctx context.Context) {
	ids, _ := r.List(ctx)
	for _, id := range ids {
		st, err := readState(r.vmDir(id))
		if err != nil || !alive(st.Pid, st.StartTicks) {
			continue
		}
		r.mu.Lock()
		_, started := r.vms[id]
		_, following := r.consoles[id]
		r.mu.Unlock()
		if started || following {
			continue
		}
		c, err := qemu.FollowConsole(r.vmDir(id), 0)
		if err != nil {
			r.log.Warn("follow the console of a re-adopted vm", "id", id, "err", err)
			continue
		}
		r.mu.Lock()
		r.consoles[id] = c
		r.mu.Unlock()
	}
}

// initramfs returns the guest's initramfs, building it on first use (once
// per agent and kernel: initramfs.Cached keeps it by a digest of its
// contents).
func (r *Runtime) initramfs() (string, error) {
	r.buildMu.Lock()
	defer r.buildMu.Unlock()
	if r.initrd != "" {
		return r.initrd, nil
	}
	initrd, err := initramfs.Cached(filepath.Join(r.cfg.StateDir, "initramfs"), initramfs.Image{
		Init:   filepath.Join(r.cfg.AgentDir, "dsec-agent"),
		Kernel: r.kernel,
		// The guest binds it into the sandbox's root at the same path.
		Files: []initramfs.File{{Name: guestShell, Source: filepath.Join(r.cfg.AgentDir, "sh"), Mode: 0o755}},
	})
	if err != nil {
		return "", err
	}
	r.initrd = initrd
	return initrd, nil
}

// guestShell is the agent's shell in the initramfs (agent.DefaultShell).
const guestShell = "/.dsec/bin/sh"

func (r *Runtime) vmsDir() string             { return filepath.Join(r.cfg.StateDir, "vms") }
func (r *Runtime) vmDir(id string) string     { return filepath.Join(r.vmsDir(), id) }
func (r *Runtime) cgroupRel(id string) string { return filepath.Join(r.cfg.CgroupParent, id) }

// Teardown undoes Init once every VM is deleted.
func (r *Runtime) Teardown(ctx context.Context) error {
	var errs []error
	if r.layout != nil {
		errs = append(errs, r.layout.RemoveParent(r.cfg.CgroupParent))
	}
	if err := os.Remove(r.vmsDir()); err != nil && !errors.Is(err, fs.ErrNotExist) {
		errs = append(errs, fmt.Errorf("tear down microvm runtime: %w", err))
	}
	if err := os.Remove(r.capturesDir()); err != nil && !errors.Is(err, fs.ErrNotExist) {
		errs = append(errs, fmt.Errorf("tear down microvm runtime: %w", err))
	}
	if err := os.Remove(r.forksDir()); err != nil && !errors.Is(err, fs.ErrNotExist) {
		errs = append(errs, fmt.Errorf("tear down microvm runtime: %w", err))
	}
	if err := os.RemoveAll(filepath.Join(r.cfg.StateDir, "initramfs")); err != nil {
		errs = append(errs, fmt.Errorf("tear down microvm runtime: %w", err))
	}
	return errors.Join(errs...)
}

// checkSpec refuses what no VM can be made of: layers without an image
// file (a node extracting tars), more layers than microvm has slots.
func (r *Runtime) checkSpec(s backend.Spec) error {
	if err := s.Validate(); err != nil {
		return err
	}
	bad := func(why string, kind error) error {
		return fmt.Errorf("check sandbox spec %q: %s: %w", s.ID, why, kind)
	}
	if len(s.Layers) > maxLayers {
		return bad(fmt.Sprintf("%d layers, a microVM takes at most %d", len(s.Layers), maxLayers), errdefs.ErrInvalidArgument)
	}
	for _, l := range s.Layers {
		if l.File == "" || l.FSType != backend.FSTypeEROFS {
			return bad(fmt.Sprintf("layer %s has no EROFS image file (a microVM attaches layer files as disks; a node in tar layer mode has none)", l.Digest), errdefs.ErrInvalidArgument)
		}
		if strings.Contains(l.File, ",") {
			return bad(fmt.Sprintf("layer file %q holds a comma", l.File), errdefs.ErrInvalidArgument)
		}
	}
	return nil
}

// size is what a spec's VM gets.
type size struct {
	memoryMiB int
	vcpus     int
	diskBytes int64
}

func sizeOf(s backend.Spec) size {
	mem := s.MemoryBytes
	if mem == 0 {
		mem = defaultMemory
	}
	mem = max(mem, minMemory)
	disk := s.DiskBytes
	if disk == 0 {
		disk = defaultDisk
	}
	return size{
		memoryMiB: int((mem + 1<<20 - 1) >> 20),
		vcpus:     max(int(math.Ceil(s.CPUs)), 1),
		diskBytes: max(disk, minDisk),
	}
}

// Start makes sandbox s.ID's VM and returns once its agent answers. On any
// error everything it made is removed again; a boot that fails says why
// with the console's last lines.
func (r *Runtime) Start(ctx context.Context, s backend.Spec) (d backend.Dialer, err error) {
	if err := r.checkSpec(s); err != nil {
		return nil, err
	}
	if r.layout == nil {
		return nil, fmt.Errorf("start sandbox %s: the microvm runtime is not initialised: %w", s.ID, errdefs.ErrFailedPrecondition)
	}
	dir := r.vmDir(s.ID)
	if err := os.Mkdir(dir, 0o700); err != nil {
		if errors.Is(err, fs.ErrExist) {
			return nil, fmt.Errorf("start sandbox %s: %w", s.ID, errdefs.ErrAlreadyExists)
		}
		return nil, fmt.Errorf("start sandbox %s: %w", s.ID, err)
	}
	defer func() {
		if err != nil {
			if derr := r.Delete(context.WithoutCancel(ctx), s.ID); derr != nil {
				r.log.Warn("remove half-made vm", "id", s.ID, "err", derr)
			}
		}
	}()
	start := time.Now()
	initrd, err := r.initramfs()
	if err != nil {
		return nil, fmt.Errorf("start sandbox %s: %w", s.ID, err)
	}
	sz := sizeOf(s)
	disk := filepath.Join(dir, upperDisk)
	if err := makeDisk(ctx, disk, sz.diskBytes, s.Inodes, agentConfig(s)); err != nil {
		return nil, fmt.Errorf("start sandbox %s: %w", s.ID, err)
	}
	tDisk := time.Now()
	qc := r.qemuConfig(s, dir, initrd, sz)
	if s.NetnsPath != "" {
		link, err := r.attachNetwork(ctx, dir, s.NetnsPath)
		if err != nil {
			return nil, fmt.Errorf("start sandbox %s: %w", s.ID, err)
		}
		// QEMU holds the tap from here; ours goes once it started (or not).
		defer link.Tap.Close()
		qc.NIC = &qemu.NIC{Tap: link.Tap, MAC: link.Guest.MAC}
		qc.Cmdline += " " + strings.Join(link.Guest.Args(), " ")
	}
	p, err := qemu.Start(ctx, qc, r.log)
	if err != nil {
		return nil, fmt.Errorf("start sandbox %s: %w", s.ID, err)
	}
	if err := writeConfig(dir, p.Config()); err != nil {
		p.Kill()
		<-p.Done()
		return nil, fmt.Errorf("start sandbox %s: %w", s.ID, err)
	}
	v := &vm{p: p, watched: make(chan struct{})}
	r.mu.Lock()
	r.vms[s.ID] = v
	r.mu.Unlock()
	go r.watch(s.ID, v)
	if err := r.layout.Place(r.cgroupRel(s.ID), p.Pid(), r.limits(s, sz)); err != nil {
		return nil, fmt.Errorf("start sandbox %s: %w", s.ID, err)
	}
	if s.QoS.Idle() {
		// The QEMU process's cgroup holds its vCPU threads.
		if err := qos.SetIdle(r.layout.Dir("cpu", r.cgroupRel(s.ID)), true); err != nil {
			return nil, fmt.Errorf("start sandbox %s: %w", s.ID, err)
		}
	}
	st := state{Pid: p.Pid(), Accel: string(p.Config().Accel), MemoryMiB: sz.memoryMiB, VCPUs: sz.vcpus, DiskBytes: sz.diskBytes}
	if st.StartTicks, err = startTicks(p.Pid()); err != nil {
		return nil, fmt.Errorf("start sandbox %s: %w", s.ID, err)
	}
	if err := writeState(dir, st); err != nil {
		return nil, fmt.Errorf("start sandbox %s: %w", s.ID, err)
	}
	if err := linkLog(s.LogPath, filepath.Join(dir, qemu.ConsoleLog)); err != nil {
		return nil, fmt.Errorf("start sandbox %s: %w", s.ID, err)
	}
	dialer := r.channels.get(p.ChannelPath())
	dialer.Booting() // a new guest: its first connection waits for the hello
	client := agentclient.New(dialer.Dial)
	defer client.Close()
	err = p.WaitBoot(ctx, r.cfg.BootTimeout, func(ctx context.Context) error {
		_, err := client.Ping(ctx, connect.NewRequest(&agentv1.PingRequest{}))
		return err
	})
	if err != nil {
		return nil, fmt.Errorf("start sandbox %s: %w", s.ID, err)
	}
	r.log.Info("vm sandbox running", "id", s.ID, "accel", st.Accel, "memory_mib", sz.memoryMiB, "vcpus", sz.vcpus,
		"disk", sz.diskBytes, "layers", len(s.Layers), "disk_took", tDisk.Sub(start), "boot_took", time.Since(tDisk),
		"guest", guestReady(dir))
	return dialer.Dial, nil
}

// upperDisk is the writable disk's file in a VM's run dir.
const upperDisk = "upper.ext4"

// The serials of the guest's disks.
const (
	upperSerial = "upper"
	layerSerial = "layer" // + its index, bottom first
)

// qemuConfig is QEMU's configuration for s.
func (r *Runtime) qemuConfig(s backend.Spec, dir, initrd string, sz size) qemu.Config {
	var drives []qemu.Drive
	pmem := 0
	for i, l := range s.Layers {
		d := qemu.Drive{Path: l.File, Serial: layerSerial + strconv.Itoa(i), ReadOnly: true}
		if r.cfg.PmemLayers && pmem < qemu.MaxPmem && l.Size > 0 && l.Size%qemu.PmemAlign == 0 {
			d.Pmem = true
			pmem++
		}
		drives = append(drives, d)
	}
	drives = append(drives, qemu.Drive{Path: filepath.Join(dir, upperDisk), Serial: upperSerial})
	qc := qemu.Config{
		Binary: r.qemu, Dir: dir, Kernel: r.kernel.Vmlinux(), Initrd: initrd,
		// In a file of the run dir (on disk), so a pause can save the VM
		// and drop its RAM from the host's memory (package vmstate).
		MemoryFile: filepath.Join(dir, memoryFile),
		MemoryMiB:  sz.memoryMiB, VCPUs: sz.vcpus, Accel: r.accel, TCGBufferMiB: TCGBufferMiB,
		Drives: drives,
		// What the guest frees goes back to the host (and out of the
		// RAM file), so an idle VM costs what it uses, not its peak.
		FreePageReporting: true,
	}
	args := []string{"--"}
	for i := range s.Layers {
		args = append(args, "--layer", qc.GuestRef(i))
	}
	args = append(args, "--upper", upperSerial)
	qc.Cmdline = strings.Join(append(args, r.cfg.GuestArgs...), " ")
	return qc
}

// agentConfig is what the guest's agent is told, from s.
func agentConfig(s backend.Spec) guestcfg.Agent {
	a := guestcfg.Agent{
		User: s.Agent.User, Workdir: s.Agent.Workdir, Hostname: s.Agent.Hostname, Address: s.Agent.Address,
		OutputLimit: s.Agent.OutputLimit,
	}
	if a.Hostname == "" {
		a.Hostname = s.Hostname
	}
	a.Pids = s.Pids
	if a.Pids == 0 {
		a.Pids = defaultPids
	}
	for _, k := range slices.Sorted(maps.Keys(s.Agent.Env)) {
		a.Env = append(a.Env, k+"="+s.Agent.Env[k])
	}
	return a
}

// limits are the bounds of QEMU's cgroup: the guest's memory and QEMU's
// overhead, its threads, and the CPU quota of s.CPUs.
func (r *Runtime) limits(s backend.Spec, sz size) cgroups.Limits {
	overhead := int64(overheadTCG)
	if r.accel == qemu.KVM {
		overhead = overheadKVM
	}
	lim := cgroups.Limits{MemoryBytes: int64(sz.memoryMiB)<<20 + overhead, Pids: qemuPids}
	if s.CPUs > 0 {
		lim.CPUPeriodUsec = cfsPeriod
		lim.CPUQuotaUsec = max(int64(math.Ceil(s.CPUs*cfsPeriod)), 1000)
	}
	return lim
}

// linkLog makes the edge's log path name the VM's console log, where the
// guest's agent writes (its stderr is the console).
func linkLog(path, console string) error {
	os.Remove(path)
	if err := os.Symlink(console, path); err != nil {
		return fmt.Errorf("link agent log: %w", err)
	}
	return nil
}

// watch records why v's QEMU ended, in its run dir, for Status.
func (r *Runtime) watch(id string, v *vm) {
	defer close(v.watched)
	<-v.p.Done()
	reason := exitReason(v.p.Err(), v.p.ConsoleTail(consoleScanLines))
	r.log.Info("vm exited", "id", id, "pid", v.p.Pid(), "reason", firstLine(reason))
	r.mu.Lock()
	if r.vms[id] == v {
		delete(r.vms, id)
	}
	r.mu.Unlock()
	dir := r.vmDir(id)
	if _, err := os.Stat(filepath.Join(dir, stateFile)); err == nil {
		_ = os.WriteFile(filepath.Join(dir, exitFile), []byte(reason), 0o600)
	}
}

// How much of the console a reason is looked for in, and how much it
// quotes.
const (
	consoleScanLines = 200
	consoleLines     = 20
)

// exitReason says why QEMU ended, from how it exited and what the console
// printed last: a kernel panic by its message, a kill by its signal.
func exitReason(err error, console string) string {
	panicked, lines := qemu.Explain(console, consoleLines)
	var why string
	var ee *exec.ExitError
	var ke killedError
	switch {
	case panicked != "":
		why = "the guest kernel panicked: " + panicked
	case errors.As(err, &ke) && ke.err != nil:
		why = ke.Error()
	case errors.As(err, &ke):
		why = "the guest powered off"
	case errors.As(err, &ee) && ee.ProcessState != nil && ee.ProcessState.String() == "signal: killed":
		why = "qemu was killed (SIGKILL)"
	case err != nil:
		why = "qemu ended: " + err.Error()
	default:
		why = "the guest powered off"
	}
	if lines == "" {
		return why
	}
	return why + "\nconsole:\n" + lines
}

// adoptedExitReason says why the QEMU of a VM an earlier instance started
// ended, as exitReason does for one this instance started, from what it
// left in its run dir: a kernel panic or a power-off on the console, a
// polite signal in QEMU's own log ("terminating on signal"); else it was
// killed (SIGKILL leaves no word) or crashed. The console's last lines
// follow.
func adoptedExitReason(dir string) string {
	console := qemu.ConsoleTail(dir, consoleScanLines)
	err := errors.New("qemu was killed (by SIGKILL, or it crashed: it was started by an earlier edge, to which its exit status went)")
	if strings.Contains(lastLineWith(console, ""), "reboot: Power down") {
		err = nil // the guest's last words: it powered off
	}
	if line := lastLineWith(readTailFile(filepath.Join(dir, qemu.QEMULog)), "terminating on signal"); line != "" {
		err = errors.New("qemu was killed: " + line)
	}
	return exitReason(killedError{err}, console)
}

// killedError is an exit that exitReason states as it is.
type killedError struct{ err error }

func (e killedError) Error() string { return e.err.Error() }

// lastLineWith is the last non-empty line of text holding sub.
func lastLineWith(text, sub string) string {
	lines := strings.Split(text, "\n")
	for i := len(lines) - 1; i >= 0; i-- {
		if strings.TrimSpace(lines[i]) != "" && strings.Contains(lines[i], sub) {
			return strings.TrimSpace(lines[i])
		}
	}
	return ""
}

// readTailFile is the last 4 KiB of the file at path ("" when unreadable).
func readTailFile(path string) string {
	f, err := os.Open(path)
	if err != nil {
		return ""
	}
	defer f.Close()
	fi, err := f.Stat()
	if err != nil {
		return ""
	}
	off := max(fi.Size()-4096, 0)
	b := make([]byte, fi.Size()-off)
	n, _ := f.ReadAt(b, off)
	return string(b[:n])
}

func firstLine(s string) string {
	line, _, _ := strings.Cut(s, "\n")
	return line
}

// Channel returns the dialer of VM id's agent channel.
func (r *Runtime) Channel(id string) (backend.Dialer, error) {
	if !backend.ValidID(id) {
		return nil, fmt.Errorf("agent channel of sandbox %q: %w", id, errdefs.ErrNotFound)
	}
	dir := r.vmDir(id)
	if _, err := os.Stat(filepath.Join(dir, stateFile)); err != nil {
		return nil, fmt.Errorf("agent channel of sandbox %s: %w", id, errdefs.ErrNotFound)
	}
	return r.channels.get(filepath.Join(dir, qemu.ChannelSocket)).Dial, nil
}

// Status reports whether VM id's QEMU runs and, when it does not, why.
// OOMKills counts the kills of QEMU's cgroup on the host and, while the VM
// lives, those of the guest's OOM killer in the sandbox's cgroup, which
// the guest's agent reports (Ping): a command that outgrew the sandbox's
// memory counts as in a container. A VM that cannot answer (frozen,
// paused to disk, busy past pingTimeout) keeps the count it last reported
// to this instance; a VM that is gone counts only QEMU's kills, which its
// reason names.
func (r *Runtime) Status(ctx context.Context, id string) (backend.Status, error) {
	if !backend.ValidID(id) {
		return backend.Status{}, fmt.Errorf("status of sandbox %q: %w", id, errdefs.ErrNotFound)
	}
	dir := r.vmDir(id)
	if _, err := os.Stat(dir); err != nil {
		return backend.Status{}, fmt.Errorf("status of sandbox %s: %w", id, errdefs.ErrNotFound)
	}
	st, err := readState(dir)
	if err != nil {
		return backend.Status{Reason: "the VM was left half made"}, nil
	}
	out := backend.Status{Accel: st.Accel}
	if r.layout != nil {
		if cs, err := r.layout.Stats(r.cgroupRel(id)); err == nil {
			out.OOMKills, out.MemoryBytes = cs.OOMKills, cs.MemoryBytes
		}
	}
	if alive(st.Pid, st.StartTicks) {
		out.Running, out.Pid = true, st.Pid
		out.OOMKills += r.guestOOMKills(ctx, id, dir)
		return out, nil
	}
	if vmstate.Saved(filepath.Join(dir, savedFile)) {
		// Paused to disk: no process, but the sandbox lives.
		out.Running = true
		r.mu.Lock()
		out.OOMKills += r.guestOOM[id]
		r.mu.Unlock()
		return out, nil
	}
	// The instance that started it recorded how it ended; give it a moment
	// when it has only just ended.
	r.mu.Lock()
	v := r.vms[id]
	r.mu.Unlock()
	if v != nil {
		select {
		case <-v.watched:
		case <-time.After(5 * time.Second):
		}
	}
	if b, err := os.ReadFile(filepath.Join(dir, exitFile)); err == nil {
		out.Reason = string(b)
	} else {
		// Not this process's child (a re-adopted VM): its exit status
		// went to its parent, so the reason comes from what it left.
		out.Reason = adoptedExitReason(dir)
	}
	if out.OOMKills > 0 {
		out.Reason = fmt.Sprintf("qemu was OOM-killed at its limit (%d MiB of guest memory and QEMU's overhead)\n%s", st.MemoryMiB, out.Reason)
	}
	return out, nil
}

// pingTimeout bounds Status's question to a guest's agent.
const pingTimeout = 2 * time.Second

// guestOOMKills is the OOM kill count VM id's agent reports, or the last
// it reported when it cannot answer now.
func (r *Runtime) guestOOMKills(ctx context.Context, id, dir string) int64 {
	r.mu.Lock()
	last, frozen := r.guestOOM[id], r.frozen[id]
	r.mu.Unlock()
	if frozen {
		return last
	}
	ctx, cancel := context.WithTimeout(ctx, pingTimeout)
	defer cancel()
	c := agentclient.New(r.channels.get(filepath.Join(dir, qemu.ChannelSocket)).Dial)
	defer c.Close()
	resp, err := c.Ping(ctx, connect.NewRequest(&agentv1.PingRequest{}))
	if err != nil {
		return last
	}
	n := max(resp.Msg.GetOomKills(), last)
	r.mu.Lock()
	r.guestOOM[id] = n
	r.mu.Unlock()
	return n
}

// Delete kills VM id's QEMU and removes its cgroup and run dir, disk
// included. It is idempotent.
func (r *Runtime) Delete(ctx context.Context, id string) error {
	if !backend.ValidID(id) {
		return fmt.Errorf("delete sandbox %q: %w", id, errdefs.ErrInvalidArgument)
	}
	ctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 30*time.Second)
	defer cancel()
	dir := r.vmDir(id)
	r.channels.close(filepath.Join(dir, qemu.ChannelSocket))
	r.mu.Lock()
	v := r.vms[id]
	r.mu.Unlock()
	if v != nil {
		// Nothing of the guest is kept: its disk goes too.
		v.p.Kill()
		select {
		case <-v.watched:
		case <-ctx.Done():
			return fmt.Errorf("delete sandbox %s: qemu %d did not exit: %w", id, v.p.Pid(), ctx.Err())
		}
	} else if st, err := readState(dir); err == nil {
		if err := killWait(ctx, st.Pid, st.StartTicks); err != nil {
			return fmt.Errorf("delete sandbox %s: %w", id, err)
		}
	}
	r.mu.Lock()
	c := r.consoles[id]
	delete(r.consoles, id)
	delete(r.guestOOM, id)
	delete(r.frozen, id)
	r.mu.Unlock()
	if c != nil {
		c.Close()
	}
	if r.layout != nil {
		rel := r.cgroupRel(id)
		if err := r.layout.Kill(ctx, rel); err != nil {
			return fmt.Errorf("delete sandbox %s: %w", id, err)
		}
		if err := r.layout.Remove(ctx, rel); err != nil {
			return fmt.Errorf("delete sandbox %s: %w", id, err)
		}
	}
	if err := detachNetwork(ctx, dir); err != nil {
		return fmt.Errorf("delete sandbox %s: %w", id, err)
	}
	if err := removeAll(ctx, dir); err != nil {
		return fmt.Errorf("delete sandbox %s: %w", id, err)
	}
	return nil
}

// removeAll removes dir, again while an earlier instance in this process
// still writes the exit it saw into it.
func removeAll(ctx context.Context, dir string) error {
	for {
		err := os.RemoveAll(dir)
		if err == nil || ctx.Err() != nil {
			return err
		}
		select {
		case <-ctx.Done():
			return err
		case <-time.After(20 * time.Millisecond):
		}
	}
}

// List returns every VM with a run dir.
func (r *Runtime) List(ctx context.Context) ([]string, error) {
	entries, err := os.ReadDir(r.vmsDir())
	if errors.Is(err, fs.ErrNotExist) {
		return nil, nil
	}
	if err != nil {
		return nil, fmt.Errorf("list vms: %w", err)
	}
	var ids []string
	for _, e := range entries {
		if e.IsDir() && backend.ValidID(e.Name()) {
			ids = append(ids, e.Name())
		}
	}
	return ids, nil
}

// Usage reads VM id's use: QEMU's cgroup for CPU time and memory (the
// guest's memory as QEMU holds it, and QEMU's own), the writable disk's
// allocated blocks against its size.
func (r *Runtime) Usage(ctx context.Context, id string) (backend.Usage, error) {
	if !backend.ValidID(id) {
		return backend.Usage{}, fmt.Errorf("usage of sandbox %q: %w", id, errdefs.ErrNotFound)
	}
	dir := r.vmDir(id)
	st, err := readState(dir)
	if err != nil {
		return backend.Usage{}, fmt.Errorf("usage of sandbox %s: %w", id, errdefs.ErrNotFound)
	}
	if r.layout == nil {
		return backend.Usage{}, fmt.Errorf("usage of sandbox %s: the runtime is not initialised: %w", id, errdefs.ErrFailedPrecondition)
	}
	cu, err := r.layout.Usage(r.cgroupRel(id))
	if err != nil {
		return backend.Usage{}, fmt.Errorf("usage of sandbox %s: %w", id, err)
	}
	var fi unix.Stat_t
	if err := unix.Stat(filepath.Join(dir, upperDisk), &fi); err != nil {
		return backend.Usage{}, fmt.Errorf("usage of sandbox %s: %w", id, err)
	}
	return backend.Usage{
		CPUUsec: cu.CPUUsec, MemoryBytes: cu.MemoryBytes, CacheBytes: cu.CacheBytes,
		MemoryLimit: int64(st.MemoryMiB) << 20,
		DiskBytes:   fi.Blocks * 512, DiskLimit: st.DiskBytes, DiskSize: st.DiskBytes,
	}, nil
}

// guestReady is what the guest's init said on the console once ready
// (its "guest ready" line from its attributes on: the boot's timeline on
// the guest's clock, the slowest modules), "" if it is not there.
func guestReady(dir string) string {
	for _, line := range strings.Split(qemu.ConsoleTail(dir, 50), "\n") {
		if _, attrs, ok := strings.Cut(line, `msg="guest ready" `); ok {
			return attrs
		}
	}
	return ""
}

// netnsFile names, in a VM's run dir, the network namespace its tap is in.
const netnsFile = "netns"

// attachNetwork makes the VM's tap in the edge's namespace at nsPath
// (package vmnet) and records where, so Delete removes it even after a
// restart or a half-made start.
func (r *Runtime) attachNetwork(ctx context.Context, dir, nsPath string) (*vmnet.Link, error) {
	if err := os.WriteFile(filepath.Join(dir, netnsFile), []byte(nsPath), 0o600); err != nil {
		return nil, fmt.Errorf("attach network: %w", err)
	}
	return vmnet.Attach(ctx, nsPath)
}

// detachNetwork removes the tap of the VM whose run dir is dir, if it has
// one. The edge removes the namespace itself afterwards.
func detachNetwork(ctx context.Context, dir string) error {
	b, err := os.ReadFile(filepath.Join(dir, netnsFile))
	if errors.Is(err, fs.ErrNotExist) {
		return nil
	}
	if err != nil {
		return fmt.Errorf("detach network: %w", err)
	}
	return vmnet.Detach(ctx, string(b))
}

package container

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"log/slog"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/opencontainers/runtime-spec/specs-go"
	"golang.org/x/sys/unix"

	"dsec.dev/dsec/internal/edge/backend"
	"dsec.dev/dsec/internal/edge/backend/cgroups"
	"dsec.dev/dsec/internal/edge/backend/container/mountinfo"
	"dsec.dev/dsec/internal/edge/backend/container/quota"
	"dsec.dev/dsec/internal/errdefs"
	"dsec.dev/dsec/internal/qos"
	"dsec.dev/dsec/internal/vm/vmnet"
)

// Container runs sandboxes as containers of an OCI runtime: the container
// backend (New) or the fncall backend (NewFnCall). Its methods are safe for
// concurrent use, for different IDs.
type Container struct {
	cfg    Config
	log    *slog.Logger
	path   string // the OCI runtime binary
	layout *cgroups.Layout

	// fncall marks the fncall backend; the paths below keep its sandboxes
	// apart from the container backend's on the same node.
	fncall       bool
	root         string // state: the OCI runtime's and the bundles
	upperBase    string // the quota root of the writable layers
	cgroupParent string

	quotaMu sync.Mutex
	quotas  *quota.Manager // opened by Init, or on first use after a restart

	// coreSched: the node gives core-scheduling cookies (qos.CoreScheduling),
	// so each latency container gets its own.
	coreSched bool
}

var _ interface {
	backend.Runtime
	backend.Pauser
	backend.Snapshotter
	backend.Meter
} = (*Container)(nil)

// New returns the container backend. It checks cfg, fills in defaults and
// reads the host's cgroup layout; it changes nothing on the host. Call Init
// before the first Start.
func New(cfg Config) (*Container, error) { return newContainer(cfg, false) }

// NewFnCall returns the fncall backend: containers for reward code, which
// an edge keeps in warm pools and reuses call after call. A sandbox is made
// as by the container backend, plus:
//
//   - its agent gets the sandbox's cpu cgroup dir (the v1 cpu controller's,
//     or the v2 unified dir) as one more fd, and runs with --cpu-cgroup-fd N
//     --fncall, so that it can give each call its own CPU limit;
//   - /tmp is a writable tmpfs of Spec.TmpBytes, whose pages are charged to
//     the sandbox's memory cgroup and so count against its memory limit;
//   - no network but loopback unless the spec names a network namespace
//     (as for containers).
//
// It has no snapshots (a pooled container's writable layer is nobody's
// state). Made from the same Config as the node's container backend, it
// keeps its state under <Root>/fncall, its writable layers under
// <UpperRoot>/.fncall on the shared upper file system, and its cgroups
// under <CgroupParent>-fncall.
func NewFnCall(cfg Config) (*Container, error) { return newContainer(cfg, true) }

func newContainer(cfg Config, fncall bool) (*Container, error) {
	if cfg.Root == "" || cfg.UpperRoot == "" || cfg.AgentDir == "" {
		return nil, fmt.Errorf("check runtime config: Root, UpperRoot and AgentDir are required: %w", errdefs.ErrInvalidArgument)
	}
	for _, p := range []*string{&cfg.Root, &cfg.UpperRoot, &cfg.AgentDir, &cfg.UpperImage, &cfg.SocketDir} {
		if *p == "" {
			continue
		}
		abs, err := filepath.Abs(*p)
		if err != nil {
			return nil, fmt.Errorf("resolve %s: %w", *p, err)
		}
		*p = abs
	}
	if cfg.UpperImage == "" {
		cfg.UpperImage = filepath.Join(filepath.Dir(cfg.UpperRoot), filepath.Base(cfg.UpperRoot)+".img")
	}
	if cfg.SocketDir == "" {
		cfg.SocketDir = filepath.Join(cfg.Root, "sockets")
	}
	if cfg.Runtime == "" {
		cfg.Runtime = "runc"
	}
	if cfg.Runtime != "runc" && cfg.Runtime != "crun" && cfg.Runtime != "runsc" {
		return nil, fmt.Errorf("check runtime config: unknown runtime %q: %w", cfg.Runtime, errdefs.ErrInvalidArgument)
	}
	if cfg.Runtime == "runsc" && cfg.RunscPlatform == "" {
		cfg.RunscPlatform = "systrap"
	}
	if cfg.CgroupParent == "" {
		cfg.CgroupParent = "dsec"
	}
	if !backend.ValidID(cfg.CgroupParent) {
		return nil, fmt.Errorf("check runtime config: bad cgroup parent %q: %w", cfg.CgroupParent, errdefs.ErrInvalidArgument)
	}
	if cfg.Log == nil {
		cfg.Log = slog.New(slog.DiscardHandler)
	}
	path := cfg.RuntimePath
	if path == "" {
		p, err := exec.LookPath(cfg.Runtime)
		if err != nil && cfg.Runtime == "runsc" {
			return nil, fmt.Errorf("find runsc (scripts/build-runsc.sh builds the version dsec runs): %w: %w", err, errdefs.ErrNotSupported)
		}
		if err != nil {
			return nil, fmt.Errorf("find %s: %w: %w", cfg.Runtime, err, errdefs.ErrNotSupported)
		}
		path = p
	}
	if cfg.Runtime == "runsc" {
		if fi, err := os.Stat(path); err != nil || fi.IsDir() || fi.Mode()&0o111 == 0 {
			return nil, fmt.Errorf("find runsc: %s is not an executable file (scripts/build-runsc.sh builds the version dsec runs): %w",
				path, errdefs.ErrNotSupported)
		}
	}
	layout, err := cgroups.Detect()
	if err != nil {
		return nil, err
	}
	// crun 1.8 refuses hybrid hosts unless told --cgroup-manager=disabled,
	// which would start sandboxes without any limit. Refuse instead.
	if cfg.Runtime == "crun" && !layout.V2() {
		return nil, fmt.Errorf("use crun: it applies no cgroup limits on a cgroup v1 host; use runc: %w", errdefs.ErrNotSupported)
	}
	r := &Container{cfg: cfg, log: cfg.Log, path: path, layout: layout,
		fncall: fncall, root: cfg.Root, upperBase: cfg.UpperRoot, cgroupParent: cfg.CgroupParent,
		coreSched: qos.CoreScheduling().Available}
	if fncall {
		// ".fncall" cannot be a sandbox ID, so the container backend never
		// names it.
		r.root = filepath.Join(cfg.Root, "fncall")
		r.upperBase = filepath.Join(cfg.UpperRoot, ".fncall")
		r.cgroupParent = cfg.CgroupParent + "-fncall"
		r.log = cfg.Log.With("backend", "fncall")
	}
	if r.gvisor() {
		// runsc beside runc on one node: its sandboxes' state, writable
		// layers and cgroups apart from runc's (".gvisor" cannot be a
		// sandbox ID either).
		r.root = filepath.Join(r.root, "gvisor")
		r.upperBase = filepath.Join(r.upperBase, ".gvisor")
		r.cgroupParent += "-gvisor"
		r.log = r.log.With("isolation", "gvisor")
	}
	return r, nil
}

// Features: both backends pause; only the container backend's writable
// layers are snapshotted. Under runsc the accelerator is gVisor's platform.
func (r *Container) Features() backend.Features {
	f := backend.Features{Pause: true, Snapshot: !r.fncall, Network: true}
	if r.gvisor() {
		f.Accelerator = r.cfg.RunscPlatform
	}
	return f
}

func (r *Container) stateDir() string { return filepath.Join(r.root, r.cfg.Runtime) }
func (r *Container) gvisor() bool     { return r.cfg.Runtime == "runsc" }

// globalArgs are the flags every call of the OCI runtime starts with.
//
// Under runsc: --host-uds=create lets the agent make its listening socket
// in the directory bind-mounted from the host (the sentry cannot accept on
// a listening socket passed in as an fd); --overlay2=none keeps runsc's
// own in-memory overlay off the root, so writes reach the writable layer
// on the host (disk limits, snapshots); --oci-seccomp has the sentry
// apply the sandbox's seccomp profile, which runsc otherwise ignores;
// --gofer-network-namespace=new gives each gofer an empty network
// namespace of its own instead of one shared through a bind mount that
// runsc leaves in its state dir (<root>/null-netns) for ever;
// --in-sandbox-cgroup=v2 gives the sentry one cgroup hierarchy, where the
// agent caps its commands' pids (v1's hierarchy per controller checks a
// fork against pids.max one time in seven: docs/gvisor.md).
func (r *Container) globalArgs() []string {
	args := []string{"--root", r.stateDir()}
	if r.gvisor() {
		args = append(args, "--platform="+r.cfg.RunscPlatform, "--host-uds=create", "--overlay2=none",
			"--oci-seccomp", "--gofer-network-namespace=new", "--in-sandbox-cgroup=v2")
	}
	return args
}

// gvisorSocketDir is the host dir bind-mounted at agentSockMount in a
// gVisor sandbox, where its agent makes its socket.
func (r *Container) gvisorSocketDir(id string) string {
	return filepath.Join(r.cfg.SocketDir, id, "gvisor")
}
func (r *Container) bundleDir(id string) string { return filepath.Join(r.root, "bundles", id) }
func (r *Container) upperDir(id string) string  { return filepath.Join(r.upperBase, id) }
func (r *Container) cgroupRel(id string) string { return filepath.Join(r.cgroupParent, id) }
func (r *Container) socketPath(id string) string {
	return filepath.Join(r.cfg.SocketDir, id, "agent.sock")
}

// Init makes the node ready for sandboxes: state dirs, the cgroup parent and
// an upper file system that enforces project quotas (the host's own when it
// can, else an ext4 image mounted from UpperImage). It is idempotent and safe
// while sandboxes of an earlier daemon run.
func (r *Container) Init(ctx context.Context) error {
	if err := r.checkRuntime(ctx); err != nil {
		return err
	}
	for _, d := range []string{r.stateDir(), filepath.Join(r.root, "bundles"), r.cfg.UpperRoot, r.cfg.SocketDir} {
		if err := os.MkdirAll(d, 0o700); err != nil {
			return fmt.Errorf("make %s: %w", d, err)
		}
	}
	if err := r.layout.EnsureParent(r.cgroupParent); err != nil {
		return err
	}
	if err := raiseNofile(); err != nil {
		r.log.Warn("sandboxes get fewer open files", "err", err)
	}
	if err := r.initUpperFS(ctx); err != nil {
		return err
	}
	if !r.Features().Snapshot {
		return nil
	}
	return r.clearCaptures()
}

// checkRuntime runs the OCI runtime's --version, so that a binary that
// cannot run here (another architecture, a broken build) is refused by Init
// rather than by every create.
func (r *Container) checkRuntime(ctx context.Context) error {
	ctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	out, err := exec.CommandContext(ctx, r.path, "--version").CombinedOutput()
	if err != nil {
		hint := ""
		if r.gvisor() {
			hint = " (scripts/build-runsc.sh builds the version dsec runs)"
		}
		return fmt.Errorf("run %s --version%s: %w: %s: %w", r.path, hint, err, bytes.TrimSpace(out), errdefs.ErrNotSupported)
	}
	return nil
}

func (r *Container) initUpperFS(ctx context.Context) error {
	// The other backend of the node may have mounted it already.
	if _, err := quota.Open(r.cfg.UpperRoot); err == nil {
		return r.openUpperBase()
	}
	ms, err := mountinfo.Read()
	if err != nil {
		return err
	}
	if m, ok := mountinfo.At(ms, r.cfg.UpperRoot); ok {
		return fmt.Errorf("prepare upper file system: %s is a %s mount without project quotas or btrfs qgroups: %w", r.cfg.UpperRoot, m.FSType, errdefs.ErrNotSupported)
	}
	r.log.Info("host file system cannot limit dirs; using an image", "upper", r.cfg.UpperRoot, "image", r.cfg.UpperImage)
	if _, err := os.Stat(r.cfg.UpperImage); errors.Is(err, fs.ErrNotExist) {
		if err := r.makeImage(ctx); err != nil {
			return err
		}
	} else if err != nil {
		return fmt.Errorf("stat %s: %w", r.cfg.UpperImage, err)
	} else if err := r.mountImage(ctx); err != nil {
		return err
	}
	return r.openUpperBase()
}

// openUpperBase makes the backend's quota root on the upper file system and
// opens its quota manager.
func (r *Container) openUpperBase() error {
	if err := os.MkdirAll(r.upperBase, 0o700); err != nil {
		return fmt.Errorf("make %s: %w", r.upperBase, err)
	}
	q, err := r.quotaManager()
	if err != nil {
		return fmt.Errorf("prepare upper file system: %w", err)
	}
	r.log.Debug("upper file system ready", "upper", r.upperBase, "quota", q.Kind())
	return nil
}

// raiseNofile lifts this process's hard RLIMIT_NOFILE to the sandboxes'
// limit: the OCI runtime sets the container's limits after dropping
// CAP_SYS_RESOURCE, so it can only lower what it inherits. It fails when
// the daemon itself lacks CAP_SYS_RESOURCE; sandboxes then get the
// daemon's hard limit (see nofile).
func raiseNofile() error {
	var lim unix.Rlimit
	if err := unix.Getrlimit(unix.RLIMIT_NOFILE, &lim); err != nil {
		return fmt.Errorf("get RLIMIT_NOFILE: %w", err)
	}
	if lim.Max >= nofileLimit {
		return nil
	}
	lim.Max = nofileLimit
	if err := unix.Setrlimit(unix.RLIMIT_NOFILE, &lim); err != nil {
		return fmt.Errorf("raise RLIMIT_NOFILE to %d: %w", nofileLimit, err)
	}
	return nil
}

// nofile is the open-file limit sandboxes get: nofileLimit, or less when
// this process may not hand out that many.
func nofile() uint64 {
	var lim unix.Rlimit
	if err := unix.Getrlimit(unix.RLIMIT_NOFILE, &lim); err != nil {
		return 1024
	}
	return min(lim.Max, nofileLimit)
}

// quotaManager opens the upper file system's quota manager once.
func (r *Container) quotaManager() (*quota.Manager, error) {
	r.quotaMu.Lock()
	defer r.quotaMu.Unlock()
	if r.quotas != nil {
		return r.quotas, nil
	}
	q, err := quota.Open(r.upperBase)
	if err != nil {
		return nil, err
	}
	r.quotas = q
	return q, nil
}

// makeImage makes the upper file system image: ext4 with project quotas
// when the kernel can enforce them (CONFIG_QUOTA and CONFIG_QFMT_V2), else
// btrfs with qgroups. It leaves the image mounted on UpperRoot.
func (r *Container) makeImage(ctx context.Context) error {
	size := r.cfg.UpperFSBytes
	if size <= 0 {
		var st unix.Statfs_t
		if err := unix.Statfs(filepath.Dir(r.cfg.UpperImage), &st); err != nil {
			return fmt.Errorf("statfs %s: %w", filepath.Dir(r.cfg.UpperImage), err)
		}
		size = int64(st.Bavail) * st.Bsize / 10 * 8
	}
	size = max(size, minUpperFSBytes)
	if err := os.MkdirAll(filepath.Dir(r.cfg.UpperImage), 0o700); err != nil {
		return fmt.Errorf("make %s: %w", filepath.Dir(r.cfg.UpperImage), err)
	}
	tmp := r.cfg.UpperImage + ".tmp"
	f, err := os.OpenFile(tmp, os.O_CREATE|os.O_TRUNC|os.O_WRONLY, 0o600)
	if err != nil {
		return fmt.Errorf("create %s: %w", tmp, err)
	}
	err = f.Truncate(size)
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	if err != nil {
		os.Remove(tmp)
		return fmt.Errorf("size %s: %w", tmp, err)
	}
	if err := os.Rename(tmp, r.cfg.UpperImage); err != nil {
		os.Remove(tmp)
		return fmt.Errorf("rename %s: %w", tmp, err)
	}
	// quota,project with prjquota only: accounting in hidden quota inodes,
	// enforced when mounted with prjquota. lazy_*_init keeps mkfs fast on a
	// large sparse file; -m 0: no blocks reserved for root.
	ext4Err := run(ctx, "mkfs.ext4", "-q", "-F", "-m", "0", "-L", "dsec-upper",
		"-O", "quota,project", "-E", "quotatype=prjquota,lazy_itable_init=1,lazy_journal_init=1,nodiscard", r.cfg.UpperImage)
	if ext4Err == nil {
		ext4Err = r.mountImage(ctx)
		if ext4Err == nil {
			return nil
		}
	}
	r.log.Info("ext4 project quotas unavailable; using btrfs qgroups", "reason", ext4Err)
	if err := mkfsBtrfs(ctx, r.log, r.cfg.UpperImage); err != nil {
		os.Remove(r.cfg.UpperImage)
		return errors.Join(ext4Err, err)
	}
	if err := r.mountImage(ctx); err != nil {
		os.Remove(r.cfg.UpperImage)
		return err
	}
	return nil
}

// mountImage mounts UpperImage on UpperRoot through a loop device. util-linux
// sets the device up with autoclear, so the unmount in Teardown frees it.
func (r *Container) mountImage(ctx context.Context) error {
	magic := make([]byte, 8)
	if f, err := os.Open(r.cfg.UpperImage); err == nil {
		_, _ = f.ReadAt(magic, 0x10040)
		f.Close()
	}
	if string(magic) == "_BHRfS_M" {
		if err := run(ctx, "mount", "-t", "btrfs", "-o", "loop,noatime", r.cfg.UpperImage, r.cfg.UpperRoot); err != nil {
			return err
		}
		return quota.EnableBtrfs(r.cfg.UpperRoot)
	}
	return run(ctx, "mount", "-t", "ext4", "-o", "loop,prjquota,noatime", r.cfg.UpperImage, r.cfg.UpperRoot)
}

func run(ctx context.Context, name string, args ...string) error {
	out, err := exec.CommandContext(ctx, name, args...).CombinedOutput()
	if err != nil {
		return fmt.Errorf("%s %s: %w: %s", name, strings.Join(args, " "), err, bytes.TrimSpace(out))
	}
	return nil
}

// Teardown undoes Init once every sandbox is deleted: it unmounts the upper
// file system if Init mounted it from UpperImage (which frees its loop
// device) and removes the cgroup parent. The image file is kept.
func (r *Container) Teardown(ctx context.Context) error {
	var errs []error
	// Another backend of the node (they share the upper file system) may
	// have unmounted it already: its captures went with it, and Init
	// clears them the next time.
	if _, err := os.Stat(r.captureDir()); r.Features().Snapshot && err == nil {
		if err := r.clearCaptures(); err != nil {
			errs = append(errs, err)
		}
	}
	if err := r.unmountUpperFS(); err != nil {
		errs = append(errs, err)
	}
	if err := r.layout.RemoveParent(r.cgroupParent); err != nil {
		errs = append(errs, err)
	}
	return errors.Join(errs...)
}

func (r *Container) unmountUpperFS() error {
	ms, err := mountinfo.Read()
	if err != nil {
		return err
	}
	m, ok := mountinfo.At(ms, r.cfg.UpperRoot)
	if !ok || !strings.HasPrefix(m.Source, "/dev/loop") {
		return nil
	}
	loop := filepath.Base(m.Source)
	if backing(loop) != r.cfg.UpperImage {
		return nil // not ours
	}
	if err := unix.Unmount(r.cfg.UpperRoot, 0); err != nil {
		return fmt.Errorf("unmount %s: %w", r.cfg.UpperRoot, err)
	}
	r.quotaMu.Lock()
	r.quotas = nil
	r.quotaMu.Unlock()
	// Autoclear frees the device on the last close; detach it ourselves if
	// something set it up without.
	if backing(loop) == r.cfg.UpperImage {
		f, err := os.OpenFile(m.Source, os.O_RDONLY, 0)
		if err != nil {
			return fmt.Errorf("open %s: %w", m.Source, err)
		}
		defer f.Close()
		if err := unix.IoctlSetInt(int(f.Fd()), unix.LOOP_CLR_FD, 0); err != nil && !errors.Is(err, unix.ENXIO) {
			return fmt.Errorf("detach %s: %w", m.Source, err)
		}
	}
	return nil
}

// backing is the file behind loop device name, or "" when it is free.
func backing(name string) string {
	b, err := os.ReadFile(filepath.Join("/sys/block", name, "loop", "backing_file"))
	if err != nil {
		return ""
	}
	return strings.TrimSpace(string(b))
}

// Start creates and starts sandbox s with the agent listening on a Unix
// socket only the host can reach, and returns its dialer. On any error
// everything made so far is removed again.
func (r *Container) Start(ctx context.Context, s backend.Spec) (dial backend.Dialer, err error) {
	t0 := time.Now()
	if err := r.checkSpec(s); err != nil {
		return nil, err
	}
	bundle := r.bundleDir(s.ID)
	rootfs := filepath.Join(bundle, "rootfs")
	rel := r.cgroupRel(s.ID)

	// The bundle dir comes first: it marks the sandbox as known (List) until
	// Delete removes it.
	if err := os.Mkdir(bundle, 0o700); err != nil {
		if errors.Is(err, fs.ErrExist) {
			return nil, fmt.Errorf("start sandbox %s: %w", s.ID, errdefs.ErrAlreadyExists)
		}
		return nil, fmt.Errorf("make bundle %s: %w", bundle, err)
	}
	// From here on a failure removes what the start made with Delete, the
	// one teardown of a sandbox: each of its steps takes what is not there
	// as done, so it is safe at any point of a start.
	defer func() {
		if err == nil {
			return
		}
		if derr := r.Delete(ctx, s.ID); derr != nil {
			r.log.Error("clean up failed sandbox", "id", s.ID, "err", derr)
		}
	}()

	upper, work, qgroup, err := r.makeUpper(s)
	if err != nil {
		return nil, err
	}
	tUpper := time.Now()

	if err := os.Mkdir(rootfs, 0o755); err != nil {
		return nil, fmt.Errorf("make rootfs dir: %w", err)
	}
	if err := mountOverlay(layerDirs(s.Layers), upper, work, rootfs); err != nil {
		return nil, err
	}
	tMount := time.Now()

	// The parent is shared by every dsecd on the host, and one's teardown
	// removes it when empty: make sure it is there.
	if err := r.layout.EnsureParent(r.cgroupParent); err != nil {
		return nil, err
	}
	// runsc sets the spec's limits only on the cgroups it makes itself
	// (one that exists is "managed by the caller"): under gVisor it makes
	// them all.
	var freezerDir, memDir string
	if !r.gvisor() {
		freezerDir, memDir, err = r.layout.Create(rel)
	}
	if err != nil {
		return nil, err
	}

	in := specInput{
		Spec:        s,
		AgentDir:    r.cfg.AgentDir,
		CgroupsPath: "/" + rel,
		MemorySwap:  r.swapAccounting(),
		Nofile:      nofile(),
		DiskQgroup:  qgroup,
		FnCall:      r.fncall,
		LogRefusals: r.cfg.LogRefusals,
	}
	var sentry *vmnet.Sentry
	if r.gvisor() {
		if in.Spec.ResolvConf, sentry, err = gvisorDNS(s, bundle); err != nil {
			return nil, err
		}
	}
	var extra []*os.File
	if r.gvisor() {
		// No fds reach a gVisor sandbox's agent: it makes its socket in a
		// dir of the host, and the sentry keeps its processes' cgroups.
		dir := r.gvisorSocketDir(s.ID)
		if err := os.RemoveAll(dir); err != nil {
			return nil, fmt.Errorf("clear agent socket dir of %s: %w", s.ID, err)
		}
		if err := os.MkdirAll(dir, 0o700); err != nil {
			return nil, fmt.Errorf("make agent socket dir of %s: %w", s.ID, err)
		}
		in.ListenDir = dir
		in.HostTasksPerTask = gvisorHostTasks(r.cfg.RunscPlatform)
	} else {
		files, pidsFD, err := r.agentFiles(s, rel, freezerDir, memDir)
		// Closed once Start returns; the agent holds its own copies.
		defer func() {
			for _, f := range files {
				f.Close()
			}
		}()
		if err != nil {
			return nil, err
		}
		extra, in.PidsFD = files, pidsFD
	}

	spec := buildSpec(in)
	cfgJSON, err := json.MarshalIndent(spec, "", "\t")
	if err != nil {
		return nil, fmt.Errorf("encode config.json: %w", err)
	}
	if err := os.WriteFile(filepath.Join(bundle, "config.json"), cfgJSON, 0o600); err != nil {
		return nil, fmt.Errorf("write config.json: %w", err)
	}

	logFile, err := os.OpenFile(s.LogPath, os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o600)
	if err != nil {
		return nil, fmt.Errorf("open agent log: %w", err)
	}
	defer logFile.Close()
	runtimeLog := filepath.Join(bundle, "runtime.log")
	args := append(r.globalArgs(), "--log", runtimeLog, "--log-format", "json")
	if r.gvisor() && s.NetnsPath == "" {
		// In a new namespace runsc's own network stack copies the host's
		// interfaces, and the new namespace's loopback is down: the sandbox
		// would have no interface at all. --network=none gives it loopback.
		args = append(args, "--network=none")
	}
	args = append(args, "run", "--detach", "--bundle", bundle)
	if len(extra) > 0 {
		args = append(args, "--preserve-fds", strconv.Itoa(len(extra)))
	}
	cmd := exec.Command(r.path, append(args, s.ID)...)
	// With --detach and no terminal the agent inherits these.
	cmd.Stdin = nil // /dev/null
	cmd.Stdout = logFile
	cmd.Stderr = logFile
	cmd.ExtraFiles = extra
	tRun := time.Now()
	var serr error
	if refusalsLogged(in) {
		serr, err = startInSession(cmd)
	} else {
		err = cmd.Start()
	}
	if err == nil {
		err = cmd.Wait()
	}
	if err != nil {
		return nil, fmt.Errorf("%s run %s: %w: %s", r.cfg.Runtime, s.ID, err, runtimeErrors(runtimeLog))
	}
	if serr != nil {
		r.log.Warn("the sandbox's refused syscalls will not be recorded", "id", s.ID, "err", serr)
	}
	tStarted := time.Now()
	if s.QoS.Idle() {
		// After the start: runc makes the cpu cgroup, and a few ms of the
		// agent's start at normal weight cost no one anything.
		if err := qos.SetIdle(r.layout.Dir("cpu", rel), true); err != nil {
			return nil, err
		}
	} else if r.coreSched && !r.gvisor() {
		r.shareCookie(ctx, s.ID)
	}
	if sentry != nil {
		if err := vmnet.AttachSentry(ctx, s.NetnsPath, *sentry); err != nil {
			return nil, err
		}
	}
	if r.gvisor() {
		if err := r.adoptSocket(ctx, s.ID); err != nil {
			return nil, err
		}
	}

	// The container holds its own copy of the overlay; drop the host's so
	// the host mount table does not grow with the sandbox count.
	if err := detach(rootfs); err != nil {
		return nil, err
	}
	r.log.Info("started sandbox", "id", s.ID, "took", time.Since(t0),
		"upper", tUpper.Sub(t0), "overlay", tMount.Sub(tUpper), "runtime_run", tStarted.Sub(tRun))
	return backend.UnixDialer(r.socketPath(s.ID)), nil
}

// agentFiles opens the fds an agent under runc gets, from 3 on: the
// channel's listening socket, then its cgroup dirs (freezer, memory, the
// commands' pids dir where there is one, cpu for fncall). pidsFD says
// whether the pids dir is among them. The caller closes the files once the
// runtime has passed them on, on error too.
func (r *Container) agentFiles(s backend.Spec, rel, freezerDir, memDir string) (files []*os.File, pidsFD bool, err error) {
	ln, err := r.listen(s.ID)
	if err != nil {
		return nil, false, err
	}
	files = append(files, ln)
	openFd := func(dir string) error {
		f, err := openDir(dir)
		if err != nil {
			return err
		}
		files = append(files, f)
		return nil
	}
	if err := openFd(freezerDir); err != nil {
		return files, false, err
	}
	if err := openFd(memDir); err != nil {
		return files, false, err
	}
	pidsDir, err := r.layout.CommandPids(rel, pidsLimit(s))
	if err != nil {
		return files, false, err
	}
	if pidsDir != "" {
		if err := openFd(pidsDir); err != nil {
			return files, false, err
		}
	}
	if r.fncall {
		cpuDir, err := r.layout.CreateCPU(rel)
		if err != nil {
			return files, false, err
		}
		if err := openFd(cpuDir); err != nil {
			return files, false, err
		}
	}
	return files, pidsDir != "", nil
}

// gvisorSocketWait bounds how long Start waits for a gVisor sandbox's
// agent to make its socket.
const gvisorSocketWait = 30 * time.Second

// adoptSocket waits for the agent of gVisor sandbox id to make its socket
// in the bind-mounted dir, links it to the sandbox's socket path and
// removes it from that dir. The host connects through the link; inside the
// sandbox the name is gone, so no process there can reach the agent (the
// sentry's file access to bind mounts is shared, so it sees the removal).
func (r *Container) adoptSocket(ctx context.Context, id string) error {
	made := filepath.Join(r.gvisorSocketDir(id), "agent.sock")
	sock := r.socketPath(id)
	deadline := time.Now().Add(gvisorSocketWait)
	for {
		fi, err := os.Lstat(made)
		if err == nil && fi.Mode().Type() == fs.ModeSocket {
			break
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("wait for the agent socket of %s: none after %s", id, gvisorSocketWait)
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("wait for the agent socket of %s: %w", id, ctx.Err())
		case <-time.After(5 * time.Millisecond):
		}
	}
	os.Remove(sock)
	if err := os.Link(made, sock); err != nil {
		return fmt.Errorf("link agent socket of %s: %w", id, err)
	}
	// The file appears at bind, before the sentry has finished the bind
	// (it looks the new file up again) and before listen: removing the
	// name earlier fails the agent's bind. A connection that is accepted
	// (the agent drops it unread) says both are done.
	for {
		var d net.Dialer
		c, err := d.DialContext(ctx, "unix", sock)
		if err == nil {
			c.Close()
			break
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("wait for the agent of %s to listen: %w", id, err)
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("wait for the agent of %s to listen: %w", id, ctx.Err())
		case <-time.After(5 * time.Millisecond):
		}
	}
	if err := os.Remove(made); err != nil {
		return fmt.Errorf("remove agent socket of %s from its sandbox: %w", id, err)
	}
	return nil
}

// listen makes sandbox id's agent socket and returns its listening fd. The
// socket file outlives the listener: the agent owns the fd once started,
// and the caller closes this copy then, so that should the agent die
// before accepting, connections fail rather than hang.
func (r *Container) listen(id string) (*os.File, error) {
	sock := r.socketPath(id)
	if err := os.MkdirAll(filepath.Dir(sock), 0o700); err != nil {
		return nil, fmt.Errorf("make agent socket dir of %s: %w", id, err)
	}
	os.Remove(sock)
	ln, err := net.ListenUnix("unix", &net.UnixAddr{Name: sock, Net: "unix"})
	if err != nil {
		return nil, fmt.Errorf("listen on agent socket of %s: %w", id, err)
	}
	ln.SetUnlinkOnClose(false)
	f, err := ln.File()
	ln.Close()
	if err != nil {
		return nil, fmt.Errorf("agent socket fd of %s: %w", id, err)
	}
	return f, nil
}

// removeSocket removes sandbox id's agent socket, and its dir once empty
// (the edge may keep its record there).
func (r *Container) removeSocket(id string) error {
	sock := r.socketPath(id)
	if err := os.Remove(sock); err != nil && !errors.Is(err, fs.ErrNotExist) {
		return fmt.Errorf("remove agent socket of %s: %w", id, err)
	}
	if err := os.RemoveAll(r.gvisorSocketDir(id)); err != nil {
		return fmt.Errorf("remove agent socket dir of %s: %w", id, err)
	}
	if err := os.Remove(filepath.Dir(sock)); err != nil && !errors.Is(err, fs.ErrNotExist) && !errors.Is(err, unix.ENOTEMPTY) && !errors.Is(err, unix.EEXIST) {
		return fmt.Errorf("remove agent socket dir of %s: %w", id, err)
	}
	return nil
}

// Channel returns the dialer of sandbox id's agent socket.
func (r *Container) Channel(id string) (backend.Dialer, error) {
	if !backend.ValidID(id) {
		return nil, fmt.Errorf("agent channel of sandbox %q: %w", id, errdefs.ErrNotFound)
	}
	if _, err := os.Stat(r.bundleDir(id)); err != nil {
		return nil, fmt.Errorf("agent channel of sandbox %s: %w", id, errdefs.ErrNotFound)
	}
	return backend.UnixDialer(r.socketPath(id)), nil
}

func (r *Container) checkSpec(s backend.Spec) error {
	if err := s.Validate(); err != nil {
		return err
	}
	for _, l := range s.Layers {
		if l.Dir == "" {
			return fmt.Errorf("check sandbox spec %q: layer %s is not mounted on the host (a container stacks mounted dirs): %w", s.ID, l.Digest, errdefs.ErrInvalidArgument)
		}
		if strings.ContainsAny(l.Dir, ":,") {
			return fmt.Errorf("check sandbox spec %q: layer dir %q must not hold ':' or ',': %w", s.ID, l.Dir, errdefs.ErrInvalidArgument)
		}
	}
	return nil
}

// layerDirs is where layers are mounted on the host, bottom first.
func layerDirs(layers []backend.Layer) []string {
	dirs := make([]string, len(layers))
	for i, l := range layers {
		dirs[i] = l.Dir
	}
	return dirs
}

// swapAccounting reports whether a memory+swap limit can be set.
func (r *Container) swapAccounting() bool {
	if r.layout.V2() {
		return true // runc ignores memory.swap.max when the kernel has no swap
	}
	_, err := os.Stat(filepath.Join(r.layout.Dir("memory", ""), "memory.memsw.limit_in_bytes"))
	return err == nil
}

// makeUpper makes <UpperRoot>/<id>, limited to s's disk and inode limits,
// and upper/ and work/ inside it, so overlayfs's copy-up renames between
// work and upper stay within one limited dir. When the limit is a btrfs
// qgroup, qgroup is its sysfs directory, from which the agent answers
// statfs (btrfs's own statfs ignores qgroups); under project quotas the
// kernel's statfs already reports the limit, and qgroup is "".
func (r *Container) makeUpper(s backend.Spec) (upper, work, qgroup string, err error) {
	q, err := r.quotaManager()
	if err != nil {
		return "", "", "", fmt.Errorf("make upper of %s: %w", s.ID, err)
	}
	dir, err := q.Create(s.ID, quota.Limit{Bytes: s.DiskBytes, Inodes: inodeLimit(s)})
	if err != nil {
		return "", "", "", fmt.Errorf("make upper of %s: %w", s.ID, err)
	}
	if s.DiskBytes > 0 {
		if qgroup, err = q.Qgroup(s.ID); err != nil {
			return "", "", "", fmt.Errorf("make upper of %s: %w", s.ID, err)
		}
	}
	upper, work = filepath.Join(dir, "upper"), filepath.Join(dir, "work")
	for _, d := range []string{upper, work} {
		if err := os.Mkdir(d, 0o755); err != nil {
			return "", "", "", fmt.Errorf("make %s: %w", d, err)
		}
	}
	return upper, work, qgroup, nil
}

// removeUpper removes sandbox id's writable layer and frees its quota.
func (r *Container) removeUpper(id string) error {
	q, err := r.quotaManager()
	if err != nil {
		// No quota on UpperRoot (not mounted?): at least remove the files.
		if err := os.RemoveAll(r.upperDir(id)); err != nil {
			return fmt.Errorf("remove upper of %s: %w", id, err)
		}
		return nil
	}
	if err := q.Remove(id); err != nil {
		return fmt.Errorf("remove upper of %s: %w", id, err)
	}
	return nil
}

func mountOverlay(lower []string, upper, work, target string) error {
	// overlayfs wants the top layer first.
	top := make([]string, len(lower))
	for i, l := range lower {
		top[len(lower)-1-i] = l
	}
	opts := fmt.Sprintf("lowerdir=%s,upperdir=%s,workdir=%s", strings.Join(top, ":"), upper, work)
	if len(opts) >= os.Getpagesize() {
		return fmt.Errorf("mount overlay on %s: %d bytes of options exceed a page: %w", target, len(opts), errdefs.ErrInvalidArgument)
	}
	if err := unix.Mount("overlay", target, "overlay", unix.MS_NODEV, opts); err != nil {
		return fmt.Errorf("mount overlay on %s: %w", target, err)
	}
	return nil
}

// removeBundle unmounts and removes a bundle dir. The rootfs dir is removed
// with rmdir first, so a rootfs still mounted is never walked into.
func removeBundle(bundle string) error {
	rootfs := filepath.Join(bundle, "rootfs")
	if err := detach(rootfs); err != nil {
		return err
	}
	if err := os.Remove(rootfs); err != nil && !errors.Is(err, fs.ErrNotExist) {
		return fmt.Errorf("remove %s: %w", rootfs, err)
	}
	if err := os.RemoveAll(bundle); err != nil {
		return fmt.Errorf("remove bundle %s: %w", bundle, err)
	}
	return nil
}

// detach lazily unmounts target; not being mounted is fine.
func detach(target string) error {
	err := unix.Unmount(target, unix.MNT_DETACH)
	if err == nil || errors.Is(err, unix.EINVAL) || errors.Is(err, unix.ENOENT) {
		return nil
	}
	return fmt.Errorf("unmount %s: %w", target, err)
}

func openDir(path string) (*os.File, error) {
	fd, err := unix.Open(path, unix.O_RDONLY|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
	if err != nil {
		return nil, fmt.Errorf("open %s: %w", path, err)
	}
	return os.NewFile(uintptr(fd), path), nil
}

// runtimeErrors returns the error messages the runtime logged to path.
func runtimeErrors(path string) string {
	f, err := os.Open(path)
	if err != nil {
		return ""
	}
	defer f.Close()
	var msgs []string
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		var e struct{ Level, Msg string }
		if json.Unmarshal(sc.Bytes(), &e) == nil && (e.Level == "error" || e.Level == "fatal") {
			msgs = append(msgs, e.Msg)
		}
	}
	return strings.Join(msgs, "; ")
}

// runtimeCmd runs the OCI runtime with args and returns its combined output.
func (r *Container) runtimeCmd(ctx context.Context, args ...string) ([]byte, error) {
	cmd := exec.CommandContext(ctx, r.path, append(r.globalArgs(), args...)...)
	out, err := cmd.CombinedOutput()
	if err != nil {
		return out, fmt.Errorf("%s %s: %w: %s", r.cfg.Runtime, args[0], err, bytes.TrimSpace(out))
	}
	return out, nil
}

// runtimeStdout runs the OCI runtime and returns its stdout alone: what
// it says on stderr (runc's list warns "load container …: container does
// not exist" for one a create has not finished writing) goes into the
// error only.
func (r *Container) runtimeStdout(ctx context.Context, args ...string) ([]byte, error) {
	cmd := exec.CommandContext(ctx, r.path, append(r.globalArgs(), args...)...)
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	out, err := cmd.Output()
	if err != nil {
		return out, fmt.Errorf("%s %s: %w: %s", r.cfg.Runtime, args[0], err, bytes.TrimSpace(stderr.Bytes()))
	}
	return out, nil
}

func notExist(out []byte) bool {
	s := string(out)
	return strings.Contains(s, "does not exist") || strings.Contains(s, "not found") || strings.Contains(s, "No such file")
}

// runtimeDelete kills and forgets container id; unknown is fine.
func (r *Container) runtimeDelete(ctx context.Context, id string) error {
	out, err := r.runtimeCmd(ctx, "delete", "--force", id)
	if err != nil && !notExist(out) {
		return err
	}
	return nil
}

type runtimeState struct {
	ID     string `json:"id"`
	Pid    int    `json:"pid"`
	Status string `json:"status"`
}

// shareCookie gives latency container id's init (the agent) a
// core-scheduling cookie of its own, which every process it starts
// inherits. A container without one still runs, unprotected from its SMT
// sibling's tasks: that is logged, not a failed create.
func (r *Container) shareCookie(ctx context.Context, id string) {
	rs, err := r.runtimeState(ctx, id)
	if err == nil {
		err = qos.ShareCookie(rs.Pid)
	}
	if err != nil {
		r.log.Warn("latency sandbox runs without a core-scheduling cookie", "id", id, "err", err)
	}
}

// runtimeState is the OCI runtime's state of container id.
func (r *Container) runtimeState(ctx context.Context, id string) (runtimeState, error) {
	var rs runtimeState
	out, err := r.runtimeCmd(ctx, "state", id)
	if err != nil {
		if notExist(out) {
			return rs, fmt.Errorf("state of sandbox %s: %w", id, errdefs.ErrNotFound)
		}
		return rs, err
	}
	if err := json.Unmarshal(out, &rs); err != nil {
		return rs, fmt.Errorf("parse state of %s: %w", id, err)
	}
	return rs, nil
}

// Status reports whether sandbox id runs and its memory statistics. It
// returns errdefs.ErrNotFound when nothing of id exists.
func (r *Container) Status(ctx context.Context, id string) (backend.Status, error) {
	if !backend.ValidID(id) {
		return backend.Status{}, fmt.Errorf("status of sandbox %q: %w", id, errdefs.ErrNotFound)
	}
	var st backend.Status
	out, err := r.runtimeCmd(ctx, "state", id)
	switch {
	case err == nil:
		var rs runtimeState
		if err := json.Unmarshal(out, &rs); err != nil {
			return backend.Status{}, fmt.Errorf("parse state of %s: %w", id, err)
		}
		if rs.Status == "running" || rs.Status == "paused" {
			st.Running, st.Pid = true, rs.Pid
		}
	case notExist(out):
		if _, serr := os.Stat(r.bundleDir(id)); serr != nil && !r.layout.Exists(r.cgroupRel(id)) {
			return backend.Status{}, fmt.Errorf("status of sandbox %s: %w", id, errdefs.ErrNotFound)
		}
	default:
		return backend.Status{}, err
	}
	if cs, err := r.layout.Stats(r.cgroupRel(id)); err == nil {
		st.OOMKills, st.MemoryBytes = cs.OOMKills, cs.MemoryBytes
	}
	if r.gvisor() && !st.Running && st.OOMKills > 0 {
		st.Reason = r.gvisorOOMReason(id)
	}
	return st, nil
}

// gvisorOOMReason says why a gVisor sandbox whose cgroup counted an OOM
// kill stopped: the memory limit is on the host cgroup of the sentry and
// the gofer, so the host's OOM killer ends the sentry and everything in
// the sandbox with it, not the one process that allocated.
func (r *Container) gvisorOOMReason(id string) string {
	limit := ""
	if u, err := r.layout.Usage(r.cgroupRel(id)); err == nil && u.MemoryLimit > 0 {
		limit = fmt.Sprintf(" of %d MiB", u.MemoryLimit>>20)
	}
	return "out of memory: the sandbox reached its memory limit" + limit +
		" and the host's OOM killer ended gVisor's sentry, with every process of the sandbox"
}

// Usage reads sandbox id's CPU time and memory from its cgroups and its
// writable layer's use from its quota.
func (r *Container) Usage(ctx context.Context, id string) (backend.Usage, error) {
	if !backend.ValidID(id) {
		return backend.Usage{}, fmt.Errorf("usage of sandbox %q: %w", id, errdefs.ErrNotFound)
	}
	rel := r.cgroupRel(id)
	if !r.layout.Exists(rel) {
		return backend.Usage{}, fmt.Errorf("usage of sandbox %s: no cgroup: %w", id, errdefs.ErrNotFound)
	}
	cu, err := r.layout.Usage(rel)
	if err != nil {
		return backend.Usage{}, fmt.Errorf("usage of sandbox %s: %w", id, err)
	}
	u := backend.Usage{CPUUsec: cu.CPUUsec, MemoryBytes: cu.MemoryBytes, MemoryLimit: cu.MemoryLimit, CacheBytes: cu.CacheBytes}
	q, err := r.quotaManager()
	if err != nil {
		return backend.Usage{}, fmt.Errorf("usage of sandbox %s: %w", id, err)
	}
	lim, du, err := q.Usage(id)
	if err != nil {
		return backend.Usage{}, fmt.Errorf("disk usage of sandbox %s: %w", id, err)
	}
	u.DiskBytes, u.DiskLimit = du.Bytes, lim.Bytes
	var st unix.Statfs_t
	if err := unix.Statfs(r.upperBase, &st); err == nil {
		u.DiskSize = int64(st.Blocks) * st.Bsize
	}
	return u, nil
}

// Delete removes sandbox id and everything it has: its processes, the
// runtime's record, its cgroups (children first), agent socket, mounts,
// writable layer and bundle. It is idempotent and works on half-made sandboxes and on ones an
// earlier daemon started. It goes on after ctx is cancelled.
func (r *Container) Delete(ctx context.Context, id string) error {
	if !backend.ValidID(id) {
		return fmt.Errorf("delete sandbox %q: %w", id, errdefs.ErrInvalidArgument)
	}
	ctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 30*time.Second)
	defer cancel()
	rel := r.cgroupRel(id)
	var errs []error
	// Freeze-free kill: the cgroup walk below catches whatever escapes.
	_, _ = r.runtimeCmd(ctx, "kill", "--all", id, "KILL")
	if err := r.layout.Kill(ctx, rel); err != nil {
		errs = append(errs, err)
	}
	if err := r.runtimeDelete(ctx, id); err != nil {
		errs = append(errs, err)
	}
	if err := r.layout.Remove(ctx, rel); err != nil {
		errs = append(errs, err)
	}
	// The socket dir may be shared with the node's other backend: the
	// socket is this runtime's only while its bundle is (made before the
	// socket, removed after it).
	if _, err := os.Stat(r.bundleDir(id)); err == nil {
		if err := r.removeSocket(id); err != nil {
			errs = append(errs, err)
		}
	}
	if err := removeBundle(r.bundleDir(id)); err != nil {
		errs = append(errs, err)
	}
	if err := r.removeUpper(id); err != nil {
		errs = append(errs, err)
	}
	if err := errors.Join(errs...); err != nil {
		return fmt.Errorf("delete sandbox %s: %w", id, err)
	}
	return nil
}

// List returns the IDs of the sandboxes the runtime knows: those in the OCI
// runtime's state and half-made ones that still have a bundle dir.
func (r *Container) List(ctx context.Context) ([]string, error) {
	out, err := r.runtimeStdout(ctx, "list", "--format", "json")
	if err != nil {
		return nil, err
	}
	var states []runtimeState
	if len(bytes.TrimSpace(out)) > 0 {
		if err := json.Unmarshal(out, &states); err != nil {
			return nil, fmt.Errorf("parse %s list: %w", r.cfg.Runtime, err)
		}
	}
	seen := map[string]bool{}
	var ids []string
	for _, s := range states {
		if !seen[s.ID] {
			seen[s.ID] = true
			ids = append(ids, s.ID)
		}
	}
	ents, err := os.ReadDir(filepath.Join(r.root, "bundles"))
	if err != nil && !errors.Is(err, fs.ErrNotExist) {
		return nil, fmt.Errorf("list bundles: %w", err)
	}
	for _, e := range ents {
		if e.IsDir() && !seen[e.Name()] && backend.ValidID(e.Name()) {
			seen[e.Name()] = true
			ids = append(ids, e.Name())
		}
	}
	return ids, nil
}

// BareSpec is the OCI config of a container made like a sandbox of s (the
// same namespaces, capabilities, seccomp profile, masked paths, rlimits and
// cgroup limits) that runs args from rootfs, read-only, in place of the
// agent and without the agent's mount. The runtime makes its cgroups, named
// after the container. The benchmarks run it under a bare runc, so that
// both sides of a comparison carry the same limits and filters.
func BareSpec(s backend.Spec, rootfs string, args []string) (*specs.Spec, error) {
	layout, err := cgroups.Detect()
	if err != nil {
		return nil, err
	}
	r := &Container{layout: layout}
	spec := buildSpec(specInput{Spec: s, MemorySwap: r.swapAccounting(), Nofile: nofile()})
	spec.Root = &specs.Root{Path: rootfs, Readonly: true}
	spec.Process.Args = args
	spec.Mounts = slices.DeleteFunc(spec.Mounts, func(m specs.Mount) bool { return m.Destination == agentMount })
	return spec, nil
}

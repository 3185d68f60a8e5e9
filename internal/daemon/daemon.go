// Package daemon assembles dsecd: on one machine it runs the apiserver, the
// edge and the embedded metadata store in one process, with the apiserver
// still talking to the edge through the same interface a remote edge will
// implement. It serves the API on a Unix socket and a loopback TCP port.
package daemon

import (
	"bytes"
	"context"
	"crypto/sha256"
	"crypto/x509"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"runtime"
	"slices"
	"strings"
	"sync"
	"time"

	"golang.org/x/sys/unix"

	dsecv1 "dsec.dev/dsec/api/gen/dsec/v1"
	"dsec.dev/dsec/internal/apiserver"
	"dsec.dev/dsec/internal/blob"
	"dsec.dev/dsec/internal/config"
	"dsec.dev/dsec/internal/edge/backend"
	"dsec.dev/dsec/internal/edge/backend/container"
	"dsec.dev/dsec/internal/edge/claims"
	"dsec.dev/dsec/internal/edge/edgesvc"
	"dsec.dev/dsec/internal/edge/eventlog"
	"dsec.dev/dsec/internal/edge/image"
	"dsec.dev/dsec/internal/edge/layers"
	"dsec.dev/dsec/internal/edge/lazyd"
	"dsec.dev/dsec/internal/edge/ledger"
	"dsec.dev/dsec/internal/edge/netctl"
	"dsec.dev/dsec/internal/edge/network"
	"dsec.dev/dsec/internal/edge/provenance"
	"dsec.dev/dsec/internal/edge/sandbox"
	"dsec.dev/dsec/internal/edge/swap"
	"dsec.dev/dsec/internal/errdefs"
	"dsec.dev/dsec/internal/metrics"
	"dsec.dev/dsec/internal/receipt"
	"dsec.dev/dsec/internal/store"
	"dsec.dev/dsec/internal/watcher"
	sdkreceipt "dsec.dev/dsec/sdk/go/receipt"
)

// Config is dsecd's configuration. Zero values take the defaults below,
// which work on a fresh machine.
type Config struct {
	Root   string // state directory; default /var/lib/dsec
	Listen string // loopback TCP address; default 127.0.0.1:8675; "none" to disable
	Socket string // Unix socket; default <Root>/dsecd.sock
	Node   string // node name in sandbox IDs; default from the host name
	// Slot and Generation are the node's place in a cluster's registry, in
	// every sandbox ID; 0 for the all-in-one dsecd.
	Slot       uint16
	Generation uint32
	// Runtime is the OCI runtime of the container isolation: runc
	// (default) or crun. runsc is deprecated here: it reads as Runsc =
	// RuntimePath (gVisor beside runc; a create asks for it with
	// isolation gvisor).
	Runtime string
	// RuntimePath is the runtime's binary; default: Runtime on PATH.
	RuntimePath string
	// Runsc is gVisor's runsc, with which the node offers the gvisor
	// isolation beside the container one: a path (it must work, or the
	// node refuses to start), "" to look for one (runsc on PATH, else
	// scripts/build-runsc.sh's DefaultRunsc; offered when it works), or
	// NoRunsc for no gvisor.
	Runsc string
	// RunscPlatform is runsc's --platform: systrap, ptrace or kvm; ""
	// picks kvm where /dev/kvm runs stock guests, else systrap.
	RunscPlatform string
	// VMKernelDir is the microVM guest kernel's directory
	// (scripts/build-vm-kernel.sh); the node offers the microvm isolation
	// where it and QEMU are found. Default $DSEC_VM_KERNEL_DIR, else
	// DefaultVMKernelDir.
	VMKernelDir string
	// QEMU is the QEMU of the microvm isolation (default
	// qemu-system-x86_64 on PATH).
	QEMU string
	// VMPmemLayers attaches microVMs' layers as virtio-pmem with DAX on
	// q35 machines, so the node's guests share one copy of a layer in the
	// host's page cache (microvm.Config.PmemLayers; docs/microvm.md).
	VMPmemLayers bool
	// runscRequired: Runsc was named, not found.
	runscRequired bool
	// CgroupParent is the cgroup under which this node's sandboxes live.
	// Zero: the one the root was first started with, else that of the
	// first set of host names no other root holds (package claims): "dsec"
	// on a host with one dsecd.
	CgroupParent string
	AgentPath    string // dsec-agent binary; default beside dsecd, else on PATH
	ShellPath    string // static shell shipped into sandboxes; default /bin/bash-static, else /bin/busybox

	Defaults sandbox.Defaults
	// Limits left at 0 are derived from the node: MaxCPUs is its core
	// count, MaxMemoryMB its physical memory (MemTotal), MaxSandboxes
	// its memory over sandboxBudgetMB.
	Limits sandbox.Limits
	// OutputLimit is the output kept per command and stream for Attach to
	// replay, in bytes; a stream following the command gets all of it.
	OutputLimit int64
	// MaxWarm bounds the sandboxes all warm pools hold together; 0 = 256.
	MaxWarm int
	// Retention is how long a stopped or failed sandbox's record stays
	// listed (ls --all) after it ended; 0 = 10 minutes.
	Retention time.Duration
	// PausedRetention is how long a sandbox may stay paused; 0 = 7 days.
	PausedRetention time.Duration
	// Swap is swap of the node's own for pauses (package swap); none by
	// default.
	Swap swap.Config

	Network NetworkConfig
	Storage StorageConfig
	FnCall  FnCallConfig
	// SandboxFusionListen serves SandboxFusion's HTTP API (package
	// sandboxfusion) on this address; "none" = off. Default
	// DefaultSandboxFusionAddr, where a port already taken is only a
	// warning.
	SandboxFusionListen string
	// SandboxFusionProject is the project a SandboxFusion call without a
	// token runs in, as a runner there (its FnCall quota charged); a call
	// with one is its token's. Default "/": the root, so a client that
	// sends no token (verl's) works with no configuration; "none" refuses
	// such calls.
	SandboxFusionProject string
	// E2BListen, if set, serves E2B's API (package e2b: the control plane,
	// envd and the code interpreter on one port) on this address. Callers
	// need an API key (dsec token --e2b); the secret that signs sandboxes'
	// access tokens is made in <root>/e2b.secret.
	E2BListen string
	// DebugListen, if set, serves Go's profiles (net/http/pprof) on this
	// address; keep it on loopback.
	DebugListen string
	// MetricsListen, if set, serves the process's Prometheus metrics
	// (/metrics) on this address; keep it on loopback or a scrape
	// network. The all-in-one serves them at its API port's /metrics too.
	MetricsListen string
	// MetricsTokenFile, if set, holds a scrape token: a scrape from off
	// loopback bearing it may read /metrics (the all-in-one accepts a
	// viewer's token on the root project too; without either, such a
	// scrape is refused).
	MetricsTokenFile string
	// MetricsProjects is how many projects, the largest by sandboxes, the
	// node's sandbox gauge names; the rest are summed under "other"
	// (docs/operations.md). 0 = metrics.DefaultProjects; negative: none.
	MetricsProjects int
	// NoEvents keeps no lifecycle events (no event log on the node, none
	// pulled into the store): for measuring what they cost.
	NoEvents bool
	// NoMetrics records no metrics at all (/metrics answers 404): for
	// measuring what recording them costs.
	NoMetrics bool
	// metrics is the process's registry (package metrics), made by the
	// role that runs the node; nil records nothing.
	metrics *metrics.Registry
	// AuditRetention is how long audit records are kept (0 =
	// apiserver.DefaultAuditRetention; negative: forever).
	AuditRetention time.Duration
	// EventRetention is how long lifecycle events are kept (0 =
	// apiserver.DefaultEventRetention; negative: forever).
	EventRetention time.Duration
	// WebhookAllowPrivate allows webhooks on http:// and on loopback and
	// private addresses (docs/events.md).
	WebhookAllowPrivate bool
	// APITuning tunes the node's apiserver (zeros: apiserver's defaults).
	APITuning APITuning
	// StartTimeout is how long a new sandbox's agent may take to answer;
	// 0 = sandbox.DefaultStartTimeout.
	StartTimeout time.Duration
	// NoLedger keeps no cost ledger (docs/usage.md): for measuring what
	// keeping it costs. LedgerInterval is how often the node samples its
	// sandboxes' use (0: ledger.DefaultInterval), LedgerCheckpoint how
	// often a live sandbox's record is offered to the pulls (0:
	// ledger.DefaultCheckpoint); UsageRetention how long an ended
	// sandbox's row is kept (0 = apiserver.DefaultUsageRetention;
	// negative: forever).
	NoLedger         bool
	LedgerInterval   time.Duration
	LedgerCheckpoint time.Duration
	UsageRetention   time.Duration
	// Trajectory says how the node records its sandboxes' trajectories.
	Trajectory TrajectoryConfig
	// NoProvenance records no provenance as sandboxes run (no baseline at
	// start, no watch of protected paths, no log of refused syscalls); a
	// Provenance call, a grade's too, then returns nothing but what is
	// unseen (docs/provenance.md).
	NoProvenance bool
}

// DefaultSandboxFusionAddr is where the all-in-one dsecd serves
// SandboxFusion's API unless told otherwise: SandboxFusion's own port, on
// loopback.
const DefaultSandboxFusionAddr = config.DefaultSandboxFusionAddr

// StorageConfig says where layers are stored and how sandboxes load them.
type StorageConfig struct {
	// BlobStore is where layer files live as chunks: a directory or
	// s3://BUCKET[/PREFIX]?endpoint=HOST:PORT; default <root>/blobstore.
	BlobStore string
	Mode      string // ondemand (default), eager, local or tar
	ChunkSize int64  // bytes per chunk; default 1 MiB
	// CacheBytes bounds the on-demand chunk cache on disk; 0 = 10 GiB.
	CacheBytes int64
	// MemoryBytes bounds the on-demand chunk cache in memory; 0 = derived
	// from the node's memory (defaultChunkMemory).
	MemoryBytes int64
	// NoPagePush keeps lazyfs from handing the kernel the rest of a chunk
	// after a read of some of it (lazy.Config.NoPagePush).
	NoPagePush bool
	// BandwidthBytesPerSec caps blob store reads (a model of a remote
	// store); 0 = none.
	BandwidthBytesPerSec int64
	// Tars also publishes layers as tar.gz, for tar mode.
	Tars bool
	// MaxUploadBytes bounds a layer upload's archive, and the tree it
	// unpacks to; 0 = 16 GiB.
	MaxUploadBytes int64
}

// NetworkConfig is the node's sandbox networking.
type NetworkConfig struct {
	Disabled  bool         // no sandbox networks: network rules are refused
	Services  string       // operator JSON file of named services and mirrors
	Upstreams []string     // DNS servers the resolver asks; default the host's
	Pool      netip.Prefix // sandbox addresses; zero: see Table
	// EgressBytesPerSec and MaxConns are per-sandbox fair-share limits.
	EgressBytesPerSec int64
	MaxConns          int
	// Table, VethPrefix and LogGroup name this node's nftables table, host
	// veths and NFLOG group. No two roots on one host share one, nor
	// overlapping pools (package claims): a zero value is what the root was
	// first started with, else taken from the first default set no other
	// root holds (dsec, dsv, 2130, 10.213.0.0/16 on a host with one dsecd);
	// a value another root holds refuses the start.
	Table      string
	VethPrefix string
	LogGroup   uint16
}

// The node's layer service takes the layers its snapshots make.
var _ sandbox.Snapshots = (*layers.Service)(nil)

// sandboxBudgetMB is the node memory one sandbox is counted at when dsecd
// derives the node's maximum number of sandboxes. An idle sandbox was
// measured at 2.6 MiB of host memory (1,000 on one node, MemTotal minus
// MemAvailable, dsecd's own growth included: its RSS was 180 MiB) and at
// 3.4 MiB (3,200 on one node); 4 MiB keeps a sixth over the worst figure
// for dsecd's per-sandbox state and the kernel's. The count bounds idle
// sandboxes; the memory of busy ones is guarded by MinAvailableMB.
const sandboxBudgetMB = 4

// defaultChunkMemory is the memory tier of the on-demand chunk cache on a
// node with memTotalMB of physical memory: a sixteenth of it (1.5 GiB of
// 24), at least 64 MiB, at most 4 GiB. Chunks are held compressed, and a
// burst of 64 sandboxes over 8 images fetched 373 MB of them.
func defaultChunkMemory(memTotalMB int64) int64 {
	return min(max(memTotalMB<<20/16, 64<<20), 4<<30)
}

// minMaxSandboxes is the least derived maximum, so that a small machine
// still runs a useful number (MinAvailableMB refuses creates before such a
// node runs out of memory).
const minMaxSandboxes = 64

// defaultMaxSandboxes is the most sandboxes a node with memTotalMB of
// physical memory holds unless told otherwise.
func defaultMaxSandboxes(memTotalMB int64) int {
	return max(int(memTotalMB/sandboxBudgetMB), minMaxSandboxes)
}

// DefaultAddr is the TCP address dsecd listens on unless told otherwise.
const DefaultAddr = config.DefaultAddr

// DefaultRoot is dsecd's state directory unless told otherwise.
const DefaultRoot = config.DefaultRoot

func (c *Config) fill() error {
	switch {
	case c.MetricsProjects == 0:
		c.MetricsProjects = metrics.DefaultProjects
	case c.MetricsProjects < 0:
		c.MetricsProjects = 0
	}
	if c.Root == "" {
		c.Root = DefaultRoot
	}
	root, err := filepath.Abs(c.Root)
	if err != nil {
		return fmt.Errorf("resolve root %s: %w", c.Root, err)
	}
	c.Root = root
	if c.Listen == "" {
		c.Listen = DefaultAddr
	}
	if c.Socket == "" {
		c.Socket = filepath.Join(c.Root, "dsecd.sock")
	}
	if c.Node == "" {
		c.Node = nodeName()
	}
	if c.Runtime == "" {
		c.Runtime = "runc"
	}
	if c.Runtime == "runsc" {
		// Deprecated: gVisor is an isolation of its own beside runc.
		if c.Runsc == "" {
			c.Runsc = c.RuntimePath
		}
		c.Runtime, c.RuntimePath = "runc", ""
		if c.Runsc == "" {
			c.Runsc = findRunsc()
			c.runscRequired = true // asked for by name, as --runtime runsc was
		}
	}
	if c.Runsc == "" {
		c.Runsc = findRunsc()
	} else if c.Runsc != NoRunsc {
		c.runscRequired = true
	}
	if c.runscRequired && c.Runsc == "" {
		return fmt.Errorf("find runsc: not on PATH nor in %s (scripts/build-runsc.sh builds the version dsec runs): %w",
			DefaultRunsc, errdefs.ErrNotSupported)
	}
	if c.ShellPath == "" {
		c.ShellPath = defaultShell()
	}
	if c.AgentPath == "" {
		c.AgentPath = findAgent()
	}
	// A zero takes the default package config holds (the one place
	// defaults live), as a Config built in Go rather than from
	// config.AllInOne has them.
	def := config.DefaultNode(func(string) string { return "" })
	d, dd := &c.Defaults, def.Defaults
	if d.CPUs == 0 {
		d.CPUs = dd.CPUs
	}
	if d.MemoryMB == 0 {
		d.MemoryMB = dd.MemoryMB
	}
	if d.DiskMB == 0 {
		d.DiskMB = dd.DiskMB
	}
	if d.Pids == 0 {
		d.Pids = dd.Pids
	}
	if d.TTL == 0 {
		d.TTL = dd.TTL
	}
	if d.IdleTimeout == 0 {
		d.IdleTimeout = dd.IdleTimeout
	}
	l := &c.Limits
	memTotal := sync.OnceValues(sandbox.MemTotalMB)
	if l.MaxSandboxes == 0 {
		total, err := memTotal()
		if err != nil {
			return fmt.Errorf("read the node's memory for the default of --max-sandboxes: %w", err)
		}
		l.MaxSandboxes = defaultMaxSandboxes(total)
	}
	if l.MaxCPUs == 0 {
		l.MaxCPUs = float64(runtime.NumCPU())
	}
	if l.MaxMemoryMB == 0 {
		// A memory limit caps a sandbox, it reserves nothing: one may ask
		// for all of the node's memory, not for more.
		total, err := memTotal()
		if err != nil {
			return fmt.Errorf("read the node's memory for the default of --max-memory-mb: %w", err)
		}
		l.MaxMemoryMB = total
	}
	if l.MaxDiskMB == 0 {
		l.MaxDiskMB = def.Limits.MaxDiskMB
	}
	if l.MaxTTL == 0 {
		l.MaxTTL = def.Limits.MaxTTL
	}
	if l.MinAvailableMB == 0 {
		l.MinAvailableMB = def.Limits.MinAvailableMB
	}
	if c.Storage.MemoryBytes == 0 {
		total, err := memTotal()
		if err != nil {
			return fmt.Errorf("read the node's memory for the default of --chunk-memory-bytes: %w", err)
		}
		c.Storage.MemoryBytes = defaultChunkMemory(total)
	}
	if c.Retention == 0 {
		c.Retention = def.Retention
	}
	return nil
}

var notNodeChars = regexp.MustCompile(`[^a-z0-9]+`)

// nodeName makes a node name from the host name: lower case letters and
// digits, at most 16 of them.
// machineID identifies this host: its systemd machine ID, else its name.
// It tells a directory blob store here from one of the same path elsewhere.
func machineID() string {
	if b, err := os.ReadFile("/etc/machine-id"); err == nil && len(bytes.TrimSpace(b)) > 0 {
		return string(bytes.TrimSpace(b))
	}
	h, _ := os.Hostname()
	return h
}

func nodeName() string {
	h, _ := os.Hostname()
	n := notNodeChars.ReplaceAllString(strings.ToLower(h), "")
	if len(n) > 16 {
		n = n[:16]
	}
	if n == "" {
		n = "local"
	}
	return n
}

// defaultShell is the static shell commands run under: bash-static, whose
// PATH lookup finds the environment's own tools. busybox's shell would run
// its built-in applets (ls, patch, tar…) instead of the environment's, so it
// is only the fallback.
func defaultShell() string {
	for _, p := range []string{"/bin/bash-static", "/usr/bin/bash-static", "/bin/busybox"} {
		if _, err := os.Stat(p); err == nil {
			return p
		}
	}
	return "/bin/bash-static"
}

func findAgent() string {
	if exe, err := os.Executable(); err == nil {
		p := filepath.Join(filepath.Dir(exe), "dsec-agent")
		if _, err := os.Stat(p); err == nil {
			return p
		}
	}
	if p, err := exec.LookPath("dsec-agent"); err == nil {
		return p
	}
	return "dsec-agent"
}

// node is everything one dsecd owns, opened but not yet serving.
type node struct {
	cfg     Config
	metrics *metrics.Edge  // what the node records (nil: nothing)
	events  *eventlog.Log  // the lifecycle events of its sandboxes, for the apiservers to pull
	ledger  *ledger.Ledger // what its sandboxes use, for the apiservers to pull; nil with NoLedger
	log     *slog.Logger
	lock    *os.File
	images  *image.Store
	layers  *layers.Service
	// runtimes are the node's, one per kind it offers (openRuntimes);
	// missing says why it lacks the isolations it lacks.
	runtimes map[sandbox.Kind]backend.Runtime
	missing  map[dsecv1.Isolation]string
	net      *netctl.Controller // nil without networking
	// reads watches sandboxes' protected paths; nil where the host has no
	// fanotify (provenance then says reads are not seen).
	reads *provenance.Watcher
	// syscalls records the syscalls sandboxes' profiles refused; nil
	// where the node has no audit netlink socket.
	syscalls *provenance.SyscallLog
	edge     *sandbox.Manager
}

func open(ctx context.Context, cfg Config, log *slog.Logger) (*node, error) {
	if cfg.Runtime == "runsc" {
		log.Warn("dsecd --runtime runsc is deprecated: the node offers gvisor beside runc (--runsc PATH), and a create asks for it with isolation gvisor")
	}
	if err := cfg.fill(); err != nil {
		return nil, err
	}
	if err := os.MkdirAll(cfg.Root, 0o711); err != nil {
		return nil, fmt.Errorf("make root %s: %w", cfg.Root, err)
	}
	lock, err := os.OpenFile(filepath.Join(cfg.Root, "dsecd.lock"), os.O_CREATE|os.O_RDWR, 0o600)
	if err != nil {
		return nil, fmt.Errorf("open lock file: %w", err)
	}
	if err := unix.Flock(int(lock.Fd()), unix.LOCK_EX|unix.LOCK_NB); err != nil {
		lock.Close()
		return nil, fmt.Errorf("lock %s: another dsecd uses this root: %w", cfg.Root, err)
	}
	n := &node{cfg: cfg, log: log, lock: lock}
	ok := false
	defer func() {
		if !ok {
			n.close()
		}
	}()
	// The names the node's sandboxes use on the host: those the root was
	// first started with, else a set no other root on the host holds.
	if err := n.claimHostNames(); err != nil {
		return nil, err
	}
	cfg = n.cfg
	agentDir := filepath.Join(cfg.Root, "agent")
	if err := installAgent(agentDir, cfg.AgentPath, cfg.ShellPath); err != nil {
		return nil, err
	}
	if n.images, err = image.Open(filepath.Join(cfg.Root, "layers"), log.With("component", "image")); err != nil {
		return nil, err
	}
	if n.layers, err = openLayers(ctx, cfg, n.images, log); err != nil {
		return nil, err
	}
	rtCfg := container.Config{
		Root:          filepath.Join(cfg.Root, "runtime"),
		UpperRoot:     filepath.Join(cfg.Root, "upper"),
		UpperImage:    filepath.Join(cfg.Root, "upper.img"),
		Runtime:       cfg.Runtime,
		RuntimePath:   cfg.RuntimePath,
		RunscPlatform: cfg.RunscPlatform,
		CgroupParent:  cfg.CgroupParent,
		AgentDir:      agentDir,
		// Beside the edge's records, where agent sockets always were.
		SocketDir:   filepath.Join(cfg.Root, "sandboxes"),
		LogRefusals: !cfg.NoProvenance,
		Log:         log.With("component", "runtime"),
	}
	if n.runtimes, n.missing, err = openRuntimes(ctx, cfg, rtCfg, log); err != nil {
		return nil, err
	}
	// A node that cannot make the swap it was told to still serves: its
	// pauses release the page cache only, as it says.
	swapDir := filepath.Join(cfg.Root, "swap")
	if _, err := swap.Provision(ctx, swapDir, cfg.Swap, log.With("component", "swap")); err != nil {
		log.Warn("no swap of the node's own: pauses keep anonymous memory in RAM", "swap", cfg.Swap.String(), "err", err)
	}
	pauseReleases := func() string {
		sw, err := swap.Describe(swapDir)
		if err != nil {
			return ""
		}
		return sw.Releases()
	}
	log.Info("what a pause can release on this node", "releases", pauseReleases())
	n.metrics = cfg.metrics.Edge()
	var network sandbox.Network
	if !cfg.Network.Disabled {
		nc := cfg.Network
		n.net, err = netctl.Open(ctx, netctl.Config{
			Dir: filepath.Join(cfg.Root, "net"), Services: nc.Services, Upstreams: nc.Upstreams, Pool: nc.Pool,
			EgressBytesPerSec: nc.EgressBytesPerSec, MaxConns: nc.MaxConns,
			Table: nc.Table, VethPrefix: nc.VethPrefix, LogGroup: nc.LogGroup, Log: log.With("component", "netctl"),
			Metrics: n.metrics,
		})
		if err != nil {
			// Without networking the node still serves; rules are refused.
			log.Warn("sandbox networking is off: network rules will be refused", "err", err)
			n.net = nil
		} else {
			network = n.net
		}
	}
	if !cfg.NoEvents {
		// Kept on the node's disk, so a dsecd killed or crashed goes on
		// in its epoch with the events no apiserver pulled yet.
		dir := filepath.Join(cfg.Root, "events")
		if n.events, err = eventlog.Open(cfg.Node, dir, eventlog.Options{Log: log.With("component", "eventlog")}); err != nil {
			log.Warn("the event log is kept in memory only: events not pulled when dsecd stops are lost", "err", err)
			n.events = eventlog.New(cfg.Node, 0)
		}
	}
	if !cfg.NoLedger {
		if n.ledger, err = ledger.Open(cfg.Node, filepath.Join(cfg.Root, "ledger.json"), log.With("component", "ledger")); err != nil {
			return nil, err
		}
		n.ledger.SetCheckpoint(cfg.LedgerCheckpoint)
	}
	var reads sandbox.ReadWatcher
	var syscalls sandbox.SyscallRecorder
	if !cfg.NoProvenance {
		if n.reads, err = provenance.NewWatcher(log.With("component", "provenance")); err != nil {
			log.Warn("reads of protected paths will not be seen", "err", err)
			n.reads = nil
		} else {
			reads = n.reads
		}
		if n.syscalls, err = provenance.NewSyscallLog(log.With("component", "provenance"), 0); err != nil {
			log.Warn("syscalls refused by sandboxes' profiles will not be recorded", "err", err)
			n.syscalls = nil
		} else {
			syscalls = n.syscalls
		}
	}
	n.edge, err = sandbox.New(sandbox.Config{
		Node:            cfg.Node,
		Slot:            cfg.Slot,
		Generation:      cfg.Generation,
		StateDir:        filepath.Join(cfg.Root, "sandboxes"),
		Defaults:        cfg.Defaults,
		Limits:          cfg.Limits,
		OutputLimit:     cfg.OutputLimit,
		StartTimeout:    cfg.StartTimeout,
		MaxWarm:         cfg.MaxWarm,
		TombstoneTTL:    cfg.Retention,
		PausedRetention: cfg.PausedRetention,
		PauseReleases:   pauseReleases,
		Missing:         n.missing,
		Metrics:         n.metrics,
		Reads:           reads,
		Syscalls:        syscalls,
		ProvenanceOff:   cfg.NoProvenance,
		Events:          n.events,
		Ledger:          n.ledger,
		LedgerInterval:  cfg.LedgerInterval,
	}, n.runtimes, n.layers, network, log.With("component", "edge"))
	if err != nil {
		return nil, err
	}
	cfg.metrics.Node(n.edge.MetricsView, cfg.MetricsProjects)
	ok = true
	return n, nil
}

// claimHostNames settles the node's host-wide names (package claims) and
// puts them in its config.
func (n *node) claimHostNames() error {
	nc := &n.cfg.Network
	asked := claims.Names{Table: nc.Table, VethPrefix: nc.VethPrefix, LogGroup: nc.LogGroup, Pool: nc.Pool, CgroupParent: n.cfg.CgroupParent}
	names, err := claims.Registry{Routes: network.HostRoutes}.Claim(n.cfg.Root, asked, hasSandboxRecords(n.cfg.Root))
	if err != nil {
		return err
	}
	nc.Table, nc.VethPrefix, nc.LogGroup, nc.Pool, n.cfg.CgroupParent = names.Table, names.VethPrefix, names.LogGroup, names.Pool, names.CgroupParent
	return nil
}

// hasSandboxRecords says whether root holds sandboxes, which on a root
// that remembers no host names were made by a dsecd older than package
// claims, on the names it was given or the first default set.
func hasSandboxRecords(root string) bool {
	des, err := os.ReadDir(filepath.Join(root, "sandboxes"))
	return err == nil && slices.ContainsFunc(des, func(de os.DirEntry) bool { return de.IsDir() })
}

// layerInUse names a live sandbox of the node that runs on layer digest, or
// "" when none does: a layer in use is not removed.
func (n *node) layerInUse(ctx context.Context, digest string) (string, error) {
	live, err := n.edge.List(ctx, nil, []dsecv1.State{dsecv1.State_STATE_CREATING, dsecv1.State_STATE_RUNNING, dsecv1.State_STATE_STOPPING,
		dsecv1.State_STATE_PAUSING, dsecv1.State_STATE_PAUSED, dsecv1.State_STATE_RESUMING})
	if err != nil {
		return "", err
	}
	for _, sb := range live {
		if slices.Contains(sb.GetLayerDigests(), digest) {
			return sb.GetId(), nil
		}
	}
	return "", nil
}

func (n *node) close() {
	if n.reads != nil {
		n.reads.Close()
	}
	if n.syscalls != nil {
		n.syscalls.Close()
	}
	if n.layers != nil {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		if err := n.layers.Close(ctx); err != nil {
			n.log.Warn("stop layer service", "err", err)
		}
		cancel()
	}
	if err := n.events.Close(); err != nil {
		n.log.Warn("close the event log", "err", err)
	}
	if n.lock != nil {
		n.lock.Close()
	}
}

// Run serves dsecd until ctx is cancelled. Sandboxes keep running after it
// returns; the next Run re-adopts them.
func Run(ctx context.Context, cfg Config, log *slog.Logger) error {
	if err := cfg.fill(); err != nil {
		return err
	}
	// Before anything is mounted or started: with an agent that cannot run
	// in a sandbox, every create would fail only after its start timeout.
	if err := checkAgent(cfg.AgentPath); err != nil {
		return err
	}
	if !cfg.NoMetrics {
		cfg.metrics = metrics.New()
	}
	n, err := open(ctx, cfg, log)
	if err != nil {
		return err
	}
	defer n.close()
	cfg = n.cfg
	if err := n.edge.Recover(ctx); err != nil {
		return err
	}
	defer n.edge.Shutdown()
	if n.net != nil {
		defer n.net.Close()
	}

	// The apiserver calls the node's edge in-process, through the same
	// EdgeService an apiserver of a cluster calls remote edges by.
	edge := edgesvc.New(n.edge, layers.NewHandler(n.layers, n.layerInUse), log.With("component", "edgesvc"))
	edge.SetMetrics(n.metrics)
	edge.SetEvents(n.events)
	edge.SetLedger(n.ledger)
	stopRecorder, err := startRecorder(ctx, cfg, edge, n.edge, log)
	if err != nil {
		return err
	}
	defer stopRecorder()
	fn, err := n.startFnCall(ctx, log.With("component", "fncall"))
	if err != nil {
		return err
	}
	if fn != nil {
		defer fn.Close()
		edge.SetFnCall(fn)
	}
	fleet := watcher.NewFixed(watcher.Node{Member: watcher.Member{Name: n.edge.Node()}, Edge: edge})
	// The metadata store is the apiserver's: an edge of a cluster, which
	// opens the same node, has none of its own.
	meta, err := store.Open(ctx, filepath.Join(cfg.Root, "meta.db"))
	if err != nil {
		return err
	}
	defer meta.Close()
	if failed := cfg.metrics.StoreErrors().Of("sqlite"); failed != nil {
		meta = store.Observe(meta, failed)
	}
	scrapeToken, err := metrics.ReadScrapeToken(cfg.MetricsTokenFile)
	if err != nil {
		return err
	}
	// The loopback TCP port needs a token; the node's own users find it in
	// <root>/admin.token (the CLI and SDKs read it there by default).
	if err := ensureAdminToken(ctx, meta, filepath.Join(cfg.Root, AdminTokenFile)); err != nil {
		return err
	}
	tokenless, err := tokenlessProject(cfg.SandboxFusionProject, "/")
	if err != nil {
		return err
	}
	// The node key grades' receipts are signed with: made once, kept in
	// the root (ROOT/receipt/node.crt is what verifiers are given).
	receipts, err := receipt.NodeSigner(cfg.Root, cfg.Node)
	if err != nil {
		return err
	}
	edge.SetReceipts(func() (*sdkreceipt.Signer, error) { return receipts, nil })
	// The all-in-one is its only node: it trusts its own attestations.
	trust, err := sdkreceipt.NewVerifier([]*x509.Certificate{receipts.Certificate()})
	if err != nil {
		return err
	}
	edge.SetTrust(func() (*sdkreceipt.Verifier, error) { return trust, nil })
	api := apiserver.New(apiserver.Config{Name: cfg.Node, Auth: meta, Audit: meta, Quotas: meta, IAM: meta, Objects: meta, AuditRetention: cfg.AuditRetention,
		Events: meta, EventRetention: cfg.EventRetention, EventsOff: cfg.NoEvents, Webhooks: meta, WebhookAllowPrivate: cfg.WebhookAllowPrivate,
		Ledger: meta, UsageRetention: cfg.UsageRetention, ConsoleSessions: meta,
		TokenlessFnCall: tokenless, Metrics: cfg.metrics, ScrapeToken: scrapeToken,
		MaxBatch: cfg.APITuning.MaxBatch, CreateConcurrency: cfg.APITuning.CreateConcurrency,
		ReconcileInterval: cfg.APITuning.ReconcileInterval, AbandonAfter: cfg.APITuning.AbandonAfter,
		WebhookTimeout: cfg.APITuning.WebhookTimeout, WebhookBackoff: cfg.APITuning.WebhookBackoff,
		WebhookMaxActive: cfg.APITuning.WebhookMaxActive, GradePool: cfg.APITuning.GradePool}, meta, fleet, log.With("component", "apiserver"))
	// A reservation left pending by a dsecd that died mid-create, say, is
	// reconciled here as in a cluster.
	stopReconciler := runReconciler(ctx, api)
	defer stopReconciler()
	var lns []net.Listener
	uln, err := listenUnix(cfg.Socket)
	if err != nil {
		return err
	}
	lns = append(lns, uln)
	if cfg.Listen != "none" {
		tln, err := net.Listen("tcp", cfg.Listen)
		if err != nil {
			uln.Close()
			return fmt.Errorf("listen on %s: %w", cfg.Listen, err)
		}
		lns = append(lns, tln)
	}
	if metricsOn(cfg.MetricsListen) && cfg.metrics != nil {
		mln, err := listenMetrics(cfg.MetricsListen)
		if err != nil {
			for _, l := range lns {
				l.Close()
			}
			return err
		}
		go serveMetrics(ctx, mln, api.MetricsHandler(), log)
	}
	var sfAddr, e2bAddr string
	if cfg.SandboxFusionListen != "none" {
		addr := cfg.SandboxFusionListen
		if addr == "" {
			addr = DefaultSandboxFusionAddr
		}
		served, wait, err := serveSandboxFusion(ctx, addr, cfg.SandboxFusionListen == "", api, log)
		if err != nil {
			for _, l := range lns {
				l.Close()
			}
			return err
		}
		defer wait()
		sfAddr = served
	}
	if cfg.E2BListen != "" {
		served, wait, err := serveE2B(ctx, cfg.E2BListen, filepath.Join(cfg.Root, E2BSecretFile), true, api, meta, log)
		if err != nil {
			for _, l := range lns {
				l.Close()
			}
			return err
		}
		defer wait()
		e2bAddr = served
	}
	api.SetEndpoints(e2bAddr, sfAddr)
	if cfg.DebugListen != "" {
		go servePprof(ctx, cfg.DebugListen, log)
	}
	// The API's socket and port serve the metrics (the node's and the
	// apiserver's, one registry) beside the API, at /metrics.
	mux := http.NewServeMux()
	mux.Handle("/", api.Handler())
	log.Info("dsecd ready", "node", cfg.Node, "root", cfg.Root, "socket", cfg.Socket, "listen", cfg.Listen, "runtime", cfg.Runtime,
		"token_file", filepath.Join(cfg.Root, AdminTokenFile), "clients", clientEnv(cfg, lns), "e2b", e2bAddr, "sandboxfusion", sfAddr,
		"metrics", metricsAt(cfg.MetricsListen, cfg.metrics != nil))
	go endFollowers(ctx, api)
	serveErr := serve(ctx, log, mux, nil, lns...)
	log.Info("dsecd stopped; sandboxes keep running")
	return serveErr
}

// clientEnv is what a client of this dsecd exports to reach it: nothing
// for the default root's socket, which the CLI and SDKs find themselves;
// the TCP address and the token file when there is a TCP port, else the
// socket.
func clientEnv(cfg Config, lns []net.Listener) string {
	if cfg.Root == DefaultRoot && cfg.Socket == filepath.Join(DefaultRoot, "dsecd.sock") {
		return "none needed (the default root)"
	}
	if len(lns) > 1 {
		return fmt.Sprintf("export DSEC_ADDR=%s DSEC_TOKEN_FILE=%s", lns[1].Addr(), filepath.Join(cfg.Root, AdminTokenFile))
	}
	return "export DSEC_ADDR=unix://" + cfg.Socket
}

// Teardown removes every sandbox of the node and unmounts everything dsecd
// mounted (layers, the writable-layer file system). It refuses while a
// dsecd serves the same root.
func Teardown(ctx context.Context, cfg Config, log *slog.Logger) error {
	n, err := open(ctx, cfg, log)
	if err != nil {
		return err
	}
	defer n.close()
	var errs []error
	if err := n.edge.Teardown(ctx); err != nil {
		errs = append(errs, err)
	}
	// Each unmounts the upper file system they share; the later ones find
	// it unmounted.
	for _, k := range n.edge.Kinds() {
		if err := n.runtimes[k].Teardown(ctx); err != nil {
			errs = append(errs, fmt.Errorf("tear down the %s runtime: %w", k, err))
		}
	}
	if n.net != nil {
		if err := n.net.Teardown(ctx); err != nil {
			errs = append(errs, err)
		}
	}
	// Paused sandboxes' memory lived in the node's swap: they are gone now.
	if err := swap.Remove(filepath.Join(n.cfg.Root, "swap")); err != nil {
		errs = append(errs, err)
	}
	if err := n.images.UnmountAll(ctx); err != nil {
		errs = append(errs, err)
	}
	// The layer mounts sat on the lazy file system's files: it goes last.
	if err := lazyd.Stop(ctx, filepath.Join(n.cfg.Root, "lazy")); err != nil {
		errs = append(errs, err)
	}
	os.Remove(n.cfg.Socket)
	if len(errs) > 0 {
		return errors.Join(errs...)
	}
	// Nothing of the node is left on the host: its names are free for any
	// root, and this one picks again at its next start.
	return claims.Registry{}.Release(n.cfg.Root)
}

// installAgent copies the agent and the static shell into dir, which every
// sandbox sees read-only at /.dsec/bin. A file is replaced (by rename, so
// running sandboxes keep their open copy) only when its content changed.
func installAgent(dir, agentPath, shellPath string) error {
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return fmt.Errorf("make agent dir: %w", err)
	}
	files := map[string]string{"dsec-agent": agentPath, "sh": shellPath}
	for name, src := range files {
		if err := installFile(filepath.Join(dir, name), src); err != nil {
			return err
		}
	}
	return nil
}

func installFile(dst, src string) error {
	want, err := fileHash(src)
	if err != nil {
		return fmt.Errorf("install %s: %w", filepath.Base(dst), err)
	}
	if have, err := fileHash(dst); err == nil && have == want {
		return nil
	}
	in, err := os.Open(src)
	if err != nil {
		return fmt.Errorf("install %s: %w", filepath.Base(dst), err)
	}
	defer in.Close()
	tmp, err := os.CreateTemp(filepath.Dir(dst), ".install-*")
	if err != nil {
		return fmt.Errorf("install %s: %w", filepath.Base(dst), err)
	}
	defer os.Remove(tmp.Name())
	if _, err := io.Copy(tmp, in); err != nil {
		tmp.Close()
		return fmt.Errorf("install %s: %w", filepath.Base(dst), err)
	}
	if err := tmp.Chmod(0o555); err != nil {
		tmp.Close()
		return fmt.Errorf("install %s: %w", filepath.Base(dst), err)
	}
	if err := tmp.Close(); err != nil {
		return fmt.Errorf("install %s: %w", filepath.Base(dst), err)
	}
	if err := os.Rename(tmp.Name(), dst); err != nil {
		return fmt.Errorf("install %s: %w", filepath.Base(dst), err)
	}
	return nil
}

func fileExists(path string) bool {
	_, err := os.Stat(path)
	return err == nil
}

func fileHash(path string) ([32]byte, error) {
	f, err := os.Open(path)
	if err != nil {
		return [32]byte{}, err
	}
	defer f.Close()
	h := sha256.New()
	if _, err := io.Copy(h, f); err != nil {
		return [32]byte{}, err
	}
	var sum [32]byte
	copy(sum[:], h.Sum(nil))
	return sum, nil
}

// openLayers opens the blob store and the layer service in the configured
// mode, connecting to (or starting) the lazy file system for ondemand.
func openLayers(ctx context.Context, cfg Config, images *image.Store, log *slog.Logger) (*layers.Service, error) {
	sc := cfg.Storage
	if sc.BlobStore == "" {
		sc.BlobStore = filepath.Join(cfg.Root, "blobstore")
	}
	if sc.Mode == "" {
		sc.Mode = string(layers.ModeOnDemand)
	}
	mode, err := layers.ParseMode(sc.Mode)
	if err != nil {
		return nil, err
	}
	blobs, err := blob.Open(ctx, sc.BlobStore)
	if err != nil {
		return nil, err
	}
	if failed := cfg.metrics.BlobErrors().Of(blob.Backend(sc.BlobStore)); failed != nil {
		blobs = blob.Observe(blobs, failed)
	}
	if sc.BandwidthBytesPerSec > 0 {
		blobs = blob.Throttle(blobs, sc.BandwidthBytesPerSec)
	}
	var loader layers.Loader
	if mode == layers.ModeOnDemand {
		self, err := os.Executable()
		if err != nil {
			return nil, fmt.Errorf("find dsecd binary for lazyfs: %w", err)
		}
		c, err := lazyd.Connect(ctx, lazyd.Config{
			Dir: filepath.Join(cfg.Root, "lazy"), BlobStore: sc.BlobStore,
			CacheBytes: sc.CacheBytes, MemoryBytes: sc.MemoryBytes, NoPagePush: sc.NoPagePush,
			BandwidthBytesPerSec: sc.BandwidthBytesPerSec,
		}, self, log.With("component", "lazyd"))
		if err != nil {
			return nil, err
		}
		loader = c
		// The loader runs in its own process: each scrape asks it.
		cfg.metrics.Layers(func() (metrics.LayerTotals, bool) { return lazyTotals(ctx, c, log) })
	}
	return layers.New(layers.Config{
		Mode: mode, Blobs: blobs, BlobSpec: sc.BlobStore, ChunkSize: sc.ChunkSize,
		Dir: filepath.Join(cfg.Root, "layers-"+string(mode)), Loader: loader, Tars: sc.Tars,
		Machine: machineID(), MaxUpload: sc.MaxUploadBytes, Log: log.With("component", "layers"),
	}, images)
}

// lazyTotals reads the lazy loader's counters for a scrape of /metrics,
// in its own process (package lazyd) over its control socket; false when
// it does not answer within a second.
func lazyTotals(ctx context.Context, c *lazyd.Client, log *slog.Logger) (metrics.LayerTotals, bool) {
	ctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), time.Second)
	defer cancel()
	t, err := c.Totals(ctx)
	if err != nil {
		log.Debug("read the lazy loader's totals for /metrics", "err", err)
		return metrics.LayerTotals{}, false
	}
	return metrics.LayerTotals{BytesRead: t.BytesRead, BytesFetched: t.BytesFetched, ChunksFetched: t.ChunksFetched,
		MemoryHits: t.MemoryHits, DiskHits: t.DiskHits, CacheMisses: t.CacheMisses, FetchErrors: t.FetchErrors,
		GetErrors: t.GetErrors, ReadErrors: t.ReadErrors, VerifyErrors: t.VerifyErrors,
		MemoryBytes: t.MemoryBytes, DiskBytes: t.DiskBytes}, true
}

// DefaultRunsc is where scripts/build-runsc.sh puts runsc by default.
const DefaultRunsc = "/var/cache/dsec/runsc/runsc"

// findRunsc is runsc on PATH, else DefaultRunsc if it is there, else ""
// (the container backend then refuses with where to build one).
func findRunsc() string {
	if p, err := exec.LookPath("runsc"); err == nil {
		return p
	}
	if _, err := os.Stat(DefaultRunsc); err == nil {
		return DefaultRunsc
	}
	return ""
}

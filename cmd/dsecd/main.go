// Command dsecd is the dsec daemon. With no arguments it runs a whole
// single-machine dsec (apiserver, edge and metadata store) with its state
// under /var/lib/dsec. `dsecd teardown` removes every sandbox of the node and
// unmounts what dsecd mounted.
package main

import (
	"context"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"net/netip"
	"os"
	"os/signal"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"time"

	"dsec.dev/dsec/internal/apiserver"
	"dsec.dev/dsec/internal/clustertls"
	"dsec.dev/dsec/internal/daemon"
	"dsec.dev/dsec/internal/e2b"
	"dsec.dev/dsec/internal/edge/fncall"
	"dsec.dev/dsec/internal/edge/lazyd"
	"dsec.dev/dsec/internal/edge/swap"
	"dsec.dev/dsec/internal/iam"
	"dsec.dev/dsec/internal/metrics"
	"dsec.dev/dsec/internal/placement"
	"dsec.dev/dsec/internal/qos"
	"dsec.dev/dsec/internal/version"
	"dsec.dev/dsec/internal/vm/fuse2fs"
)

const usage = `usage:
  dsecd [flags]                the whole dsec on this machine: apiserver, edge and embedded store
  dsecd teardown [flags]       remove every sandbox of the node and unmount what dsecd mounted
  dsecd edge [flags]           one node of a cluster: serves EdgeService to apiservers (mutual TLS)
  dsecd apiserver [flags]      a stateless apiserver of a cluster, in front of its edges
  dsecd init-cluster [flags]   make the cluster's CA and the certificates of its apiservers and edges
  dsecd hollow-fleet [flags]   many hollow edges in one process, for control-plane scale tests
  dsecd token [flags]          mint an API token in a metadata store and print it
  dsecd --version              print which build this is

Run "dsecd COMMAND -h" for a command's flags. Every flag can also be set
in the environment: --max-sandboxes as DSECD_MAX_SANDBOXES, and so on; the
command line wins.
`

func main() {
	if fuse2fs.IsFusermount(os.Args[0]) {
		// fuse2fs's fusermount while a microVM's disk is captured
		// (package fuse2fs).
		os.Exit(fuse2fs.Fusermount(os.Args))
	}
	os.Exit(dispatch(os.Args[1:], os.Stdout))
}

// dispatch runs the command args name and returns the exit code.
func dispatch(args []string, stdout io.Writer) int {
	if len(args) == 1 && (args[0] == "--version" || args[0] == "-version" || args[0] == "version") {
		fmt.Fprintln(stdout, version.String("dsecd"))
		return 0
	}
	cmd := ""
	if len(args) > 0 && !strings.HasPrefix(args[0], "-") {
		cmd, args = args[0], args[1:]
	}
	var code int
	switch cmd {
	case "":
		code = nodeMain("dsecd", args, false)
	case "teardown":
		code = nodeMain("dsecd teardown", args, true)
	case "edge":
		code = edgeMain(args)
	case "apiserver":
		code = apiserverMain(args)
	case "init-cluster":
		code = initClusterMain(args)
	case "hollow-fleet":
		code = hollowFleetMain(args)
	case "token":
		code = tokenMain(args)
	case "lazyfs":
		code = lazyfsMain(args)
	default:
		fmt.Fprint(os.Stderr, usage)
		code = 2
	}
	return code
}

// nodeFlags are the settings of a node: the all-in-one dsecd's and an
// edge's.
type nodeFlags struct {
	noNetwork bool
	upstreams string
}

func addNodeFlags(fs *flag.FlagSet, cfg *daemon.Config, nf *nodeFlags) {
	fs.StringVar(&cfg.Root, "root", daemon.DefaultRoot, "state directory")
	fs.StringVar(&cfg.Node, "node", "", "node name used in sandbox IDs (default: from the host name)")
	fs.IntVar(&cfg.MetricsProjects, "metrics-projects", metrics.DefaultProjects, "how many projects, the largest by sandboxes, the sandbox gauge names; the rest are summed under \"other\" (negative: none; docs/operations.md)")
	fs.BoolVar(&cfg.NoMetrics, "no-metrics", false, "record no metrics at all (/metrics answers 404): to measure what they cost")
	fs.StringVar(&cfg.Runtime, "runtime", "runc", "OCI runtime of the container isolation: runc or crun (an edge also takes fake: a hollow node that starts nothing); runsc is deprecated here: it means --runsc with --runtime-path")
	fs.StringVar(&cfg.RuntimePath, "runtime-path", "", "the runtime's binary (default: --runtime on PATH)")
	fs.StringVar(&cfg.Runsc, "runsc", os.Getenv("DSEC_RUNSC"), "gVisor's runsc, for the gvisor isolation beside runc: a path that must work, none for no gvisor (default $DSEC_RUNSC, else runsc on PATH or "+daemon.DefaultRunsc+" when it works; scripts/build-runsc.sh builds it)")
	fs.Func("runsc-platform", "runsc's platform for the gvisor isolation: systrap, ptrace or kvm (default: kvm where /dev/kvm runs stock guests, else systrap)", func(v string) error {
		if v != "systrap" && v != "ptrace" && v != "kvm" {
			return fmt.Errorf("runsc platform %q: want systrap, ptrace or kvm", v)
		}
		cfg.RunscPlatform = v
		return nil
	})
	fs.StringVar(&cfg.VMKernelDir, "vm-kernel-dir", os.Getenv("DSEC_VM_KERNEL_DIR"), "the microVM guest kernel's directory, for the microvm isolation where QEMU is found too (default $DSEC_VM_KERNEL_DIR, else "+daemon.DefaultVMKernelDir+"; scripts/build-vm-kernel.sh builds it)")
	fs.StringVar(&cfg.QEMU, "qemu", "", "QEMU of the microvm isolation (default qemu-system-x86_64 on PATH; Debian's qemu-system-x86)")
	fs.BoolVar(&cfg.VMPmemLayers, "vm-pmem-layers", false, "attach microVMs' layers as virtio-pmem with DAX (q35 machines, ~0.3 s slower to boot under TCG): the node's guests share one copy of a layer in the host's page cache")
	fs.StringVar(&cfg.AgentPath, "agent", "", "dsec-agent binary (default: beside dsecd, else on PATH)")
	fs.StringVar(&cfg.ShellPath, "shell", "", "static shell shipped read-only into every sandbox (default /bin/bash-static, else /bin/busybox)")
	fs.Float64Var(&cfg.Defaults.CPUs, "default-cpus", 1, "CPU cores of a sandbox that asks for none")
	fs.Int64Var(&cfg.Defaults.MemoryMB, "default-memory-mb", 512, "memory of a sandbox that asks for none")
	fs.Int64Var(&cfg.Defaults.DiskMB, "default-disk-mb", 1024, "writable-layer size of a sandbox that asks for none")
	fs.DurationVar(&cfg.Defaults.TTL, "default-ttl", time.Hour, "lifetime of a sandbox that asks for none")
	fs.DurationVar(&cfg.Defaults.IdleTimeout, "default-idle-timeout", 15*time.Minute, "idle timeout of a sandbox that asks for none")
	fs.IntVar(&cfg.Limits.MaxSandboxes, "max-sandboxes", 0, "most sandboxes on this node (default: its physical memory / 4 MiB, at least 64)")
	fs.Float64Var(&cfg.Limits.MaxCPUs, "max-cpus", 0, "most CPU cores one sandbox may ask for (default: the node's core count)")
	fs.Int64Var(&cfg.Limits.MaxMemoryMB, "max-memory-mb", 0, "most memory in MiB one sandbox may ask for (default: the node's physical memory)")
	fs.IntVar(&cfg.MaxWarm, "max-warm", 0, "most sandboxes all warm pools of this node hold together (default 256)")
	fs.DurationVar(&cfg.Retention, "retention", 0, "how long a stopped or failed sandbox stays listed (dsec ls --all) after it ended (default 10m)")
	fs.DurationVar(&cfg.PausedRetention, "paused-retention", 0, "how long a sandbox may stay paused before it is stopped (default 168h)")
	fs.Func("swap", "swap of the node's own, so a pause can take sandboxes' anonymous memory out of RAM: none, file:SIZE (a swap file under the root) or zram:SIZE (default none: a pause releases the page cache only; a swap the host has is used, never changed)", func(v string) error {
		c, err := swap.Parse(v)
		cfg.Swap = c
		return err
	})
	fs.BoolVar(&cfg.NoProvenance, "no-provenance", false, "record no provenance as sandboxes run: no baseline of their writable layer at start, no watch of protected paths, no log of refused syscalls; provenance calls and grades then return nothing but what is unseen (docs/provenance.md)")
	fs.BoolVar(&cfg.Trajectory.Off, "no-trajectories", false, "record no trajectories of the node's sandboxes (docs/trajectories.md)")
	fs.DurationVar(&cfg.Trajectory.Retention, "trajectory-retention", 0, "how long a sandbox's trajectory is kept after it is gone, here and in a cluster's blob store (default 24h)")
	fs.Int64Var(&cfg.Trajectory.MaxBytes, "trajectory-max-bytes", 0, "bytes of full lines a trajectory keeps; past them calls keep hashes and counts, past twice them calls are counted only (default 16 MiB)")
	fs.IntVar(&cfg.Trajectory.MaxOutput, "trajectory-max-output", 0, "bytes of each output stream a trajectory keeps per call; the rest is hashed and counted (default 16 KiB)")
	fs.Int64Var(&cfg.OutputLimit, "output-limit", 0, "output kept per command and stream for attach to replay, in bytes (default 16 MiB); a stream following the command gets all of it")
	fs.StringVar(&cfg.Storage.BlobStore, "blob-store", "", "where layer files live as chunks: a directory or s3://BUCKET[/PREFIX]?endpoint=HOST:PORT[&insecure=1] (default <root>/blobstore)")
	fs.StringVar(&cfg.Storage.Mode, "layer-mode", "ondemand", "how sandboxes load layers: ondemand, eager, local (pre-cached) or tar (baseline)")
	fs.Int64Var(&cfg.Storage.ChunkSize, "chunk-size", 1<<20, "bytes per layer chunk in the blob store")
	fs.Int64Var(&cfg.Storage.CacheBytes, "cache-bytes", 10<<30, "on-demand chunk cache limit on disk in bytes (hot chunks only, compressed)")
	fs.Int64Var(&cfg.Storage.MemoryBytes, "chunk-memory-bytes", 0, "on-demand chunk cache limit in memory in bytes: fetched chunks as the store served them (compressed) and, while they fit, decoded, until they prove hot or are evicted (default: 1/16 of physical memory, at most 4 GiB)")
	fs.BoolVar(&cfg.Storage.NoPagePush, "no-page-push", false, "read every page of an on-demand layer through lazyfs: without it, once a read takes some of a chunk, lazyfs hands the kernel the rest of the chunk's pages")
	fs.Int64Var(&cfg.Storage.BandwidthBytesPerSec, "blob-bandwidth", 0, "cap on blob store reads in bytes/s, to model a remote store (0: none)")
	fs.BoolVar(&cfg.Storage.Tars, "layer-tars", false, "also publish layers as tar.gz (tar mode needs them)")
	fs.Int64Var(&cfg.Storage.MaxUploadBytes, "max-upload-bytes", 16<<30, "most bytes a layer upload's archive may have, and the tree it unpacks to")
	fs.BoolVar(&nf.noNetwork, "no-network", false, "give sandboxes loopback only and refuse network rules")
	fs.StringVar(&cfg.Network.Services, "network-services", "", "JSON file of named services and mirrors (merged over what the host's package configuration names)")
	fs.StringVar(&nf.upstreams, "dns-upstream", "", "comma-separated DNS servers (host:port) the sandboxes' resolver asks (default: the host's)")
	fs.TextVar(&cfg.Network.Pool, "network-pool", netip.Prefix{}, "IPv4 prefix sandbox addresses come from (default: what the root was first started with, else 10.213.0.0/16, or the first of 10.214-255.0.0/16 no other root on the host holds)")
	fs.Int64Var(&cfg.Network.EgressBytesPerSec, "sandbox-egress-bytes", 0, "egress bandwidth per sandbox in bytes/s (default 125000000, 1 Gbit/s)")
	fs.IntVar(&cfg.Network.MaxConns, "sandbox-max-conns", 0, "concurrent connections per sandbox (default 1024)")
	fs.StringVar(&cfg.Network.Table, "nft-table", "", "nftables table of this node's sandbox network (default: what the root was first started with, else dsec, or dsecN when another root on the host holds it; the five host names --nft-table, --veth-prefix, --nflog-group, --network-pool and --cgroup-parent default together)")
	fs.StringVar(&cfg.Network.VethPrefix, "veth-prefix", "", "three characters starting this node's host veth names (default: as --nft-table: dsv, or dNN)")
	fs.Func("nflog-group", "NFLOG group of this node's network audit (default: as --nft-table: 2130, or 2130+N)", func(v string) error {
		n, err := strconv.ParseUint(v, 10, 16)
		cfg.Network.LogGroup = uint16(n)
		return err
	})
	fs.StringVar(&cfg.CgroupParent, "cgroup-parent", "", "cgroup under which this node's sandboxes live (default: as --nft-table: dsec, or dsecN)")
	fs.BoolVar(&cfg.FnCall.Disabled, "no-fncall", false, "run no fncall backend (FnCallService, SandboxFusion's API) on this node")
	fs.StringVar(&cfg.FnCall.Languages, "fncall-languages", "", "JSON file of languages registered on top of the builtin ones (docs/fncall.md)")
	fs.IntVar(&cfg.FnCall.Pools.MinIdle, "fncall-min-idle", 1, "idle containers each fncall pool keeps once used (the floor)")
	fs.IntVar(&cfg.FnCall.Pools.MaxPerPool, "fncall-max-per-pool", 0, "most containers of one fncall pool on this node (default: --fncall-max-containers)")
	fs.IntVar(&cfg.FnCall.Pools.SoftMaxPerPool, "fncall-soft-max-per-pool", 0, "containers of one fncall pool that run short calls at once; past it a pool grows only for long calls, as far as the node's memory holds them (default 4 per CPU core)")
	fs.Func("fncall-qos", "CPU class of fncall containers: latency (the default: calls' time limits are wall-clock) or best_effort (SCHED_IDLE: the node's latency sandboxes come first; docs/qos.md)", func(v string) error {
		c, err := qos.Parse(v, qos.Latency)
		cfg.FnCall.Pools.QoS = string(c)
		return err
	})
	fs.IntVar(&cfg.FnCall.Pools.MaxContainers, "fncall-max-containers", 256, "most fncall containers on this node, every pool")
	fs.DurationVar(&cfg.FnCall.Pools.MaxStartDelay, "fncall-max-start-delay", fncall.DefaultMaxStartDelay, "longest a call waits for a fncall container when none is starting for it; then it is refused (ResourceExhausted, 504 in SandboxFusion's API)")
	fs.IntVar(&cfg.FnCall.Pools.MaxQueue, "fncall-max-queue", 4096, "most calls waiting for a fncall container on this node; more are refused (ResourceExhausted, 504 in SandboxFusion's API)")
	fs.DurationVar(&cfg.FnCall.Pools.IdleRetire, "fncall-idle-retire", time.Minute, "how long a fncall container above its pool's floor may stay idle")
	fs.IntVar(&cfg.FnCall.Pools.MaxCalls, "fncall-max-calls", 10000, "calls after which a fncall container is replaced (0: never)")

}

func (nf *nodeFlags) apply(cfg *daemon.Config) {
	cfg.Network.Disabled = nf.noNetwork
	if nf.upstreams != "" {
		cfg.Network.Upstreams = strings.Split(nf.upstreams, ",")
	}
}

func logger(level slog.Level) *slog.Logger {
	return slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: level}))
}

// run runs fn until SIGINT or SIGTERM and returns the process's exit code.
func run(name string, fn func(ctx context.Context) error) int {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	if err := fn(ctx); err != nil {
		fmt.Fprintln(os.Stderr, name+":", err)
		return 1
	}
	return 0
}

// envName is the environment variable that sets a flag: DSECD_ and its
// name, upper case, dashes as underscores (--max-sandboxes:
// DSECD_MAX_SANDBOXES).
func envName(flagName string) string {
	return "DSECD_" + strings.ToUpper(strings.ReplaceAll(flagName, "-", "_"))
}

// fromEnv sets every flag its environment variable names; the command
// line, parsed after, wins.
func fromEnv(fs *flag.FlagSet, getenv func(string) string) error {
	var err error
	fs.VisitAll(func(f *flag.Flag) {
		if v := getenv(envName(f.Name)); v != "" && err == nil {
			if serr := f.Value.Set(v); serr != nil {
				err = fmt.Errorf("%s=%q: %w", envName(f.Name), v, serr)
			}
		}
	})
	return err
}

func parse(fs *flag.FlagSet, args []string) bool {
	if err := fromEnv(fs, os.Getenv); err != nil {
		fmt.Fprintf(fs.Output(), "%s: %v\n", fs.Name(), err)
		return false
	}
	if fs.Parse(args) != nil {
		return false
	}
	if fs.NArg() > 0 {
		fmt.Fprintf(fs.Output(), "%s: unexpected argument %q\n", fs.Name(), fs.Arg(0))
		fs.Usage()
		return false
	}
	return true
}

func nodeMain(name string, args []string, teardown bool) int {
	var cfg daemon.Config
	var nf nodeFlags
	var level slog.Level
	fs := flag.NewFlagSet(name, flag.ContinueOnError)
	fs.Usage = func() {
		fmt.Fprint(fs.Output(), usage+"\nflags of "+name+":\n")
		fs.PrintDefaults()
	}
	addNodeFlags(fs, &cfg, &nf)
	fs.StringVar(&cfg.Listen, "listen", daemon.DefaultAddr, `loopback TCP address to serve the API on ("none" to disable)`)
	fs.StringVar(&cfg.Socket, "socket", "", "Unix socket to serve the API on (default <root>/dsecd.sock)")
	fs.StringVar(&cfg.DebugListen, "debug-listen", "", "serve Go's profiles (/debug/pprof/) on this loopback address")
	fs.StringVar(&cfg.MetricsListen, "metrics-listen", "", "serve Prometheus metrics (/metrics) on this address too (the API port serves them already; off loopback a scrape needs a token: docs/operations.md)")
	fs.StringVar(&cfg.MetricsTokenFile, "metrics-token-file", "", "a file (mode 600) holding the scrape token (a viewer's token on the root project is accepted too) a scrape from off loopback must bear to read /metrics; docs/operations.md")
	fs.StringVar(&cfg.SandboxFusionListen, "sandboxfusion-listen", "", `TCP address to serve SandboxFusion's HTTP API on (default `+daemon.DefaultSandboxFusionAddr+`, skipped with a warning if taken; "none" to disable)`)
	fs.StringVar(&cfg.SandboxFusionProject, "sandboxfusion-project", "/", `the project SandboxFusion's calls without a token run in, as a runner there ("/": the root; "none" refuses them); a call with a token is its token's`)
	fs.StringVar(&cfg.E2BListen, "e2b-listen", "", "TCP address to serve E2B's API on (control plane, envd and code interpreter; callers need an E2B API key: dsecd token --e2b; default: off)")
	fs.DurationVar(&cfg.AuditRetention, "audit-retention", apiserver.DefaultAuditRetention, "how long audit records are kept (negative: forever)")
	fs.DurationVar(&cfg.EventRetention, "event-retention", apiserver.DefaultEventRetention, "how long sandbox lifecycle events are kept (negative: forever)")
	fs.BoolVar(&cfg.WebhookAllowPrivate, "webhook-allow-private", false, "allow webhooks on http:// and on loopback, private and link-local addresses")
	fs.TextVar(&level, "log-level", slog.LevelInfo, "log level: debug, info, warn, error")
	if !parse(fs, args) {
		return 2
	}
	nf.apply(&cfg)
	log := logger(level)
	return run("dsecd", func(ctx context.Context) error {
		if teardown {
			return daemon.Teardown(ctx, cfg, log)
		}
		return daemon.Run(ctx, cfg, log)
	})
}

func edgeMain(args []string) int {
	var cfg daemon.EdgeConfig
	var nf nodeFlags
	var level slog.Level
	var tlsDir string
	fs := flag.NewFlagSet("dsecd edge", flag.ContinueOnError)
	addNodeFlags(fs, &cfg.Node, &nf)
	fs.StringVar(&cfg.Listen, "listen", daemon.DefaultEdgeAddr, "TCP address to serve EdgeService on, to apiservers only (mutual TLS)")
	addTLSFlags(fs, &cfg.TLS, &tlsDir, "edge", "NODE")
	fs.StringVar(&cfg.Node.MetricsListen, "metrics-listen", "", "serve Prometheus metrics (/metrics) on this address (docs/operations.md)")
	fs.StringVar(&cfg.Node.MetricsTokenFile, "metrics-token-file", "", "a file (mode 600) holding the scrape token a scrape from off loopback must bear to read /metrics; docs/operations.md")
	fs.StringVar(&cfg.Registry, "registry", "", "the cluster's metadata store (postgres://…) to register in and heartbeat to (default: none; apiservers are told of this edge with --edge)")
	fs.StringVar(&cfg.Advertise, "advertise", "", "the URL apiservers reach this edge at (default https://<listen>)")
	fs.IntVar(&cfg.Hollow.MaxSandboxes, "hollow-max-sandboxes", 200, "with --runtime fake: sandboxes the hollow node admits")
	fs.DurationVar(&cfg.Hollow.StartDelay, "hollow-start-delay", 0, "with --runtime fake: how long a hollow create takes")
	fs.IntVar(&cfg.Hollow.MaxStarting, "hollow-max-starting", 0, "with --runtime fake: creates it starts at once (0: no bound)")
	fs.TextVar(&level, "log-level", slog.LevelInfo, "log level: debug, info, warn, error")
	if !parse(fs, args) {
		return 2
	}
	nf.apply(&cfg.Node)
	if cfg.Node.Node == "" {
		fmt.Fprintln(os.Stderr, "dsecd edge: --node is required (the name in its certificate and sandbox IDs)")
		return 2
	}
	if tlsDir != "" {
		def := clustertls.ComponentFiles(tlsDir, clustertls.RoleEdge, cfg.Node.Node)
		cfg.TLS = orFiles(cfg.TLS, def)
	}
	log := logger(level)
	return run("dsecd edge", func(ctx context.Context) error { return daemon.RunEdge(ctx, cfg, log) })
}

func apiserverMain(args []string) int {
	var cfg daemon.APIServerConfig
	var level slog.Level
	var tlsDir string
	var edges listFlag
	fs := flag.NewFlagSet("dsecd apiserver", flag.ContinueOnError)
	fs.StringVar(&cfg.Name, "name", "", "this replica's name, as its certificate has it (default: from the host name)")
	fs.StringVar(&cfg.Listen, "listen", daemon.DefaultAddr, "TCP address to serve the public API on")
	fs.StringVar(&cfg.Socket, "socket", "", "Unix socket to serve the public API on too")
	fs.StringVar(&cfg.DB, "db", "", "the metadata store all replicas share: postgres://… (or a SQLite file for a lone replica)")
	fs.Var(&edges, "edge", "an edge, NAME=https://HOST:PORT (repeatable; default: the edges registered in --db)")
	fs.IntVar(&cfg.Replicas, "replicas", 1, "how many apiservers place onto these edges (placement weighs its own recent placements by it)")
	fs.IntVar(&cfg.PlacementGroup, "placement-group", placement.DefaultGroup, "how many sandboxes of a batch go to one node together, in one call to it (1 spreads each on its own)")
	fs.StringVar(&cfg.SandboxFusionListen, "sandboxfusion-listen", "", "TCP address to serve SandboxFusion's HTTP API on (default: off)")
	fs.StringVar(&cfg.SandboxFusionProject, "sandboxfusion-project", "", `the project SandboxFusion's calls without a token run in, as a runner there ("/": the root); unset, such calls are refused (401) and every call needs a runner's token`)
	fs.StringVar(&cfg.E2BListen, "e2b-listen", "", "TCP address to serve E2B's API on (default: off; needs --e2b-secret-file)")
	fs.StringVar(&cfg.E2BSecretFile, "e2b-secret-file", "", "the secret that signs E2B access tokens, the same file on every apiserver (dsecd init-cluster writes e2b.secret)")
	fs.StringVar(&cfg.DebugListen, "debug-listen", "", "serve Go's profiles (/debug/pprof/) on this loopback address")
	fs.StringVar(&cfg.MetricsListen, "metrics-listen", "", "serve Prometheus metrics (/metrics) on this address (docs/operations.md)")
	fs.StringVar(&cfg.MetricsTokenFile, "metrics-token-file", "", "a file (mode 600) holding the scrape token (a viewer's token on the root project is accepted too) a scrape from off loopback must bear to read /metrics; docs/operations.md")
	fs.DurationVar(&cfg.PollInterval, "poll-interval", 0, "how often the watcher polls each edge (default 750ms; three missed polls make an edge unroutable)")
	fs.DurationVar(&cfg.ReconcileInterval, "reconcile-interval", 30*time.Second, "how often to settle creates left in doubt, abandon stale reservations and check sandbox rows against the edges")
	fs.DurationVar(&cfg.AbandonAfter, "abandon-after", apiserver.DefaultAbandonAfter, "how long a pending idempotent create may go without renewing its lease before any apiserver abandons it and reaps its sandboxes")
	fs.DurationVar(&cfg.AuditRetention, "audit-retention", apiserver.DefaultAuditRetention, "how long audit records are kept (negative: forever); every apiserver expires older ones about hourly")
	fs.DurationVar(&cfg.EventRetention, "event-retention", apiserver.DefaultEventRetention, "how long sandbox lifecycle events are kept (negative: forever); every apiserver expires older ones about hourly")
	fs.BoolVar(&cfg.WebhookAllowPrivate, "webhook-allow-private", false, "allow webhooks on http:// and on loopback, private and link-local addresses")
	addTLSFlags(fs, &cfg.TLS, &tlsDir, "apiserver", "NAME")
	fs.TextVar(&level, "log-level", slog.LevelInfo, "log level: debug, info, warn, error")
	if !parse(fs, args) {
		return 2
	}
	for _, e := range edges {
		se, err := daemon.ParseStaticEdge(e)
		if err != nil {
			fmt.Fprintln(os.Stderr, "dsecd apiserver:", err)
			return 2
		}
		cfg.Edges = append(cfg.Edges, se)
	}
	if tlsDir != "" {
		name := cfg.Name
		if name == "" {
			fmt.Fprintln(os.Stderr, "dsecd apiserver: --tls-dir needs --name (the name in its certificate)")
			return 2
		}
		cfg.TLS = orFiles(cfg.TLS, clustertls.ComponentFiles(tlsDir, clustertls.RoleAPIServer, name))
	}
	log := logger(level)
	return run("dsecd apiserver", func(ctx context.Context) error { return daemon.RunAPIServer(ctx, cfg, log) })
}

func initClusterMain(args []string) int {
	var dir string
	var apiservers, edges listFlag
	fs := flag.NewFlagSet("dsecd init-cluster", flag.ContinueOnError)
	fs.StringVar(&dir, "dir", "", "where the CA and certificates go (made 0700); an existing CA there is kept and used")
	fs.Var(&apiservers, "apiserver", "an apiserver's name (repeatable)")
	fs.Var(&edges, "edge", "an edge: NAME or NAME=HOST[,HOST...], the host names and addresses it serves on (repeatable)")
	if !parse(fs, args) {
		return 2
	}
	if dir == "" {
		fmt.Fprintln(os.Stderr, "dsecd init-cluster: --dir is required")
		return 2
	}
	var specs []clustertls.EdgeSpec
	for _, e := range edges {
		name, hosts, _ := strings.Cut(e, "=")
		spec := clustertls.EdgeSpec{Name: name}
		if hosts != "" {
			spec.Hosts = strings.Split(hosts, ",")
		}
		specs = append(specs, spec)
	}
	if err := clustertls.InitCluster(dir, apiservers, specs); err != nil {
		fmt.Fprintln(os.Stderr, "dsecd init-cluster:", err)
		return 1
	}
	// The apiservers' shared secret for E2B's access tokens (--e2b-secret-file).
	if err := daemon.EnsureE2BSecret(filepath.Join(dir, daemon.E2BSecretFile)); err != nil {
		fmt.Fprintln(os.Stderr, "dsecd init-cluster:", err)
		return 1
	}
	return 0
}

func tokenMain(args []string) int {
	var db, principal, project, role string
	var ttl time.Duration
	var asE2B bool
	fs := flag.NewFlagSet("dsecd token", flag.ContinueOnError)
	fs.StringVar(&project, "project", "/", "the project the token is for (a path: ml/rl-run-42)")
	fs.StringVar(&role, "role", "admin", "the token's role: viewer, runner, builder or admin (the principal is granted it on the project if it holds less)")
	fs.BoolVar(&asE2B, "e2b", false, "print the token as an E2B API key (e2b_…), for E2B_API_KEY")
	fs.StringVar(&db, "db", "", "the metadata store: postgres://… (a cluster's) or the all-in-one's <root>/meta.db")
	fs.StringVar(&principal, "principal", daemon.AdminPrincipal, "who the token is for (made if new)")
	fs.DurationVar(&ttl, "ttl", 0, "how long the token is valid (default: until revoked)")
	if !parse(fs, args) {
		return 2
	}
	if db == "" {
		fmt.Fprintln(os.Stderr, "dsecd token: --db is required")
		return 2
	}
	r, err := iam.ParseRole(role)
	if err != nil {
		fmt.Fprintln(os.Stderr, "dsecd token:", err)
		return 2
	}
	return run("dsecd token", func(ctx context.Context) error {
		tok, err := daemon.IssueToken(ctx, db, principal, project, r, ttl)
		if err == nil && asE2B {
			tok, err = e2b.APIKey(tok)
		}
		if err == nil {
			fmt.Println(tok)
		}
		return err
	})
}

func hollowFleetMain(args []string) int {
	var cfg daemon.HollowFleetConfig
	var level slog.Level
	fs := flag.NewFlagSet("dsecd hollow-fleet", flag.ContinueOnError)
	fs.IntVar(&cfg.Count, "count", 160, "hollow edges to run")
	fs.StringVar(&cfg.Prefix, "prefix", "h", "their names: PREFIX1…PREFIXn (dsecd init-cluster must have made their certificates)")
	fs.StringVar(&cfg.TLSDir, "tls-dir", "", "dsecd init-cluster's directory")
	fs.StringVar(&cfg.Registry, "registry", "", "the cluster's metadata store (postgres://…)")
	fs.IntVar(&cfg.Hollow.MaxSandboxes, "max-sandboxes", 200, "sandboxes each admits")
	fs.DurationVar(&cfg.Hollow.StartDelay, "start-delay", 0, "how long each create takes")
	fs.IntVar(&cfg.Hollow.MaxStarting, "max-starting", 0, "creates each starts at once (0: no bound)")
	fs.TextVar(&level, "log-level", slog.LevelInfo, "log level: debug, info, warn, error")
	if !parse(fs, args) {
		return 2
	}
	log := logger(level)
	return run("dsecd hollow-fleet", func(ctx context.Context) error { return daemon.RunHollowFleet(ctx, cfg, log) })
}

// addTLSFlags adds a role's certificate flags: the directory init-cluster
// wrote, or each file named.
func addTLSFlags(fs *flag.FlagSet, files *clustertls.Files, dir *string, role, name string) {
	base := role + "-" + name
	fs.StringVar(dir, "tls-dir", "", "directory dsecd init-cluster wrote: ca.crt and "+base+".{crt,key}")
	fs.StringVar(&files.Cert, "tls-cert", "", "the "+role+"'s certificate (default <tls-dir>/"+base+".crt)")
	fs.StringVar(&files.Key, "tls-key", "", "its key (default <tls-dir>/"+base+".key)")
	fs.StringVar(&files.CABundle, "tls-ca", "", "the cluster's CA bundle (default <tls-dir>/ca.crt)")
}

// orFiles fills the files not named with the defaults.
func orFiles(f, def clustertls.Files) clustertls.Files {
	if f.Cert == "" {
		f.Cert = def.Cert
	}
	if f.Key == "" {
		f.Key = def.Key
	}
	if f.CABundle == "" {
		f.CABundle = def.CABundle
	}
	return f
}

type listFlag []string

func (l *listFlag) String() string     { return strings.Join(*l, ",") }
func (l *listFlag) Set(v string) error { *l = append(*l, v); return nil }

// lazyfsMain runs `dsecd lazyfs`: the on-demand layer file system in a
// process of its own, which dsecd starts and which outlives a dsecd restart.
func lazyfsMain(args []string) int {
	var cfg lazyd.Config
	fs := flag.NewFlagSet("dsecd lazyfs", flag.ExitOnError)
	fs.StringVar(&cfg.Dir, "dir", "", "state directory")
	fs.StringVar(&cfg.BlobStore, "blob-store", "", "blob store spec")
	fs.Int64Var(&cfg.CacheBytes, "cache-bytes", 0, "chunk cache limit on disk")
	fs.Int64Var(&cfg.MemoryBytes, "chunk-memory-bytes", 0, "chunk cache limit in memory")
	fs.Int64Var(&cfg.BandwidthBytesPerSec, "bandwidth", 0, "cap on blob store reads in bytes/s")
	fs.BoolVar(&cfg.NoPagePush, "no-page-push", false, "do not hand the kernel the rest of a chunk a read took some of")
	fs.Parse(args)
	if cfg.Dir == "" || cfg.BlobStore == "" {
		fmt.Fprintln(os.Stderr, "dsecd lazyfs: --dir and --blob-store are required")
		return 2
	}
	log := slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelInfo}))
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	if err := lazyd.Serve(ctx, cfg, log); err != nil {
		fmt.Fprintln(os.Stderr, "dsecd lazyfs:", err)
		return 1
	}
	return 0
}

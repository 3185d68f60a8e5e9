// Package config holds dsecd's configuration: one typed struct per role
// (AllInOne, Edge, APIServer) with every setting an operator tunes and its
// default, and the one way they are set. A setting's value comes from, in
// order, each weaker than the next: its default here, a configuration file
// (--config FILE, TOML or YAML), its DSECD_* environment variable, and its
// command-line flag. Each field's struct tags name it in all three places:
// key (the file's dotted key), flag (the flag, whose upper-cased name with
// DSECD_ before it is the variable) and help (what it does).
//
// cmd/dsecd loads a role's struct with Load and hands it to package daemon,
// which turns it into the running configuration. Print writes the effective
// configuration as TOML (what `dsecd config print` shows), and Markdown the
// table docs/configuration.md holds, so the docs cannot drift from here.
package config

import (
	"net/netip"
	"time"
)

// The roles, as `dsecd config print --role` names them.
const (
	RoleAllInOne  = "all-in-one"
	RoleEdge      = "edge"
	RoleAPIServer = "apiserver"
)

// Roles lists every role.
var Roles = []string{RoleAllInOne, RoleEdge, RoleAPIServer}

// AllInOne is the whole dsec on one machine (`dsecd`): a node, and the API
// in front of it.
type AllInOne struct {
	Node
	API
	LogLevel string `key:"log_level" flag:"log-level" check:"log-level" help:"log level: debug, info, warn, error"`
}

// Edge is one node of a cluster (`dsecd edge`): it serves EdgeService to
// apiservers over mutual TLS.
type Edge struct {
	Node
	Listen        string `key:"listen" flag:"listen" help:"TCP address to serve EdgeService on, to apiservers only (mutual TLS)"`
	DebugListen   string `key:"debug_listen" flag:"debug-listen" help:"serve Go's profiles (/debug/pprof/) on this loopback address"`
	MetricsListen string `key:"metrics_listen" flag:"metrics-listen" help:"serve Prometheus metrics (/metrics) on this address (\"none\" or empty: off; a taken address stops the start; docs/operations.md)"`
	// MetricsTokenFile: an edge keeps no IAM, so only the scrape token.
	MetricsTokenFile string        `key:"metrics_token_file" flag:"metrics-token-file" help:"a file (mode 600) holding the scrape token a scrape from off loopback must bear to read /metrics; docs/operations.md"`
	Registry         string        `key:"registry" flag:"registry" secret:"url" help:"the cluster's metadata store (postgres://…) to register in and heartbeat to (empty: none; apiservers are told of this edge with --edge)"`
	Advertise        string        `key:"advertise" flag:"advertise" help:"the URL apiservers reach this edge at (empty: https://<listen>)"`
	Heartbeat        time.Duration `key:"heartbeat" flag:"heartbeat" help:"how often the edge tells the registry it lives"`
	TLS              TLS           `key:"tls"`
	Hollow           Hollow        `key:"hollow"`
	LogLevel         string        `key:"log_level" flag:"log-level" check:"log-level" help:"log level: debug, info, warn, error"`
}

// APIServer is a stateless apiserver of a cluster (`dsecd apiserver`), in
// front of its edges.
type APIServer struct {
	Name string `key:"name" flag:"name" help:"this replica's name, as its certificate has it (empty: from the host name)"`
	API
	DB             string        `key:"db" flag:"db" secret:"url" help:"the metadata store all replicas share: postgres://… (or a SQLite file, which only replicas on one machine can share)"`
	Edges          []string      `key:"edges" flag:"edge" list:"repeat" help:"an edge, NAME=https://HOST:PORT (repeatable; empty: the edges registered in the metadata store)"`
	Replicas       int           `key:"replicas" flag:"replicas" help:"how many apiservers place onto these edges (placement weighs its own recent placements by it)"`
	PlacementGroup int           `key:"placement_group" flag:"placement-group" help:"how many sandboxes of a batch go to one node together, in one call to it (1 spreads each on its own)"`
	E2BSecretFile  string        `key:"e2b_secret_file" flag:"e2b-secret-file" help:"the secret that signs E2B access tokens, the same file on every apiserver (dsecd init-cluster writes e2b.secret)"`
	PollInterval   time.Duration `key:"poll_interval" flag:"poll-interval" help:"how often the watcher polls each edge (three missed polls make an edge unroutable)"`
	NoMetrics      bool          `key:"no_metrics" flag:"no-metrics" help:"record no metrics at all (/metrics answers 404): to measure what they cost"`
	NoEvents       bool          `key:"no_events" flag:"no-events" help:"pull no lifecycle events from the edges (docs/events.md): to measure what they cost"`
	UsagePull      time.Duration `key:"usage_pull_interval" flag:"usage-pull-interval" help:"the least time between two pulls of one node's cost ledger (0: as soon as it moved, at the next pull tick; at most 15m, a quarter of the hour a node keeps an ended sandbox's record): a sandbox's samples in between are stored as one row, not one each (docs/usage.md)"`
	NoLedger       bool          `key:"no_ledger" flag:"no-ledger" help:"keep no cost ledger: an edge (or the all-in-one) samples none of its sandboxes, an apiserver pulls and stores none and refuses dsec usage (docs/usage.md): to measure what it costs"`
	TLS            TLS           `key:"tls"`
	LogLevel       string        `key:"log_level" flag:"log-level" check:"log-level" help:"log level: debug, info, warn, error"`
}

// API is the public API's settings, the all-in-one's and an apiserver's.
type API struct {
	Listen               string        `key:"listen" flag:"listen" help:"TCP address to serve the API on (the all-in-one's: loopback, \"none\" to disable)"`
	Socket               string        `key:"socket" flag:"socket" help:"Unix socket to serve the API on (the all-in-one's default: <root>/dsecd.sock; an apiserver's: none)"`
	DebugListen          string        `key:"debug_listen" flag:"debug-listen" help:"serve Go's profiles (/debug/pprof/) on this loopback address"`
	MetricsListen        string        `key:"metrics_listen" flag:"metrics-listen" help:"serve Prometheus metrics (/metrics) on this address too (\"none\" or empty: off, the API port serves them already; a taken address stops the start; off loopback a scrape needs a token: docs/operations.md)"`
	MetricsTokenFile     string        `key:"metrics_token_file" flag:"metrics-token-file" help:"a file (mode 600) holding the scrape token (a viewer's token on the root project is accepted too) a scrape from off loopback must bear to read /metrics; docs/operations.md"`
	SandboxFusionListen  string        `key:"sandboxfusion_listen" flag:"sandboxfusion-listen" help:"TCP address to serve SandboxFusion's HTTP API on (the all-in-one's: skipped with a warning if taken; \"none\" or empty: off)"`
	SandboxFusionProject string        `key:"sandboxfusion_project" flag:"sandboxfusion-project" help:"the project SandboxFusion's calls without a token run in, as a runner there (\"/\": the root; \"none\" or empty refuses them); a call with a token is its token's"`
	E2BListen            string        `key:"e2b_listen" flag:"e2b-listen" help:"TCP address to serve E2B's API on (control plane, envd and code interpreter; callers need an E2B API key: dsecd token --e2b; empty or \"none\": off; an apiserver needs --e2b-secret-file)"`
	AuditRetention       time.Duration `key:"audit_retention" flag:"audit-retention" help:"how long audit records are kept (negative: forever)"`
	EventRetention       time.Duration `key:"event_retention" flag:"event-retention" help:"how long sandbox lifecycle events are kept (negative: forever)"`
	WebhookAllowPrivate  bool          `key:"webhook_allow_private" flag:"webhook-allow-private" help:"allow webhooks on http:// and on loopback, private and link-local addresses"`
	WebhookTimeout       time.Duration `key:"webhook_timeout" flag:"webhook-timeout" help:"how long one webhook delivery attempt may take"`
	WebhookBackoff       time.Duration `key:"webhook_backoff" flag:"webhook-backoff" help:"the first wait after a failed webhook delivery, doubled each time up to a minute"`
	WebhookMaxActive     int           `key:"webhook_max_active" flag:"webhook-max-active" help:"how many webhooks one apiserver delivers at once"`
	MaxBatch             int           `key:"max_batch" flag:"max-batch" help:"the most sandboxes one create may ask for"`
	CreateConcurrency    int           `key:"create_concurrency" flag:"create-concurrency" help:"how many sandboxes of one batch the apiserver starts at once"`
	ReconcileInterval    time.Duration `key:"reconcile_interval" flag:"reconcile-interval" help:"how often to settle creates left in doubt, abandon stale reservations and check sandbox rows against the edges"`
	AbandonAfter         time.Duration `key:"abandon_after" flag:"abandon-after" help:"how long a pending idempotent create may go without renewing its lease before any apiserver abandons it and reaps its sandboxes"`
	UsageRetention       time.Duration `key:"usage_retention" flag:"usage-retention" help:"how long the cost ledger keeps an ended sandbox's row (negative: forever; docs/usage.md)"`
	GradePool            int           `key:"grade_pool" flag:"grade-pool" help:"clean rooms of each shape grades keep started ahead on the graded sandbox's node, into which a grade lays its capture (0: each grade starts its own; docs/grading.md)"`
}

// Node is a node's settings: the all-in-one dsecd's and an edge's.
type Node struct {
	Root             string        `key:"root" flag:"root" help:"state directory"`
	Node             string        `key:"node" flag:"node" help:"node name used in sandbox IDs (empty: from the host name; an edge needs one, the name in its certificate)"`
	Runtime          string        `key:"runtime" flag:"runtime" help:"OCI runtime of the container isolation: runc or crun (an edge also takes fake: a hollow node that starts nothing); runsc is deprecated here: it means --runsc with --runtime-path"`
	RuntimePath      string        `key:"runtime_path" flag:"runtime-path" help:"the runtime's binary (empty: --runtime on PATH)"`
	Runsc            string        `key:"runsc" flag:"runsc" help:"gVisor's runsc, for the gvisor isolation beside runc: a path that must work, none for no gvisor (empty: $DSEC_RUNSC, else runsc on PATH or /var/cache/dsec/runsc/runsc when it works; scripts/build-runsc.sh builds it)"`
	RunscPlatform    string        `key:"runsc_platform" flag:"runsc-platform" check:"runsc-platform" help:"runsc's platform for the gvisor isolation: systrap, ptrace or kvm (empty: kvm where /dev/kvm runs stock guests, else systrap)"`
	VMKernelDir      string        `key:"vm_kernel_dir" flag:"vm-kernel-dir" help:"the microVM guest kernel's directory, for the microvm isolation where QEMU is found too (empty: $DSEC_VM_KERNEL_DIR, else /var/cache/dsec/vm-kernel; scripts/build-vm-kernel.sh builds it)"`
	QEMU             string        `key:"qemu" flag:"qemu" help:"QEMU of the microvm isolation (empty: qemu-system-x86_64 on PATH; Debian's qemu-system-x86)"`
	VMPmemLayers     bool          `key:"vm_pmem_layers" flag:"vm-pmem-layers" help:"attach microVMs' layers as virtio-pmem with DAX (q35 machines, ~0.3 s slower to boot under TCG): the node's guests share one copy of a layer in the host's page cache"`
	Agent            string        `key:"agent" flag:"agent" help:"dsec-agent binary (empty: beside dsecd, else on PATH)"`
	Shell            string        `key:"shell" flag:"shell" help:"static shell shipped read-only into every sandbox (empty: /bin/bash-static, else /bin/busybox)"`
	CgroupParent     string        `key:"cgroup_parent" flag:"cgroup-parent" help:"cgroup under which this node's sandboxes live (empty: as network.nft_table: dsec, or dsecN)"`
	MaxWarm          int           `key:"max_warm" flag:"max-warm" help:"most sandboxes all warm pools of this node hold together"`
	Retention        time.Duration `key:"retention" flag:"retention" help:"how long a stopped or failed sandbox stays listed (dsec ls --all) after it ended"`
	PausedRetention  time.Duration `key:"paused_retention" flag:"paused-retention" help:"how long a sandbox may stay paused before it is stopped"`
	Swap             string        `key:"swap" flag:"swap" check:"swap" help:"swap of the node's own, so a pause can take sandboxes' anonymous memory out of RAM: none, file:SIZE (a swap file under the root) or zram:SIZE (none: a pause releases the page cache only; a swap the host has is used, never changed)"`
	NoProvenance     bool          `key:"no_provenance" flag:"no-provenance" help:"record no provenance as sandboxes run: no baseline of their writable layer at start, no watch of protected paths, no log of refused syscalls (docs/provenance.md)"`
	StartTimeout     time.Duration `key:"start_timeout" flag:"start-timeout" help:"how long a new sandbox's agent may take to answer before the create fails"`
	OutputLimit      int64         `key:"output_limit" flag:"output-limit" help:"output kept per command and stream for attach to replay, in bytes; a stream following the command gets all of it"`
	MetricsProjects  int           `key:"metrics_projects" flag:"metrics-projects" help:"how many projects, the largest by sandboxes, the sandbox gauge names; the rest are summed under \"other\" (negative: none; docs/operations.md)"`
	NoMetrics        bool          `key:"no_metrics" flag:"no-metrics" help:"record no metrics at all (/metrics answers 404): to measure what they cost"`
	NoEvents         bool          `key:"no_events" flag:"no-events" help:"keep no lifecycle events of this node's sandboxes (the all-in-one stores none either; docs/events.md): to measure what they cost"`
	NoLedger         bool          `key:"no_ledger" flag:"no-ledger" help:"keep no cost ledger: an edge (or the all-in-one) samples none of its sandboxes, an apiserver pulls and stores none and refuses dsec usage (docs/usage.md): to measure what it costs"`
	LedgerInterval   time.Duration `key:"ledger_interval" flag:"ledger-interval" help:"how often the cost ledger samples each sandbox's cgroup, writable layer and veth (a last sample is taken as a sandbox ends)"`
	LedgerCheckpoint time.Duration `key:"ledger_checkpoint" flag:"ledger-checkpoint" help:"how often a live sandbox's ledger record is offered to the apiservers' pulls to be stored (from ledger_interval to 15m: a node lost for good loses at most this much of its live sandboxes' use, and dsec usage counts a node that does not answer as of its last checkpoint; docs/usage.md)"`

	Defaults   SandboxDefaults `key:"defaults"`
	Limits     Limits          `key:"limits"`
	Storage    Storage         `key:"storage"`
	Network    Network         `key:"network"`
	FnCall     FnCall          `key:"fncall"`
	Trajectory Trajectory      `key:"trajectory"`
}

// SandboxDefaults is what a sandbox that asks for none gets.
type SandboxDefaults struct {
	CPUs        float64       `key:"cpus" flag:"default-cpus" help:"CPU cores of a sandbox that asks for none"`
	MemoryMB    int64         `key:"memory_mb" flag:"default-memory-mb" help:"memory in MiB of a sandbox that asks for none"`
	DiskMB      int64         `key:"disk_mb" flag:"default-disk-mb" help:"writable-layer size in MiB of a sandbox that asks for none"`
	Pids        int64         `key:"pids" flag:"default-pids" help:"most processes of a sandbox that asks for no bound"`
	TTL         time.Duration `key:"ttl" flag:"default-ttl" help:"lifetime of a sandbox that asks for none"`
	IdleTimeout time.Duration `key:"idle_timeout" flag:"default-idle-timeout" help:"idle timeout of a sandbox that asks for none"`
}

// Limits bound what one sandbox may ask for and how many a node holds.
type Limits struct {
	MaxSandboxes   int           `key:"max_sandboxes" flag:"max-sandboxes" help:"most sandboxes on this node (0: its physical memory / 4 MiB, at least 64)"`
	MaxCPUs        float64       `key:"max_cpus" flag:"max-cpus" help:"most CPU cores one sandbox may ask for (0: the node's core count)"`
	MaxMemoryMB    int64         `key:"max_memory_mb" flag:"max-memory-mb" help:"most memory in MiB one sandbox may ask for (0: the node's physical memory)"`
	MaxDiskMB      int64         `key:"max_disk_mb" flag:"max-disk-mb" help:"most writable-layer MiB one sandbox may ask for"`
	MaxTTL         time.Duration `key:"max_ttl" flag:"max-ttl" help:"longest lifetime one sandbox may ask for"`
	MinAvailableMB int64         `key:"min_available_mb" flag:"min-available-mb" help:"creates are refused while the node's available memory (MemAvailable) is below this many MiB"`
}

// Storage says where layers are stored and how sandboxes load them.
type Storage struct {
	BlobStore      string `key:"blob_store" flag:"blob-store" secret:"url" help:"where layer files live as chunks: a directory or s3://BUCKET[/PREFIX]?endpoint=HOST:PORT[&insecure=1] (empty: <root>/blobstore)"`
	Mode           string `key:"mode" flag:"layer-mode" check:"layer-mode" help:"how sandboxes load layers: ondemand, eager, local (pre-cached) or tar (baseline)"`
	ChunkSize      int64  `key:"chunk_size" flag:"chunk-size" help:"bytes per layer chunk in the blob store"`
	CacheBytes     int64  `key:"cache_bytes" flag:"cache-bytes" help:"on-demand chunk cache limit on disk in bytes (hot chunks only, compressed)"`
	MemoryBytes    int64  `key:"memory_bytes" flag:"chunk-memory-bytes" help:"on-demand chunk cache limit in memory in bytes: fetched chunks as the store served them (compressed) and, while they fit, decoded (0: 1/16 of physical memory, at least 64 MiB, at most 4 GiB)"`
	NoPagePush     bool   `key:"no_page_push" flag:"no-page-push" help:"read every page of an on-demand layer through lazyfs: without it, once a read takes some of a chunk, lazyfs hands the kernel the rest of the chunk's pages"`
	Bandwidth      int64  `key:"bandwidth" flag:"blob-bandwidth" help:"cap on blob store reads in bytes/s, to model a remote store (0: none)"`
	Tars           bool   `key:"tars" flag:"layer-tars" help:"also publish layers as tar.gz (tar mode needs them)"`
	MaxUploadBytes int64  `key:"max_upload_bytes" flag:"max-upload-bytes" help:"most bytes a layer upload's archive may have, and the tree it unpacks to"`
}

// Network is the node's sandbox networking.
type Network struct {
	Disabled     bool         `key:"disabled" flag:"no-network" help:"give sandboxes loopback only and refuse network rules"`
	Services     string       `key:"services" flag:"network-services" help:"JSON file of named services and mirrors (merged over what the host's package configuration names)"`
	DNSUpstreams []string     `key:"dns_upstreams" flag:"dns-upstream" list:"comma" check:"hostport" help:"DNS servers (host:port) the sandboxes' resolver asks; a flag or variable takes them comma-separated (empty: the host's)"`
	Pool         netip.Prefix `key:"pool" flag:"network-pool" help:"IPv4 prefix sandbox addresses come from (empty: what the root was first started with, else 10.213.0.0/16, or the first of 10.214-255.0.0/16 no other root on the host holds)"`
	EgressBytes  int64        `key:"egress_bytes" flag:"sandbox-egress-bytes" help:"egress bandwidth per sandbox in bytes/s (125000000 is 1 Gbit/s)"`
	MaxConns     int          `key:"max_conns" flag:"sandbox-max-conns" help:"concurrent connections per sandbox"`
	NftTable     string       `key:"nft_table" flag:"nft-table" help:"nftables table of this node's sandbox network (empty: what the root was first started with, else dsec, or dsecN when another root on the host holds it; the five host names nft_table, veth_prefix, nflog_group, pool and cgroup_parent default together)"`
	VethPrefix   string       `key:"veth_prefix" flag:"veth-prefix" help:"three characters starting this node's host veth names (empty: as nft_table: dsv, or dNN)"`
	NflogGroup   uint16       `key:"nflog_group" flag:"nflog-group" help:"NFLOG group of this node's network audit (0: as nft_table: 2130, or 2130+N)"`
}

// FnCall is the node's function-call backend (FnCallService,
// SandboxFusion's API; docs/fncall.md).
type FnCall struct {
	Disabled       bool          `key:"disabled" flag:"no-fncall" help:"run no fncall backend (FnCallService, SandboxFusion's API) on this node"`
	Languages      string        `key:"languages" flag:"fncall-languages" help:"JSON file of languages registered on top of the builtin ones (docs/fncall.md)"`
	MinIdle        int           `key:"min_idle" flag:"fncall-min-idle" help:"idle containers each fncall pool keeps once used (the floor)"`
	MaxPerPool     int           `key:"max_per_pool" flag:"fncall-max-per-pool" help:"most containers of one fncall pool on this node (0: fncall.max_containers)"`
	SoftMaxPerPool int           `key:"soft_max_per_pool" flag:"fncall-soft-max-per-pool" help:"containers of one fncall pool that run short calls at once; past it a pool grows only for long calls, as far as the node's memory holds them (0: 4 per CPU core)"`
	QoS            string        `key:"qos" flag:"fncall-qos" check:"qos" help:"CPU class of fncall containers: latency (calls' time limits are wall-clock) or best_effort (SCHED_IDLE: the node's latency sandboxes come first; docs/qos.md)"`
	MaxContainers  int           `key:"max_containers" flag:"fncall-max-containers" help:"most fncall containers on this node, every pool"`
	MaxCreating    int           `key:"max_creating" flag:"fncall-max-creating" help:"fncall containers being created at once on this node, every pool (0: 8 per CPU core)"`
	DiskMB         int64         `key:"disk_mb" flag:"fncall-disk-mb" help:"writable-layer size in MiB of a fncall container"`
	MaxStartDelay  time.Duration `key:"max_start_delay" flag:"fncall-max-start-delay" help:"longest a call waits for a fncall container when none is starting for it; then it is refused (ResourceExhausted, 504 in SandboxFusion's API)"`
	MaxQueue       int           `key:"max_queue" flag:"fncall-max-queue" help:"most calls waiting for a fncall container on this node; more are refused (ResourceExhausted, 504 in SandboxFusion's API)"`
	IdleRetire     time.Duration `key:"idle_retire" flag:"fncall-idle-retire" help:"how long a fncall container above its pool's floor may stay idle"`
	MaxCalls       int           `key:"max_calls" flag:"fncall-max-calls" help:"calls after which a fncall container is replaced (0: never)"`
}

// Trajectory says how the node records its sandboxes' trajectories
// (docs/trajectories.md).
type Trajectory struct {
	Off       bool          `key:"off" flag:"no-trajectories" help:"record no trajectories of the node's sandboxes (docs/trajectories.md)"`
	Retention time.Duration `key:"retention" flag:"trajectory-retention" help:"how long a sandbox's trajectory is kept after it is gone, here and in a cluster's blob store"`
	MaxBytes  int64         `key:"max_bytes" flag:"trajectory-max-bytes" help:"bytes of full lines a trajectory keeps; past them calls keep hashes and counts, past twice them calls are counted only"`
	MaxOutput int           `key:"max_output" flag:"trajectory-max-output" help:"bytes of each output stream a trajectory keeps per call; the rest is hashed and counted"`
}

// TLS is a cluster member's certificate: the directory dsecd init-cluster
// wrote, or each file named.
type TLS struct {
	Dir  string `key:"dir" flag:"tls-dir" help:"directory dsecd init-cluster wrote: ca.crt and ROLE-NAME.{crt,key} (an edge's NAME is its node, an apiserver's its name)"`
	Cert string `key:"cert" flag:"tls-cert" help:"this member's certificate (empty: <tls-dir>/ROLE-NAME.crt)"`
	Key  string `key:"key" flag:"tls-key" help:"its key (empty: <tls-dir>/ROLE-NAME.key)"`
	CA   string `key:"ca" flag:"tls-ca" help:"the cluster's CA bundle (empty: <tls-dir>/ca.crt)"`
}

// Hollow shapes an edge whose runtime is fake (a hollow node that starts
// nothing, for control-plane scale tests).
type Hollow struct {
	MaxSandboxes int           `key:"max_sandboxes" flag:"hollow-max-sandboxes" help:"with runtime fake: sandboxes the hollow node admits"`
	StartDelay   time.Duration `key:"start_delay" flag:"hollow-start-delay" help:"with runtime fake: how long a hollow create takes"`
	MaxStarting  int           `key:"max_starting" flag:"hollow-max-starting" help:"with runtime fake: creates it starts at once (0: no bound)"`
}

// The defaults that are addresses and paths, which package daemon names
// too.
const (
	DefaultRoot              = "/var/lib/dsec"
	DefaultAddr              = "127.0.0.1:8675"
	DefaultEdgeAddr          = "127.0.0.1:8676"
	DefaultSandboxFusionAddr = "127.0.0.1:8080"
)

// DefaultNode is a node's defaults. getenv supplies the test machines'
// DSEC_RUNSC and DSEC_VM_KERNEL_DIR, which name where gVisor and the
// microVM kernel are when they are not in their installed places.
func DefaultNode(getenv func(string) string) Node {
	return Node{
		Root:             DefaultRoot,
		Runtime:          "runc",
		Runsc:            getenv("DSEC_RUNSC"),
		VMKernelDir:      getenv("DSEC_VM_KERNEL_DIR"),
		MaxWarm:          256,
		Retention:        10 * time.Minute,
		PausedRetention:  7 * 24 * time.Hour,
		LedgerInterval:   10 * time.Second,
		LedgerCheckpoint: 5 * time.Minute,
		Swap:             "none",
		StartTimeout:     15 * time.Second,
		OutputLimit:      16 << 20,
		MetricsProjects:  20,
		Defaults: SandboxDefaults{
			CPUs: 1, MemoryMB: 512, DiskMB: 1024, Pids: 1024,
			TTL: time.Hour, IdleTimeout: 15 * time.Minute,
		},
		Limits: Limits{MaxDiskMB: 64 << 10, MaxTTL: 24 * time.Hour, MinAvailableMB: 256},
		Storage: Storage{
			Mode: "ondemand", ChunkSize: 1 << 20, CacheBytes: 10 << 30, MaxUploadBytes: 16 << 30,
		},
		Network: Network{EgressBytes: 125_000_000, MaxConns: 1024},
		FnCall: FnCall{
			MinIdle: 1, QoS: "latency", MaxContainers: 256, DiskMB: 4096, MaxStartDelay: 2 * time.Second,
			MaxQueue: 4096, IdleRetire: time.Minute, MaxCalls: 10000,
		},
		Trajectory: Trajectory{Retention: 24 * time.Hour, MaxBytes: 16 << 20, MaxOutput: 16 << 10},
	}
}

func defaultAPI() API {
	return API{
		Listen:            DefaultAddr,
		AuditRetention:    30 * 24 * time.Hour,
		EventRetention:    7 * 24 * time.Hour,
		WebhookTimeout:    10 * time.Second,
		WebhookBackoff:    time.Second,
		WebhookMaxActive:  256,
		MaxBatch:          1000,
		CreateConcurrency: 8,
		ReconcileInterval: 30 * time.Second,
		AbandonAfter:      2 * time.Minute,
		UsageRetention:    90 * 24 * time.Hour,
		GradePool:         2, // apiserver.DefaultGradePool
	}
}

// DefaultAllInOne is the all-in-one dsecd's defaults, with which it runs
// on a fresh machine.
func DefaultAllInOne(getenv func(string) string) AllInOne {
	api := defaultAPI()
	api.SandboxFusionListen = DefaultSandboxFusionAddr
	api.SandboxFusionProject = "/"
	return AllInOne{Node: DefaultNode(getenv), API: api, LogLevel: "info"}
}

// DefaultEdge is an edge's defaults.
func DefaultEdge(getenv func(string) string) Edge {
	return Edge{
		Node:      DefaultNode(getenv),
		Listen:    DefaultEdgeAddr,
		Heartbeat: 2 * time.Second,
		Hollow:    Hollow{MaxSandboxes: 200},
		LogLevel:  "info",
	}
}

// DefaultAPIServer is an apiserver's defaults.
func DefaultAPIServer() APIServer {
	return APIServer{
		API:            defaultAPI(),
		Replicas:       1,
		PlacementGroup: 4,
		PollInterval:   750 * time.Millisecond,
		LogLevel:       "info",
	}
}

// Default returns a role's defaults, as a pointer to its struct.
func Default(role string, getenv func(string) string) (any, bool) {
	switch role {
	case RoleAllInOne:
		c := DefaultAllInOne(getenv)
		return &c, true
	case RoleEdge:
		c := DefaultEdge(getenv)
		return &c, true
	case RoleAPIServer:
		c := DefaultAPIServer()
		return &c, true
	}
	return nil, false
}

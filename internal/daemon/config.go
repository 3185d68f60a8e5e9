package daemon

import (
	"fmt"
	"path/filepath"
	"runtime"
	"time"

	"dsec.dev/dsec/internal/clustertls"
	"dsec.dev/dsec/internal/config"
	"dsec.dev/dsec/internal/edge/claims"
	"dsec.dev/dsec/internal/edge/fncall"
	"dsec.dev/dsec/internal/edge/ledger"
	"dsec.dev/dsec/internal/edge/sandbox"
	"dsec.dev/dsec/internal/edge/swap"
	"dsec.dev/dsec/internal/qos"
)

// FromAllInOne is the all-in-one dsecd's configuration from its settings
// (package config).
func FromAllInOne(c config.AllInOne) (Config, error) {
	cfg, err := fromNode(c.Node)
	if err != nil {
		return Config{}, err
	}
	a := c.API
	cfg.Listen, cfg.Socket, cfg.DebugListen, cfg.MetricsListen = a.Listen, a.Socket, a.DebugListen, a.MetricsListen
	cfg.MetricsTokenFile = a.MetricsTokenFile
	cfg.APITuning = APITuning{MaxBatch: a.MaxBatch, CreateConcurrency: a.CreateConcurrency,
		ReconcileInterval: a.ReconcileInterval, AbandonAfter: a.AbandonAfter,
		WebhookTimeout: a.WebhookTimeout, WebhookBackoff: a.WebhookBackoff, WebhookMaxActive: a.WebhookMaxActive,
		GradePool: a.GradePool}
	cfg.SandboxFusionListen, cfg.SandboxFusionProject, cfg.E2BListen = a.SandboxFusionListen, a.SandboxFusionProject, off(a.E2BListen)
	cfg.AuditRetention, cfg.EventRetention, cfg.WebhookAllowPrivate = a.AuditRetention, a.EventRetention, a.WebhookAllowPrivate
	cfg.UsageRetention = a.UsageRetention
	return cfg, nil
}

// off maps an optional listener's "none", which the flags' help offers
// as the other listeners take it, to "": not served.
func off(addr string) string {
	if addr == "none" {
		return ""
	}
	return addr
}

// FromEdge is `dsecd edge`'s configuration from its settings: its
// certificate files default to those init-cluster wrote in the TLS
// directory for the node.
func FromEdge(c config.Edge) (EdgeConfig, error) {
	node, err := fromNode(c.Node)
	if err != nil {
		return EdgeConfig{}, err
	}
	if c.Node.Node == "" {
		return EdgeConfig{}, fmt.Errorf("node is required (--node: the name in its certificate and sandbox IDs)")
	}
	node.MetricsListen, node.MetricsTokenFile = c.MetricsListen, c.MetricsTokenFile
	cfg := EdgeConfig{
		Node: node, Listen: c.Listen, DebugListen: c.DebugListen, Registry: c.Registry, Advertise: c.Advertise, Heartbeat: c.Heartbeat,
		TLS: tlsFiles(c.TLS, clustertls.RoleEdge, c.Node.Node),
	}
	cfg.Hollow.MaxSandboxes, cfg.Hollow.StartDelay, cfg.Hollow.MaxStarting = c.Hollow.MaxSandboxes, c.Hollow.StartDelay, c.Hollow.MaxStarting
	return cfg, nil
}

// MaxUsagePull bounds --usage-pull-interval: a node drops an ended
// sandbox's ledger record ledger.Keep after it ends, so a node's ledger
// must be pulled well within that, with room left for an apiserver that
// dies to be replaced and a node unreachable for a while.
const MaxUsagePull = ledger.Keep / 4

// MaxLedgerCheckpoint bounds --ledger-checkpoint as MaxUsagePull bounds
// the pulls: a node lost for good loses at most a checkpoint of its live
// sandboxes' use, and Usage counts the live sandboxes of a node that does
// not answer as of their last checkpoint, so neither is further behind
// than the pulls may be.
const MaxLedgerCheckpoint = ledger.Keep / 4

// checkLedgerCheckpoint refuses a checkpoint interval shorter than the
// sampling interval (a checkpoint is a sample's: a shorter one offers
// every sample, the store written per sample as before checkpoints) or
// longer than MaxLedgerCheckpoint.
func checkLedgerCheckpoint(checkpoint, interval time.Duration) error {
	if interval <= 0 {
		interval = ledger.DefaultInterval
	}
	if checkpoint < interval || checkpoint > MaxLedgerCheckpoint {
		return fmt.Errorf("ledger_checkpoint %s: want ledger_interval (%s) to %s: a checkpoint comes with a sample, and a node lost for good loses at most a checkpoint of its live sandboxes' use",
			checkpoint, interval, MaxLedgerCheckpoint)
	}
	return nil
}

// FromAPIServer is `dsecd apiserver`'s configuration from its settings.
func FromAPIServer(c config.APIServer) (APIServerConfig, error) {
	a := c.API
	cfg := APIServerConfig{
		Name: c.Name, Listen: a.Listen, Socket: a.Socket, DB: c.DB, PollInterval: c.PollInterval,
		Replicas: c.Replicas, PlacementGroup: c.PlacementGroup, DebugListen: a.DebugListen, MetricsListen: a.MetricsListen, MetricsTokenFile: a.MetricsTokenFile,
		SandboxFusionListen: off(a.SandboxFusionListen), SandboxFusionProject: a.SandboxFusionProject,
		E2BListen: off(a.E2BListen), E2BSecretFile: c.E2BSecretFile,
		ReconcileInterval: a.ReconcileInterval, AbandonAfter: a.AbandonAfter, NoMetrics: c.NoMetrics, NoEvents: c.NoEvents, NoLedger: c.NoLedger, UsagePullEvery: c.UsagePull,
		MaxBatch: a.MaxBatch, CreateConcurrency: a.CreateConcurrency,
		WebhookTimeout: a.WebhookTimeout, WebhookBackoff: a.WebhookBackoff, WebhookMaxActive: a.WebhookMaxActive,
		AuditRetention: a.AuditRetention, EventRetention: a.EventRetention, WebhookAllowPrivate: a.WebhookAllowPrivate,
		UsageRetention: a.UsageRetention,
		GradePool:      a.GradePool,
	}
	if c.UsagePull < 0 || c.UsagePull > MaxUsagePull {
		return APIServerConfig{}, fmt.Errorf("usage_pull_interval %s: want 0 to %s: a node keeps an ended sandbox's ledger record for %s after it ends, and pulls further apart lose the records it dropped in between",
			c.UsagePull, MaxUsagePull, ledger.Keep)
	}
	for _, e := range c.Edges {
		se, err := ParseStaticEdge(e)
		if err != nil {
			return APIServerConfig{}, fmt.Errorf("edges: %w", err)
		}
		cfg.Edges = append(cfg.Edges, se)
	}
	if c.TLS.Dir != "" && c.Name == "" {
		return APIServerConfig{}, fmt.Errorf("tls.dir needs name (--name: the name in its certificate)")
	}
	cfg.TLS = tlsFiles(c.TLS, clustertls.RoleAPIServer, c.Name)
	return cfg, nil
}

// tlsFiles are the files t names, those it does not taken from its
// directory, where init-cluster wrote them for the role's member name.
func tlsFiles(t config.TLS, role clustertls.Role, name string) clustertls.Files {
	f := clustertls.Files{Cert: t.Cert, Key: t.Key, CABundle: t.CA}
	if t.Dir == "" {
		return f
	}
	def := clustertls.ComponentFiles(t.Dir, role, name)
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

func fromNode(n config.Node) (Config, error) {
	sw, err := swap.Parse(n.Swap)
	if err != nil {
		return Config{}, fmt.Errorf("swap: %w", err)
	}
	q, err := qos.Parse(n.FnCall.QoS, qos.Latency)
	if err != nil {
		return Config{}, fmt.Errorf("fncall.qos: %w", err)
	}
	if err := checkLedgerCheckpoint(n.LedgerCheckpoint, n.LedgerInterval); err != nil {
		return Config{}, err
	}
	cfg := Config{
		Root: n.Root, Node: n.Node, Runtime: n.Runtime, RuntimePath: n.RuntimePath, Runsc: n.Runsc,
		RunscPlatform: n.RunscPlatform, VMKernelDir: n.VMKernelDir, QEMU: n.QEMU, VMPmemLayers: n.VMPmemLayers,
		CgroupParent: n.CgroupParent, AgentPath: n.Agent, ShellPath: n.Shell,
		OutputLimit: n.OutputLimit, StartTimeout: n.StartTimeout, MaxWarm: n.MaxWarm, Retention: n.Retention, PausedRetention: n.PausedRetention,
		Swap: sw, MetricsProjects: n.MetricsProjects, NoMetrics: n.NoMetrics, NoEvents: n.NoEvents, NoProvenance: n.NoProvenance,
		NoLedger: n.NoLedger, LedgerInterval: n.LedgerInterval, LedgerCheckpoint: n.LedgerCheckpoint,
		Trajectory: TrajectoryConfig{Off: n.Trajectory.Off, Retention: n.Trajectory.Retention,
			MaxBytes: n.Trajectory.MaxBytes, MaxOutput: n.Trajectory.MaxOutput},
	}
	d := n.Defaults
	cfg.Defaults.CPUs, cfg.Defaults.MemoryMB, cfg.Defaults.DiskMB, cfg.Defaults.Pids = d.CPUs, d.MemoryMB, d.DiskMB, d.Pids
	cfg.Defaults.TTL, cfg.Defaults.IdleTimeout = d.TTL, d.IdleTimeout
	l := n.Limits
	cfg.Limits.MaxSandboxes, cfg.Limits.MaxCPUs, cfg.Limits.MaxMemoryMB = l.MaxSandboxes, l.MaxCPUs, l.MaxMemoryMB
	cfg.Limits.MaxDiskMB, cfg.Limits.MaxTTL, cfg.Limits.MinAvailableMB = l.MaxDiskMB, l.MaxTTL, l.MinAvailableMB
	s := n.Storage
	cfg.Storage = StorageConfig{BlobStore: s.BlobStore, Mode: s.Mode, ChunkSize: s.ChunkSize, CacheBytes: s.CacheBytes,
		MemoryBytes: s.MemoryBytes, NoPagePush: s.NoPagePush, BandwidthBytesPerSec: s.Bandwidth, Tars: s.Tars,
		MaxUploadBytes: s.MaxUploadBytes}
	w := n.Network
	cfg.Network = NetworkConfig{Disabled: w.Disabled, Services: w.Services, Upstreams: w.DNSUpstreams, Pool: w.Pool,
		EgressBytesPerSec: w.EgressBytes, MaxConns: w.MaxConns, Table: w.NftTable, VethPrefix: w.VethPrefix, LogGroup: w.NflogGroup}
	f := n.FnCall
	cfg.FnCall = FnCallConfig{Disabled: f.Disabled, Languages: f.Languages, Pools: fncall.PoolConfig{
		MinIdle: f.MinIdle, MaxPerPool: f.MaxPerPool, SoftMaxPerPool: f.SoftMaxPerPool, QoS: string(q),
		MaxContainers: f.MaxContainers, MaxCreating: f.MaxCreating, DiskMB: f.DiskMB, MaxStartDelay: f.MaxStartDelay, MaxQueue: f.MaxQueue,
		IdleRetire: f.IdleRetire, MaxCalls: f.MaxCalls,
	}}
	return cfg, nil
}

// Derived is what the settings of a node whose state directory is root
// left at their zeros come to on this machine, by key, for dsecd config
// print to note: the node's name, its limits and chunk memory from its
// cores and memory, the shell, the agent and runsc found, the
// all-in-one's socket, and the host names (nftables table, veth prefix,
// NFLOG group, address pool, cgroup parent) root was first started with,
// which say where its sandboxes' cgroups and veths are.
func Derived(root string) map[string]string {
	out := map[string]string{
		"node":            nodeName(),
		"shell":           defaultShell(),
		"agent":           findAgent(),
		"limits.max_cpus": fmt.Sprint(runtime.NumCPU()),
	}
	if r := findRunsc(); r != "" {
		out["runsc"] = r
	} else {
		out["runsc"] = "none found: no gvisor isolation"
	}
	if abs, err := filepath.Abs(root); err == nil {
		out["socket"] = filepath.Join(abs, "dsecd.sock")
	}
	if names, ok, err := claims.Recall(root); err == nil && ok {
		out["network.nft_table"] = names.Table
		out["network.veth_prefix"] = names.VethPrefix
		out["network.nflog_group"] = fmt.Sprint(names.LogGroup)
		out["network.pool"] = names.Pool.String()
		out["cgroup_parent"] = names.CgroupParent
	}
	if total, err := sandbox.MemTotalMB(); err == nil {
		out["limits.max_sandboxes"] = fmt.Sprint(defaultMaxSandboxes(total))
		out["limits.max_memory_mb"] = fmt.Sprint(total)
		out["storage.memory_bytes"] = fmt.Sprint(defaultChunkMemory(total))
	}
	return out
}

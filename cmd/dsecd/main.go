// Command dsecd is the dsec daemon. With no arguments it runs a whole
// single-machine dsec (apiserver, edge and metadata store) with its state
// under /var/lib/dsec. `dsecd teardown` removes every sandbox of the node and
// unmounts what dsecd mounted.
package main

import (
	"context"
	"flag"
	"fmt"
	"log/slog"
	"net/netip"
	"os"
	"os/signal"
	"strconv"
	"strings"
	"syscall"
	"time"

	"dsec.dev/dsec/internal/daemon"
	"dsec.dev/dsec/internal/edge/lazyd"
)

func main() {
	var cfg daemon.Config
	var level slog.Level
	fs := flag.NewFlagSet("dsecd", flag.ExitOnError)
	fs.Usage = func() {
		fmt.Fprintf(fs.Output(), "usage: dsecd [flags]           run the node\n       dsecd teardown [flags]  remove every sandbox and unmount what dsecd mounted\n\nflags:\n")
		fs.PrintDefaults()
	}
	fs.StringVar(&cfg.Root, "root", daemon.DefaultRoot, "state directory")
	fs.StringVar(&cfg.Listen, "listen", daemon.DefaultAddr, `loopback TCP address to serve the API on ("none" to disable)`)
	fs.StringVar(&cfg.Socket, "socket", "", "Unix socket to serve the API on (default <root>/dsecd.sock)")
	fs.StringVar(&cfg.Node, "node", "", "node name used in sandbox IDs (default: from the host name)")
	fs.StringVar(&cfg.Runtime, "runtime", "runc", "OCI runtime: runc or crun")
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
	fs.Int64Var(&cfg.OutputLimit, "output-limit", 0, "retained output per command and stream in bytes (default 16 MiB)")
	fs.TextVar(&level, "log-level", slog.LevelInfo, "log level: debug, info, warn, error")
	fs.StringVar(&cfg.Storage.BlobStore, "blob-store", "", "where layer files live as chunks: a directory or s3://BUCKET[/PREFIX]?endpoint=HOST:PORT[&insecure=1] (default <root>/blobstore)")
	fs.StringVar(&cfg.Storage.Mode, "layer-mode", "ondemand", "how sandboxes load layers: ondemand, eager, local (pre-cached) or tar (baseline)")
	fs.Int64Var(&cfg.Storage.ChunkSize, "chunk-size", 1<<20, "bytes per layer chunk in the blob store")
	fs.Int64Var(&cfg.Storage.CacheBytes, "cache-bytes", 10<<30, "on-demand chunk cache limit in bytes")
	fs.Int64Var(&cfg.Storage.BandwidthBytesPerSec, "blob-bandwidth", 0, "cap on blob store reads in bytes/s, to model a remote store (0: none)")
	fs.BoolVar(&cfg.Storage.Tars, "layer-tars", false, "also publish layers as tar.gz (tar mode needs them)")
	var noNetwork bool
	var upstreams string
	fs.BoolVar(&noNetwork, "no-network", false, "give sandboxes loopback only and refuse network rules")
	fs.StringVar(&cfg.Network.Services, "network-services", "", "JSON file of named services and mirrors (merged over what the host's package configuration names)")
	fs.StringVar(&upstreams, "dns-upstream", "", "comma-separated DNS servers (host:port) the sandboxes' resolver asks (default: the host's)")
	fs.TextVar(&cfg.Network.Pool, "network-pool", netip.MustParsePrefix("10.213.0.0/16"), "IPv4 prefix sandbox addresses come from")
	fs.Int64Var(&cfg.Network.EgressBytesPerSec, "sandbox-egress-bytes", 0, "egress bandwidth per sandbox in bytes/s (default 125000000, 1 Gbit/s)")
	fs.IntVar(&cfg.Network.MaxConns, "sandbox-max-conns", 0, "concurrent connections per sandbox (default 1024)")
	fs.StringVar(&cfg.Network.Table, "nft-table", "", "nftables table of this node's sandbox network (default dsec); nodes sharing a host need different ones")
	fs.StringVar(&cfg.Network.VethPrefix, "veth-prefix", "", "three characters starting this node's host veth names (default dsv)")
	fs.Func("nflog-group", "NFLOG group of this node's network audit (default 2130)", func(v string) error {
		n, err := strconv.ParseUint(v, 10, 16)
		cfg.Network.LogGroup = uint16(n)
		return err
	})
	fs.StringVar(&cfg.CgroupParent, "cgroup-parent", "", "cgroup under which this node's sandboxes live (default dsec)")

	args := os.Args[1:]
	if len(args) > 0 && args[0] == "lazyfs" {
		os.Exit(lazyfsMain(args[1:]))
	}
	teardown := len(args) > 0 && args[0] == "teardown"
	if teardown {
		args = args[1:]
	}
	fs.Parse(args)
	if fs.NArg() > 0 {
		fs.Usage()
		os.Exit(2)
	}
	cfg.Network.Disabled = noNetwork
	if upstreams != "" {
		cfg.Network.Upstreams = strings.Split(upstreams, ",")
	}
	log := slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: level}))
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	var err error
	if teardown {
		err = daemon.Teardown(ctx, cfg, log)
	} else {
		err = daemon.Run(ctx, cfg, log)
	}
	if err != nil {
		fmt.Fprintln(os.Stderr, "dsecd:", err)
		os.Exit(1)
	}
}

// lazyfsMain runs `dsecd lazyfs`: the on-demand layer file system in a
// process of its own, which dsecd starts and which outlives a dsecd restart.
func lazyfsMain(args []string) int {
	var cfg lazyd.Config
	fs := flag.NewFlagSet("dsecd lazyfs", flag.ExitOnError)
	fs.StringVar(&cfg.Dir, "dir", "", "state directory")
	fs.StringVar(&cfg.BlobStore, "blob-store", "", "blob store spec")
	fs.Int64Var(&cfg.CacheBytes, "cache-bytes", 0, "chunk cache limit")
	fs.Int64Var(&cfg.BandwidthBytesPerSec, "bandwidth", 0, "cap on blob store reads in bytes/s")
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

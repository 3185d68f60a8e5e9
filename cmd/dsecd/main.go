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
	"os"
	"os/signal"
	"syscall"
	"time"

	"dsec.dev/dsec/internal/daemon"
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
	fs.IntVar(&cfg.Limits.MaxSandboxes, "max-sandboxes", 2000, "most sandboxes on this node")
	fs.Int64Var(&cfg.OutputLimit, "output-limit", 0, "retained output per command and stream in bytes (default 16 MiB)")
	fs.TextVar(&level, "log-level", slog.LevelInfo, "log level: debug, info, warn, error")

	args := os.Args[1:]
	teardown := len(args) > 0 && args[0] == "teardown"
	if teardown {
		args = args[1:]
	}
	fs.Parse(args)
	if fs.NArg() > 0 {
		fs.Usage()
		os.Exit(2)
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

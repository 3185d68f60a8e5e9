// Command dsec-agent is the agent inside every sandbox (pid 1 of a container).
//
//	dsec-agent serve --listen-fd 3 [--cgroup-fd 4] [--memory-cgroup-fd 5] [--user U]
//	    [--workdir DIR] [--env K=V]... [--shell PATH] [--output-limit BYTES] [--hostname H] [--address IP]
//	    [--disk-qgroup DIR]
//
//	dsec-agent guest [--layer SERIAL|pmem@PCIADDR]... [--upper SERIAL] [serve's flags but the fds]
//	/init [the same]   (pid 1 of a microVM's initramfs: guest mode)
//
//	dsec-agent hold-memory MIB [DIR]
//
// Guest mode is the agent as a microVM's init (package agent/guest): the
// kernel runs it as /init, with the kernel command line's words after "--"
// as its flags. The mode state-dump is internal: the agent's sessions run it themselves.
// hold-memory is a helper for pause tests and benchmarks, run as a command
// in a sandbox (see agent.HoldMemoryMain).
package main

import (
	"context"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"os"
	"strings"

	"dsec.dev/dsec/internal/agent"
	"dsec.dev/dsec/internal/agent/guest"
)

type listFlag []string

func (l *listFlag) String() string     { return strings.Join(*l, ",") }
func (l *listFlag) Set(v string) error { *l = append(*l, v); return nil }

func main() {
	mode, args := "", []string(nil)
	switch {
	case os.Getpid() == 1 && os.Args[0] == "/init":
		mode, args = "guest", os.Args[1:]
	case len(os.Args) >= 2:
		mode, args = os.Args[1], os.Args[2:]
	default:
		fmt.Fprintln(os.Stderr, "usage: dsec-agent serve --listen-fd N [flags]")
		os.Exit(2)
	}
	switch mode {
	case "state-dump":
		os.Exit(agent.StateDumpMain())
	case "hold-memory":
		os.Exit(agent.HoldMemoryMain(args))
	case "serve", "guest":
	default:
		fmt.Fprintf(os.Stderr, "dsec-agent: unknown mode %q\n", mode)
		os.Exit(2)
	}

	fs := flag.NewFlagSet(mode, flag.ExitOnError)
	cfg := agent.Config{}
	var env listFlag
	logLevel := fs.String("log-level", "info", "log level: debug, info, warn, error")
	fs.IntVar(&cfg.ListenFD, "listen-fd", 3, "fd of the listening Unix socket")
	fs.StringVar(&cfg.ListenPath, "listen-path", "", "make the listening Unix socket at this path instead of using --listen-fd (gVisor)")
	fs.IntVar(&cfg.CgroupFD, "cgroup-fd", -1, "fd of the sandbox's cgroup dir (freezer on v1, unified on v2)")
	fs.IntVar(&cfg.MemoryCgroupFD, "memory-cgroup-fd", -1, "fd of the sandbox's memory cgroup dir")
	fs.IntVar(&cfg.PidsCgroupFD, "pids-cgroup-fd", -1, "fd of the cgroup v1 pids dir every command joins (its limit excludes the agent)")
	fs.StringVar(&cfg.CgroupPath, "cgroup-path", "", "without --cgroup-fd: the agent's own cgroup v2 dir, where it makes the commands' cgroup (gVisor: the sentry's own, runsc --in-sandbox-cgroup=v2)")
	fs.Int64Var(&cfg.PidsMax, "pids-max", 0, "with --cgroup-path: the commands' pids.max")
	fs.StringVar(&cfg.User, "user", "", "default user (name or uid[:gid])")
	fs.StringVar(&cfg.Workdir, "workdir", "", "default working directory")
	fs.Var(&env, "env", "K=V added to every command's environment (repeatable)")
	fs.StringVar(&cfg.Shell, "shell", agent.DefaultShell, "shell for commands and sessions")
	fs.Int64Var(&cfg.OutputLimit, "output-limit", 0, "output kept per stream for attach to replay, in bytes (0 = 16 MiB); a stream following the command gets all of it")
	fs.StringVar(&cfg.Hostname, "hostname", "", "hostname to set (pid 1 only)")
	fs.StringVar(&cfg.Address, "address", "", "the sandbox's IPv4 address, written to /etc/hosts for its host name (pid 1 only)")
	fs.IntVar(&cfg.CPUCgroupFD, "cpu-cgroup-fd", -1, "fd of the sandbox's cgroup v1 cpu dir (fncall calls' CPU limits)")
	fs.BoolVar(&cfg.FnCall, "fncall", false, "serve fncall calls (Call): a pooled reward-code container")
	fs.StringVar(&cfg.ZygotePreload, "zygote-preload", "", "comma-separated modules the warm Python interpreter imports first (default: common standard modules)")
	fs.StringVar(&cfg.CallScratch, "call-scratch", "", "directory of fncall calls' scratch directories (default /tmp)")
	fs.StringVar(&cfg.CallWipe, "call-wipe", "", "comma-separated directories emptied after every fncall call (default /tmp,/var/tmp,/dev/shm)")
	fs.BoolVar(&cfg.LogRefusals, "log-refusals", false, "log (audit records) the calls the sandbox's profile refuses, with a filter refusing the same (needs no_new_privs)")
	fs.StringVar(&cfg.DiskQgroup, "disk-qgroup", "", "sysfs dir of the btrfs qgroup capping the writable layer: statfs of / then reports its limit")
	var layers, netDNS listFlag
	var upper, netMAC, netAddr, netGateway string
	var netMTU int
	if mode == "guest" {
		fs.Var(&layers, "layer", "a read-only EROFS disk of the root, lowest first: a virtio-blk serial, or pmem@ and a virtio-pmem device's PCI address, mounted with DAX (repeatable; none = the initramfs is the root)")
		fs.StringVar(&upper, "upper", "", "serial of the writable ext4 disk of the root (default: a tmpfs)")
		fs.StringVar(&netMAC, "net-mac", "", "MAC of the network card to configure (none: loopback only)")
		fs.StringVar(&netAddr, "net-addr", "", "the card's IPv4 address/prefix")
		fs.StringVar(&netGateway, "net-gateway", "", "the default route's gateway (on-link)")
		fs.IntVar(&netMTU, "net-mtu", 1500, "the card's MTU")
		fs.Var(&netDNS, "net-dns", "a nameserver for /etc/resolv.conf, on-link (repeatable)")
	}
	if mode == "guest" {
		// pid 1 must not exit (the kernel panics, and the trace buries
		// the reason): a bad flag is said on the console, and the VM
		// powers off.
		fs.Init(mode, flag.ContinueOnError)
		fs.SetOutput(io.Discard)
	}
	if err := fs.Parse(args); err != nil {
		fmt.Fprintf(os.Stderr, "dsec-agent %s: %v\n", mode, err)
		if mode == "guest" && os.Getpid() == 1 {
			guest.PowerOff()
		}
		os.Exit(2)
	}
	cfg.Env = env

	var level slog.Level
	if err := level.UnmarshalText([]byte(*logLevel)); err != nil {
		fmt.Fprintf(os.Stderr, "dsec-agent: %v\n", err)
		os.Exit(2)
	}
	cfg.Log = slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: level}))
	if mode == "guest" {
		network, err := guest.ParseNetwork(netMAC, netAddr, netGateway, netMTU, netDNS)
		if err == nil {
			err = guest.Run(context.Background(), guest.Config{Agent: cfg, Layers: layers, Upper: upper, Network: network})
		}
		cfg.Log.Error("guest agent stopped; powering off", "err", err)
		if os.Getpid() == 1 {
			guest.PowerOff()
		}
		os.Exit(1)
	}
	if err := agent.Serve(context.Background(), cfg); err != nil {
		cfg.Log.Error("agent stopped", "err", err)
		os.Exit(1)
	}
}

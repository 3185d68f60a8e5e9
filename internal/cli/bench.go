package cli

import (
	"cmp"
	"context"
	"fmt"
	"io"
	"os"
	"strings"
	"time"

	"connectrpc.com/connect"
	"github.com/spf13/cobra"

	dsecv1 "dsec.dev/dsec/api/gen/dsec/v1"
	"dsec.dev/dsec/internal/bench"
	"dsec.dev/dsec/internal/edge/image"
	"dsec.dev/dsec/internal/vm/kernel"
	dsec "dsec.dev/dsec/sdk/go"
)

// benchEnv is the environment `dsec bench` uses unless told otherwise; it
// is imported from the host's busybox when missing.
const benchEnv = "busybox:bench"

func (a *app) benchCommand() *cobra.Command {
	o := bench.Options{Env: benchEnv, Seq: 20, Burst: 50, Execs: 200, Idle: 100, IdleWindow: 30 * time.Second, RateProbe: 50,
		Warm: 4, Baseline: true, Runtime: "runc"}
	cmd := &cobra.Command{
		Use:   "bench",
		Short: "measure create, exec and memory figures against bare runc in the same run",
		Long: "Measures dsec on the daemon at --addr and, beside it, a bare runc on this machine (needs root):\n" +
			"create → first exec (sequential and in a burst), creation throughput, warm exec latency and\n" +
			"host memory per idle sandbox; then, for dsec, the CPU an idle sandbox costs and the create\n" +
			"rate with the idle sandboxes live against the empty node's, each against its target. Run it on\n" +
			"the daemon's host. Density alone: --seq 0 --burst 0 --execs 0 --warm-pool 0 --baseline=false --idle N.",
		Args: noSubcommand,
		RunE: func(cmd *cobra.Command, args []string) error {
			return a.runBench(cmd.Context(), o.Env, &o.Progress, func(ctx context.Context) (report, error) {
				return bench.Run(ctx, a.c, o)
			})
		},
	}
	f := cmd.Flags()
	f.StringVar(&o.Env, "env", benchEnv, "environment to benchmark")
	f.IntVar(&o.Seq, "seq", o.Seq, "sequential create → exec rounds")
	f.IntVar(&o.Burst, "burst", o.Burst, "concurrent creates in the burst")
	f.IntVar(&o.Execs, "execs", o.Execs, "execs in one warm sandbox")
	f.IntVar(&o.Warm, "warm-pool", o.Warm, "warm pool size for the pooled create → exec rounds (0: skip them)")
	f.IntVar(&o.Idle, "idle", o.Idle, "idle sandboxes for the memory, CPU and create rate figures")
	f.DurationVar(&o.IdleWindow, "idle-window", o.IdleWindow, "how long the idle sandboxes' CPU is measured (0: not at all)")
	f.IntVar(&o.RateProbe, "rate-probe", o.RateProbe, "creates timed on the empty node and again with the idle sandboxes live (0: none)")
	f.BoolVar(&o.Baseline, "baseline", o.Baseline, "also measure bare runc")
	cmd.AddCommand(a.benchNetworkCommand(), a.benchStorageCommand(), a.benchClusterCommand(), a.benchExecHopCommand(), a.benchTrajectoryCommand(), a.benchLifecycleCommand(), a.benchGradeCommand(), a.benchFnCallCommand(), a.benchE2BCommand(), a.benchVMCommand(), a.benchProvenanceCommand(), a.benchQoSCommand())
	return cmd
}

// report is a benchmark's result.
type report interface {
	Print(io.Writer)
	JSON(io.Writer) error
}

// runBench makes sure the default environment exists, sends progress to
// stderr unless --json, runs the benchmark and prints its report.
func (a *app) runBench(ctx context.Context, env string, progress *io.Writer, run func(context.Context) (report, error)) error {
	if env == benchEnv {
		if err := a.ensureBusybox(ctx, benchEnv); err != nil {
			return err
		}
	}
	if !a.json {
		*progress = a.stderr
	}
	rep, err := run(ctx)
	if err != nil {
		return err
	}
	if a.json {
		return rep.JSON(a.stdout)
	}
	rep.Print(a.stdout)
	return nil
}

// ensureBusybox imports a busybox base as ref unless the daemon has it.
func (a *app) ensureBusybox(ctx context.Context, ref string) error {
	resp, err := a.c.Layers.ListLayers(ctx, connect.NewRequest(&dsecv1.ListLayersRequest{}))
	if err != nil {
		return err
	}
	for _, l := range resp.Msg.GetLayers() {
		for _, r := range l.GetRefs() {
			if r == ref {
				return nil
			}
		}
	}
	dir, err := os.MkdirTemp("", "dsec-busybox-")
	if err != nil {
		return err
	}
	defer os.RemoveAll(dir)
	if err := image.BuildBusyboxRootfs(dir); err != nil {
		return fmt.Errorf("build busybox base: %w", err)
	}
	_, err = a.c.Layers.ImportLayer(ctx, connect.NewRequest(&dsecv1.ImportLayerRequest{Ref: ref, Kind: dsecv1.LayerKind_LAYER_KIND_BASE, Path: dir}))
	return err
}

func (a *app) benchNetworkCommand() *cobra.Command {
	o := bench.NetworkOptions{Env: benchEnv, Seq: 30, Scale: 500, Updates: 50, Parallel: 8}
	cmd := &cobra.Command{
		Use:   "network",
		Short: "measure what network rules add to create, hold 500 networked sandboxes, time rule updates at that scale",
		Args:  cobra.NoArgs,
		RunE: func(cmd *cobra.Command, args []string) error {
			return a.runBench(cmd.Context(), o.Env, &o.Progress, func(ctx context.Context) (report, error) {
				return bench.RunNetwork(ctx, a.c, o)
			})
		},
	}
	f := cmd.Flags()
	f.StringVar(&o.Env, "env", benchEnv, "environment to benchmark")
	f.IntVar(&o.Seq, "seq", o.Seq, "creates with and without rules (each)")
	f.IntVar(&o.Scale, "scale", o.Scale, "networked sandboxes held at once")
	f.IntVar(&o.Updates, "updates", o.Updates, "rule updates to time, alone and at scale")
	f.IntVar(&o.Parallel, "parallel", o.Parallel, "creates in flight while scaling up")
	return cmd
}

func (a *app) benchProvenanceCommand() *cobra.Command {
	o := bench.ProvenanceOptions{Env: benchEnv, Execs: 300, Command: "cat /etc/passwd >/dev/null"}
	cmd := &cobra.Command{
		Use:   "provenance",
		Short: "exec p50 with provenance on (protected paths watched, a protected read per exec) against off, alternating in one run; the Provenance call's latency",
		Args:  cobra.NoArgs,
		RunE: func(cmd *cobra.Command, args []string) error {
			return a.runBench(cmd.Context(), o.Env, &o.Progress, func(ctx context.Context) (report, error) {
				return bench.RunProvenance(ctx, a.c, o)
			})
		},
	}
	f := cmd.Flags()
	f.StringVar(&o.Env, "env", benchEnv, "environment to benchmark")
	f.IntVar(&o.Execs, "execs", o.Execs, "execs per side")
	f.StringVar(&o.Command, "command", o.Command, "the shell command each exec runs")
	return cmd
}

func (a *app) benchClusterCommand() *cobra.Command {
	o := bench.ClusterOptions{Env: "base:1", Duration: 60 * time.Second, Batch: 50, BatchWorkers: 6, SingleWorkers: 40,
		SimulateSeeds: 3, SimulateNodes: 160, SimulateFillTo: 0.8}
	var quotaToken string
	var quotaRounds int
	cmd := &cobra.Command{
		Use:   "cluster",
		Short: "keyed creates against a cluster's apiservers (batches and singles at once): rates, latency, spread",
		Long: "Drives a closed-loop load of keyed creates through every apiserver of --addr (a comma-separated\n" +
			"list), as the SDKs send them, for --duration, and reports sandboxes created per second, single\n" +
			"create calls per second and their latency, errors and the spread over edges; then, in the same\n" +
			"run, the placement simulation of 160 nodes at 80 % fill with 2 s stale reports, against random\n" +
			"placement. Meant for a cluster of hollow edges (scripts/cluster.sh up --hollow 160), where a\n" +
			"create starts nothing, so the control plane is measured alone.",
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, args []string) error {
			dial := func(token, name string) ([]*dsec.Conn, error) {
				var clients []*dsec.Conn
				for _, addr := range strings.Split(dsec.Addr(a.addr), ",") {
					c, err := dsec.Dial(strings.TrimSpace(addr), dsec.DialOptions{Token: token, TokenName: name, CAFile: a.caFile})
					if err != nil {
						return nil, err
					}
					clients = append(clients, c)
				}
				return clients, nil
			}
			clients, err := dial(a.token, "--token")
			if err != nil {
				return err
			}
			if quotaToken != "" {
				charged, err := dial(quotaToken, "--quota-token")
				if err != nil {
					return err
				}
				return a.runBench(cmd.Context(), o.Env, &o.Progress, func(ctx context.Context) (report, error) {
					return bench.RunClusterQuota(ctx, clients, charged, o, quotaRounds)
				})
			}
			return a.runBench(cmd.Context(), o.Env, &o.Progress, func(ctx context.Context) (report, error) {
				return bench.RunCluster(ctx, clients, o)
			})
		},
	}
	f := cmd.Flags()
	f.StringVar(&quotaToken, "quota-token", "", "a token of a project under a quota limit: compare its create rate (every create charged) with --token's (a project under none), in alternating rounds")
	f.IntVar(&quotaRounds, "quota-rounds", 4, "rounds of each side with --quota-token (even: ABBA cancels a drift)")
	f.StringVar(&o.Env, "env", o.Env, "environment the creates name (hollow edges accept any)")
	f.DurationVar(&o.Duration, "duration", o.Duration, "how long the load runs")
	f.DurationVar(&o.TTL, "ttl", 0, "each sandbox's TTL, whole seconds (0: none): the nodes end what the load made as it runs")
	f.IntVar(&o.Batch, "batch", o.Batch, "sandboxes per batch create")
	f.IntVar(&o.BatchWorkers, "batch-workers", o.BatchWorkers, "callers issuing batch creates, one at a time each")
	f.IntVar(&o.SingleWorkers, "single-workers", o.SingleWorkers, "callers issuing single creates")
	f.IntVar(&o.SimulateSeeds, "sim-seeds", o.SimulateSeeds, "placement simulations (their worst is reported)")
	return cmd
}

func (a *app) benchExecHopCommand() *cobra.Command {
	var via, viaToken, env, compare string
	var n int
	cmd := &cobra.Command{
		Use:   "exec-hop --via APISERVER",
		Short: "exec latency of the all-in-one dsecd (--addr) beside a cluster's apiserver → edge in another process (--via), in turns",
		Args:  cobra.NoArgs,
		RunE: func(cmd *cobra.Command, args []string) error {
			if via == "" {
				return fmt.Errorf("--via names the cluster's apiserver")
			}
			cl, err := dsec.Dial(via, dsec.DialOptions{Token: viaToken, TokenName: "--via-token"})
			if err != nil {
				return err
			}
			var names []string
			if compare != "" {
				if names = strings.Split(compare, ","); len(names) != 2 {
					return fmt.Errorf("--compare %q: want two names, --addr's and --via's, comma-separated", compare)
				}
			}
			var progress io.Writer
			return a.runBench(cmd.Context(), env, &progress, func(ctx context.Context) (report, error) {
				return bench.RunExecHop(ctx, a.c, cl, env, n, names, progress)
			})
		},
	}
	f := cmd.Flags()
	f.StringVar(&via, "via", "", "the cluster's apiserver")
	f.StringVar(&viaToken, "via-token", "", "its token (default $DSEC_TOKEN)")
	f.StringVar(&env, "env", "busybox:test", "environment on both sides")
	f.IntVar(&n, "execs", 500, "execs on each side")
	f.StringVar(&compare, "compare", "", "NAME,NAME: --addr and --via are two peers (e.g. \"metrics on,metrics off\": dsecd and dsecd --no-metrics); report their p50 ratio and its spread over the turns instead of the hop")
	return cmd
}

func (a *app) benchQoSCommand() *cobra.Command {
	o := bench.QoSOptions{Env: benchEnv, Loop: 100000, Steps: 10, Rounds: 3}
	cmd := &cobra.Command{
		Use:   "qos",
		Short: "a latency sandbox's fixed step alone and beside sandboxes burning 50 % and 100 % of the node, unprotected (burners qos=latency) and protected (qos=best_effort)",
		Long: "Reproduces the CPU QoS experiment (docs/qos.md) with real sandboxes: a latency sandbox of 1 CPU\n" +
			"times a shell loop (--loop additions; exec to exit) --steps times per condition, alone and beside\n" +
			"burner sandboxes of 1 CPU each (half the node's CPUs, then all of them), once with the burners\n" +
			"qos=latency and once qos=best_effort, in --rounds rounds that interleave the conditions, and\n" +
			"prints each condition's slowdown against alone in the same run. Target: protected at 50 % load\n" +
			"slows the step at most 10 %.",
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, args []string) error {
			return a.runBench(cmd.Context(), o.Env, &o.Progress, func(ctx context.Context) (report, error) {
				return bench.RunQoS(ctx, a.c, o)
			})
		},
	}
	f := cmd.Flags()
	f.StringVar(&o.Env, "env", o.Env, "environment of every sandbox (it needs sh and nproc)")
	f.IntVar(&o.Loop, "loop", o.Loop, "additions in one step")
	f.IntVar(&o.Steps, "steps", o.Steps, "steps per condition and round")
	f.IntVar(&o.Rounds, "rounds", o.Rounds, "rounds of all conditions")
	return cmd
}

func (a *app) benchTrajectoryCommand() *cobra.Command {
	var env, command string
	var n int
	cmd := &cobra.Command{
		Use:   "trajectory",
		Short: "exec latency with the sandbox's trajectory recorded against a sandbox with recording off (spec no_trajectory), in turns on one node",
		Args:  cobra.NoArgs,
		RunE: func(cmd *cobra.Command, args []string) error {
			var progress io.Writer
			return a.runBench(cmd.Context(), env, &progress, func(ctx context.Context) (report, error) {
				return bench.RunTrajectory(ctx, a.c, env, command, n, progress)
			})
		},
	}
	f := cmd.Flags()
	f.StringVar(&env, "env", "busybox:test", "environment of both sandboxes")
	f.StringVar(&command, "command", "seq 200", "the command each exec runs (its output is recorded: hashed, and kept up to the node's cap)")
	f.IntVar(&n, "execs", 1000, "execs in each sandbox")
	return cmd
}

func (a *app) benchFnCallCommand() *cobra.Command {
	o := bench.FnCallOptions{URL: "http://127.0.0.1:8080", EnvTree: "/var/cache/dsec/fncall-env", Concurrency: 64,
		Duration: 10 * time.Second, Rounds: 3, Mixed: 256, Busy: 100, BusyTimeout: 10 * time.Second}
	cmd := &cobra.Command{
		Use:   "fncall",
		Short: "the fncall backend through SandboxFusion's API: print(1) rate against bare python3, one call's latency, C++ a+b against the host's g++, a mixed burst, a CPU-bound burst",
		Long: "Sends SandboxFusion /run_code calls to --url (a dsecd's SandboxFusion API) and, in alternate\n" +
			"phases of --duration, runs the same print(1) as bare `python3 -c` processes chrooted into the\n" +
			"fncall environment's tree (--env-tree) at the same concurrency. Needs root (the chroot).",
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, args []string) error {
			return a.runBench(cmd.Context(), "", &o.Progress, func(ctx context.Context) (report, error) {
				return bench.RunFnCall(ctx, o)
			})
		},
	}
	f := cmd.Flags()
	f.StringVar(&o.URL, "url", o.URL, "SandboxFusion's API of the daemon under test")
	f.StringVar(&o.EnvTree, "env-tree", o.EnvTree, "the fncall environment's root file system (scripts/build-fncall-env.sh), for the baseline")
	f.IntVar(&o.Concurrency, "concurrency", o.Concurrency, "calls in flight in the rate figures")
	f.DurationVar(&o.Duration, "duration", o.Duration, "length of each rate phase")
	f.IntVar(&o.Rounds, "rounds", o.Rounds, "rate phases of each side, interleaved")
	f.IntVar(&o.Mixed, "mixed", o.Mixed, "calls in the mixed burst")
	f.IntVar(&o.Busy, "busy", o.Busy, "calls in the CPU-bound burst (-1: none)")
	f.DurationVar(&o.BusyTimeout, "busy-timeout", o.BusyTimeout, "run_timeout of each call of the CPU-bound burst")
	f.BoolVar(&o.BusyOnly, "busy-only", false, "run the CPU-bound burst alone (against a fresh dsecd: cold pools, as a node's first burst)")
	return cmd
}

func (a *app) benchLifecycleCommand() *cobra.Command {
	o := bench.LifecycleOptions{Env: benchEnv, Rounds: 10, MemoryMiB: 512, SnapFiles: 20000, SnapMiB: 100}
	cmd := &cobra.Command{
		Use:   "lifecycle",
		Short: "pause, resume, snapshot, restore and fork: time to frozen, memory released, resume to first exec, prefetch, snapshot stopped time, restore and fork cost",
		Long: "Pauses and resumes one sandbox of the daemon at --addr holding --memory-mib MiB (dsec-agent\n" +
			"hold-memory), --rounds times each way: full pauses (memory pushed out, then resumed with and\n" +
			"without the prefetch in alternate rounds) and freeze-only ones. Without swap on the node\n" +
			"(dsecd --swap) anonymous memory cannot leave RAM, and the report says so.",
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, args []string) error {
			return a.runBench(cmd.Context(), o.Env, &o.Progress, func(ctx context.Context) (report, error) {
				return bench.RunLifecycle(ctx, a.c, o)
			})
		},
	}
	f := cmd.Flags()
	f.StringVar(&o.Env, "env", benchEnv, "environment of the sandbox")
	f.IntVar(&o.Rounds, "rounds", o.Rounds, "pauses of each kind")
	f.IntVar(&o.MemoryMiB, "memory-mib", o.MemoryMiB, "memory the sandbox holds")
	f.IntVar(&o.SnapFiles, "snapshot-files", o.SnapFiles, "files in the writable layer snapshots capture (0: no snapshots)")
	f.IntVar(&o.SnapMiB, "snapshot-mib", o.SnapMiB, "MiB those files hold")
	return cmd
}

func (a *app) benchGradeCommand() *cobra.Command {
	o := bench.GradeOptions{Env: "demo-debian:2+demo-textstats:1+demo-harness:1", Demo: "demo", Rollouts: 12, Concurrency: 2, WarmPool: 4}
	cmd := &cobra.Command{
		Use:   "grade",
		Short: "the demo's rollouts graded in a clean room against grading them in place, in one run (target <= 1.25x)",
		Long: "Runs --rollouts of the demo's coding rollouts (demo/rollout.py's patches, in --env, which\n" +
			"scripts/demo.sh imports), --concurrency at once; each sandbox is graded twice, alternating\n" +
			"which goes first: in place (the trusted tests and grader written into it, the grader run there)\n" +
			"and in a clean room (Grade, as the demo does). Prints each side's latency from the client, the\n" +
			"clean room's parts and the ratio of the p50s. --demo is the repository's demo directory.",
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, args []string) error {
			c, err := dsec.NewClient(a.addr, dsec.WithToken(a.token), dsec.WithCAFile(a.caFile))
			if err != nil {
				return err
			}
			defer c.Close()
			return a.runBench(cmd.Context(), o.Env, &o.Progress, func(ctx context.Context) (report, error) {
				return bench.RunGrade(ctx, c, o)
			})
		},
	}
	f := cmd.Flags()
	f.StringVar(&o.Env, "env", o.Env, "the demo's environment (BASE+WORKSPACE+TOOLKIT)")
	f.StringVar(&o.Demo, "demo", o.Demo, "the repository's demo directory (patches, tests, grader)")
	f.IntVar(&o.Rollouts, "rollouts", o.Rollouts, "rollouts, each graded both ways")
	f.IntVar(&o.Concurrency, "concurrency", o.Concurrency, "rollouts at once")
	f.IntVar(&o.WarmPool, "warm-pool", o.WarmPool, "a warm pool of the rollouts' shape kept while the bench runs, as the demo keeps one (0: none)")
	return cmd
}

func (a *app) benchE2BCommand() *cobra.Command {
	o := bench.E2BOptions{Node: "node", Script: "test/e2b/bench.mjs", Template: "base", Rounds: 20, Warm: 4, Runs: 200,
		APIURL: os.Getenv("E2B_API_URL"), SandboxURL: os.Getenv("E2B_SANDBOX_URL"), APIKey: os.Getenv("E2B_API_KEY")}
	var apiKey string // never printed as a default
	cmd := &cobra.Command{
		Use:   "e2b",
		Short: "the E2B SDK against dsec's own client on one daemon: create → first run (cold and warm pool), commands.run('true') p50",
		Long: "Drives the official E2B SDK (test/e2b/bench.mjs in node; npm ci in test/e2b first) against the\n" +
			"daemon's E2B API and dsec's own client against the daemon at --addr, in alternate turns, with the\n" +
			"spec the adapter makes of --template on both sides. Prints each figure, the ratio and PASS/MISS\n" +
			"against issue 16's targets (create → first run ≤ 1.2×, run p50 ≤ 2×). The SDK is configured by\n" +
			"E2B_API_URL, E2B_SANDBOX_URL and E2B_API_KEY, as users configure it (or the flags).",
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, args []string) error {
			if apiKey != "" {
				o.APIKey = apiKey
			}
			o.DsecAddr = a.addr
			return a.runBench(cmd.Context(), "", &o.Progress, func(ctx context.Context) (report, error) {
				return bench.RunE2B(ctx, a.c, o)
			})
		},
	}
	f := cmd.Flags()
	f.StringVar(&o.APIURL, "e2b-url", o.APIURL, "the daemon's E2B API, http://HOST:PORT (default $E2B_API_URL)")
	f.StringVar(&o.SandboxURL, "sandbox-url", o.SandboxURL, "E2B_SANDBOX_URL for the SDK (default $E2B_SANDBOX_URL, else --e2b-url)")
	f.StringVar(&apiKey, "api-key", "", "E2B API key (default $E2B_API_KEY; dsecd token --e2b prints one)")
	f.StringVar(&o.Template, "template", o.Template, "E2B template both sides start")
	f.StringVar(&o.Node, "node", o.Node, "node binary")
	f.StringVar(&o.Script, "script", o.Script, "the E2B side's script, beside its node_modules")
	f.IntVar(&o.Rounds, "rounds", o.Rounds, "create → first run rounds of each side, cold and warm each")
	f.IntVar(&o.Warm, "warm-pool", o.Warm, "warm pool size for the warm rounds (0: skip them)")
	f.IntVar(&o.Runs, "runs", o.Runs, "commands.run('true') calls, and as many execs")
	return cmd
}

func (a *app) benchVMCommand() *cobra.Command {
	o := bench.VMOptions{Env: benchEnv, Rounds: 5, Execs: 50, WarmPool: 2, Pauses: 5, Forks: 4, SharedVMs: 8, SharedMiB: 200, SharedMemoryMiB: 512, VMs: 32,
		IdleWindow: 30 * time.Second, MemoryMiB: 256, Parallel: 2, KernelDir: cmp.Or(os.Getenv("DSEC_VM_KERNEL_DIR"), kernel.DefaultDir)}
	var only, pmemAddr, pmemToken string
	cmd := &cobra.Command{
		Use:   "vm",
		Short: "microVMs and gVisor against runc in one run: create → first exec (cold, warm pool), restore and resume, pause, fork, shared layer pages, idle microVMs, gVisor side by side",
		Long: "Drives the daemon at --addr (run it on the daemon's host) through every microVM and gVisor target of\n" +
			"issue 30, each against its baseline measured in the same run (a runc container, a cold boot), and\n" +
			"prints the node's accelerator (kvm or tcg), the machine's cores and memory, and PASS/MISS for each\n" +
			"target. Parts (--only, comma-separated): cold, warm, pause (restore and resume), fork, shared,\n" +
			"idle, gvisor. microVMs boot --parallel at a time: under TCG a boot takes a core for seconds. The shared\n" +
			"part compares --addr's node with a node whose layers are shared pages (--shared-pmem-addr).",
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, args []string) error {
			parts, err := bench.ParseVMParts(only)
			if err != nil {
				return err
			}
			o.Parts = parts
			if pmemAddr != "" {
				if o.Pmem, err = dsec.Dial(pmemAddr, dsec.DialOptions{Token: pmemToken, TokenName: "--shared-pmem-token"}); err != nil {
					return err
				}
			}
			return a.runBench(cmd.Context(), o.Env, &o.Progress, func(ctx context.Context) (report, error) {
				return bench.RunVM(ctx, a.c, o)
			})
		},
	}
	f := cmd.Flags()
	f.StringVar(&only, "only", "", "parts to run, comma-separated: "+strings.Join(bench.VMParts, ",")+" (default all)")
	f.StringVar(&o.Env, "env", benchEnv, "environment of the sandboxes (the shared part imports its own)")
	f.IntVar(&o.Rounds, "rounds", o.Rounds, "create → first exec rounds of each isolation, cold and from the warm pool")
	f.IntVar(&o.Execs, "execs", o.Execs, "execs of true in one sandbox of each isolation")
	f.IntVar(&o.WarmPool, "warm-pool", o.WarmPool, "the microVM warm pool's size")
	f.IntVar(&o.Pauses, "pauses", o.Pauses, "pause → resume → first exec rounds")
	f.IntVar(&o.Forks, "forks", o.Forks, "children of each fork (fork ×N → every child's first exec against N cold creates)")
	f.IntVar(&o.SharedVMs, "shared-vms", o.SharedVMs, "microVMs reading the same file of a base layer")
	f.IntVar(&o.SharedMiB, "shared-mib", o.SharedMiB, "that file's size")
	f.IntVar(&o.SharedMemoryMiB, "shared-memory-mib", o.SharedMemoryMiB, "the shared part's microVMs' memory: enough to cache that file beside the guest's kernel and agent (0: --memory-mib)")
	f.StringVar(&pmemAddr, "shared-pmem-addr", "", "a second dsecd on this host, run with --vm-pmem-layers, for the shared part's figure with shared pages (default: none, that figure pending)")
	f.StringVar(&pmemToken, "shared-pmem-token", "", "its token")
	f.IntVar(&o.VMs, "vms", o.VMs, "idle microVMs held at once")
	f.DurationVar(&o.IdleWindow, "idle-window", o.IdleWindow, "how long the idle microVMs' CPU is measured")
	f.IntVar(&o.MemoryMiB, "memory-mib", o.MemoryMiB, "each microVM's memory")
	f.IntVar(&o.Parallel, "parallel", o.Parallel, "microVM creates in flight")
	f.StringVar(&o.KernelDir, "vm-kernel-dir", o.KernelDir, "the node's guest kernel directory, for the floor VMs the cold and idle parts boot beside its microVMs (QEMU and a static busybox from PATH; \"\": no floors)")
	f.IntVar(&o.FloorVMs, "floor-vms", 2, "floor VMs the idle part holds beside its microVMs")
	return cmd
}

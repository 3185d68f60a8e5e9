package cluster

import (
	"context"
	"fmt"
	"io"
	"net/http"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"connectrpc.com/connect"

	dsecv1 "dsec.dev/dsec/api/gen/dsec/v1"
	"dsec.dev/dsec/internal/bench"
	"dsec.dev/dsec/internal/testutil"
	dsec "dsec.dev/dsec/sdk/go"
)

// opsOff switches off what the operations cost: metrics, events and the
// cost ledger, on apiservers and edges alike.
var opsOff = []string{"--no-metrics", "--no-events", "--no-ledger"}

// opsOn are the flags of the side with the operations on: none, or, with
// DSEC_BENCH_OPS=metrics,events (say), those of opsOff it does not name,
// to tell what each part costs.
func opsOn() []string {
	ops := os.Getenv("DSEC_BENCH_OPS")
	if ops == "" {
		return nil
	}
	var out []string
	for _, f := range opsOff {
		if !slices.Contains(strings.Split(ops, ","), strings.TrimPrefix(f, "--no-")) {
			out = append(out, f)
		}
	}
	return out
}

// BenchmarkClusterOps is `dsec bench cluster` on two clusters of two
// apiservers and three hollow edges each, each over a PostgreSQL of its
// own, one with
// metrics, events and the cost ledger on (the hollow edges keep a ledger
// of synthetic use, sampled at each sandbox's checkpoints: what the pulls
// bring, as a real edge's), one with all
// three off: the first's create rate over the second's in alternating
// rounds (ABBA), the cluster not measured frozen (SIGSTOP), its
// PostgreSQL with it, so that its background work (the ledger's samples
// and pulls of the sandboxes it holds, its database's checkpoints and
// vacuums) costs the other nothing. Target ≥ 0.98× (issue 33). It prints
// too the CPU time each side's processes used (its apiservers, its edges,
// PostgreSQL, the callers) during its rounds, and over the sandboxes it
// made, which other work on a shared machine moves less than the rate;
// DSEC_BENCH_OPS=none compares two clusters with all three off, the
// baseline's own spread; DSEC_BENCH_SWAP=1 makes the cluster with them
// off the first side (a pair of runs, one each way, cancels what being
// first costs, if anything: two clusters with all three off read 1.014×
// and 1.001× in create rate so; before the quota sweep tallied, it
// listed every sandbox each 30 s, and that read them up to 10 % apart,
// the cluster started first the worse). DSEC_BENCH_TTL=5s gives each
// sandbox that TTL, which the hollow edges end it at: each sandbox then
// costs its end too (its event, its ledger row in the store), as in a
// training loop's steady state; without it no sandbox ends in a run.
// Keep the TTL at most half a turn (5 s): a sandbox that expires while
// its cluster is frozen ends at the cluster's next turn, and with a TTL
// of 20 s the side that goes first pays the ends of 3.5 turns' creates
// in its rounds, the other of 2.5 (ABBA, each warm-up half a turn); at
// 5 s each pays 4.
//
//	go test -v -run '^$' -bench ClusterOps -benchtime 1x ./test/cluster   # as root; -v: the whole report
func BenchmarkClusterOps(b *testing.B) {
	// Each cluster its own PostgreSQL, frozen with it: one server for
	// both did its background work (checkpoints, autovacuum, pruning
	// after a side's deletes) in whichever side's rounds ran then, and
	// one side's PostgreSQL CPU a sandbox read up to a third above the
	// other's in a run, either way. No checkpoint in a run either (a run
	// writes a few GiB of WAL), and no autovacuum: its launcher looks at
	// each database once a minute of its server's time, so a run held
	// one or two passes over each side's tables (sandboxes, idempotency,
	// audit: some 100 MiB by then), in whichever rounds they fell; in one
	// run the side with the operations on had all four of its passes in
	// its rounds and the other none (pg_stat_user_tables).
	settings := []string{"max_wal_size=32GB", "checkpoint_timeout=1d", "autovacuum=off"}
	// DSEC_BENCH_SWAP=1 starts the cluster with the operations off first,
	// its PostgreSQL too, and gives it the first round: whatever favours
	// one side for being first then favours the other, and a run each way
	// cancels it. The on cluster's PostgreSQL was once started first
	// either way: two clusters with all three off read the one over it
	// 0.975× the other over six pairs of runs (0.950–1.014×); with the
	// servers' order swapped too, 0.998× and 1.003×.
	swap := os.Getenv("DSEC_BENCH_SWAP") != ""
	var pgOn, pgOff *testutil.Postgres
	if swap {
		pgOff = testutil.StartPostgresServer(b, settings...)
		pgOn = testutil.StartPostgresServer(b, settings...)
	} else {
		pgOn = testutil.StartPostgresServer(b, settings...)
		pgOff = testutil.StartPostgresServer(b, settings...)
	}
	// Room for every sandbox of a run without a TTL (200,000 a node was
	// reached at 13,000 creates a second a side).
	edgeArgs := []string{"--runtime", "fake", "--hollow-max-sandboxes", "1000000"}
	if iv := os.Getenv("DSEC_BENCH_LEDGER_INTERVAL"); iv != "" {
		edgeArgs = append(edgeArgs, "--ledger-interval", iv)
	}
	apiArgs := opsOn()
	if every := os.Getenv("DSEC_BENCH_USAGE_PULL"); every != "" {
		apiArgs = append(apiArgs, "--usage-pull-interval", every)
	}
	// DSEC_BENCH_PROFILE=DIR writes a CPU profile of each side's first
	// apiserver and first edge, over the whole comparison, to DIR.
	profDir := os.Getenv("DSEC_BENCH_PROFILE")
	// DSEC_BENCH_PROGRESS=1 writes each round's rate as it ends.
	var progress io.Writer
	if os.Getenv("DSEC_BENCH_PROGRESS") != "" {
		progress = os.Stderr
	}
	var ttl time.Duration
	if v := os.Getenv("DSEC_BENCH_TTL"); v != "" {
		var err error
		if ttl, err = time.ParseDuration(v); err != nil {
			b.Fatalf("DSEC_BENCH_TTL: %v", err)
		}
	}
	// DSEC_BENCH_ROUNDS=N runs N rounds of each side (default 4), each
	// 10 s as the default's: more rounds, more alternations to average
	// what the machine's own load does to one side or the other (single
	// runs of 4 rounds spread ±5 % with a TTL).
	rounds := 4
	if v := os.Getenv("DSEC_BENCH_ROUNDS"); v != "" {
		n, err := strconv.Atoi(v)
		if err != nil || n < 1 {
			b.Fatalf("DSEC_BENCH_ROUNDS=%q: want a number of rounds, 1 or more", v)
		}
		rounds = n
	}
	// Each apiserver reconciles (removes the rows of the sandboxes that
	// ended, among others) once every turn of the two sides, 20 s: the
	// tick falls in its cluster's round, or in its frozen half and fires
	// as it is thawed, so each round has one pass. With the default 30 s
	// the passes fell two in three turns, more of them in the rounds of
	// the cluster started first, whichever it was: 24 against 18 row
	// checks in a run, a third more rows deleted, some 6 % of the rate
	// to that side in single runs, either way.
	reconcile := []string{"--reconcile-interval", "20s"}
	cluster := func(edgeOps, apiArgs []string, pg *testutil.Postgres) *testutil.Cluster {
		return testutil.StartCluster(b, testutil.ClusterOptions{APIServers: 2, Edges: 3, DB: pg.NewDatabase(b), Registry: true,
			EdgeArgs: append(slices.Clip(edgeArgs), edgeOps...), APIServerArgs: append(slices.Clip(reconcile), apiArgs...), Profiles: profDir != ""})
	}
	var on, off *testutil.Cluster
	if swap {
		off = cluster(opsOff, opsOff, pgOff)
		on = cluster(opsOn(), apiArgs, pgOn)
	} else {
		on = cluster(opsOn(), apiArgs, pgOn)
		off = cluster(opsOff, opsOff, pgOff)
	}
	pgOf := map[*testutil.Cluster]*testutil.Postgres{on: pgOn, off: pgOff}
	ctx := context.Background()
	// Where the CPU goes in each side's rounds: its apiservers, its
	// edges, its PostgreSQL and the benchmark's own callers.
	cpu := newCPUMeter()
	cpu.addCluster("ops on", on)
	cpu.addCluster("ops off", off)
	cpu.add("ops on postgres", pgOn.CPU)
	cpu.add("ops off postgres", pgOff.CPU)
	self := os.Getpid()
	cpu.add("the benchmark's callers", func() time.Duration { return testutil.ProcCPU(self, false) })
	side := func(name string, c, other *testutil.Cluster) bench.ClusterSide {
		var clients []*dsec.Conn
		for _, a := range c.APIServers {
			cl, err := dsec.Dial(a.Addr, dsec.DialOptions{Token: a.Token})
			if err != nil {
				b.Fatal(err)
			}
			clients = append(clients, cl)
		}
		// Each round runs c alone, its CPU charged to charge ("": none,
		// a warm-up's).
		enter := func(charge string) func(ctx context.Context) error {
			return func(ctx context.Context) error {
				cpu.switchTo(charge)
				freeze(other, pgOf[other])
				return thaw(ctx, c, pgOf[c], clients)
			}
		}
		return bench.ClusterSide{Name: name, Clients: clients, Before: enter(name), WarmUp: enter("")}
	}
	defer thaw(ctx, on, pgOn, nil)
	defer thaw(ctx, off, pgOff, nil)
	for range b.N {
		var profiles sync.WaitGroup
		if profDir != "" {
			for side, c := range map[string]*testutil.Cluster{"on": on, "off": off} {
				for _, p := range []*testutil.Proc{c.APIServers[0], c.Edges[0]} {
					path := filepath.Join(profDir, side+"-"+p.Name+".pprof")
					profiles.Go(func() { profile(b, p.DebugAddr, path, time.Duration(rounds)*20*time.Second+30*time.Second) })
				}
			}
		}
		sides := [2]bench.ClusterSide{side("ops on", on, off), side("ops off", off, on)}
		if swap {
			sides[0], sides[1] = sides[1], sides[0]
		}
		rep, err := bench.RunClusterCompare(ctx, sides, bench.ClusterOptions{Env: "base:1", Duration: time.Duration(rounds) * 20 * time.Second,
			TTL: ttl, Batch: 50, BatchWorkers: 6, SingleWorkers: 40, Progress: progress}, rounds, 0.98)
		cpu.switchTo("")
		thaw(ctx, on, pgOn, nil)
		thaw(ctx, off, pgOff, nil)
		profiles.Wait()
		if err != nil {
			b.Fatal(err)
		}
		var out strings.Builder
		rep.Print(&out)
		onI, offI := 0, 1
		if swap {
			onI, offI = 1, 0
			fmt.Fprintf(&out, "swapped (the off cluster first): ops on ÷ ops off create rate: %.3f×\n",
				rep.Sides[onI].SandboxesPerSec/rep.Sides[offI].SandboxesPerSec)
		}
		out.WriteString("\n")
		cpu.print(&out, [2]string{"ops on", "ops off"}, [2]int64{rep.Sides[onI].Sandboxes, rep.Sides[offI].Sandboxes})
		b.Log("\n" + out.String())
	}
}

// freeze stops every process of c (SIGSTOP): its apiservers first, so
// none sees its edges go, then its PostgreSQL.
func freeze(c *testutil.Cluster, pg *testutil.Postgres) {
	for _, a := range c.APIServers {
		a.Stop()
	}
	for _, e := range c.Edges {
		e.Stop()
	}
	pg.Freeze()
}

// thaw lets c's processes run again (its PostgreSQL, then its edges, then
// its apiservers) and, given its
// clients, waits until each apiserver makes a sandbox again.
func thaw(ctx context.Context, c *testutil.Cluster, pg *testutil.Postgres, clients []*dsec.Conn) error {
	pg.Thaw()
	for _, e := range c.Edges {
		e.Cont()
	}
	for _, a := range c.APIServers {
		a.Cont()
	}
	for i, cl := range clients {
		deadline := time.Now().Add(30 * time.Second)
		for {
			cctx, cancel := context.WithTimeout(ctx, 5*time.Second)
			_, err := cl.Sandboxes.Create(cctx, connect.NewRequest(&dsecv1.CreateRequest{Spec: &dsecv1.SandboxSpec{Environment: "base:1"}}))
			cancel()
			if err == nil {
				break
			}
			if time.Now().After(deadline) {
				return fmt.Errorf("apiserver %s makes no sandbox 30 s after it was thawed: %w", c.APIServers[i].Name, err)
			}
			time.Sleep(50 * time.Millisecond)
		}
	}
	return nil
}

// profile writes the CPU profile of the process serving Go's profiles at
// addr over d to path (the process's CPU time: none while it is frozen),
// then its lock contention since it started to path's name with .mutex
// for .pprof.
func profile(b *testing.B, addr, path string, d time.Duration) {
	get := func(url, path string) {
		resp, err := http.Get(url)
		if err != nil {
			b.Errorf("profile %s: %v", addr, err)
			return
		}
		defer resp.Body.Close()
		data, err := io.ReadAll(resp.Body)
		if err == nil && resp.StatusCode != http.StatusOK {
			err = fmt.Errorf("%s: %s", resp.Status, data)
		}
		if err == nil {
			err = os.WriteFile(path, data, 0o644)
		}
		if err != nil {
			b.Errorf("profile %s: %v", addr, err)
		}
	}
	get(fmt.Sprintf("http://%s/debug/pprof/profile?seconds=%d", addr, int(d.Seconds())), path)
	get(fmt.Sprintf("http://%s/debug/pprof/mutex", addr), strings.TrimSuffix(path, ".pprof")+".mutex")
	get(fmt.Sprintf("http://%s/debug/pprof/allocs", addr), strings.TrimSuffix(path, ".pprof")+".allocs")
}

package cluster

import (
	"context"
	"fmt"
	"os"
	"slices"
	"strings"
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
// apiservers over PostgreSQL and three hollow edges each, one with
// metrics, events and the cost ledger on (the hollow edges keep a ledger
// of synthetic use, sampled each 10 s as a real edge's), one with all
// three off: the first's create rate over the second's in alternating
// rounds (ABBA), the cluster not measured frozen (SIGSTOP) so that its
// background work (the ledger's samples and pulls of the sandboxes it
// holds) costs the other nothing. Target ≥ 0.98× (issue 33).
//
//	go test -run '^$' -bench ClusterOps -benchtime 1x ./test/cluster   # as root
func BenchmarkClusterOps(b *testing.B) {
	pg := testutil.StartPostgresServer(b)
	edgeArgs := []string{"--runtime", "fake", "--hollow-max-sandboxes", "200000"}
	if iv := os.Getenv("DSEC_BENCH_LEDGER_INTERVAL"); iv != "" {
		edgeArgs = append(edgeArgs, "--ledger-interval", iv)
	}
	apiArgs := opsOn()
	if every := os.Getenv("DSEC_BENCH_USAGE_PULL"); every != "" {
		apiArgs = append(apiArgs, "--usage-pull-interval", every)
	}
	on := testutil.StartCluster(b, testutil.ClusterOptions{APIServers: 2, Edges: 3, DB: pg.NewDatabase(b), Registry: true,
		EdgeArgs: append(slices.Clip(edgeArgs), opsOn()...), APIServerArgs: apiArgs})
	off := testutil.StartCluster(b, testutil.ClusterOptions{APIServers: 2, Edges: 3, DB: pg.NewDatabase(b), Registry: true,
		EdgeArgs: append(slices.Clip(edgeArgs), opsOff...), APIServerArgs: opsOff})
	ctx := context.Background()
	side := func(name string, c, other *testutil.Cluster) bench.ClusterSide {
		var clients []*dsec.Conn
		for _, a := range c.APIServers {
			cl, err := dsec.Dial(a.Addr, dsec.DialOptions{Token: a.Token})
			if err != nil {
				b.Fatal(err)
			}
			clients = append(clients, cl)
		}
		return bench.ClusterSide{Name: name, Clients: clients, Before: func(ctx context.Context) error {
			freeze(other)
			return thaw(ctx, c, clients)
		}}
	}
	defer thaw(ctx, on, nil)
	defer thaw(ctx, off, nil)
	for range b.N {
		rep, err := bench.RunClusterCompare(ctx, [2]bench.ClusterSide{side("ops on", on, off), side("ops off", off, on)},
			bench.ClusterOptions{Env: "base:1", Duration: 80 * time.Second, Batch: 50, BatchWorkers: 6, SingleWorkers: 40}, 4, 0.98)
		if err != nil {
			b.Fatal(err)
		}
		var out strings.Builder
		rep.Print(&out)
		b.Log("\n" + out.String())
	}
}

// freeze stops every process of c (SIGSTOP): its apiservers first, so
// none sees its edges go.
func freeze(c *testutil.Cluster) {
	for _, a := range c.APIServers {
		a.Stop()
	}
	for _, e := range c.Edges {
		e.Stop()
	}
}

// thaw lets c's processes run again (its edges first) and, given its
// clients, waits until each apiserver makes a sandbox again.
func thaw(ctx context.Context, c *testutil.Cluster, clients []*dsec.Conn) error {
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

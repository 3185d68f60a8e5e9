package bench

import (
	"context"
	"fmt"
	"io"
	"sync"
	"text/tabwriter"
	"time"

	"connectrpc.com/connect"

	dsecv1 "dsec.dev/dsec/api/gen/dsec/v1"
	dsec "dsec.dev/dsec/sdk/go"
)

// NetworkOptions size the network benchmark.
type NetworkOptions struct {
	Env      string
	Seq      int // sequential creates with and without rules
	Scale    int // networked sandboxes held at once
	Updates  int // rule updates measured at scale
	Parallel int // creates in flight while scaling up
	Progress io.Writer
}

// NetworkReport is what `dsec bench network` prints.
type NetworkReport struct {
	Env             string   `json:"env"`
	CreatePlain     Latency  `json:"create_loopback_only"`
	CreateNetworked Latency  `json:"create_networked"`
	SetupAddedP50   float64  `json:"network_setup_added_p50_ms"`
	Scale           int      `json:"scale_target"`
	ScaleReached    int      `json:"scale_reached"`
	ScaleErrors     int      `json:"scale_errors"`
	ScaleWallS      float64  `json:"scale_wall_s"`
	UpdateAtScale   Latency  `json:"rule_update_at_scale"`
	UpdateAtOne     Latency  `json:"rule_update_alone"`
	Notes           []string `json:"notes,omitempty"`
}

// rules the benchmark gives its sandboxes: a mix of kinds, none reachable.
var benchRules = []map[string]bool{
	{"192.0.2.0/24:443/tcp": true, "*.example.invalid": true, "0.0.0.0/0": false},
	{"198.51.100.7:80/tcp": true, "pypi": true, "npm": false},
}

// RunNetwork measures what networking adds to a create, holds Scale
// networked sandboxes at once, and times rule updates alone and at scale.
// A rule update is applied in the kernel before SetNetworkRules returns, so
// the call's latency is the time until new connections follow the rules.
func RunNetwork(ctx context.Context, c *dsec.Conn, o NetworkOptions) (*NetworkReport, error) {
	rep := &NetworkReport{Env: o.Env, Scale: o.Scale}
	progress := func(format string, args ...any) {
		if o.Progress != nil {
			fmt.Fprintf(o.Progress, format+"\n", args...)
		}
	}
	var made []string
	var mu sync.Mutex
	defer func() {
		progress("deleting %d sandboxes", len(made))
		deleteAll(c, made)
	}()
	create := func(rules map[string]bool) (string, time.Duration, error) {
		t0 := time.Now()
		resp, err := c.Sandboxes.Create(ctx, connect.NewRequest(&dsecv1.CreateRequest{Spec: &dsecv1.SandboxSpec{
			Environment: o.Env, NetworkRules: rules, Labels: map[string]string{"bench": "network"},
		}}))
		d := time.Since(t0)
		if err != nil {
			return "", d, err
		}
		id := resp.Msg.GetSandboxes()[0].GetId()
		mu.Lock()
		made = append(made, id)
		mu.Unlock()
		return id, d, nil
	}

	// Create latency with and without rules, interleaved so drift hits both.
	progress("create: %d with and %d without network rules, interleaved", o.Seq, o.Seq)
	var plain, networked []time.Duration
	for i := 0; i < o.Seq; i++ {
		for _, rules := range []map[string]bool{nil, benchRules[i%len(benchRules)]} {
			id, d, err := create(rules)
			if err != nil {
				return nil, fmt.Errorf("create: %w", err)
			}
			if rules == nil {
				plain = append(plain, d)
			} else {
				networked = append(networked, d)
			}
			c.Sandboxes.Delete(ctx, connect.NewRequest(&dsecv1.DeleteRequest{Id: id}))
		}
	}
	mu.Lock()
	made = nil
	mu.Unlock()
	rep.CreatePlain, rep.CreateNetworked = summarize(plain), summarize(networked)
	rep.SetupAddedP50 = rep.CreateNetworked.P50 - rep.CreatePlain.P50

	// One networked sandbox alone: rule updates.
	one, _, err := create(benchRules[0])
	if err != nil {
		return nil, fmt.Errorf("create: %w", err)
	}
	rep.UpdateAtOne = summarize(updates(ctx, c, one, o.Updates))

	// Scale up.
	progress("scaling to %d networked sandboxes, %d at a time", o.Scale, o.Parallel)
	t0 := time.Now()
	sem := make(chan struct{}, max(o.Parallel, 1))
	var wg sync.WaitGroup
	var errs int
	for i := 1; i < o.Scale; i++ {
		wg.Add(1)
		sem <- struct{}{}
		go func() {
			defer wg.Done()
			defer func() { <-sem }()
			if _, _, err := create(benchRules[i%len(benchRules)]); err != nil {
				mu.Lock()
				errs++
				if errs == 1 {
					rep.Notes = append(rep.Notes, "first scale error: "+err.Error())
				}
				mu.Unlock()
			}
			if i%50 == 0 {
				progress("  %d/%d", i, o.Scale)
			}
		}()
	}
	wg.Wait()
	rep.ScaleWallS = time.Since(t0).Seconds()
	mu.Lock()
	rep.ScaleReached, rep.ScaleErrors = len(made), errs
	mu.Unlock()
	progress("at scale (%d sandboxes): %d rule updates", rep.ScaleReached, o.Updates)
	rep.UpdateAtScale = summarize(updates(ctx, c, one, o.Updates))
	rep.Notes = append(rep.Notes, "a rule update is committed to nftables before SetNetworkRules returns: its latency is the time until new connections follow the new rules")
	return rep, nil
}

func updates(ctx context.Context, c *dsec.Conn, id string, n int) []time.Duration {
	var out []time.Duration
	for i := 0; i < n; i++ {
		t0 := time.Now()
		_, err := c.Sandboxes.SetNetworkRules(ctx, connect.NewRequest(&dsecv1.SetNetworkRulesRequest{
			SandboxId: id, Rules: benchRules[i%len(benchRules)], Cut: i%2 == 0,
		}))
		if err == nil {
			out = append(out, time.Since(t0))
		}
	}
	return out
}

// Print writes the report as a table with the targets.
func (r *NetworkReport) Print(w io.Writer) {
	tw := tabwriter.NewWriter(w, 2, 4, 2, ' ', 0)
	fmt.Fprintf(tw, "network benchmark on %s\n\n", r.Env)
	fmt.Fprintln(tw, "figure\tp50 ms\tp99 ms\tn")
	row := func(name string, l Latency) { fmt.Fprintf(tw, "%s\t%.1f\t%.1f\t%d\n", name, l.P50, l.P99, l.N) }
	row("create, loopback only (baseline)", r.CreatePlain)
	row("create, with network rules", r.CreateNetworked)
	row("rule update, 1 sandbox", r.UpdateAtOne)
	row(fmt.Sprintf("rule update, %d sandboxes present", r.ScaleReached), r.UpdateAtScale)
	tw.Flush()
	fmt.Fprintln(w)
	verdict := func(ok bool) string {
		if ok {
			return "PASS"
		}
		return "MISS"
	}
	fmt.Fprintf(w, "network setup adds %.1f ms at p50 to create (%.2fx the loopback-only create)   target <= 10 ms   %s\n",
		r.SetupAddedP50, ratio(r.CreateNetworked.P50, r.CreatePlain.P50), verdict(r.SetupAddedP50 <= 10))
	fmt.Fprintf(w, "networked sandboxes held at once: %d of %d (%d errors, %.1f s)   target 500   %s\n",
		r.ScaleReached, r.Scale, r.ScaleErrors, r.ScaleWallS, verdict(r.ScaleReached >= 500 && r.ScaleErrors == 0))
	fmt.Fprintf(w, "rule update with %d present: p50 %.1f ms, p99 %.1f ms (%.2fx the update alone)   target <= 100 ms   %s\n",
		r.ScaleReached, r.UpdateAtScale.P50, r.UpdateAtScale.P99, ratio(r.UpdateAtScale.P50, r.UpdateAtOne.P50), verdict(r.UpdateAtScale.P99 <= 100))
	for _, n := range r.Notes {
		fmt.Fprintln(w, "note:", n)
	}
}

// JSON writes the report as one JSON object.
func (r *NetworkReport) JSON(w io.Writer) error { return writeJSON(w, r) }

func ratio(a, b float64) float64 {
	if b == 0 {
		return 0
	}
	return a / b
}

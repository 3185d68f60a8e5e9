package bench

import (
	"context"
	"fmt"
	"io"
	"slices"
	"time"

	"connectrpc.com/connect"

	dsecv1 "dsec.dev/dsec/api/gen/dsec/v1"
	dsec "dsec.dev/dsec/sdk/go"
)

// ExecHopReport compares exec of `true` in a sandbox of the all-in-one
// dsecd (apiserver and edge in one process) with one reached through a
// cluster's apiserver and its edge in another process, measured in turns
// in the same run. With Names set (--compare), the two sides are any two
// dsecds, named so (e.g. metrics on and metrics off), and the report gives
// their p50 ratio and its spread over the turns instead of the hop.
type ExecHopReport struct {
	Execs    int     `json:"execs"`
	AllInOne Latency `json:"all_in_one"`
	Cluster  Latency `json:"cluster"`
	AddedP50 float64 `json:"added_p50_ms"`
	// Names name the two sides (--addr's, --via's) when they are compared
	// as peers; P50Ratio is the second's p50 over the first's, and
	// TurnRatios each turn's p50 ratio, MinRatio and MaxRatio their range.
	Names      []string  `json:"names,omitempty"`
	P50Ratio   float64   `json:"p50_ratio,omitempty"`
	TurnRatios []float64 `json:"turn_ratios,omitempty"`
}

// execTurn is how many execs each side runs in one turn.
const execTurn = 50

// RunExecHop creates one sandbox of env on each side and runs n execs on
// each, in turns of 50, so that a slow spell of the machine hits both.
// names, if given, are the two sides' names (see ExecHopReport).
func RunExecHop(ctx context.Context, local, cluster *dsec.Conn, env string, n int, names []string, progress io.Writer) (*ExecHopReport, error) {
	mk := func(c *dsec.Conn) (string, error) {
		resp, err := c.Sandboxes.Create(ctx, connect.NewRequest(&dsecv1.CreateRequest{Spec: &dsecv1.SandboxSpec{Environment: env}}))
		if err != nil {
			return "", err
		}
		return resp.Msg.GetSandboxes()[0].GetId(), nil
	}
	first, second := "the all-in-one dsecd", "the cluster"
	if len(names) == 2 {
		first, second = names[0], names[1]
	}
	a, err := mk(local)
	if err != nil {
		return nil, fmt.Errorf("create on %s: %w", first, err)
	}
	defer deleteAll(local, []string{a})
	b, err := mk(cluster)
	if err != nil {
		return nil, fmt.Errorf("create on %s: %w", second, err)
	}
	defer deleteAll(cluster, []string{b})
	var da, db []time.Duration
	for i := 0; i < 10; i++ { // warm both paths' connections
		execTrue(ctx, local, a)
		execTrue(ctx, cluster, b)
	}
	var ratios []float64
	for len(da) < n {
		for _, side := range []struct {
			c   *dsec.Conn
			id  string
			out *[]time.Duration
		}{{local, a, &da}, {cluster, b, &db}} {
			for range execTurn {
				start := time.Now()
				if err := execTrue(ctx, side.c, side.id); err != nil {
					return nil, err
				}
				*side.out = append(*side.out, time.Since(start))
			}
		}
		ta, tb := summarize(da[len(da)-execTurn:]), summarize(db[len(db)-execTurn:])
		if ta.P50 > 0 {
			ratios = append(ratios, tb.P50/ta.P50)
		}
		if progress != nil {
			fmt.Fprintf(progress, "%d execs each\n", len(da))
		}
	}
	r := &ExecHopReport{Execs: len(da), AllInOne: summarize(da), Cluster: summarize(db)}
	r.AddedP50 = r.Cluster.P50 - r.AllInOne.P50
	if len(names) == 2 {
		r.Names, r.TurnRatios = names, ratios
		if r.AllInOne.P50 > 0 {
			r.P50Ratio = r.Cluster.P50 / r.AllInOne.P50
		}
	}
	return r, nil
}

// Print writes the comparison.
func (r *ExecHopReport) Print(w io.Writer) {
	if len(r.Names) == 2 {
		r.printCompare(w)
		return
	}
	fmt.Fprintf(w, "exec of true, %d each, in turns of 50        p50        p99\n", r.Execs)
	fmt.Fprintf(w, "all-in-one dsecd                          %6.2f ms  %6.2f ms\n", r.AllInOne.P50, r.AllInOne.P99)
	fmt.Fprintf(w, "apiserver -> edge in another process      %6.2f ms  %6.2f ms\n", r.Cluster.P50, r.Cluster.P99)
	fmt.Fprintf(w, "added by the hop, p50                     %6.2f ms   (target ≤ 0.5 ms)\n", r.AddedP50)
}

// printCompare writes two named peers' figures, their p50 ratio and its
// spread over the turns.
func (r *ExecHopReport) printCompare(w io.Writer) {
	fmt.Fprintf(w, "exec of true, %d each, in turns of %d        p50        p99\n", r.Execs, execTurn)
	fmt.Fprintf(w, "%-40s  %6.2f ms  %6.2f ms\n", r.Names[0], r.AllInOne.P50, r.AllInOne.P99)
	fmt.Fprintf(w, "%-40s  %6.2f ms  %6.2f ms\n", r.Names[1], r.Cluster.P50, r.Cluster.P99)
	lo, hi := 0.0, 0.0
	if len(r.TurnRatios) > 0 {
		lo, hi = slices.Min(r.TurnRatios), slices.Max(r.TurnRatios)
	}
	med := 0.0
	if len(r.TurnRatios) > 0 {
		s := slices.Sorted(slices.Values(r.TurnRatios))
		med = s[len(s)/2]
	}
	fmt.Fprintf(w, "p50 %s / %s: %.3f (turns: median %.3f, %.3f–%.3f over %d turns)\n", r.Names[1], r.Names[0], r.P50Ratio, med, lo, hi, len(r.TurnRatios))
}

// JSON writes the comparison as JSON.
func (r *ExecHopReport) JSON(w io.Writer) error { return writeJSON(w, r) }

package bench

import (
	"context"
	"fmt"
	"io"
	"time"

	"connectrpc.com/connect"

	dsecv1 "dsec.dev/dsec/api/gen/dsec/v1"
	dsec "dsec.dev/dsec/sdk/go"
)

// ExecHopReport compares exec of `true` in a sandbox of the all-in-one
// dsecd (apiserver and edge in one process) with one reached through a
// cluster's apiserver and its edge in another process, measured in turns
// in the same run.
type ExecHopReport struct {
	Execs    int     `json:"execs"`
	AllInOne Latency `json:"all_in_one"`
	Cluster  Latency `json:"cluster"`
	AddedP50 float64 `json:"added_p50_ms"`
}

// RunExecHop creates one sandbox of env on each side and runs n execs on
// each, in turns of 50, so that a slow spell of the machine hits both.
func RunExecHop(ctx context.Context, local, cluster *dsec.Conn, env string, n int, progress io.Writer) (*ExecHopReport, error) {
	mk := func(c *dsec.Conn) (string, error) {
		resp, err := c.Sandboxes.Create(ctx, connect.NewRequest(&dsecv1.CreateRequest{Spec: &dsecv1.SandboxSpec{Environment: env}}))
		if err != nil {
			return "", err
		}
		return resp.Msg.GetSandboxes()[0].GetId(), nil
	}
	a, err := mk(local)
	if err != nil {
		return nil, fmt.Errorf("create on the all-in-one dsecd: %w", err)
	}
	defer deleteAll(local, []string{a})
	b, err := mk(cluster)
	if err != nil {
		return nil, fmt.Errorf("create through the cluster: %w", err)
	}
	defer deleteAll(cluster, []string{b})
	var da, db []time.Duration
	for i := 0; i < 10; i++ { // warm both paths' connections
		execTrue(ctx, local, a)
		execTrue(ctx, cluster, b)
	}
	for len(da) < n {
		for _, side := range []struct {
			c   *dsec.Conn
			id  string
			out *[]time.Duration
		}{{local, a, &da}, {cluster, b, &db}} {
			for range 50 {
				start := time.Now()
				if err := execTrue(ctx, side.c, side.id); err != nil {
					return nil, err
				}
				*side.out = append(*side.out, time.Since(start))
			}
		}
		if progress != nil {
			fmt.Fprintf(progress, "%d execs each\n", len(da))
		}
	}
	r := &ExecHopReport{Execs: len(da), AllInOne: summarize(da), Cluster: summarize(db)}
	r.AddedP50 = r.Cluster.P50 - r.AllInOne.P50
	return r, nil
}

// Print writes the comparison.
func (r *ExecHopReport) Print(w io.Writer) {
	fmt.Fprintf(w, "exec of true, %d each, in turns of 50        p50        p99\n", r.Execs)
	fmt.Fprintf(w, "all-in-one dsecd                          %6.2f ms  %6.2f ms\n", r.AllInOne.P50, r.AllInOne.P99)
	fmt.Fprintf(w, "apiserver -> edge in another process      %6.2f ms  %6.2f ms\n", r.Cluster.P50, r.Cluster.P99)
	fmt.Fprintf(w, "added by the hop, p50                     %6.2f ms   (target ≤ 0.5 ms)\n", r.AddedP50)
}

// JSON writes the comparison as JSON.
func (r *ExecHopReport) JSON(w io.Writer) error { return writeJSON(w, r) }

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

// TrajectoryReport compares exec in a sandbox whose trajectory is recorded
// with one whose is not, on the same node, in turns in the same run.
type TrajectoryReport struct {
	Execs    int     `json:"execs"`
	Command  string  `json:"command"`
	Recorded Latency `json:"recorded"`
	Off      Latency `json:"off"`
	// Ratio is the recorded side's p50 over the other's (target ≤ 1.05).
	Ratio float64 `json:"p50_ratio"`
}

// RunTrajectory creates two sandboxes of env, one with recording off, and
// runs n execs of command in each, in turns of 50.
func RunTrajectory(ctx context.Context, c *dsec.Conn, env, command string, n int, progress io.Writer) (*TrajectoryReport, error) {
	mk := func(spec *dsecv1.SandboxSpec) (string, error) {
		spec.Environment = env
		resp, err := c.Sandboxes.Create(ctx, connect.NewRequest(&dsecv1.CreateRequest{Spec: spec}))
		if err != nil {
			return "", err
		}
		return resp.Msg.GetSandboxes()[0].GetId(), nil
	}
	on, err := mk(&dsecv1.SandboxSpec{Labels: map[string]string{"bench": "trajectory"}})
	if err != nil {
		return nil, fmt.Errorf("create the recorded sandbox: %w", err)
	}
	defer deleteAll(c, []string{on})
	off, err := mk(&dsecv1.SandboxSpec{Labels: map[string]string{"bench": "trajectory"}, NoTrajectory: true})
	if err != nil {
		return nil, fmt.Errorf("create the unrecorded sandbox: %w", err)
	}
	defer deleteAll(c, []string{off})
	run := func(id string) error {
		return execOK(ctx, c, &dsecv1.ExecRequest{SandboxId: id, Command: command})
	}
	for range 10 { // warm both
		if err := run(on); err != nil {
			return nil, err
		}
		if err := run(off); err != nil {
			return nil, err
		}
	}
	var don, doff []time.Duration
	for len(don) < n {
		for _, side := range []struct {
			id  string
			out *[]time.Duration
		}{{on, &don}, {off, &doff}} {
			for range 50 {
				start := time.Now()
				if err := run(side.id); err != nil {
					return nil, err
				}
				*side.out = append(*side.out, time.Since(start))
			}
		}
		if progress != nil {
			fmt.Fprintf(progress, "%d execs each\n", len(don))
		}
	}
	r := &TrajectoryReport{Execs: len(don), Command: command, Recorded: summarize(don), Off: summarize(doff)}
	if r.Off.P50 > 0 {
		r.Ratio = r.Recorded.P50 / r.Off.P50
	}
	return r, nil
}

// Print writes the comparison.
func (r *TrajectoryReport) Print(w io.Writer) {
	fmt.Fprintf(w, "exec of %q, %d each, in turns of 50      p50        p99\n", r.Command, r.Execs)
	fmt.Fprintf(w, "trajectory recorded                       %6.2f ms  %6.2f ms\n", r.Recorded.P50, r.Recorded.P99)
	fmt.Fprintf(w, "recording off                             %6.2f ms  %6.2f ms\n", r.Off.P50, r.Off.P99)
	fmt.Fprintf(w, "recorded / off, p50                       %6.3fx    (target ≤ 1.05x)\n", r.Ratio)
}

// JSON writes the comparison as JSON.
func (r *TrajectoryReport) JSON(w io.Writer) error { return writeJSON(w, r) }

package bench

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"text/tabwriter"
	"time"

	"connectrpc.com/connect"

	dsecv1 "dsec.dev/dsec/api/gen/dsec/v1"
	dsec "dsec.dev/dsec/sdk/go"
)

// ProvenanceOptions size the provenance benchmark.
type ProvenanceOptions struct {
	Env      string
	Execs    int // per side
	Command  string
	Progress io.Writer
}

// ProvenanceReport is what `dsec bench provenance` prints: exec latency in
// a sandbox with provenance paths (its protected dir watched, each exec
// reading a protected file: an event per exec, the worst case) against one
// without, execs alternating between them in one run, and what the
// Provenance call itself takes.
type ProvenanceReport struct {
	Env        string  `json:"env"`
	Command    string  `json:"command"`
	Off        Latency `json:"exec_provenance_off"`
	On         Latency `json:"exec_provenance_on"`
	Ratio      float64 `json:"p50_ratio_on_off"`
	Target     float64 `json:"target_ratio"`
	Query      Latency `json:"provenance_call"`
	FlagsAfter string  `json:"flags_after"`
}

// RunProvenance measures what provenance adds to an exec.
func RunProvenance(ctx context.Context, c *dsec.Conn, o ProvenanceOptions) (*ProvenanceReport, error) {
	rep := &ProvenanceReport{Env: o.Env, Command: o.Command, Target: 1.05}
	var made []string
	defer func() { deleteAll(c, made) }()
	mk := func(p *dsecv1.ProvenancePaths) (string, error) {
		resp, err := c.Sandboxes.Create(ctx, connect.NewRequest(&dsecv1.CreateRequest{Spec: &dsecv1.SandboxSpec{
			Environment: o.Env, Provenance: p, Labels: map[string]string{"bench": "provenance"}}}))
		if err != nil {
			return "", err
		}
		id := resp.Msg.GetSandboxes()[0].GetId()
		made = append(made, id)
		return id, nil
	}
	off, err := mk(nil)
	if err != nil {
		return nil, fmt.Errorf("create a sandbox without provenance paths: %w", err)
	}
	on, err := mk(&dsecv1.ProvenancePaths{Workspace: []string{"/tmp"}, Tests: []string{"/tmp/tests"}, Protected: []string{"/etc"}})
	if err != nil {
		return nil, fmt.Errorf("create a sandbox with provenance paths: %w", err)
	}
	run := func(id string) (time.Duration, error) {
		t0 := time.Now()
		if err := execOK(ctx, c, &dsecv1.ExecRequest{SandboxId: id, Command: o.Command}); err != nil {
			return 0, err
		}
		return time.Since(t0), nil
	}
	// Warm both up, then alternate so both sides see the same machine.
	for _, id := range []string{off, on} {
		if _, err := run(id); err != nil {
			return nil, err
		}
	}
	var dOff, dOn, dQuery []time.Duration
	for i := range o.Execs {
		order := []string{off, on}
		if i%2 == 1 {
			order = []string{on, off}
		}
		for _, id := range order {
			d, err := run(id)
			if err != nil {
				return nil, err
			}
			if id == on {
				dOn = append(dOn, d)
			} else {
				dOff = append(dOff, d)
			}
		}
		if o.Progress != nil && (i+1)%100 == 0 {
			fmt.Fprintf(o.Progress, "%d execs per side\n", i+1)
		}
	}
	for range 20 {
		t0 := time.Now()
		p, err := c.Sandboxes.Provenance(ctx, connect.NewRequest(&dsecv1.ProvenanceRequest{SandboxId: on}))
		if err != nil {
			return nil, fmt.Errorf("provenance of %s: %w", on, err)
		}
		dQuery = append(dQuery, time.Since(t0))
		rep.FlagsAfter = fmt.Sprint(dsec.ProvenanceFlagNames(p.Msg.GetFlags()))
	}
	rep.Off, rep.On, rep.Query = summarize(dOff), summarize(dOn), summarize(dQuery)
	if rep.Off.P50 > 0 {
		rep.Ratio = rep.On.P50 / rep.Off.P50
	}
	return rep, nil
}

// Print writes the report as a table.
func (r *ProvenanceReport) Print(w io.Writer) {
	tw := tabwriter.NewWriter(w, 2, 4, 2, ' ', 0)
	fmt.Fprintf(tw, "exec %q in %s, alternating\tn\tp50 ms\tp99 ms\n", r.Command, r.Env)
	fmt.Fprintf(tw, "provenance off\t%d\t%.2f\t%.2f\n", r.Off.N, r.Off.P50, r.Off.P99)
	fmt.Fprintf(tw, "provenance on (protected /etc watched)\t%d\t%.2f\t%.2f\n", r.On.N, r.On.P50, r.On.P99)
	verdict := "met"
	if r.Ratio > r.Target {
		verdict = "MISSED"
	}
	fmt.Fprintf(tw, "exec p50 on/off\t%.3fx\t(target <= %.2fx: %s)\t\n", r.Ratio, r.Target, verdict)
	fmt.Fprintf(tw, "Provenance call\t%d\t%.2f\t%.2f\n", r.Query.N, r.Query.P50, r.Query.P99)
	fmt.Fprintf(tw, "flags after the run\t%s\t\t\n", r.FlagsAfter)
	tw.Flush()
}

// JSON writes the report as JSON.
func (r *ProvenanceReport) JSON(w io.Writer) error {
	enc := json.NewEncoder(w)
	enc.SetIndent("", "  ")
	return enc.Encode(r)
}

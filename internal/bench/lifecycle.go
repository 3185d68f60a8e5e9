package bench

import (
	"context"
	"fmt"
	"io"
	"strconv"
	"strings"
	"text/tabwriter"
	"time"

	"connectrpc.com/connect"

	dsecv1 "dsec.dev/dsec/api/gen/dsec/v1"
	"dsec.dev/dsec/internal/apiclient"
)

// LifecycleOptions shape `dsec bench lifecycle`.
type LifecycleOptions struct {
	Env       string
	Rounds    int // pauses of each kind
	MemoryMiB int // what the paused sandbox holds (dsec-agent hold-memory)
	Progress  io.Writer
}

// LifecycleReport is what `dsec bench lifecycle` prints: pause and resume
// of a sandbox holding MemoryMiB of anonymous memory, each figure beside
// its baseline in the same run.
type LifecycleReport struct {
	Env           string `json:"env"`
	MemoryMiB     int    `json:"memory_mib"`
	PauseReleases string `json:"pause_releases"` // the node's words on what a pause can release

	Frozen      Latency `json:"pause_to_frozen"`        // the node's freeze, server side
	PauseCall   Latency `json:"pause_call"`             // the whole Pause call with reclaim, client side
	ReleasedMiB float64 `json:"released_mib_p50"`       // per pause
	ResidentMiB float64 `json:"resident_mib_p50"`       // per pause, before it
	ReleaseRate float64 `json:"release_mib_per_s_p50"`  // released over reclaim time
	Released90  int     `json:"pauses_releasing_90pct"` // pauses that released ≥ 90 % of resident

	// Resume → first exec done, after a freeze-only pause and after a full
	// one (memory paged out, prefetched on resume).
	ResumeExecKept  Latency `json:"resume_to_first_exec_memory_kept"`
	ResumeExecPaged Latency `json:"resume_to_first_exec_paged_out"`
	// First touch of all of the memory after resume, with the prefetch and
	// without it (skip_prefetch), in alternate rounds.
	TouchPrefetched Latency `json:"first_touch_prefetched"`
	TouchFaulted    Latency `json:"first_touch_without_prefetch"`
	PrefetchGain    float64 `json:"prefetch_speedup_p50"`

	Notes []string `json:"notes,omitempty"`
}

func (o *LifecycleOptions) logf(format string, args ...any) {
	if o.Progress != nil {
		fmt.Fprintf(o.Progress, format+"\n", args...)
	}
}

// RunLifecycle measures pause and resume through c.
func RunLifecycle(ctx context.Context, c *apiclient.Clients, o LifecycleOptions) (*LifecycleReport, error) {
	r := &LifecycleReport{Env: o.Env, MemoryMiB: o.MemoryMiB}
	resp, err := c.Sandboxes.Create(ctx, connect.NewRequest(&dsecv1.CreateRequest{Spec: &dsecv1.SandboxSpec{
		Environment: o.Env, MemoryMb: int64(o.MemoryMiB) + 256, IdleTimeoutSeconds: -1}}))
	if err != nil {
		return nil, fmt.Errorf("create the sandbox to pause: %w", err)
	}
	id := resp.Msg.GetSandboxes()[0].GetId()
	defer deleteAll(c, []string{id})
	if got, err := c.Sandboxes.Get(ctx, connect.NewRequest(&dsecv1.GetRequest{Id: id})); err == nil {
		r.PauseReleases = got.Msg.GetPauseReleases()
	}
	if !strings.Contains(r.PauseReleases, "swap free") {
		r.Notes = append(r.Notes, "the node has no swap: a pause keeps anonymous memory in RAM (run dsecd with --swap file:SIZE)")
	}
	if err := startHold(ctx, c, id, o.MemoryMiB); err != nil {
		return nil, err
	}
	o.logf("sandbox %s holds %d MiB", id, o.MemoryMiB)

	var frozen, calls, resumeKept, resumePaged, touchPre, touchRaw []time.Duration
	var released, resident, rates []float64
	for i := range o.Rounds {
		// A full pause: freeze, then push the memory out.
		t0 := time.Now()
		p, err := c.Sandboxes.Pause(ctx, connect.NewRequest(&dsecv1.PauseRequest{SandboxId: id}))
		if err != nil {
			return nil, fmt.Errorf("pause %d: %w", i, err)
		}
		calls = append(calls, time.Since(t0))
		st := p.Msg.GetSandbox().GetLastPause()
		frozen = append(frozen, time.Duration(st.GetFrozenUs())*time.Microsecond)
		released = append(released, float64(st.GetReleasedBytes())/(1<<20))
		resident = append(resident, float64(st.GetResidentBytes())/(1<<20))
		if st.GetReclaimMs() > 0 {
			rates = append(rates, float64(st.GetReleasedBytes())/(1<<20)/(float64(st.GetReclaimMs())/1000))
		}
		if st.GetReleasedBytes()*10 >= st.GetResidentBytes()*9 {
			r.Released90++
		}
		// Alternate rounds thaw with and without the prefetch.
		skip := i%2 == 1
		t1 := time.Now()
		if _, err := c.Sandboxes.Resume(ctx, connect.NewRequest(&dsecv1.ResumeRequest{SandboxId: id, SkipPrefetch: skip})); err != nil {
			return nil, fmt.Errorf("resume %d: %w", i, err)
		}
		if err := execTrue(ctx, c, id); err != nil {
			return nil, err
		}
		if !skip {
			resumePaged = append(resumePaged, time.Since(t1))
		}
		touch, err := touchHeld(ctx, c, id)
		if err != nil {
			return nil, err
		}
		if skip {
			touchRaw = append(touchRaw, touch)
		} else {
			touchPre = append(touchPre, touch)
		}
		// A freeze-only pause: the memory stays; resume is a thaw.
		if _, err := c.Sandboxes.Pause(ctx, connect.NewRequest(&dsecv1.PauseRequest{SandboxId: id, KeepMemory: true})); err != nil {
			return nil, fmt.Errorf("freeze-only pause %d: %w", i, err)
		}
		t2 := time.Now()
		if _, err := c.Sandboxes.Resume(ctx, connect.NewRequest(&dsecv1.ResumeRequest{SandboxId: id})); err != nil {
			return nil, fmt.Errorf("resume %d: %w", i, err)
		}
		if err := execTrue(ctx, c, id); err != nil {
			return nil, err
		}
		resumeKept = append(resumeKept, time.Since(t2))
		o.logf("round %d: frozen in %s, released %.0f of %.0f MiB, first touch %s (prefetch %v)",
			i+1, frozen[len(frozen)-1].Round(time.Microsecond), released[len(released)-1], resident[len(resident)-1], touch.Round(time.Millisecond), !skip)
	}
	r.Frozen, r.PauseCall = summarize(frozen), summarize(calls)
	r.ReleasedMiB, r.ResidentMiB, r.ReleaseRate = median(released), median(resident), median(rates)
	r.ResumeExecKept, r.ResumeExecPaged = summarize(resumeKept), summarize(resumePaged)
	r.TouchPrefetched, r.TouchFaulted = summarize(touchPre), summarize(touchRaw)
	r.PrefetchGain = ratio(r.TouchFaulted.P50, r.TouchPrefetched.P50)
	return r, nil
}

// startHold starts dsec-agent hold-memory in the sandbox and waits until
// its memory is filled.
func startHold(ctx context.Context, c *apiclient.Clients, id string, mib int) error {
	stream, err := c.Sandboxes.Exec(ctx, connect.NewRequest(&dsecv1.ExecRequest{SandboxId: id, Background: true,
		Command: "exec /.dsec/bin/dsec-agent hold-memory " + strconv.Itoa(mib)}))
	if err != nil {
		return fmt.Errorf("start hold-memory: %w", err)
	}
	stream.Close()
	deadline := time.Now().Add(2 * time.Minute)
	for time.Now().Before(deadline) {
		if out, err := readFile(ctx, c, id, "/tmp/memhog.sum"); err == nil && out != "" {
			return nil
		}
		time.Sleep(50 * time.Millisecond)
	}
	return fmt.Errorf("hold-memory in %s did not fill %d MiB within 2 minutes", id, mib)
}

// touchHeld makes hold-memory read all its memory and returns how long
// that took, as it measured it.
func touchHeld(ctx context.Context, c *apiclient.Clients, id string) (time.Duration, error) {
	st, err := c.Sandboxes.Exec(ctx, connect.NewRequest(&dsecv1.ExecRequest{SandboxId: id,
		Command: "rm -f /tmp/memhog.check; kill -USR1 $(cat /tmp/memhog.pid)"}))
	if err != nil {
		return 0, err
	}
	for st.Receive() {
	}
	st.Close()
	deadline := time.Now().Add(time.Minute)
	for time.Now().Before(deadline) {
		out, err := readFile(ctx, c, id, "/tmp/memhog.check")
		if err == nil && out != "" {
			f := strings.Fields(out)
			if len(f) < 2 {
				return 0, fmt.Errorf("hold-memory wrote %q", out)
			}
			ns, err := strconv.ParseInt(f[1], 10, 64)
			if err != nil {
				return 0, fmt.Errorf("hold-memory wrote %q", out)
			}
			return time.Duration(ns), nil
		}
		time.Sleep(5 * time.Millisecond)
	}
	return 0, fmt.Errorf("hold-memory in %s did not answer", id)
}

func readFile(ctx context.Context, c *apiclient.Clients, id, path string) (string, error) {
	resp, err := c.Sandboxes.ReadFile(ctx, connect.NewRequest(&dsecv1.ReadFileRequest{SandboxId: id, Path: path}))
	if err != nil {
		return "", err
	}
	return strings.TrimSpace(string(resp.Msg.GetData())), nil
}

// Print writes the figures and each target's verdict.
func (r *LifecycleReport) Print(w io.Writer) {
	fmt.Fprintf(w, "pause and resume of a sandbox holding %d MiB (%s)\n", r.MemoryMiB, r.Env)
	fmt.Fprintf(w, "the node: a pause releases %s\n\n", r.PauseReleases)
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', 0)
	fmt.Fprintln(tw, "figure\tp50 ms\tp99 ms\tn")
	row := func(name string, l Latency) { fmt.Fprintf(tw, "%s\t%.1f\t%.1f\t%d\n", name, l.P50, l.P99, l.N) }
	row("pause: call to frozen (node)", r.Frozen)
	row("pause call with reclaim (client)", r.PauseCall)
	row("resume -> first exec, memory kept", r.ResumeExecKept)
	row("resume -> first exec, memory paged out", r.ResumeExecPaged)
	row("first touch of all memory, prefetched", r.TouchPrefetched)
	row("first touch of all memory, no prefetch", r.TouchFaulted)
	tw.Flush()
	fmt.Fprintln(w)
	verdict := func(ok bool) string {
		if ok {
			return "PASS"
		}
		return "MISS"
	}
	fmt.Fprintf(w, "pause to frozen p50 %.1f ms   target <= 100 ms   %s\n", r.Frozen.P50, verdict(r.Frozen.N > 0 && r.Frozen.P50 <= 100))
	fmt.Fprintf(w, "memory released: %.0f of %.0f MiB per pause (p50), %d of %d pauses released >= 90 %%, at %.0f MiB/s   target >= 250 MiB/s   %s\n",
		r.ReleasedMiB, r.ResidentMiB, r.Released90, r.Frozen.N, r.ReleaseRate, verdict(r.ReleaseRate >= 250))
	fmt.Fprintf(w, "resume -> first exec, memory kept: p50 %.1f ms   target <= 50 ms   %s\n", r.ResumeExecKept.P50, verdict(r.ResumeExecKept.N > 0 && r.ResumeExecKept.P50 <= 50))
	fmt.Fprintf(w, "resume -> first exec, %d MiB paged out: p99 %.1f ms   target <= 1000 ms   %s\n", r.MemoryMiB, r.ResumeExecPaged.P99, verdict(r.ResumeExecPaged.N > 0 && r.ResumeExecPaged.P99 <= 1000))
	fmt.Fprintf(w, "first touch without prefetch / with it: %.1fx (p50 %.1f vs %.1f ms)   target >= 5x   %s\n",
		r.PrefetchGain, r.TouchFaulted.P50, r.TouchPrefetched.P50, verdict(r.PrefetchGain >= 5))
	for _, n := range r.Notes {
		fmt.Fprintln(w, "note:", n)
	}
}

// JSON writes the report as JSON.
func (r *LifecycleReport) JSON(w io.Writer) error { return writeJSON(w, r) }

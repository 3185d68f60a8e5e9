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
	dsec "dsec.dev/dsec/sdk/go"
)

// LifecycleOptions shape `dsec bench lifecycle`.
type LifecycleOptions struct {
	Env       string
	Rounds    int // pauses of each kind; snapshots, restores and forks
	MemoryMiB int // what the paused sandbox holds (dsec-agent hold-memory)
	// SnapFiles and SnapMiB make the upper snapshots capture (0: skip
	// snapshots).
	SnapFiles, SnapMiB int
	Progress           io.Writer
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

	// Snapshots of a sandbox whose writable layer holds SnapFiles files of
	// SnapMiB MiB in all.
	SnapFiles, SnapMiB int
	SnapFrozen         Latency `json:"snapshot_frozen"`    // the source stood still (node)
	SnapPublished      Latency `json:"snapshot_published"` // from the thaw to the layer published
	SnapMethod         string  `json:"snapshot_capture_method"`
	// Create → first exec from the snapshot's environment, beside the same
	// from the source's environment, in turns.
	RestoreExec Latency `json:"restore_create_to_first_exec"`
	PlainExec   Latency `json:"plain_create_to_first_exec"`
	RestoreCost float64 `json:"restore_added_p50_ms"`
	ForkWall    Latency `json:"fork_16_wall"`

	Notes []string `json:"notes,omitempty"`
}

func (o *LifecycleOptions) logf(format string, args ...any) {
	if o.Progress != nil {
		fmt.Fprintf(o.Progress, format+"\n", args...)
	}
}

// RunLifecycle measures pause and resume through c.
func RunLifecycle(ctx context.Context, c *dsec.Conn, o LifecycleOptions) (*LifecycleReport, error) {
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
	if o.SnapFiles > 0 {
		if err := runSnapshots(ctx, c, o, r); err != nil {
			return nil, err
		}
	}
	return r, nil
}

// runSnapshots fills a sandbox's writable layer, snapshots it Rounds times
// (each timing the source's freeze and the publish), restores from the
// last beside plain creates in turns, and forks 16 children Rounds/2+1
// times. Before each snapshot and fork the sandbox writes a file of its
// own, as an agent's step would: every round builds and publishes a new
// layer, and none finds its files published already.
func runSnapshots(ctx context.Context, c *dsec.Conn, o LifecycleOptions, r *LifecycleReport) error {
	r.SnapFiles, r.SnapMiB = o.SnapFiles, o.SnapMiB
	resp, err := c.Sandboxes.Create(ctx, connect.NewRequest(&dsecv1.CreateRequest{Spec: &dsecv1.SandboxSpec{
		Environment: o.Env, DiskMb: int64(o.SnapMiB)*2 + 512, IdleTimeoutSeconds: -1}}))
	if err != nil {
		return fmt.Errorf("create the sandbox to snapshot: %w", err)
	}
	id := resp.Msg.GetSandboxes()[0].GetId()
	defer deleteAll(c, []string{id})
	per := max(o.SnapMiB<<20/o.SnapFiles, 1)
	fill := fmt.Sprintf(`set -e; mkdir -p /work; cd /work; head -c %d /dev/urandom > seed
i=0; while [ $i -lt %d ]; do d=d$((i / 1000)); [ -d $d ] || mkdir $d; cp seed $d/f$i; i=$((i+1)); done; rm seed`, per, o.SnapFiles)
	if err := execOK(ctx, c, &dsecv1.ExecRequest{SandboxId: id, Command: fill}); err != nil {
		return fmt.Errorf("fill the writable layer: %w", err)
	}
	o.logf("sandbox %s holds %d files, %d MiB, in its writable layer", id, o.SnapFiles, o.SnapMiB)
	var frozen, published []time.Duration
	var env string
	var names []string
	defer func() {
		for _, n := range names {
			c.Sandboxes.DeleteSnapshot(context.WithoutCancel(ctx), connect.NewRequest(&dsecv1.DeleteSnapshotRequest{Name: n}))
		}
	}()
	step := func(round string) error {
		if err := execOK(ctx, c, &dsecv1.ExecRequest{SandboxId: id, Command: "echo " + round + " > /work/step"}); err != nil {
			return fmt.Errorf("the step before %s: %w", round, err)
		}
		return nil
	}
	for i := range o.Rounds {
		name := fmt.Sprintf("bench-%s-%d", id, i)
		if err := step(name); err != nil {
			return err
		}
		start := time.Now()
		s, err := c.Sandboxes.Snapshot(ctx, connect.NewRequest(&dsecv1.SnapshotRequest{SandboxId: id, Name: name}))
		if err != nil {
			return fmt.Errorf("snapshot %d: %w", i, err)
		}
		names = append(names, name)
		fz := time.Duration(s.Msg.GetFrozenUs()) * time.Microsecond
		frozen = append(frozen, fz)
		published = append(published, time.Since(start)-fz)
		env, r.SnapMethod = s.Msg.GetEnvironment(), s.Msg.GetCaptureMethod()
		o.logf("snapshot %d: frozen %s (%s), published %s later", i+1, fz.Round(time.Microsecond), r.SnapMethod, published[i].Round(time.Millisecond))
	}
	r.SnapFrozen, r.SnapPublished = summarize(frozen), summarize(published)

	var restore, plain []time.Duration
	var made []string
	defer func() { deleteAll(c, made) }()
	for range o.Rounds {
		for _, side := range []struct {
			env string
			out *[]time.Duration
		}{{env, &restore}, {o.Env, &plain}} {
			sid, took, err := createExec(ctx, c, &dsecv1.SandboxSpec{Environment: side.env})
			made = append(made, sid)
			if err != nil {
				return fmt.Errorf("create from %s: %w", side.env, err)
			}
			*side.out = append(*side.out, took)
		}
	}
	r.RestoreExec, r.PlainExec = summarize(restore), summarize(plain)
	r.RestoreCost = r.RestoreExec.P50 - r.PlainExec.P50

	var forks []time.Duration
	for i := range o.Rounds/2 + 1 {
		name := fmt.Sprintf("bench-fork-%s-%d", id, i)
		if err := step(name); err != nil {
			return err
		}
		start := time.Now()
		f, err := c.Sandboxes.Fork(ctx, connect.NewRequest(&dsecv1.ForkRequest{SandboxId: id, Count: 16, Name: name}))
		if err != nil {
			return fmt.Errorf("fork %d: %w", i, err)
		}
		forks = append(forks, time.Since(start))
		names = append(names, f.Msg.GetSnapshot().GetName())
		for _, ch := range f.Msg.GetChildren() {
			if ch.GetError() != "" {
				return fmt.Errorf("fork %d: a child: %s", i, ch.GetError())
			}
			made = append(made, ch.GetSandbox().GetId())
		}
		deleteAll(c, made)
		made = nil
	}
	r.ForkWall = summarize(forks)
	return nil
}

// startHold starts dsec-agent hold-memory in the sandbox and waits until
// its memory is filled.
func startHold(ctx context.Context, c *dsec.Conn, id string, mib int) error {
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
func touchHeld(ctx context.Context, c *dsec.Conn, id string) (time.Duration, error) {
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

func readFile(ctx context.Context, c *dsec.Conn, id, path string) (string, error) {
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
	latencyTable(w, []namedLatency{
		{"pause: call to frozen (node)", r.Frozen},
		{"pause call with reclaim (client)", r.PauseCall},
		{"resume -> first exec, memory kept", r.ResumeExecKept},
		{"resume -> first exec, memory paged out", r.ResumeExecPaged},
		{"first touch of all memory, prefetched", r.TouchPrefetched},
		{"first touch of all memory, no prefetch", r.TouchFaulted},
	})
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
	if r.SnapFiles > 0 {
		fmt.Fprintf(w, "\nsnapshots of a writable layer of %d files, %d MiB (%s)\n", r.SnapFiles, r.SnapMiB, r.SnapMethod)
		latencyTable(w, []namedLatency{
			{"snapshot: source stood still", r.SnapFrozen},
			{"snapshot: thaw -> layer published", r.SnapPublished},
			{"create -> first exec from the snapshot", r.RestoreExec},
			{"create -> first exec from its base (baseline)", r.PlainExec},
			{"fork x16, whole call", r.ForkWall},
		})
		fmt.Fprintf(w, "snapshot stopped time p99 %.1f ms   target <= 100 ms   %s\n", r.SnapFrozen.P99, verdict(r.SnapFrozen.N > 0 && r.SnapFrozen.P99 <= 100))
		fmt.Fprintf(w, "layer published p99 %.1f ms after the thaw   target <= 2000 ms   %s\n", r.SnapPublished.P99, verdict(r.SnapPublished.N > 0 && r.SnapPublished.P99 <= 2000))
		fmt.Fprintf(w, "restore = create + %.1f ms (p50 %.1f vs %.1f ms)   target <= 10 ms   %s\n", r.RestoreCost, r.RestoreExec.P50, r.PlainExec.P50, verdict(r.RestoreExec.N > 0 && r.RestoreCost <= 10))
		fmt.Fprintf(w, "fork x16 p50 %.1f ms   target <= 2000 ms   %s\n", r.ForkWall.P50, verdict(r.ForkWall.N > 0 && r.ForkWall.P50 <= 2000))
	}
	for _, n := range r.Notes {
		fmt.Fprintln(w, "note:", n)
	}
}

type namedLatency struct {
	name string
	l    Latency
}

// latencyTable writes one row per figure: p50, p99 and n.
func latencyTable(w io.Writer, rows []namedLatency) {
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', 0)
	fmt.Fprintln(tw, "figure\tp50 ms\tp99 ms\tn")
	for _, r := range rows {
		fmt.Fprintf(tw, "%s\t%.1f\t%.1f\t%d\n", r.name, r.l.P50, r.l.P99, r.l.N)
	}
	tw.Flush()
}

// JSON writes the report as JSON.
func (r *LifecycleReport) JSON(w io.Writer) error { return writeJSON(w, r) }

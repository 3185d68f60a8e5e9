// Package bench measures a dsecd against a bare OCI runtime on the same
// machine in the same run: create-to-first-exec latency (one at a time and
// in a burst), creation throughput, exec latency in a warm sandbox, and
// host memory per idle sandbox. Every dsec figure is printed beside the
// baseline's and their ratio; nothing here asserts a number. The idle
// sandboxes' CPU and the create rate with them live are printed against
// their targets, the rate as a ratio to the empty node's in the same run.
package bench

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"math"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"text/tabwriter"
	"time"

	"connectrpc.com/connect"

	dsecv1 "dsec.dev/dsec/api/gen/dsec/v1"
	dsec "dsec.dev/dsec/sdk/go"
)

// The limits of every benchmarked sandbox, and of the runc bundles measured
// beside them.
const (
	benchCPUs     = 1
	benchMemoryMB = 64
)

// Options size the benchmark.
type Options struct {
	Env   string // environment to run; imported from busybox when it is the default and missing
	Seq   int    // sequential create → exec rounds
	Burst int    // concurrent creates in the burst
	Execs int    // execs in one warm sandbox
	Idle  int    // idle sandboxes for the memory and CPU figures
	// IdleWindow is how long the idle sandboxes' CPU is measured (0: not
	// at all); RateProbe how many creates are timed on the empty node (the
	// idle set's first) and again with the whole set live (0: none).
	IdleWindow time.Duration
	RateProbe  int
	Warm       int    // warm pool size for the pooled create figure; 0 skips it
	Baseline   bool   // also measure bare runc
	Runtime    string // runc binary for the baseline
	Progress   io.Writer
	// Settle bounds each wait for the host's used memory to settle before
	// it is read for the idle memory figures (settledMemMiB; 0: 30 s). A
	// test that checks no memory figure need not wait on a busy machine,
	// whose memory never settles.
	Settle time.Duration
}

// Latency is a distribution summary in milliseconds.
type Latency struct {
	N   int     `json:"n"`
	P50 float64 `json:"p50_ms"`
	P99 float64 `json:"p99_ms"`
	Max float64 `json:"max_ms"`
}

// Side is one system's figures.
type Side struct {
	CreateToExec     Latency `json:"create_to_first_exec"`
	WarmCreateToExec Latency `json:"create_to_first_exec_warm_pool,omitzero"`
	WarmPoolHits     int     `json:"warm_pool_hits,omitempty"`
	BurstCreateExec  Latency `json:"burst_create_to_first_exec"`
	BurstWallS       float64 `json:"burst_wall_s"`
	BurstPerSecond   float64 `json:"burst_per_second"`
	BurstErrors      int     `json:"burst_errors"`
	WarmExec         Latency `json:"warm_exec"`
	IdleCount        int     `json:"idle_count"`
	IdleAnswering    int     `json:"idle_answering"`
	IdleMemPerMiB    float64 `json:"idle_host_memory_per_sandbox_mib"`
	DaemonRSSMiB     float64 `json:"daemon_rss_mib,omitempty"`
	IdleMemoryMethod string  `json:"idle_memory_method"`
	// IdleCPU and CreateRate are dsec's alone (nil when not measured).
	IdleCPU    *IdleCPU    `json:"idle_cpu,omitempty"`
	CreateRate *CreateRate `json:"create_rate,omitempty"`
}

// Report is what `dsec bench` prints.
type Report struct {
	Env      string   `json:"env"`
	Burst    int      `json:"burst"`
	Dsec     Side     `json:"dsec"`
	Baseline *Side    `json:"runc,omitempty"`
	Notes    []string `json:"notes,omitempty"`
}

func summarize(ds []time.Duration) Latency {
	if len(ds) == 0 {
		return Latency{}
	}
	s := slices.Clone(ds)
	slices.Sort(s)
	pick := func(q float64) float64 {
		i := int(q*float64(len(s))+0.5) - 1
		i = max(0, min(i, len(s)-1))
		return float64(s[i].Microseconds()) / 1000
	}
	return Latency{N: len(s), P50: pick(0.5), P99: pick(0.99), Max: float64(s[len(s)-1].Microseconds()) / 1000}
}

func (o *Options) logf(format string, args ...any) {
	if o.Progress != nil {
		fmt.Fprintf(o.Progress, format+"\n", args...)
	}
}

// Run measures dsec through c and, when asked, the bare runtime beside it.
func Run(ctx context.Context, c *dsec.Conn, o Options) (*Report, error) {
	rep := &Report{Env: o.Env, Burst: o.Burst}
	var b *baseline
	if o.Baseline {
		if os.Geteuid() != 0 {
			rep.Notes = append(rep.Notes, "baseline skipped: measuring bare runc needs root")
		} else if nb, err := newBaseline(o); err != nil {
			rep.Notes = append(rep.Notes, "baseline failed: "+err.Error())
		} else {
			b = nb
			defer b.close()
		}
	}
	d, runcExec, err := runDsec(ctx, c, o, b)
	if err != nil {
		return nil, err
	}
	rep.Dsec = *d
	if b != nil {
		side, err := runBaseline(ctx, o, b)
		if err != nil {
			rep.Notes = append(rep.Notes, "baseline failed: "+err.Error())
		} else {
			side.WarmExec = runcExec
			rep.Baseline = side
		}
	}
	return rep, nil
}

func createExec(ctx context.Context, c *dsec.Conn, spec *dsecv1.SandboxSpec) (string, time.Duration, error) {
	t0 := time.Now()
	resp, err := c.Sandboxes.Create(ctx, connect.NewRequest(&dsecv1.CreateRequest{Spec: spec}))
	if err != nil {
		return "", 0, err
	}
	id := resp.Msg.GetSandboxes()[0].GetId()
	if err := execTrue(ctx, c, id); err != nil {
		return id, 0, err
	}
	return id, time.Since(t0), nil
}

func execTrue(ctx context.Context, c *dsec.Conn, id string) error {
	return execOK(ctx, c, &dsecv1.ExecRequest{SandboxId: id, Argv: []string{"true"}})
}

// execOK runs req to its end and fails unless the command exited 0,
// saying how it ended and what it wrote to stderr.
func execOK(ctx context.Context, c *dsec.Conn, req *dsecv1.ExecRequest) error {
	stream, err := c.Sandboxes.Exec(ctx, connect.NewRequest(req))
	if err != nil {
		return err
	}
	defer stream.Close()
	var x *dsecv1.ExecExited
	var errOut []byte
	for stream.Receive() {
		if e := stream.Msg().GetExited(); e != nil {
			x = e
		}
		errOut = append(errOut, stream.Msg().GetStderr()...)
	}
	if err := stream.Err(); err != nil {
		return err
	}
	if x.GetStatus() != dsecv1.ExitStatus_EXIT_STATUS_OK || x.GetExitCode() != 0 {
		what := req.GetCommand()
		if what == "" {
			what = strings.Join(req.GetArgv(), " ")
		}
		return fmt.Errorf("exec %q in %s: %s, exit %d %s: %s", what, req.GetSandboxId(), x.GetStatus(), x.GetExitCode(), x.GetMessage(), errOut)
	}
	return nil
}

func deleteAll(c *dsec.Conn, ids []string) {
	var wg sync.WaitGroup
	sem := make(chan struct{}, 8)
	for _, id := range ids {
		if id == "" {
			continue
		}
		wg.Add(1)
		sem <- struct{}{}
		go func() {
			defer wg.Done()
			defer func() { <-sem }()
			c.Sandboxes.Delete(context.Background(), connect.NewRequest(&dsecv1.DeleteRequest{Id: id}))
		}()
	}
	wg.Wait()
}

// runDsec measures dsec; with b, the warm exec alternates with b's, whose
// figure it returns too.
func runDsec(ctx context.Context, c *dsec.Conn, o Options, b *baseline) (*Side, Latency, error) {
	spec := &dsecv1.SandboxSpec{Environment: o.Env, Labels: map[string]string{"dsec-bench": "1"}, MemoryMb: benchMemoryMB, Cpus: benchCPUs}
	side := &Side{}
	// Sequential.
	o.logf("dsec: %d sequential create → exec", o.Seq)
	var lat []time.Duration
	for range o.Seq {
		id, d, err := createExec(ctx, c, spec)
		deleteAll(c, []string{id})
		if err != nil {
			return nil, Latency{}, fmt.Errorf("sequential create: %w", err)
		}
		lat = append(lat, d)
	}
	side.CreateToExec = summarize(lat)

	if o.Warm > 0 {
		if err := runWarm(ctx, c, o, spec, side); err != nil {
			return nil, Latency{}, err
		}
	}

	// Burst.
	o.logf("dsec: burst of %d concurrent creates", o.Burst)
	ids := make([]string, o.Burst)
	lats := make([]time.Duration, o.Burst)
	errs := make([]error, o.Burst)
	var wg sync.WaitGroup
	t0 := time.Now()
	for i := range o.Burst {
		wg.Add(1)
		go func() {
			defer wg.Done()
			ids[i], lats[i], errs[i] = createExec(ctx, c, spec)
		}()
	}
	wg.Wait()
	wall := time.Since(t0)
	lat = lat[:0]
	for i, err := range errs {
		if err != nil {
			side.BurstErrors++
			if side.BurstErrors == 1 {
				o.logf("dsec: burst error: %v", err)
			}
			continue
		}
		lat = append(lat, lats[i])
	}
	deleteAll(c, ids)
	side.BurstCreateExec = summarize(lat)
	side.BurstWallS = wall.Seconds()
	side.BurstPerSecond = float64(len(lat)) / wall.Seconds()

	// Warm exec, alternating with the baseline's so that both see the
	// machine in the same state.
	warm, runcExec, err := warmExecs(ctx, c, o, spec, b)
	if err != nil {
		return nil, Latency{}, err
	}
	side.WarmExec = warm

	if err := runIdle(ctx, c, o, spec, side); err != nil {
		return nil, Latency{}, err
	}
	return side, runcExec, nil
}

// runIdle makes o.Idle idle sandboxes of spec and measures what they cost:
// host memory, dsecd's RSS, CPU over o.IdleWindow, the create rate with
// them live against the empty node's (o.RateProbe creates each), and
// whether each still answers an exec. It deletes them all.
func runIdle(ctx context.Context, c *dsec.Conn, o Options, spec *dsecv1.SandboxSpec, side *Side) error {
	o.logf("dsec: %d idle sandboxes", o.Idle)
	before := o.settledMemMiB()
	progress := func(made int, rate float64) {
		if made%500 == 0 || made == o.Idle {
			o.logf("dsec: %d idle sandboxes, the last %d at %.1f/s", made, min(idleBatch, made), rate)
		}
	}
	probe := min(o.RateProbe, o.Idle)
	rate := &CreateRate{N: probe, Target: createRateTarget, BatchCalls: min(idleBatch, probe), EmptyLoad: loadAvg()}
	idle, empty, emptyCPU, err := timedCreates(ctx, c, spec, probe, progress)
	if err == nil {
		var rest []string
		rest, _, err = createIdleSet(ctx, c, spec, o.Idle-probe, func(made int, r float64) { progress(probe+made, r) })
		idle = append(idle, rest...)
	}
	defer deleteAll(c, idle)
	if err != nil {
		return err
	}
	side.IdleCount = len(idle)
	side.IdleMemPerMiB, side.IdleMemoryMethod = perSandboxMiB(o.settledMemMiB()-before, len(idle))
	side.DaemonRSSMiB = rssOf("dsecd")
	if o.IdleWindow > 0 && len(idle) > 0 {
		o.logf("dsec: CPU of %d idle sandboxes over %s", len(idle), o.IdleWindow)
		cpu, err := measureIdleCPU(ctx, idle, o.IdleWindow)
		if err != nil {
			return err
		}
		side.IdleCPU = &cpu
	}
	if probe > 0 {
		o.logf("dsec: %d creates with %d idle sandboxes live", probe, len(idle))
		rate.FullLoad = loadAvg()
		more, full, fullCPU, err := timedCreates(ctx, c, spec, probe, nil)
		deleteAll(c, more)
		if err != nil {
			return err
		}
		rate.Live, rate.EmptyPerS, rate.FullPerS = len(idle), empty, full
		rate.EmptyCPUMs, rate.FullCPUMs = emptyCPU, fullCPU
		if empty > 0 {
			rate.Ratio = full / empty
		}
		side.CreateRate = rate
	}
	for _, id := range idle {
		if execTrue(ctx, c, id) == nil {
			side.IdleAnswering++
		}
	}
	return nil
}

// runWarm measures create → first exec from a warm pool of o.Warm
// sandboxes of spec's shape: the pool is filled first, and each round waits
// until the refill has put a sandbox back, as a trainer whose creates come
// slower than the pool refills would see. The pool is removed at the end.
func runWarm(ctx context.Context, c *dsec.Conn, o Options, spec *dsecv1.SandboxSpec, side *Side) error {
	o.logf("dsec: %d sequential create → exec from a warm pool of %d", o.Seq, o.Warm)
	setPool := func(size int) error {
		_, err := c.Sandboxes.SetWarmPool(ctx, connect.NewRequest(&dsecv1.SetWarmPoolRequest{Spec: spec, Size: int32(size)}))
		return err
	}
	if err := setPool(o.Warm); err != nil {
		return fmt.Errorf("set warm pool: %w", err)
	}
	defer setPool(0)
	waitReady := func(n int32) error { return waitWarmPool(ctx, c, spec.GetEnvironment(), n) }
	if err := waitReady(int32(o.Warm)); err != nil {
		return err
	}
	var lat []time.Duration
	for range o.Seq {
		if err := waitReady(1); err != nil {
			return err
		}
		t0 := time.Now()
		resp, err := c.Sandboxes.Create(ctx, connect.NewRequest(&dsecv1.CreateRequest{Spec: spec}))
		if err != nil {
			return fmt.Errorf("create from warm pool: %w", err)
		}
		sb := resp.Msg.GetSandboxes()[0]
		err = execTrue(ctx, c, sb.GetId())
		d := time.Since(t0)
		deleteAll(c, []string{sb.GetId()})
		if err != nil {
			return err
		}
		if sb.GetFromWarmPool() {
			side.WarmPoolHits++
		}
		lat = append(lat, d)
	}
	side.WarmCreateToExec = summarize(lat)
	return nil
}

// Print writes the report as a table.
func (r *Report) Print(w io.Writer) {
	tw := tabwriter.NewWriter(w, 2, 4, 2, ' ', tabwriter.AlignRight)
	fmt.Fprintf(tw, "metric\tdsec\trunc\tdsec/runc\t\n")
	b := r.Baseline
	if b == nil {
		b = &Side{}
	}
	// Small figures get two decimals, and a ratio well under one reads as
	// a fraction: "1/15.2" is exec's "15.2 times faster".
	num := func(v float64) string {
		if v < 10 {
			return fmt.Sprintf("%.2f", v)
		}
		return fmt.Sprintf("%.1f", v)
	}
	row := func(name string, d, base float64, unit string) {
		ratio := "-"
		switch {
		case base <= 0 || d <= 0:
		case d/base < 0.5:
			ratio = fmt.Sprintf("1/%.1f", base/d)
		default:
			ratio = fmt.Sprintf("%.2f×", d/base)
		}
		bs := "-"
		if base > 0 {
			bs = num(base) + " " + unit
		}
		fmt.Fprintf(tw, "%s\t%s %s\t%s\t%s\t\n", name, num(d), unit, bs, ratio)
	}
	row("create→first exec p50", r.Dsec.CreateToExec.P50, b.CreateToExec.P50, "ms")
	row("create→first exec p99", r.Dsec.CreateToExec.P99, b.CreateToExec.P99, "ms")
	if r.Dsec.WarmCreateToExec.N > 0 {
		row("warm pool create→first exec p50", r.Dsec.WarmCreateToExec.P50, b.CreateToExec.P50, "ms")
		row("warm pool create→first exec p99", r.Dsec.WarmCreateToExec.P99, b.CreateToExec.P99, "ms")
	}
	row(fmt.Sprintf("burst(%d) create→exec p50", r.Burst), r.Dsec.BurstCreateExec.P50, b.BurstCreateExec.P50, "ms")
	row(fmt.Sprintf("burst(%d) create→exec p99", r.Burst), r.Dsec.BurstCreateExec.P99, b.BurstCreateExec.P99, "ms")
	row("burst throughput", r.Dsec.BurstPerSecond, b.BurstPerSecond, "/s")
	row("warm exec p50", r.Dsec.WarmExec.P50, b.WarmExec.P50, "ms")
	row("warm exec p99", r.Dsec.WarmExec.P99, b.WarmExec.P99, "ms")
	if r.Dsec.IdleCount > 0 {
		row("host memory per idle sandbox", r.Dsec.IdleMemPerMiB, b.IdleMemPerMiB, "MiB")
	}
	tw.Flush()
	fmt.Fprintf(w, "burst errors: %d; idle sandboxes answering exec: %d/%d; dsecd RSS at that load: %.0f MiB\n",
		r.Dsec.BurstErrors, r.Dsec.IdleAnswering, r.Dsec.IdleCount, r.Dsec.DaemonRSSMiB)
	printIdle(w, r.Dsec.IdleCPU, r.Dsec.CreateRate)
	if n := r.Dsec.WarmCreateToExec.N; n > 0 {
		fmt.Fprintf(w, "warm pool rows: %d of %d creates were served by the pool (each round waits for the refill); the other rows start a container per create.\n",
			r.Dsec.WarmPoolHits, n)
	}
	fmt.Fprintln(w, "runc column: bare `runc run` / `runc exec` of a busybox bundle made like the sandboxes (same seccomp")
	fmt.Fprintln(w, "profile, capabilities and limits), measured in this run; the warm execs of both columns go in turns.")
	for _, n := range r.Notes {
		fmt.Fprintln(w, "note:", n)
	}
}

// JSON writes the report as one JSON object.
func (r *Report) JSON(w io.Writer) error { return writeJSON(w, r) }

// writeJSON writes v as one indented JSON object.
func writeJSON(w io.Writer, v any) error {
	enc := json.NewEncoder(w)
	enc.SetIndent("", "  ")
	return enc.Encode(v)
}

// idleMemoryMethod says how the idle memory figures are measured.
const idleMemoryMethod = "(MemTotal-MemAvailable) once settled, after minus before, divided by the count"

// perSandboxMiB divides grown, the host memory n sandboxes added, among
// them. When the host's use did not grow (other work freed more than they
// took, which the runc column's 200 small containers are prone to), there
// is no figure: 0, and a method that says why.
func perSandboxMiB(grown float64, n int) (float64, string) {
	if n <= 0 {
		return 0, idleMemoryMethod
	}
	if grown <= 0 {
		return 0, idleMemoryMethod + "; not measured: the host's used memory did not grow (other activity freed memory meanwhile)"
	}
	return grown / float64(n), idleMemoryMethod
}

// settledMemMiB is the host's used memory once it stops moving: two
// readings a second apart within 2 MiB, or the last of those o.Settle
// (default 30 s) allows. Freeing what an earlier phase deleted, and
// starting what this one made, go on for seconds after the calls return:
// a fixed wait measured the runc column's idle containers at less than
// nothing right after dsec's 1,000 sandboxes were deleted.
func (o *Options) settledMemMiB() float64 {
	wait := o.Settle
	if wait <= 0 {
		wait = 30 * time.Second
	}
	prev := usedMemMiB()
	for range max(1, int(wait/time.Second)) {
		time.Sleep(time.Second)
		cur := usedMemMiB()
		if math.Abs(cur-prev) < 2 {
			return cur
		}
		prev = cur
	}
	return prev
}

func usedMemMiB() float64 {
	data, err := os.ReadFile("/proc/meminfo")
	if err != nil {
		return 0
	}
	var total, avail float64
	for _, line := range strings.Split(string(data), "\n") {
		var v float64
		if n, _ := fmt.Sscanf(line, "MemTotal: %f kB", &v); n == 1 {
			total = v
		}
		if n, _ := fmt.Sscanf(line, "MemAvailable: %f kB", &v); n == 1 {
			avail = v
		}
	}
	return (total - avail) / 1024
}

// rssOf sums the resident memory of processes named comm, in MiB.
func rssOf(comm string) float64 {
	entries, _ := os.ReadDir("/proc")
	var kb float64
	for _, e := range entries {
		c, err := os.ReadFile(filepath.Join("/proc", e.Name(), "comm"))
		if err != nil || strings.TrimSpace(string(c)) != comm {
			continue
		}
		st, _ := os.ReadFile(filepath.Join("/proc", e.Name(), "status"))
		for _, line := range strings.Split(string(st), "\n") {
			var v float64
			if n, _ := fmt.Sscanf(line, "VmRSS: %f kB", &v); n == 1 {
				kb += v
			}
		}
	}
	return kb / 1024
}

// runCmd runs a command to completion. Its output goes to a file, not a
// pipe: a detached container inherits the runtime's stdio, and a pipe would
// stay open for the container's whole life.
func runCmd(ctx context.Context, name string, args ...string) error {
	f, err := os.CreateTemp("", "dsec-bench-out-")
	if err != nil {
		return err
	}
	defer os.Remove(f.Name())
	defer f.Close()
	cmd := exec.CommandContext(ctx, name, args...)
	cmd.Stdout, cmd.Stderr = f, f
	err = cmd.Run()
	out, _ := os.ReadFile(f.Name())
	if err != nil {
		return fmt.Errorf("%s %s: %v: %s", name, strings.Join(args, " "), err, strings.TrimSpace(string(out)))
	}
	return nil
}

// warmExecs times o.Execs execs of `true` in one running sandbox and, with
// b, as many `runc exec` of `true` in a running container of b. The two go
// in turns of execBlock, so that a slow spell of the machine hits both
// columns alike; within a turn execs follow each other, as in a rollout.
// (Alternating one by one would not do: each runc exec leaves the machine
// busy for the exec after it.)
func warmExecs(ctx context.Context, c *dsec.Conn, o Options, spec *dsecv1.SandboxSpec, b *baseline) (dsec, runc Latency, err error) {
	o.logf("dsec: %d execs in a warm sandbox", o.Execs)
	id, _, err := createExec(ctx, c, spec)
	if err != nil {
		return Latency{}, Latency{}, fmt.Errorf("warm sandbox: %w", err)
	}
	defer deleteAll(c, []string{id})
	container := ""
	if b != nil {
		o.logf("runc: %d runc exec in a running container, in turns of %d with dsec's", o.Execs, execBlock)
		if container, err = b.startSleeper(ctx); err != nil {
			return Latency{}, Latency{}, fmt.Errorf("warm runc container: %w", err)
		}
	}
	var dl, rl []time.Duration
	for len(dl) < o.Execs {
		n := min(execBlock, o.Execs-len(dl))
		for range n {
			t := time.Now()
			if err := execTrue(ctx, c, id); err != nil {
				return Latency{}, Latency{}, err
			}
			dl = append(dl, time.Since(t))
		}
		if container == "" {
			continue
		}
		for range n {
			d, err := b.exec(ctx, container)
			if err != nil {
				return Latency{}, Latency{}, fmt.Errorf("runc exec: %w", err)
			}
			rl = append(rl, d)
		}
	}
	return summarize(dl), summarize(rl), nil
}

// execBlock is how many warm execs one column runs before the other's turn.
const execBlock = 50

// waitWarmPool waits, up to 2 minutes, until the warm pool of environment
// env holds n ready sandboxes.
func waitWarmPool(ctx context.Context, c *dsec.Conn, env string, n int32) error {
	deadline := time.Now().Add(2 * time.Minute)
	for {
		resp, err := c.Sandboxes.ListWarmPools(ctx, connect.NewRequest(&dsecv1.ListWarmPoolsRequest{}))
		if err != nil {
			return err
		}
		for _, p := range resp.Msg.GetPools() {
			if p.GetSpec().GetEnvironment() == env && p.GetReady() >= n {
				return nil
			}
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("warm pool did not reach %d ready sandboxes in 2 minutes: %v", n, resp.Msg.GetPools())
		}
		time.Sleep(2 * time.Millisecond)
	}
}

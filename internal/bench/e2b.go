package bench

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"text/tabwriter"
	"time"

	"connectrpc.com/connect"
	"google.golang.org/protobuf/proto"

	dsecv1 "dsec.dev/dsec/api/gen/dsec/v1"
	"dsec.dev/dsec/internal/e2b"
	dsec "dsec.dev/dsec/sdk/go"
)

// The targets of the E2B surface (issue 16), as ratios to dsec's own client
// measured in the same run.
const (
	e2bCreateTarget = 1.2 // Sandbox.create() → first commands.run against create → first exec
	e2bRunTarget    = 2.0 // commands.run('true') p50 against exec p50
)

// E2BOptions size `dsec bench e2b`.
type E2BOptions struct {
	// Node is the node binary; Script the E2B side's script
	// (test/e2b/bench.mjs, with the SDK installed beside it by npm ci).
	Node, Script string
	// APIURL, SandboxURL and APIKey configure the SDK as a user does
	// (E2B_API_URL, E2B_SANDBOX_URL, E2B_API_KEY); SandboxURL "" = APIURL.
	APIURL, SandboxURL, APIKey string
	// Template is the E2B template both sides start: dsec's side uses the
	// spec the adapter made of it (environment, limits), read back from a
	// sandbox the SDK created.
	Template string
	// DsecAddr is the address dsec's client dials (its kind picks the
	// instant server's: a Unix socket or loopback TCP).
	DsecAddr string
	Rounds   int // create → first run rounds of each side, cold and warm each
	Warm     int // warm pool size of the warm rounds; 0 skips them
	Runs     int // commands.run / exec calls of each side for the p50
	Progress io.Writer
}

// E2BReport is what `dsec bench e2b` prints.
type E2BReport struct {
	Template      string   `json:"template"`
	Environment   string   `json:"environment"`
	Cold          E2BPair  `json:"create_to_first_run_cold"`
	Warm          E2BPair  `json:"create_to_first_run_warm_pool,omitzero"`
	WarmHitsE2B   int      `json:"warm_pool_hits_e2b,omitempty"`
	WarmHitsOwn   int      `json:"warm_pool_hits_dsec,omitempty"`
	E2BCreate     Latency  `json:"e2b_create_call"`                    // Sandbox.create alone, cold
	E2BCreateWarm Latency  `json:"e2b_create_call_warm_pool,omitzero"` // and from the warm pool
	Run           E2BPair  `json:"run_true"`
	Notes         []string `json:"notes,omitempty"`
}

// E2BPair is one figure through the E2B SDK and through dsec's own client.
type E2BPair struct {
	E2B  Latency `json:"e2b"`
	Dsec Latency `json:"dsec"`
	// DsecBash is dsec's client running what the SDK's commands.run('true')
	// runs (/bin/bash -l -c true) instead of true: the adapter's cost
	// without the login shell's.
	DsecBash Latency `json:"dsec_bash_login,omitzero"`
	// E2BFloor and DsecFloor are the same calls of each client against a
	// server that answers at once (e2bfloor.go): what the clients cost
	// by themselves.
	E2BFloor  Latency `json:"e2b_instant_server,omitzero"`
	DsecFloor Latency `json:"dsec_instant_server,omitzero"`
}

// ZeroCost is what the E2B figure would be with an adapter that cost
// nothing: the SDK's own cost (E2BFloor) plus dsec's work for the command
// the SDK runs (DsecBash less what dsec's client costs by itself); 0 when
// a figure is missing.
func (p E2BPair) ZeroCost() float64 {
	if p.E2BFloor.P50 <= 0 || p.DsecBash.P50 <= 0 || p.DsecFloor.P50 <= 0 {
		return 0
	}
	return p.E2BFloor.P50 + max(0, p.DsecBash.P50-p.DsecFloor.P50)
}

// Ratio is E2B's p50 over dsec's; 0 when either is missing.
func (p E2BPair) Ratio() float64 {
	if p.E2B.P50 <= 0 || p.Dsec.P50 <= 0 {
		return 0
	}
	return p.E2B.P50 / p.Dsec.P50
}

func (o *E2BOptions) logf(format string, args ...any) {
	if o.Progress != nil {
		fmt.Fprintf(o.Progress, format+"\n", args...)
	}
}

// nodeSide is the running E2B side (bench.mjs).
type nodeSide struct {
	cmd    *exec.Cmd
	in     io.WriteCloser
	out    *bufio.Scanner
	stderr *bytes.Buffer
}

// nodeReply is one answer of bench.mjs.
type nodeReply struct {
	Error    string          `json:"error"`
	MS       json.RawMessage `json:"ms"`
	CreateMS float64         `json:"create_ms"`
	ID       string          `json:"id"`
}

func startNode(ctx context.Context, o E2BOptions) (*nodeSide, error) {
	if _, err := os.Stat(o.Script); err != nil {
		return nil, fmt.Errorf("the E2B side's script: %w (run from the repository, or give --script)", err)
	}
	cmd := exec.CommandContext(ctx, o.Node, o.Script)
	sandboxURL := o.SandboxURL
	if sandboxURL == "" {
		sandboxURL = o.APIURL
	}
	cmd.Env = append(os.Environ(), "E2B_API_URL="+o.APIURL, "E2B_SANDBOX_URL="+sandboxURL,
		"E2B_API_KEY="+o.APIKey, "E2B_TEMPLATE="+o.Template)
	in, err := cmd.StdinPipe()
	if err != nil {
		return nil, err
	}
	out, err := cmd.StdoutPipe()
	if err != nil {
		return nil, err
	}
	n := &nodeSide{cmd: cmd, in: in, out: bufio.NewScanner(out), stderr: &bytes.Buffer{}}
	n.out.Buffer(make([]byte, 1<<20), 1<<20)
	cmd.Stderr = n.stderr
	if err := cmd.Start(); err != nil {
		return nil, fmt.Errorf("start %s %s: %w", o.Node, o.Script, err)
	}
	return n, nil
}

// call sends one request and waits for its answer.
func (n *nodeSide) call(req map[string]any) (*nodeReply, error) {
	b, _ := json.Marshal(req)
	if _, err := n.in.Write(append(b, '\n')); err != nil {
		return nil, fmt.Errorf("send %s to node: %w (stderr: %s)", b, err, n.stderr.String())
	}
	if !n.out.Scan() {
		return nil, fmt.Errorf("node answered nothing to %s (stderr: %s)", b, n.stderr.String())
	}
	var r nodeReply
	if err := json.Unmarshal(n.out.Bytes(), &r); err != nil {
		return nil, fmt.Errorf("node's answer %q: %w", n.out.Bytes(), err)
	}
	if r.Error != "" {
		return nil, fmt.Errorf("E2B SDK: %s", r.Error)
	}
	return &r, nil
}

// close asks node to clean up and exit, and kills it if it does not.
func (n *nodeSide) close() {
	done := make(chan struct{})
	go func() {
		n.call(map[string]any{"op": "quit"})
		n.in.Close()
		n.cmd.Wait()
		close(done)
	}()
	select {
	case <-done:
	case <-time.After(30 * time.Second):
		n.cmd.Process.Kill()
		<-done
	}
}

// sdkCreate times Sandbox.create → first commands.run through the SDK,
// against url ("" = the daemon the SDK is configured for), and returns
// node's answer with the total.
func sdkCreate(n *nodeSide, url string) (*nodeReply, time.Duration, error) {
	req := map[string]any{"op": "create"}
	if url != "" {
		req["url"] = url
	}
	r, err := n.call(req)
	if err != nil {
		return nil, 0, err
	}
	var ms float64
	if err := json.Unmarshal(r.MS, &ms); err != nil {
		return nil, 0, fmt.Errorf("node's create answer: %w", err)
	}
	return r, msDuration(ms), nil
}

// e2bCreate times Sandbox.create → first commands.run through the SDK and
// returns the dsec ID of the sandbox (still running) and whether it came
// from a warm pool.
func e2bCreate(ctx context.Context, c *dsec.Conn, n *nodeSide) (id string, total, create time.Duration, pooled bool, err error) {
	r, total, err := sdkCreate(n, "")
	if err != nil {
		return "", 0, 0, false, err
	}
	id, err = e2b.DsecID(r.ID)
	if err != nil {
		return "", 0, 0, false, err
	}
	sb, err := c.Sandboxes.Get(ctx, connect.NewRequest(&dsecv1.GetRequest{Id: id}))
	if err != nil {
		return id, 0, 0, false, fmt.Errorf("get %s, made through E2B: %w", id, err)
	}
	return id, total, msDuration(r.CreateMS), sb.Msg.GetFromWarmPool(), nil
}

func msDuration(ms float64) time.Duration { return time.Duration(ms * float64(time.Millisecond)) }

// RunE2B measures the E2B surface against dsec's own client, side by side on
// one daemon, in alternate turns.
func RunE2B(ctx context.Context, c *dsec.Conn, o E2BOptions) (*E2BReport, error) {
	if o.APIURL == "" || o.APIKey == "" {
		return nil, errors.New("the E2B side needs E2B_API_URL and E2B_API_KEY (or --e2b-url and --api-key)")
	}
	fl, err := startFloors(dsec.Addr(o.DsecAddr))
	if err != nil {
		return nil, err
	}
	defer fl.close()
	n, err := startNode(ctx, o)
	if err != nil {
		return nil, err
	}
	defer n.close()
	rep := &E2BReport{Template: o.Template}

	// The spec the adapter makes of the template is dsec's side's spec:
	// same environment, same limits.
	o.logf("e2b: a first Sandbox.create(%q), for the spec it makes", o.Template)
	id, _, _, _, err := e2bCreate(ctx, c, n)
	if err != nil {
		return nil, err
	}
	got, err := c.Sandboxes.Get(ctx, connect.NewRequest(&dsecv1.GetRequest{Id: id}))
	deleteAll(c, []string{id})
	if err != nil {
		return nil, err
	}
	spec := proto.Clone(got.Msg.GetSpec()).(*dsecv1.SandboxSpec)
	spec.Labels = map[string]string{"dsec-bench": "e2b"}
	rep.Environment = spec.GetEnvironment()
	// One of dsec's too, so neither side pays a first use.
	if id, _, err := createExec(ctx, c, spec); err != nil {
		deleteAll(c, []string{id})
		return nil, fmt.Errorf("dsec create → exec of the same spec: %w", err)
	} else {
		deleteAll(c, []string{id})
	}

	o.logf("e2b: %d cold create → first run on each side, in turns", o.Rounds)
	if err := e2bRounds(ctx, c, n, fl, spec, o.Rounds, nil, &rep.Cold, &rep.E2BCreate, nil, nil); err != nil {
		return nil, err
	}

	if o.Warm > 0 {
		o.logf("e2b: %d create → first run from a warm pool of %d on each side, in turns", o.Rounds, o.Warm)
		if err := e2bWarm(ctx, c, n, fl, spec, o, rep); err != nil {
			return nil, err
		}
	}

	o.logf("e2b: %d commands.run('true') and %d dsec execs of true, in batches", o.Runs, o.Runs)
	if err := e2bRuns(ctx, c, n, fl, spec, o.Runs, rep); err != nil {
		return nil, err
	}
	if rep.Warm.E2B.N > 0 && rep.WarmHitsE2B < rep.Warm.E2B.N {
		rep.Notes = append(rep.Notes, fmt.Sprintf("only %d of %d E2B creates were served by the warm pool: the adapter's spec differs from the pool's shape, or the refill was late",
			rep.WarmHitsE2B, rep.Warm.E2B.N))
	}
	return rep, nil
}

// e2bRounds runs rounds of create → first run on each side, alternating
// which goes first; before, when set, runs ahead of each create (the warm
// pool's wait for a ready member).
func e2bRounds(ctx context.Context, c *dsec.Conn, n *nodeSide, fl *floors, spec *dsecv1.SandboxSpec, rounds int,
	before func() error, pair *E2BPair, createOnly *Latency, hitsE2B, hitsOwn *int) error {
	var lat, own, bash, creates, e2bFloor, dsecFloor []time.Duration
	e2bTurn := func() error {
		if before != nil {
			if err := before(); err != nil {
				return err
			}
		}
		id, d, cd, pooled, err := e2bCreate(ctx, c, n)
		deleteAll(c, []string{id})
		if err != nil {
			return err
		}
		lat, creates = append(lat, d), append(creates, cd)
		if pooled && hitsE2B != nil {
			*hitsE2B++
		}
		return nil
	}
	dsecTurn := func(argv []string, into *[]time.Duration, countHits bool) func() error {
		return func() error {
			if before != nil {
				if err := before(); err != nil {
					return err
				}
			}
			t0 := time.Now()
			resp, err := c.Sandboxes.Create(ctx, connect.NewRequest(&dsecv1.CreateRequest{Spec: spec}))
			if err != nil {
				return fmt.Errorf("dsec create: %w", err)
			}
			sb := resp.Msg.GetSandboxes()[0]
			err = execArgvOK(ctx, c, sb.GetId(), argv)
			d := time.Since(t0)
			deleteAll(c, []string{sb.GetId()})
			if err != nil {
				return err
			}
			*into = append(*into, d)
			if countHits && sb.GetFromWarmPool() && hitsOwn != nil {
				*hitsOwn++
			}
			return nil
		}
	}
	// Each client against its instant server, for the floors.
	e2bFloorTurn := func() error {
		_, d, err := sdkCreate(n, fl.e2bURL)
		if err != nil {
			return fmt.Errorf("against an instant server: %w", err)
		}
		e2bFloor = append(e2bFloor, d)
		return nil
	}
	dsecFloorTurn := func() error {
		t0 := time.Now()
		resp, err := fl.dsec.Sandboxes.Create(ctx, connect.NewRequest(&dsecv1.CreateRequest{Spec: spec}))
		if err != nil {
			return fmt.Errorf("create against an instant server: %w", err)
		}
		if err := execArgvOK(ctx, fl.dsec, resp.Msg.GetSandboxes()[0].GetId(), []string{"true"}); err != nil {
			return fmt.Errorf("exec against an instant server: %w", err)
		}
		dsecFloor = append(dsecFloor, time.Since(t0))
		return nil
	}
	turns := []func() error{e2bTurn, dsecTurn([]string{"true"}, &own, true), dsecTurn([]string{"/bin/bash", "-l", "-c", "true"}, &bash, false),
		e2bFloorTurn, dsecFloorTurn}
	for i := range rounds {
		// Each side goes first as often as the others.
		for j := range turns {
			if err := turns[(i+j)%len(turns)](); err != nil {
				return err
			}
		}
	}
	pair.E2B, pair.Dsec, pair.DsecBash = summarize(lat), summarize(own), summarize(bash)
	pair.E2BFloor, pair.DsecFloor = summarize(e2bFloor), summarize(dsecFloor)
	if createOnly != nil {
		*createOnly = summarize(creates)
	}
	return nil
}

// e2bWarm runs the rounds again with a warm pool of the spec's shape,
// each create waiting for a ready member first.
func e2bWarm(ctx context.Context, c *dsec.Conn, n *nodeSide, fl *floors, spec *dsecv1.SandboxSpec, o E2BOptions, rep *E2BReport) error {
	setPool := func(ctx context.Context, size int) error {
		_, err := c.Sandboxes.SetWarmPool(ctx, connect.NewRequest(&dsecv1.SetWarmPoolRequest{Spec: spec, Size: int32(size)}))
		return err
	}
	if err := setPool(ctx, o.Warm); err != nil {
		return fmt.Errorf("set warm pool: %w", err)
	}
	defer setPool(context.WithoutCancel(ctx), 0)
	waitReady := func(want int32) error { return waitWarmPool(ctx, c, spec.GetEnvironment(), want) }
	if err := waitReady(int32(o.Warm)); err != nil {
		return err
	}
	return e2bRounds(ctx, c, n, fl, spec, o.Rounds, func() error { return waitReady(1) }, &rep.Warm, &rep.E2BCreateWarm, &rep.WarmHitsE2B, &rep.WarmHitsOwn)
}

// e2bRuns times commands.run('true') in one E2B sandbox against dsec's
// exec of true (and of bash -l -c true) in one of its own, in alternating
// batches so both see the machine alike.
func e2bRuns(ctx context.Context, c *dsec.Conn, n *nodeSide, fl *floors, spec *dsecv1.SandboxSpec, runs int, rep *E2BReport) error {
	resp, err := c.Sandboxes.Create(ctx, connect.NewRequest(&dsecv1.CreateRequest{Spec: spec}))
	if err != nil {
		return fmt.Errorf("dsec create: %w", err)
	}
	id := resp.Msg.GetSandboxes()[0].GetId()
	defer deleteAll(c, []string{id})
	const batch = 20
	var e2bLat, own, bash, e2bFloor, dsecFloor []time.Duration
	execArgv := func(c *dsec.Conn, id string, argv ...string) (time.Duration, error) {
		t0 := time.Now()
		err := execArgvOK(ctx, c, id, argv)
		return time.Since(t0), err
	}
	floorResp, err := fl.dsec.Sandboxes.Create(ctx, connect.NewRequest(&dsecv1.CreateRequest{Spec: spec}))
	if err != nil {
		return fmt.Errorf("create against an instant server: %w", err)
	}
	floorID := floorResp.Msg.GetSandboxes()[0].GetId()
	nodeRuns := func(k int, url string, into *[]time.Duration) error {
		req := map[string]any{"op": "runs", "n": k}
		if url != "" {
			req["url"] = url
		}
		r, err := n.call(req)
		if err != nil {
			return err
		}
		var ms []float64
		if err := json.Unmarshal(r.MS, &ms); err != nil {
			return fmt.Errorf("node's runs answer: %w", err)
		}
		for _, m := range ms {
			*into = append(*into, msDuration(m))
		}
		return nil
	}
	// Warm all up: connections, the SDK's first-call work, page cache.
	var discard []time.Duration
	for _, url := range []string{"", fl.e2bURL} {
		if err := nodeRuns(5, url, &discard); err != nil {
			return err
		}
	}
	for range 5 {
		if _, err := execArgv(c, id, "true"); err != nil {
			return err
		}
		if _, err := execArgv(fl.dsec, floorID, "true"); err != nil {
			return err
		}
	}
	for done := 0; done < runs; done += batch {
		k := min(batch, runs-done)
		if err := nodeRuns(k, "", &e2bLat); err != nil {
			return err
		}
		if err := nodeRuns(k, fl.e2bURL, &e2bFloor); err != nil {
			return err
		}
		for range k {
			d, err := execArgv(c, id, "true")
			if err != nil {
				return err
			}
			own = append(own, d)
			d, err = execArgv(c, id, "/bin/bash", "-l", "-c", "true")
			if err != nil {
				return err
			}
			bash = append(bash, d)
			d, err = execArgv(fl.dsec, floorID, "true")
			if err != nil {
				return err
			}
			dsecFloor = append(dsecFloor, d)
		}
	}
	rep.Run = E2BPair{E2B: summarize(e2bLat), Dsec: summarize(own), DsecBash: summarize(bash),
		E2BFloor: summarize(e2bFloor), DsecFloor: summarize(dsecFloor)}
	return nil
}

// execArgvOK runs argv in sandbox id as the user the SDK's commands run
// as (E2B's default; root's login shell costs more, its ~/.profile runs
// mesg), and fails unless it exits 0.
func execArgvOK(ctx context.Context, c *dsec.Conn, id string, argv []string) error {
	return execOK(ctx, c, &dsecv1.ExecRequest{SandboxId: id, Argv: argv, User: e2b.DefaultUser})
}

// verdict is PASS or MISS of a ratio against its target.
func verdict(ratio, target float64) string {
	switch {
	case ratio <= 0:
		return "-"
	case ratio <= target:
		return "PASS"
	}
	return "MISS"
}

// Print writes the report as a table.
func (r *E2BReport) Print(w io.Writer) {
	tw := tabwriter.NewWriter(w, 2, 4, 2, ' ', tabwriter.AlignRight)
	fmt.Fprintf(tw, "metric\tE2B SDK\tdsec client\tE2B/dsec\ttarget\t\t\n")
	ms := func(v float64) string {
		if v <= 0 {
			return "-"
		}
		if v < 10 {
			return fmt.Sprintf("%.2f ms", v)
		}
		return fmt.Sprintf("%.1f ms", v)
	}
	row := func(name string, p E2BPair, target float64) {
		ratio, t := "-", "-"
		if x := p.Ratio(); x > 0 {
			ratio = fmt.Sprintf("%.2f×", x)
		}
		if target > 0 {
			t = fmt.Sprintf("≤ %.1f×", target)
		}
		v := "-"
		if target > 0 {
			v = verdict(p.Ratio(), target)
		}
		fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t%s\t%s\t\n", name, ms(p.E2B.P50), ms(p.Dsec.P50), ratio, t, v)
	}
	p99 := func(p E2BPair) E2BPair {
		return E2BPair{E2B: Latency{P50: p.E2B.P99}, Dsec: Latency{P50: p.Dsec.P99}}
	}
	bash := func(p E2BPair) E2BPair { return E2BPair{E2B: p.E2B, Dsec: p.DsecBash} }
	floor := func(p E2BPair) E2BPair { return E2BPair{E2B: p.E2BFloor, Dsec: p.DsecFloor} }
	zero := func(name string, p E2BPair, target float64) {
		// What no adapter could beat, against the target: the verdict
		// says whether the target is within reach at all.
		z := E2BPair{E2B: Latency{P50: p.ZeroCost()}, Dsec: p.Dsec}
		ratio, reach := "-", "-"
		if x := z.Ratio(); x > 0 {
			ratio = fmt.Sprintf("%.2f×", x)
			reach = "reachable"
			if x > target {
				reach = "out of reach"
			}
		}
		fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t%s\t%s\t\n", name, ms(z.E2B.P50), ms(z.Dsec.P50), ratio, fmt.Sprintf("≤ %.1f×", target), reach)
	}
	figure := func(name string, p E2BPair, target float64) {
		row(name+" p50", p, target)
		row(name+" p99", p99(p), 0)
		row("  dsec running bash -l -c true, p50", bash(p), 0)
		if p.E2BFloor.N > 0 {
			row("  each client against an instant server, p50", floor(p), 0)
			zero("  E2B with a zero-cost adapter, p50", p, target)
		}
	}
	figure("create→first run (cold)", r.Cold, e2bCreateTarget)
	if r.Warm.E2B.N > 0 {
		figure("create→first run (warm pool)", r.Warm, e2bCreateTarget)
	}
	figure("commands.run('true') / exec true", r.Run, e2bRunTarget)
	tw.Flush()
	fmt.Fprintf(w, "template %s = environment %s; %d cold and %d warm rounds a side, %d runs a side; Sandbox.create alone p50 %s cold, %s warm.\n",
		r.Template, r.Environment, r.Cold.E2B.N, r.Warm.E2B.N, r.Run.E2B.N, ms(r.E2BCreate.P50), ms(r.E2BCreateWarm.P50))
	if r.Warm.E2B.N > 0 {
		fmt.Fprintf(w, "warm pool hits: E2B %d/%d, dsec %d/%d (each create waits for a ready member).\n",
			r.WarmHitsE2B, r.Warm.E2B.N, r.WarmHitsOwn, r.Warm.Dsec.N)
	}
	fmt.Fprintln(w, "E2B column: the official SDK in node, timed inside node (node's start excluded); dsec column: dsec's")
	fmt.Fprintln(w, "Go client, same daemon, same spec (the one the adapter made of the template), same user (\"user\"), in alternate turns.")
	fmt.Fprintln(w, "commands.run runs /bin/bash -l -c CMD, as E2B's SDK asks; the indented rows give dsec's client that command too.")
	fmt.Fprintln(w, "Instant server: each client against a server of its protocol that answers at once (what the client alone costs).")
	fmt.Fprintln(w, "Zero-cost adapter: the SDK's instant-server figure plus dsec's own work for bash -l -c true (its bash row less")
	fmt.Fprintln(w, "its client's instant-server figure): the best any E2B server could do here, and whether the target is within reach.")
	for _, n := range r.Notes {
		fmt.Fprintln(w, "note:", n)
	}
}

// JSON writes the report as one JSON object.
func (r *E2BReport) JSON(w io.Writer) error { return writeJSON(w, r) }

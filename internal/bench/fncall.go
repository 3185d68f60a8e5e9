package bench

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"text/tabwriter"
	"time"
)

// FnCallOptions shape `dsec bench fncall`.
type FnCallOptions struct {
	// URL is SandboxFusion's API of the daemon under test (…/run_code is
	// appended), the path verl's reward code takes.
	URL string
	// EnvTree is the fncall environment's root file system on this host:
	// the baseline chroots into it.
	EnvTree     string
	Concurrency int           // calls in flight in the throughput figures
	Duration    time.Duration // of each throughput phase
	Rounds      int           // throughput phases of each side, interleaved; sequential calls of the latency and C++ figures
	Mixed       int           // calls of the mixed burst
	// Busy calls of the CPU-bound burst, each a Python loop with
	// BusyTimeout as its run_timeout; 0 = 100 of 10 s, negative = none.
	Busy        int
	BusyTimeout time.Duration
	// BusyOnly runs the CPU-bound burst alone: against a fresh dsecd it
	// meets cold pools, as a node's first burst does.
	BusyOnly bool
	Progress io.Writer
}

// FnCallReport is what `dsec bench fncall` prints.
type FnCallReport struct {
	URL         string `json:"url"`
	Concurrency int    `json:"concurrency"`

	// Python print(1) at Concurrency in flight: through /run_code, and as
	// bare `python3 -c 'print(1)'` processes chrooted into the
	// environment, in alternate phases.
	DsecRate     float64 `json:"run_code_calls_per_s"`
	BareRate     float64 `json:"bare_python_per_s"`
	RateRatio    float64 `json:"rate_ratio"`
	DsecErrors   int     `json:"run_code_errors"`
	BareErrors   int     `json:"bare_errors"`
	DsecLatency  Latency `json:"run_code_latency_under_load"`
	SingleCall   Latency `json:"run_code_one_at_a_time"`
	ZygoteServed bool    `json:"zygote"`

	// C++ a+b, compiled and run: through /run_code, and the host's g++
	// then the binary, in turns.
	CppDsec  Latency `json:"cpp_run_code"`
	CppHost  Latency `json:"cpp_host_gpp_and_run"`
	CppRatio float64 `json:"cpp_ratio"`
	CppNote  string  `json:"cpp_note,omitempty"`

	// A burst of mixed calls of the shape verl sends.
	MixedCalls     int     `json:"mixed_calls"`
	MixedErrors    int     `json:"mixed_errors"`
	MixedLate      int     `json:"mixed_over_timeout"`
	MixedWrong     int     `json:"mixed_wrong_status"`
	MixedWallS     float64 `json:"mixed_wall_s"`
	MixedLatency   Latency `json:"mixed_latency"`
	MixedFirstFail string  `json:"mixed_first_failure,omitempty"`

	// A burst of CPU-bound calls (`while True: pass`) with run_timeout
	// BusyTimeoutS, sent at once as verl sends them: how many came back
	// TimeLimitExceeded, how many otherwise (another status, an HTTP
	// error such as 504, or verl's client timeout), and when the last
	// answer came.
	BusyCalls    int     `json:"busy_calls"`
	BusyTimeoutS float64 `json:"busy_run_timeout_s"`
	BusyTLE      int     `json:"busy_time_limit_exceeded"`
	BusyOther    int     `json:"busy_other_status"`
	BusyErrors   int     `json:"busy_errors"`
	BusyLate     int     `json:"busy_client_timeouts"`
	BusyLastS    float64 `json:"busy_last_answer_s"`
	// The least a TimeLimitExceeded call ran (its execution_time): the
	// rest of its run_timeout went on waiting for a container to start.
	BusyLeastRanS float64 `json:"busy_least_ran_s"`
	BusyLatency   Latency `json:"busy_latency"`
	BusyFirstErr  string  `json:"busy_first_error,omitempty"`
	BusyOnly      bool    `json:"busy_only,omitempty"`

	Notes []string `json:"notes,omitempty"`
}

func (o *FnCallOptions) logf(format string, args ...any) {
	if o.Progress != nil {
		fmt.Fprintf(o.Progress, format+"\n", args...)
	}
}

// sfResult is the part of SandboxFusion's RunCodeResponse the bench reads.
type sfResult struct {
	Status    string `json:"status"`
	Message   string `json:"message"`
	RunResult *struct {
		Status        string  `json:"status"`
		ExecutionTime float64 `json:"execution_time"`
		ReturnCode    *int    `json:"return_code"`
		Stdout        string  `json:"stdout"`
		Stderr        string  `json:"stderr"`
	} `json:"run_result"`
	CompileResult *struct {
		Status string `json:"status"`
		Stderr string `json:"stderr"`
	} `json:"compile_result"`
}

type sfClient struct {
	url string
	hc  *http.Client
}

func (c *sfClient) run(ctx context.Context, req map[string]any) (*sfResult, error) {
	body, _ := json.Marshal(req)
	hr, err := http.NewRequestWithContext(ctx, "POST", c.url, bytes.NewReader(body))
	if err != nil {
		return nil, err
	}
	hr.Header.Set("Content-Type", "application/json")
	resp, err := c.hc.Do(hr)
	if err != nil {
		return nil, err
	}
	defer resp.Body.Close()
	data, err := io.ReadAll(resp.Body)
	if err != nil {
		return nil, err
	}
	if resp.StatusCode != http.StatusOK {
		return nil, fmt.Errorf("HTTP %d: %s", resp.StatusCode, bytes.TrimSpace(data))
	}
	var r sfResult
	if err := json.Unmarshal(data, &r); err != nil {
		return nil, fmt.Errorf("decode the response: %w", err)
	}
	return &r, nil
}

// RunFnCall measures the fncall backend through SandboxFusion's API.
func RunFnCall(ctx context.Context, o FnCallOptions) (*FnCallReport, error) {
	if o.Concurrency <= 0 {
		o.Concurrency = 64
	}
	if o.Duration <= 0 {
		o.Duration = 10 * time.Second
	}
	if o.Rounds <= 0 {
		o.Rounds = 3
	}
	if o.Mixed <= 0 {
		o.Mixed = 256
	}
	if o.Busy == 0 {
		o.Busy = 100
	}
	if o.BusyTimeout <= 0 {
		o.BusyTimeout = 10 * time.Second
	}
	url := strings.TrimSuffix(o.URL, "/") + "/run_code"
	c := &sfClient{url: url, hc: &http.Client{Transport: &http.Transport{MaxIdleConnsPerHost: 1024, MaxConnsPerHost: 0}}}
	r := &FnCallReport{URL: o.URL, Concurrency: o.Concurrency}
	if o.BusyOnly {
		r.BusyOnly = true
		r.busy(ctx, c, o)
		return r, nil
	}
	python3 := filepath.Join(o.EnvTree, "usr/bin/python3")
	if _, err := os.Stat(python3); err != nil {
		return nil, fmt.Errorf("bench fncall: the environment tree %s has no usr/bin/python3 (build it with scripts/build-fncall-env.sh): %w", o.EnvTree, err)
	}
	if os.Geteuid() != 0 {
		return nil, fmt.Errorf("bench fncall: the baseline chroots into the environment: run as root")
	}

	printOne := map[string]any{"language": "python", "code": "print(1)", "run_timeout": 10, "memory_limit_MB": 1024}
	// Warm the pools up to the concurrency first: the figure is the
	// steady state, as in a training loop's hundredth step.
	o.logf("warming up: %d calls at once", o.Concurrency)
	if _, _, _, err := runLoad(ctx, o.Concurrency, 5*time.Second, func(ctx context.Context) error {
		res, err := c.run(ctx, printOne)
		if err == nil && res.Status != "Success" {
			err = fmt.Errorf("status %s: %s", res.Status, res.Message)
		}
		return err
	}); err != nil {
		return nil, err
	}

	var dsecCalls, bareCalls int64
	var dsecTime, bareTime time.Duration
	var lat []time.Duration
	var firstErr error
	for round := range o.Rounds {
		o.logf("round %d/%d: bare python3 -c 'print(1)' in a chroot, %d at once for %s", round+1, o.Rounds, o.Concurrency, o.Duration)
		n, errs, _, _ := runLoad(ctx, o.Concurrency, o.Duration, func(ctx context.Context) error {
			return bareRun(ctx, o.EnvTree, "/usr/bin/python3", "-c", "print(1)")
		})
		bareCalls += n
		bareTime += o.Duration
		r.BareErrors += errs
		o.logf("round %d/%d: /run_code print(1), %d at once for %s", round+1, o.Rounds, o.Concurrency, o.Duration)
		n, errs, ds, err := runLoad(ctx, o.Concurrency, o.Duration, func(ctx context.Context) error {
			res, err := c.run(ctx, printOne)
			if err == nil && (res.Status != "Success" || res.RunResult == nil || res.RunResult.Stdout != "1\n") {
				err = fmt.Errorf("status %s: %s", res.Status, res.Message)
			}
			return err
		})
		if err != nil && firstErr == nil {
			firstErr = err
		}
		dsecCalls += n
		dsecTime += o.Duration
		r.DsecErrors += errs
		lat = append(lat, ds...)
	}
	r.DsecRate = float64(dsecCalls) / dsecTime.Seconds()
	r.BareRate = float64(bareCalls) / bareTime.Seconds()
	r.RateRatio = ratio(r.DsecRate, r.BareRate)
	r.DsecLatency = summarize(lat)
	if firstErr != nil {
		r.Notes = append(r.Notes, "first /run_code error: "+firstErr.Error())
	}

	o.logf("one call at a time: %d calls", 50*o.Rounds)
	var single []time.Duration
	for range 50 * o.Rounds {
		t0 := time.Now()
		res, err := c.run(ctx, printOne)
		if err != nil {
			return nil, err
		}
		if res.Status != "Success" {
			return nil, fmt.Errorf("bench fncall: print(1): %s %s", res.Status, res.Message)
		}
		single = append(single, time.Since(t0))
	}
	r.SingleCall = summarize(single)
	if res, err := c.run(ctx, map[string]any{"language": "python", "code": "import sys; print('zygote' if 'runpy' in sys.modules else 'fresh')"}); err == nil && res.RunResult != nil {
		r.ZygoteServed = strings.TrimSpace(res.RunResult.Stdout) == "zygote"
	}

	if err := r.cpp(ctx, c, o); err != nil {
		return nil, err
	}
	if err := r.mixed(ctx, c, o); err != nil {
		return nil, err
	}
	if o.Busy > 0 {
		r.busy(ctx, c, o)
	}
	return r, nil
}

// runLoad runs fn from n workers for d and counts the calls that ended
// and the errors; the first error is returned too.
func runLoad(ctx context.Context, n int, d time.Duration, fn func(context.Context) error) (calls int64, errs int, lat []time.Duration, first error) {
	deadline := time.Now().Add(d)
	var mu sync.Mutex
	var wg sync.WaitGroup
	var count atomic.Int64
	for range n {
		wg.Add(1)
		go func() {
			defer wg.Done()
			var mine []time.Duration
			for time.Now().Before(deadline) && ctx.Err() == nil {
				t0 := time.Now()
				err := fn(ctx)
				mine = append(mine, time.Since(t0))
				count.Add(1)
				if err != nil {
					mu.Lock()
					errs++
					if first == nil {
						first = err
					}
					mu.Unlock()
				}
			}
			mu.Lock()
			lat = append(lat, mine...)
			mu.Unlock()
		}()
	}
	wg.Wait()
	return count.Load(), errs, lat, first
}

// bareRun runs argv chrooted into root as an unprivileged uid, in a fresh
// directory of root's /tmp, with no sandbox around it.
func bareRun(ctx context.Context, root string, argv ...string) error {
	cmd := exec.CommandContext(ctx, argv[0], argv[1:]...)
	cmd.Dir = "/tmp"
	cmd.Env = []string{"PATH=/usr/local/bin:/usr/bin:/bin", "HOME=/tmp", "LANG=C.UTF-8"}
	cmd.SysProcAttr = &syscall.SysProcAttr{Chroot: root, Credential: &syscall.Credential{Uid: 65534, Gid: 65534}}
	out, err := cmd.Output()
	if err != nil {
		return err
	}
	if string(out) != "1\n" {
		return fmt.Errorf("printed %q", out)
	}
	return nil
}

const cppAPlusB = `#include <iostream>
int main() { long long a, b; std::cin >> a >> b; std::cout << a + b << std::endl; return 0; }
`

// cpp times a+b in C++ through /run_code beside the host's own g++ and
// run of the same source.
func (r *FnCallReport) cpp(ctx context.Context, c *sfClient, o FnCallOptions) error {
	gpp, err := exec.LookPath("g++")
	if err != nil {
		r.CppNote = "the host has no g++: no baseline"
	}
	dir, err := os.MkdirTemp("", "dsec-bench-cpp-")
	if err != nil {
		return err
	}
	defer os.RemoveAll(dir)
	src := filepath.Join(dir, "a.cpp")
	if err := os.WriteFile(src, []byte(cppAPlusB), 0o644); err != nil {
		return err
	}
	req := map[string]any{"language": "cpp", "code": cppAPlusB, "stdin": "2 3\n", "compile_timeout": 30, "run_timeout": 10}
	var dsecT, hostT []time.Duration
	n := max(12, o.Rounds*4)
	o.logf("C++ a+b: %d compiles and runs each way, in turns", n)
	for range n {
		t0 := time.Now()
		res, err := c.run(ctx, req)
		if err != nil {
			return fmt.Errorf("bench fncall: cpp: %w", err)
		}
		if res.Status != "Success" || res.RunResult == nil || strings.TrimSpace(res.RunResult.Stdout) != "5" {
			return fmt.Errorf("bench fncall: cpp a+b: status %s %s", res.Status, res.Message)
		}
		dsecT = append(dsecT, time.Since(t0))
		if gpp == "" {
			continue
		}
		t0 = time.Now()
		bin := filepath.Join(dir, "test")
		if out, err := exec.CommandContext(ctx, gpp, "-std=c++17", src, "-o", bin, "-lpthread").CombinedOutput(); err != nil {
			return fmt.Errorf("bench fncall: host g++: %v: %s", err, out)
		}
		run := exec.CommandContext(ctx, bin)
		run.Stdin = strings.NewReader("2 3\n")
		if out, err := run.Output(); err != nil || strings.TrimSpace(string(out)) != "5" {
			return fmt.Errorf("bench fncall: host a+b: %v %q", err, out)
		}
		hostT = append(hostT, time.Since(t0))
	}
	r.CppDsec, r.CppHost = summarize(dsecT), summarize(hostT)
	r.CppRatio = ratio(r.CppDsec.P50, r.CppHost.P50)
	return nil
}

// mixedCall is one call of the mixed burst and the status it must get.
type mixedCall struct {
	req    map[string]any
	status string // SandboxFusion's
	stdout string // of the run step, when status is Success
}

// clientTimeout is how long verl waits for the call before it scores it
// −1: its HTTP timeout, compile_timeout + run_timeout + 10 s (a missing
// compile_timeout is SandboxFusion's default, 10 s).
func (mc mixedCall) clientTimeout() time.Duration {
	secs := func(k string, def float64) float64 {
		if v, ok := mc.req[k].(int); ok {
			return float64(v)
		}
		return def
	}
	return time.Duration((secs("compile_timeout", 10) + secs("run_timeout", 10) + 10) * float64(time.Second))
}

func mixedCalls() []mixedCall {
	py := func(code, stdin string) map[string]any {
		return map[string]any{"language": "python", "code": code, "stdin": stdin, "compile_timeout": 10, "run_timeout": 5,
			"memory_limit_MB": 1024, "files": map[string]any{}, "fetch_files": []string{}}
	}
	cpp := func(code, stdin string) map[string]any {
		return map[string]any{"language": "cpp", "code": code, "stdin": stdin, "compile_timeout": 30, "run_timeout": 5,
			"memory_limit_MB": 1024, "files": map[string]any{}, "fetch_files": []string{}}
	}
	return []mixedCall{
		{py("a, b = map(int, input().split())\nprint(a + b)", "2 3\n"), "Success", "5\n"},
		{py("print(int(input()) * 2)", "21\n"), "Success", "42\n"},
		{py("a, b = map(int, input().split())\nprint(a - b)", "2 3\n"), "Success", "-1\n"},
		{py("raise SystemExit(input())", "3\n"), "Failed", ""},
		{py("import time\ntime.sleep(60)", ""), "Failed", ""},
		{py("x = [0] * (1 << 30)", ""), "Failed", ""},
		{py("print(sum(range(10**6)))", ""), "Success", "499999500000\n"},
		{cpp(cppAPlusB, "2 3\n"), "Success", "5\n"},
		{cpp("int main( { return 0; }", ""), "Failed", ""},
		{map[string]any{"language": "bash", "code": "read a; echo $((a+1))", "stdin": "41\n", "run_timeout": 5}, "Success", "42\n"},
	}
}

func (r *FnCallReport) mixed(ctx context.Context, c *sfClient, o FnCallOptions) error {
	calls := mixedCalls()
	r.MixedCalls = o.Mixed
	o.logf("mixed burst: %d calls at once", o.Mixed)
	var mu sync.Mutex
	var wg sync.WaitGroup
	var lat []time.Duration
	t0 := time.Now()
	for i := range o.Mixed {
		mc := calls[i%len(calls)]
		wg.Add(1)
		go func() {
			defer wg.Done()
			start := time.Now()
			res, err := c.run(ctx, mc.req)
			took := time.Since(start)
			mu.Lock()
			defer mu.Unlock()
			lat = append(lat, took)
			fail := func(msg string) {
				if r.MixedFirstFail == "" {
					r.MixedFirstFail = msg
				}
			}
			switch {
			case err != nil:
				r.MixedErrors++
				fail(err.Error())
			case res.Status == "SandboxError":
				r.MixedErrors++
				fail("SandboxError: " + res.Message)
			case res.Status != mc.status || (mc.stdout != "" && (res.RunResult == nil || res.RunResult.Stdout != mc.stdout)):
				r.MixedWrong++
				fail(fmt.Sprintf("%v: got %s, want %s", mc.req["code"], res.Status, mc.status))
			}
			if took > mc.clientTimeout() {
				r.MixedLate++
				fail(fmt.Sprintf("%v took %s, over its timeouts", mc.req["code"], took))
			}
		}()
	}
	wg.Wait()
	r.MixedWallS = time.Since(t0).Seconds()
	r.MixedLatency = summarize(lat)
	return nil
}

// busy sends o.Busy CPU-bound calls at once, each with verl's payload
// and verl's HTTP timeout (compile_timeout + run_timeout + 10 s), and
// counts how they came back. SandboxFusion starts every call at once and
// times it by the wall clock, so each ends at its run_timeout as
// TimeLimitExceeded; verl's reward code is written for that.
func (r *FnCallReport) busy(ctx context.Context, c *sfClient, o FnCallOptions) {
	const compileTimeout = 10
	req := map[string]any{"language": "python", "code": "while True:\n    pass\n", "stdin": "",
		"compile_timeout": compileTimeout, "run_timeout": o.BusyTimeout.Seconds(), "memory_limit_MB": 1024,
		"files": map[string]any{}, "fetch_files": []string{}}
	patience := time.Duration(compileTimeout)*time.Second + o.BusyTimeout + 10*time.Second
	r.BusyCalls, r.BusyTimeoutS = o.Busy, o.BusyTimeout.Seconds()
	o.logf("CPU-bound burst: %d calls at once, run_timeout %s", o.Busy, o.BusyTimeout)
	var mu sync.Mutex
	var wg sync.WaitGroup
	var lat []time.Duration
	t0 := time.Now()
	for range o.Busy {
		wg.Add(1)
		go func() {
			defer wg.Done()
			cctx, cancel := context.WithTimeout(ctx, patience)
			defer cancel()
			start := time.Now()
			res, err := c.run(cctx, req)
			took := time.Since(start)
			mu.Lock()
			defer mu.Unlock()
			lat = append(lat, took)
			r.BusyLastS = max(r.BusyLastS, time.Since(t0).Seconds())
			fail := func(msg string) {
				if r.BusyFirstErr == "" {
					r.BusyFirstErr = msg
				}
			}
			switch {
			case err != nil && cctx.Err() != nil && ctx.Err() == nil:
				r.BusyLate++
				fail(fmt.Sprintf("no answer within verl's %s", patience))
			case err != nil:
				r.BusyErrors++
				fail(err.Error())
			case res.RunResult != nil && res.RunResult.Status == "TimeLimitExceeded":
				if r.BusyTLE == 0 || res.RunResult.ExecutionTime < r.BusyLeastRanS {
					r.BusyLeastRanS = res.RunResult.ExecutionTime
				}
				r.BusyTLE++
			default:
				r.BusyOther++
				fail(fmt.Sprintf("status %s: %s", res.Status, res.Message))
			}
		}()
	}
	wg.Wait()
	r.BusyLatency = summarize(lat)
}

// JSON writes the report as one JSON object.
func (r *FnCallReport) JSON(w io.Writer) error { return writeJSON(w, r) }

// Print writes the report as tables, each target beside its figure.
func (r *FnCallReport) Print(w io.Writer) {
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', 0)
	fmt.Fprintf(tw, "fncall through SandboxFusion's API at %s\n\n", r.URL)
	fmt.Fprintf(tw, "FIGURE\tDSEC\tBASELINE\tRATIO\n")
	if r.BusyOnly {
		r.printBusy(tw)
		tw.Flush()
		fmt.Fprintf(w, "\nTARGETS\n")
		r.checkBusy(w)
		return
	}
	fmt.Fprintf(tw, "python print(1), %d in flight (calls/s)\t%.0f\t%.0f (bare python3 -c in a chroot)\t%.2f\n", r.Concurrency, r.DsecRate, r.BareRate, r.RateRatio)
	fmt.Fprintf(tw, "  latency under that load p50 / p99 (ms)\t%.1f / %.1f\t\t\n", r.DsecLatency.P50, r.DsecLatency.P99)
	fmt.Fprintf(tw, "  errors\t%d\t%d\t\n", r.DsecErrors, r.BareErrors)
	fmt.Fprintf(tw, "python print(1), one at a time p50 / p99 (ms)\t%.1f / %.1f\t\t\n", r.SingleCall.P50, r.SingleCall.P99)
	fmt.Fprintf(tw, "C++ a+b compile and run p50 (ms)\t%.0f\t%.0f (host g++ and run)\t%.2f\n", r.CppDsec.P50, r.CppHost.P50, r.CppRatio)
	fmt.Fprintf(tw, "mixed burst of %d: errors / wrong / over timeout\t%d / %d / %d\t\t\n", r.MixedCalls, r.MixedErrors, r.MixedWrong, r.MixedLate)
	fmt.Fprintf(tw, "  wall (s), latency p50 / p99 (ms)\t%.1f, %.0f / %.0f\t\t\n", r.MixedWallS, r.MixedLatency.P50, r.MixedLatency.P99)
	r.printBusy(tw)
	tw.Flush()
	fmt.Fprintf(w, "\nTARGETS\n")
	check := func(name string, ok bool, fig string) { checkLine(w, name, ok, fig) }
	check("print(1) rate ≥ 3× bare python3", r.RateRatio >= 3, fmt.Sprintf("%.2f×", r.RateRatio))
	check("print(1) rate ≥ 300 calls/s", r.DsecRate >= 300, fmt.Sprintf("%.0f/s", r.DsecRate))
	check("one call p50 ≤ 15 ms", r.SingleCall.P50 <= 15 && r.SingleCall.N > 0, fmt.Sprintf("%.1f ms", r.SingleCall.P50))
	if r.CppHost.N > 0 {
		check("C++ a+b ≤ 1.15× host g++ and run", r.CppRatio <= 1.15, fmt.Sprintf("%.2f×", r.CppRatio))
	}
	check(fmt.Sprintf("%d mixed calls: 0 errors, all within timeouts", r.MixedCalls), r.MixedErrors == 0 && r.MixedLate == 0 && r.MixedWrong == 0,
		fmt.Sprintf("%d/%d/%d", r.MixedErrors, r.MixedWrong, r.MixedLate))
	r.checkBusy(w)
	if !r.ZygoteServed {
		fmt.Fprintln(w, "  note: python calls were not served by the warm interpreter")
	}
	if r.MixedFirstFail != "" {
		fmt.Fprintf(w, "  first mixed failure: %s\n", r.MixedFirstFail)
	}
	if r.CppNote != "" {
		fmt.Fprintf(w, "  note: %s\n", r.CppNote)
	}
	for _, n := range r.Notes {
		fmt.Fprintf(w, "  note: %s\n", n)
	}
}

func checkLine(w io.Writer, name string, ok bool, fig string) {
	v := "MISS"
	if ok {
		v = "PASS"
	}
	fmt.Fprintf(w, "  %-52s %-22s %s\n", name, fig, v)
}

func (r *FnCallReport) printBusy(tw io.Writer) {
	if r.BusyCalls == 0 {
		return
	}
	fmt.Fprintf(tw, "CPU-bound burst of %d, run_timeout %gs: TLE / other / errors / client timeouts\t%d / %d / %d / %d\t\t\n", r.BusyCalls, r.BusyTimeoutS, r.BusyTLE, r.BusyOther, r.BusyErrors, r.BusyLate)
	fmt.Fprintf(tw, "  last answer (s), latency p50 / p99 (ms)\t%.1f, %.0f / %.0f\t\t\n", r.BusyLastS, r.BusyLatency.P50, r.BusyLatency.P99)
	fmt.Fprintf(tw, "  least a TLE call ran (s)\t%.1f\t\t\n", r.BusyLeastRanS)
}

// checkBusy is the CPU-bound burst's target: SandboxFusion ends each call
// at its run_timeout; a second over it is allowed for the kill and the
// answer of every call.
func (r *FnCallReport) checkBusy(w io.Writer) {
	if r.BusyCalls == 0 {
		return
	}
	checkLine(w, fmt.Sprintf("%d CPU-bound calls: all TLE by run_timeout + 1 s", r.BusyCalls), r.BusyTLE == r.BusyCalls && r.BusyLastS <= r.BusyTimeoutS+1,
		fmt.Sprintf("%d TLE, last %.1f s", r.BusyTLE, r.BusyLastS))
	if r.BusyFirstErr != "" {
		fmt.Fprintf(w, "  first CPU-bound failure: %s\n", r.BusyFirstErr)
	}
}

package dsec

import (
	"bytes"
	"context"
	"fmt"
	"math"
	"sync"
	"time"

	"connectrpc.com/connect"

	dsecv1 "dsec.dev/dsec/api/gen/dsec/v1"
)

// FnCall: short programs (reward code, test cases) run in the fncall
// backend's pooled warm containers, as SandboxFusion's /run_code runs them
// (docs/fncall.md).

const (
	// defaultStepTimeout is the runner's timeout of a step left at 0.
	defaultStepTimeout = 10 * time.Second
	// callGrace is how long beyond its steps' timeouts a call's default
	// deadline leaves for its wait in the node's queue and its answer.
	callGrace = 30 * time.Second
	// batchGrace is how long beyond its longest call a batch's default
	// deadline leaves for its calls' wait in the pools' queues.
	batchGrace = 10 * time.Minute
)

// maxBatch is the most calls an apiserver takes in one RunCodeBatch;
// longer batches are sent as several at once. Tests lower it.
var maxBatch = 4096

// RunCodeRequest is one call. Zero fields take the runner's defaults.
type RunCodeRequest struct {
	Language string // see Languages: python, cpp, go, java, ...
	Code     string
	Stdin    []byte // the run step's standard input
	// Files are written into the call's scratch directory before it runs,
	// by path relative to it.
	Files map[string][]byte
	// FetchFiles are read back after the run into RunCodeResult.Files;
	// missing ones are left out.
	FetchFiles     []string
	CompileTimeout time.Duration // default 10 s
	RunTimeout     time.Duration // default 10 s
	MemoryMB       int64         // the call's memory limit; default 1024
	CPUs           float64       // the call's CPU limit; default 1
	// NetworkRules as CreateOptions.NetworkRules; none means no network.
	NetworkRules map[string]bool
	// Environment to run in; "" is the language's (fncall:latest unless a
	// registered language names another).
	Environment string
}

func (r *RunCodeRequest) msg() (*dsecv1.RunCodeRequest, error) {
	if r.Language == "" {
		return nil, invalid("run code: Language is required (see Client.Languages)")
	}
	for name, d := range map[string]time.Duration{"CompileTimeout": r.CompileTimeout, "RunTimeout": r.RunTimeout} {
		if d < 0 {
			return nil, invalid("run code: %s %v: want 0 (the default) or more", name, d)
		}
	}
	if r.MemoryMB < 0 || r.CPUs < 0 || math.IsNaN(r.CPUs) || math.IsInf(r.CPUs, 0) {
		return nil, invalid("run code: MemoryMB %d, CPUs %v: want 0 (the default) or more", r.MemoryMB, r.CPUs)
	}
	return &dsecv1.RunCodeRequest{
		Language: r.Language, Code: r.Code, Stdin: r.Stdin, Files: r.Files, FetchFiles: r.FetchFiles,
		CompileTimeoutSeconds: r.CompileTimeout.Seconds(), RunTimeoutSeconds: r.RunTimeout.Seconds(),
		MemoryMb: r.MemoryMB, Cpus: r.CPUs, NetworkRules: r.NetworkRules, Environment: r.Environment,
	}, nil
}

// deadline is how long a client waits for the call by default.
func (r *RunCodeRequest) deadline() time.Duration {
	step := func(d time.Duration) time.Duration {
		if d == 0 {
			return defaultStepTimeout
		}
		return d
	}
	return step(r.CompileTimeout) + step(r.RunTimeout) + callGrace
}

// repeatable: the call leaves nothing behind, unless its network rules let
// it reach out, so it may be sent again after an Unavailable answer.
func (r *RunCodeRequest) repeatable() bool { return len(r.NetworkRules) == 0 }

// RunStatus says how a call went.
type RunStatus string

const (
	RunSuccess RunStatus = "success" // every step exited 0
	RunFailed  RunStatus = "failed"  // a step exited non-zero, was killed or timed out
	// RunSandboxError: the call could not be run as asked; Message says why.
	RunSandboxError RunStatus = "sandbox_error"
)

// CommandStatus says how a step ended.
type CommandStatus string

const (
	CommandFinished          CommandStatus = "finished"            // it exited (any code) or was killed
	CommandError             CommandStatus = "error"               // it could not be started
	CommandTimeLimitExceeded CommandStatus = "time_limit_exceeded" // killed at its timeout; output so far kept
)

// CommandResult is one step (compile or run) of a call.
type CommandResult struct {
	Status CommandStatus
	// ReturnCode is the step's exit code, the negative signal number when
	// it was killed, and nil after a timeout.
	ReturnCode      *int
	Stdout, Stderr  []byte // each the first 1 MiB
	StdoutTruncated bool
	StderrTruncated bool
	ExecutionTime   time.Duration // wall time
	// MemoryLimitExceeded: the call's memory cgroup OOM-killed the step.
	MemoryLimitExceeded bool
}

// RunCodeResult is what a call did. A program that fails is a result
// (RunFailed), not an error.
type RunCodeResult struct {
	Status  RunStatus
	Message string
	Compile *CommandResult    // nil for interpreted languages
	Run     *CommandResult    // nil when the compile step failed
	Files   map[string][]byte // the FetchFiles that existed, by the path asked for
	Node    string            // the node that ran it
	// Container is the pooled container's sandbox ID.
	Container string
	// InfraFault is the platform's fault when the call could not be run
	// for the platform's sake (Status is RunSandboxError then): a lost
	// edge, a container that died under it twice, a full node; FaultNone
	// when the call's code or request decided the result.
	InfraFault Fault
}

// OK says whether the call succeeded.
func (r *RunCodeResult) OK() bool { return r.Status == RunSuccess }

// Stdout is the run step's stdout; "" without a run step.
func (r *RunCodeResult) Stdout() string {
	if r.Run == nil {
		return ""
	}
	return string(r.Run.Stdout)
}

// Stderr is the run step's stderr; "" without a run step.
func (r *RunCodeResult) Stderr() string {
	if r.Run == nil {
		return ""
	}
	return string(r.Run.Stderr)
}

func commandResultOf(m *dsecv1.CommandResult) *CommandResult {
	if m == nil {
		return nil
	}
	out := &CommandResult{
		Stdout: m.GetStdout(), Stderr: m.GetStderr(), StdoutTruncated: m.GetStdoutTruncated(),
		StderrTruncated: m.GetStderrTruncated(), MemoryLimitExceeded: m.GetMemoryLimitExceeded(),
		ExecutionTime: time.Duration(m.GetExecutionTimeSeconds() * float64(time.Second)),
	}
	switch m.GetStatus() {
	case dsecv1.CommandStatus_COMMAND_STATUS_FINISHED:
		out.Status = CommandFinished
	case dsecv1.CommandStatus_COMMAND_STATUS_TIME_LIMIT_EXCEEDED:
		out.Status = CommandTimeLimitExceeded
	default:
		out.Status = CommandError
	}
	if m.ReturnCode != nil {
		rc := int(m.GetReturnCode())
		out.ReturnCode = &rc
	}
	return out
}

func runCodeResultOf(m *dsecv1.RunCodeResponse) *RunCodeResult {
	out := &RunCodeResult{
		Message: m.GetMessage(), Compile: commandResultOf(m.GetCompileResult()), Run: commandResultOf(m.GetRunResult()),
		Files: m.GetFiles(), Node: m.GetNode(), Container: m.GetContainer(), InfraFault: FaultFromProto(m.GetFault()),
	}
	switch m.GetStatus() {
	case dsecv1.RunStatus_RUN_STATUS_SUCCESS:
		out.Status = RunSuccess
	case dsecv1.RunStatus_RUN_STATUS_FAILED:
		out.Status = RunFailed
	default:
		out.Status = RunSandboxError
	}
	return out
}

// unaryFn runs a FnCallService call with default deadline d and, when the
// call may repeat, the retries of the SDK's idempotent calls.
func (c *Client) unaryFn(ctx context.Context, d time.Duration, repeatable bool, call func(context.Context) error) error {
	ctx, cancel := withTimeout(ctx, d)
	defer cancel()
	if !repeatable {
		return fromConnect(call(ctx), false)
	}
	return c.retry(ctx, false, call)
}

// RunCode compiles (for compiled languages) and runs one program. The
// call's default deadline is its compile and run timeouts plus 30 s. Errors
// are for calls that could not be run: ErrInvalidArgument (an unknown
// language, a bad path or timeout), ErrOverloaded (every pool that could
// run it is full, its queue too), ErrUnavailable. A call without network
// rules leaves nothing behind, so it is sent again after an Unavailable
// answer, as reads are.
func (c *Client) RunCode(ctx context.Context, req RunCodeRequest) (*RunCodeResult, error) {
	m, err := req.msg()
	if err != nil {
		return nil, err
	}
	var out *dsecv1.RunCodeResponse
	err = c.unaryFn(ctx, req.deadline(), req.repeatable(), func(ctx context.Context) error {
		r, err := c.fn.RunCode(ctx, connect.NewRequest(m))
		if err == nil {
			out = r.Msg
		}
		return err
	})
	if err != nil {
		return nil, fmt.Errorf("run %s code: %w", req.Language, err)
	}
	return runCodeResultOf(out), nil
}

// RunCodeBatch runs many calls at once, as the pools allow, and returns
// their results in order. A call that could not be run is a result with
// RunSandboxError and the reason as Message, not an error. Over 4096 calls
// go as several batches at once. The default deadline is the longest
// call's plus 10 minutes, for the calls' wait in the pools' queues.
func (c *Client) RunCodeBatch(ctx context.Context, reqs []RunCodeRequest) ([]*RunCodeResult, error) {
	if len(reqs) == 0 {
		return nil, nil
	}
	msgs := make([]*dsecv1.RunCodeRequest, len(reqs))
	var longest time.Duration
	repeatable := true
	for i := range reqs {
		m, err := reqs[i].msg()
		if err != nil {
			return nil, fmt.Errorf("call %d: %w", i, err)
		}
		msgs[i] = m
		longest = max(longest, reqs[i].deadline())
		repeatable = repeatable && reqs[i].repeatable()
	}
	ctx, cancel := withTimeout(ctx, longest+batchGrace)
	defer cancel()
	out := make([]*RunCodeResult, len(reqs))
	var (
		wg    sync.WaitGroup
		mu    sync.Mutex
		first error
	)
	for lo := 0; lo < len(msgs); lo += maxBatch {
		hi := min(lo+maxBatch, len(msgs))
		wg.Add(1)
		go func() {
			defer wg.Done()
			var resp *dsecv1.RunCodeBatchResponse
			err := c.unaryFn(ctx, 0, repeatable, func(ctx context.Context) error {
				r, err := c.fn.RunCodeBatch(ctx, connect.NewRequest(&dsecv1.RunCodeBatchRequest{Calls: msgs[lo:hi]}))
				if err == nil {
					resp = r.Msg
				}
				return err
			})
			if err == nil && len(resp.GetResults()) != hi-lo {
				err = &Error{Kind: ErrInternal, Code: connect.CodeInternal,
					Message: fmt.Sprintf("%d results for %d calls", len(resp.GetResults()), hi-lo)}
			}
			if err != nil {
				mu.Lock()
				if first == nil {
					first = err
					cancel()
				}
				mu.Unlock()
				return
			}
			for i, r := range resp.GetResults() {
				out[lo+i] = runCodeResultOf(r)
			}
		}()
	}
	wg.Wait()
	if first != nil {
		return nil, fmt.Errorf("run code batch of %d calls: %w", len(reqs), first)
	}
	return out, nil
}

// TestCase is one input of RunTests.
type TestCase struct {
	Stdin string
	// Expected, when not nil, is the stdout the case must print; see
	// TestResult.Passed.
	Expected *string
}

// TestResult is one case's result.
type TestResult struct {
	*RunCodeResult
	// Passed says whether the case passed as verl judges one: the call
	// succeeded and its stdout equals the case's Expected once trailing
	// newlines are cut from both. Always false for a case without Expected.
	Passed bool
}

// RunTests runs the program of req once per case, with the case's stdin
// (req.Stdin is not used), all in one batch, in parallel as the pools
// allow. Results come in the cases' order.
func (c *Client) RunTests(ctx context.Context, req RunCodeRequest, cases []TestCase) ([]*TestResult, error) {
	reqs := make([]RunCodeRequest, len(cases))
	for i, tc := range cases {
		reqs[i] = req
		reqs[i].Stdin = []byte(tc.Stdin)
	}
	rs, err := c.RunCodeBatch(ctx, reqs)
	if err != nil {
		return nil, err
	}
	out := make([]*TestResult, len(rs))
	for i, r := range rs {
		out[i] = &TestResult{RunCodeResult: r}
		if want := cases[i].Expected; want != nil && r.OK() {
			out[i].Passed = bytes.Equal(bytes.TrimRight(r.Run.Stdout, "\n"), bytes.TrimRight([]byte(*want), "\n"))
		}
	}
	return out, nil
}

// Language is a language the runner knows.
type Language struct {
	Name        string
	Environment string
	Compiled    bool
	SourceFile  string // the file the code is written to
	CompileArgv []string
	RunArgv     []string
	Zygote      bool // served by a warm interpreter
}

// Languages lists the languages RunCode takes, with how each is compiled
// and run.
func (c *Client) Languages(ctx context.Context) ([]Language, error) {
	var resp *dsecv1.ListLanguagesResponse
	err := c.unary(ctx, true, func(ctx context.Context) error {
		r, err := c.fn.ListLanguages(ctx, connect.NewRequest(&dsecv1.ListLanguagesRequest{}))
		if err == nil {
			resp = r.Msg
		}
		return err
	})
	if err != nil {
		return nil, fmt.Errorf("list languages: %w", err)
	}
	out := make([]Language, 0, len(resp.GetLanguages()))
	for _, l := range resp.GetLanguages() {
		out = append(out, Language{
			Name: l.GetName(), Environment: l.GetEnvironment(), Compiled: l.GetCompiled(), SourceFile: l.GetSourceFile(),
			CompileArgv: l.GetCompileArgv(), RunArgv: l.GetRunArgv(), Zygote: l.GetZygote(),
		})
	}
	return out, nil
}

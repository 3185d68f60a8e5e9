package fncall

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"maps"
	"math"
	"path"
	"runtime"
	"slices"
	"strings"
	"time"

	agentv1 "dsec.dev/dsec/api/gen/dsec/agent/v1"
	dsecv1 "dsec.dev/dsec/api/gen/dsec/v1"
	"dsec.dev/dsec/internal/errdefs"
	"dsec.dev/dsec/internal/metrics"
)

// Call defaults and bounds, SandboxFusion's where it has them.
const (
	DefaultCompileTimeout = 10 * time.Second
	DefaultRunTimeout     = 10 * time.Second
	MaxTimeout            = 15 * time.Minute
	DefaultMemoryMB       = 1024
	MaxMemoryMB           = 64 << 10
	DefaultCPUs           = 1
	OutputLimit           = 1 << 20 // per stream, as SandboxFusion reads
	MaxFilesBytes         = 128 << 20
	// DefaultMaxStartDelay bounds a call's wait for a container when
	// none is starting for it (PoolConfig.MaxStartDelay).
	DefaultMaxStartDelay = 2 * time.Second
	// DefaultDiskMB is a pooled container's writable layer
	// (PoolConfig.DiskMB).
	DefaultDiskMB = 4096
	// scratchPrefix is where the agent makes calls' scratch directories
	// (internal/agent/call): an absolute path under it is taken as one
	// relative to the scratch directory.
	scratchPrefix = "/tmp/call-"
)

// memoryClasses are the pools' container sizes: a call's memory limit
// rounds up to the first that holds it (plus room for the agent and the
// zygote), so calls of similar sizes share containers.
var memoryClasses = []int64{256, 512, 1024, 2048, 4096, 8192, 16384, 32768, 65536}

// agentOverheadMB is the container's room above its calls' limit: the
// agent and the warm interpreter.
const agentOverheadMB = 64

// Config configures the node's fncall backend.
type Config struct {
	Node  string
	Pools PoolConfig
	// Languages are the builtin ones plus any registered; nil = Builtin().
	Languages map[string]Language
	Log       *slog.Logger
	// Metrics records calls by language (metrics.Registry.FnCall, given
	// the Service's Load); nil records nothing.
	Metrics *metrics.FnCall
}

// Service runs calls on one node.
type Service struct {
	cfg   Config
	langs map[string]Language
	pools *pools
	sb    Sandboxes
	log   *slog.Logger
	stop  chan struct{}
	done  chan struct{}
}

// NewService starts the node's fncall backend over sb.
func NewService(sb Sandboxes, cfg Config) *Service {
	if cfg.Log == nil {
		cfg.Log = slog.New(slog.DiscardHandler)
	}
	if cfg.Languages == nil {
		cfg.Languages = Builtin()
	}
	p := &cfg.Pools
	if p.MinIdle < 0 {
		p.MinIdle = 0
	}
	if p.MaxContainers <= 0 {
		p.MaxContainers = 256
	}
	if p.MaxPerPool <= 0 {
		p.MaxPerPool = p.MaxContainers
	}
	if p.MaxCreating <= 0 {
		p.MaxCreating = 8 * runtime.NumCPU()
	}
	if p.SoftMaxPerPool <= 0 {
		p.SoftMaxPerPool = max(4, 4*runtime.NumCPU())
	}
	if p.LookEvery <= 0 {
		p.LookEvery = 100 * time.Millisecond
	}
	if p.MaxStartDelay <= 0 {
		p.MaxStartDelay = DefaultMaxStartDelay
	}
	if p.MaxQueue <= 0 {
		p.MaxQueue = 4096
	}
	if p.IdleRetire <= 0 {
		p.IdleRetire = time.Minute
	}
	if p.DiskMB <= 0 {
		p.DiskMB = DefaultDiskMB
	}
	s := &Service{cfg: cfg, langs: cfg.Languages, sb: sb, log: cfg.Log,
		pools: newPools(sb, cfg.Pools, cfg.Log), stop: make(chan struct{}), done: make(chan struct{})}
	go s.loop()
	return s
}

func (s *Service) loop() {
	defer close(s.done)
	t := time.NewTicker(5 * time.Second)
	defer t.Stop()
	for {
		select {
		case <-s.stop:
			return
		case now := <-t.C:
			s.pools.trim(now)
		}
	}
}

// Close removes every pooled container.
func (s *Service) Close() {
	close(s.stop)
	<-s.done
	s.pools.close()
}

// Pools reports the pools' state.
func (s *Service) Pools() []PoolStatus { return s.pools.status() }

// Load is the backend's load: calls running, calls waiting for a
// container, idle containers.
func (s *Service) Load() (busy, queue, idle int) {
	for _, p := range s.pools.status() {
		busy += p.Busy
		queue += p.Queue
		idle += p.Idle
	}
	return busy, queue, idle
}

// Languages lists the languages the node runs.
func (s *Service) Languages() []*dsecv1.Language {
	var out []*dsecv1.Language
	for _, name := range slices.Sorted(maps.Keys(s.langs)) {
		l := s.langs[name]
		out = append(out, &dsecv1.Language{
			Name: l.Name, Environment: l.env(), Compiled: l.Compile != nil, SourceFile: l.File,
			CompileArgv: l.Compile, RunArgv: l.Run, Zygote: l.Zygote,
		})
	}
	return out
}

func (l Language) env() string {
	if l.Environment != "" {
		return l.Environment
	}
	return DefaultEnvironment
}

// RunCode runs one call. An error means the call could not be run as
// asked: InvalidArgument for a bad request, ResourceExhausted when no
// container could take it within the start bound (or the node's queue is
// full), others for the node's own failures.
//
// The call's timeouts are wall-clock from its arrival, as SandboxFusion
// times a call from its start: what it waited for a container (at most
// MaxStartDelay, or a container's start under load) counts against its
// first step, and a call whose first step's time ran out before it could
// start is answered as having exceeded it.
func (s *Service) RunCode(ctx context.Context, req *dsecv1.RunCodeRequest) (resp *dsecv1.RunCodeResponse, err error) {
	arrived := time.Now()
	language := "unknown"
	defer func() { s.cfg.Metrics.Call(language, callStatus(resp, err), time.Since(arrived)) }()
	lang, call, key, err := s.prepare(req)
	if err != nil {
		return nil, err
	}
	language = lang.Name
	first := call.Steps[0]
	budget := first.TimeoutSeconds
	// A container that breaks under a call (its agent gone, say) is
	// retired and the call tried once more on another.
	var last error
	for attempt := 0; attempt < 2; attempt++ {
		m, err := s.pools.acquire(ctx, key, call.GetMemoryBytes()>>20)
		if err != nil {
			return nil, err
		}
		waited := time.Since(arrived)
		if first.TimeoutSeconds = budget - waited.Seconds(); first.TimeoutSeconds <= 0 {
			s.pools.release(key, m, false)
			return s.outOfTime(lang, budget, waited), nil
		}
		resp, err := s.run(ctx, m, key, req, call)
		if err != nil {
			s.pools.release(key, m, true)
			last = err
			if ctx.Err() != nil {
				break
			}
			if callsOwnFault(err) {
				// The call could not be run as asked (its files do not fit,
				// say): its answer, not the node's failure, and not tried
				// again. The container is retired all the same.
				return &dsecv1.RunCodeResponse{Status: dsecv1.RunStatus_RUN_STATUS_SANDBOX_ERROR,
					Message: err.Error(), Node: s.cfg.Node, Container: m.id}, nil
			}
			s.log.Warn("fncall container failed a call; retired", "id", m.id, "err", err)
			continue
		}
		m.calls++
		retire := resp.GetDirty()
		if retire {
			s.log.Warn("fncall call left its container dirty; retired", "id", m.id, "reason", resp.GetDirtyReason())
		}
		s.pools.release(key, m, retire)
		out := result(lang, resp)
		out.Node, out.Container = s.cfg.Node, m.id
		return out, nil
	}
	return nil, fmt.Errorf("run code: %w", last)
}

// callStatus is a call's status label: its run status's name in lower
// case (success, failed, sandbox_error), or "error" for a call not run.
func callStatus(resp *dsecv1.RunCodeResponse, err error) string {
	if err != nil || resp == nil {
		return "error"
	}
	return strings.ToLower(strings.TrimPrefix(resp.GetStatus().String(), "RUN_STATUS_"))
}

// outOfTime answers a call whose first step's timeout of budget seconds
// ran out while it waited for a container: that step exceeded its time
// limit without running, as a SandboxFusion process still starting at its
// timeout would.
func (s *Service) outOfTime(lang Language, budget float64, waited time.Duration) *dsecv1.RunCodeResponse {
	step := "run"
	if lang.Compile != nil {
		step = "compile"
	}
	out := result(lang, &agentv1.CallResponse{Steps: []*agentv1.CallStepResult{{Exited: &dsecv1.ExecExited{
		Status: dsecv1.ExitStatus_EXIT_STATUS_TIMEOUT, DurationSeconds: waited.Seconds()}}}})
	out.Message = fmt.Sprintf("the call waited %.2f s for a container, past its %s timeout of %g s", waited.Seconds(), step, budget)
	out.Node = s.cfg.Node
	return out
}

func (s *Service) run(ctx context.Context, m *member, key poolKey, req *dsecv1.RunCodeRequest, call *agentv1.CallRequest) (*agentv1.CallResponse, error) {
	if key.network {
		ns, ok := s.sb.(NetworkSandboxes)
		if !ok {
			return nil, fmt.Errorf("network rules for calls are not available on node %s: %w", s.cfg.Node, errdefs.ErrNotSupported)
		}
		if err := ns.SetNetworkRules(ctx, m.id, req.GetNetworkRules()); err != nil {
			return nil, fmt.Errorf("set the call's network rules: %w", err)
		}
		defer func() {
			rctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 10*time.Second)
			defer cancel()
			if err := ns.SetNetworkRules(rctx, m.id, map[string]bool{denyAll: false}); err != nil {
				s.log.Warn("reset a fncall container's network rules", "id", m.id, "err", err)
			}
		}()
	}
	return s.sb.Call(ctx, m.id, call)
}

// callsOwnFault says whether an agent's refusal of a call is about the
// call itself rather than the container.
func callsOwnFault(err error) bool {
	return errors.Is(err, errdefs.ErrInvalidArgument) || errors.Is(err, errdefs.ErrResourceExhausted)
}

// NetworkSandboxes can change a pooled container's network rules (and cut
// what they no longer allow).
type NetworkSandboxes interface {
	SetNetworkRules(ctx context.Context, id string, rules map[string]bool) error
}

// prepare checks req and builds the agent's call and the pool it runs in.
func (s *Service) prepare(req *dsecv1.RunCodeRequest) (Language, *agentv1.CallRequest, poolKey, error) {
	bad := func(format string, a ...any) (Language, *agentv1.CallRequest, poolKey, error) {
		return Language{}, nil, poolKey{}, fmt.Errorf("run code: "+format+": %w", append(a, errdefs.ErrInvalidArgument)...)
	}
	lang, ok := s.langs[req.GetLanguage()]
	if !ok {
		return bad("unknown language %q (known: %s)", req.GetLanguage(), strings.Join(slices.Sorted(maps.Keys(s.langs)), ", "))
	}
	compileTimeout, err := timeout(req.GetCompileTimeoutSeconds(), DefaultCompileTimeout)
	if err != nil {
		return bad("compile_timeout: %v", err)
	}
	runTimeout, err := timeout(req.GetRunTimeoutSeconds(), DefaultRunTimeout)
	if err != nil {
		return bad("run_timeout: %v", err)
	}
	memMB := req.GetMemoryMb()
	switch {
	case memMB <= 0:
		memMB = DefaultMemoryMB
	case memMB < 16:
		return bad("memory_mb %d is below the 16 MiB a call needs", memMB)
	case memMB > MaxMemoryMB:
		return bad("memory_mb %d is over the %d a call may have", memMB, MaxMemoryMB)
	}
	cpus := req.GetCpus()
	switch {
	case cpus == 0:
		cpus = DefaultCPUs
	case cpus < 0.01 || math.IsNaN(cpus) || cpus > 64:
		return bad("cpus %v is outside 0.01..64", cpus)
	}
	files := map[string][]byte{}
	total := int64(len(req.GetCode()))
	for p, data := range req.GetFiles() {
		rel, err := scratchRel(p)
		if err != nil {
			return bad("files: %v", err)
		}
		if rel == lang.File {
			return bad("files: %q is where the code goes", p)
		}
		files[rel] = data
		total += int64(len(data))
	}
	if total > MaxFilesBytes {
		return bad("the code and files are %d bytes, over the %d a call may bring", total, MaxFilesBytes)
	}
	files[lang.File] = []byte(req.GetCode())
	var fetch []string
	for _, p := range req.GetFetchFiles() {
		rel, err := scratchRel(p)
		if err != nil {
			return bad("fetch_files: %v", err)
		}
		fetch = append(fetch, rel)
	}
	env := maps.Clone(lang.Env)
	if env == nil {
		env = map[string]string{}
	}
	// A JVM sizes its heap from the memory cgroup it can see, which is the
	// container's, not the call's.
	env["JAVA_TOOL_OPTIONS"] = fmt.Sprintf("-XX:MaxRAM=%dm", memMB)
	call := &agentv1.CallRequest{
		Files:            files,
		FetchFiles:       fetch,
		MemoryBytes:      memMB << 20,
		Cpus:             cpus,
		OutputLimitBytes: OutputLimit,
		Env:              env,
	}
	if lang.Compile != nil {
		call.Steps = append(call.Steps, &agentv1.CallStep{Argv: lang.Compile, TimeoutSeconds: compileTimeout.Seconds()})
	}
	run := &agentv1.CallStep{Argv: lang.Run, Stdin: req.GetStdin(), TimeoutSeconds: runTimeout.Seconds()}
	if lang.Zygote {
		run.ZygoteFile = lang.File
	}
	call.Steps = append(call.Steps, run)

	envName := req.GetEnvironment()
	if envName == "" {
		envName = lang.env()
	}
	key := poolKey{env: envName, memoryMB: memoryClass(memMB), network: len(req.GetNetworkRules()) > 0}
	return lang, call, key, nil
}

func timeout(sec float64, def time.Duration) (time.Duration, error) {
	switch {
	case sec == 0:
		return def, nil
	case sec < 0 || math.IsNaN(sec) || math.IsInf(sec, 0):
		return 0, fmt.Errorf("%v is not a number of seconds", sec)
	}
	d := time.Duration(sec * float64(time.Second))
	if d > MaxTimeout {
		return 0, fmt.Errorf("%v s is over the %s a step may take", sec, MaxTimeout)
	}
	return d, nil
}

func memoryClass(mb int64) int64 {
	for _, c := range memoryClasses {
		if c >= mb+agentOverheadMB {
			return c
		}
	}
	return mb + agentOverheadMB
}

// scratchRel turns a files path into one relative to the scratch
// directory: relative paths stay, absolute ones must lie inside a scratch
// directory (/tmp/call-N/...).
func scratchRel(p string) (string, error) {
	if p == "" || strings.ContainsRune(p, 0) {
		return "", fmt.Errorf("path %q is empty or holds a NUL byte", p)
	}
	if path.IsAbs(p) {
		c := path.Clean(p)
		rest, ok := strings.CutPrefix(c, scratchPrefix)
		i := strings.IndexByte(rest, '/')
		if !ok || i <= 0 {
			return "", fmt.Errorf("path %q is outside the call's scratch directory (give paths relative to it)", p)
		}
		p = rest[i+1:]
	}
	c := path.Clean(p)
	if c == "." || c == ".." || strings.HasPrefix(c, "../") {
		return "", fmt.Errorf("path %q leaves the call's scratch directory", p)
	}
	return c, nil
}

// result turns the agent's answer into SandboxFusion's terms.
func result(lang Language, resp *agentv1.CallResponse) *dsecv1.RunCodeResponse {
	out := &dsecv1.RunCodeResponse{Files: resp.GetFiles()}
	steps := resp.GetSteps()
	var compile, run *agentv1.CallStepResult
	if lang.Compile != nil {
		if len(steps) > 0 {
			compile = steps[0]
		}
		if len(steps) > 1 {
			run = steps[1]
		}
	} else if len(steps) > 0 {
		run = steps[0]
	}
	if compile != nil {
		out.CompileResult = command(compile)
	}
	if run != nil {
		out.RunResult = command(run)
	}
	out.Status = dsecv1.RunStatus_RUN_STATUS_SUCCESS
	for _, r := range []*dsecv1.CommandResult{out.CompileResult, out.RunResult} {
		if r == nil {
			continue
		}
		switch {
		case r.Status == dsecv1.CommandStatus_COMMAND_STATUS_ERROR:
			out.Status = dsecv1.RunStatus_RUN_STATUS_SANDBOX_ERROR
			out.Message = string(r.Stderr)
			return out
		case r.Status == dsecv1.CommandStatus_COMMAND_STATUS_TIME_LIMIT_EXCEEDED, r.GetReturnCode() != 0:
			out.Status = dsecv1.RunStatus_RUN_STATUS_FAILED
		}
	}
	if out.RunResult == nil && out.Status == dsecv1.RunStatus_RUN_STATUS_SUCCESS {
		out.Status = dsecv1.RunStatus_RUN_STATUS_SANDBOX_ERROR
		out.Message = "the call ran no step"
	}
	return out
}

func command(st *agentv1.CallStepResult) *dsecv1.CommandResult {
	e := st.GetExited()
	r := &dsecv1.CommandResult{
		ExecutionTimeSeconds: e.GetDurationSeconds(),
		Stdout:               st.GetStdout(),
		Stderr:               st.GetStderr(),
		StdoutTruncated:      e.GetStdoutTruncated(),
		StderrTruncated:      e.GetStderrTruncated(),
		MemoryLimitExceeded:  st.GetOomKilled(),
	}
	switch e.GetStatus() {
	case dsecv1.ExitStatus_EXIT_STATUS_START_ERROR:
		r.Status = dsecv1.CommandStatus_COMMAND_STATUS_ERROR
		if len(r.Stderr) == 0 {
			r.Stderr = []byte(e.GetMessage())
		}
	case dsecv1.ExitStatus_EXIT_STATUS_TIMEOUT:
		r.Status = dsecv1.CommandStatus_COMMAND_STATUS_TIME_LIMIT_EXCEEDED
	default:
		r.Status = dsecv1.CommandStatus_COMMAND_STATUS_FINISHED
		rc := e.GetExitCode()
		if e.GetSignal() != 0 {
			rc = -e.GetSignal()
		}
		r.ReturnCode = &rc
	}
	return r
}

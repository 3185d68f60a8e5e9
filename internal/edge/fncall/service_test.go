package fncall

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	agentv1 "dsec.dev/dsec/api/gen/dsec/agent/v1"
	dsecv1 "dsec.dev/dsec/api/gen/dsec/v1"
	"dsec.dev/dsec/internal/errdefs"
)

// fakeSandboxes starts containers that answer calls with what answer says.
type fakeSandboxes struct {
	mu         sync.Mutex
	live       map[string]*dsecv1.SandboxSpec
	n          int
	created    atomic.Int32
	failCreate error
	answer     func(id string, req *agentv1.CallRequest) (*agentv1.CallResponse, error)
	calls      []*agentv1.CallRequest
}

func newFake() *fakeSandboxes {
	return &fakeSandboxes{live: map[string]*dsecv1.SandboxSpec{}, answer: func(string, *agentv1.CallRequest) (*agentv1.CallResponse, error) {
		return &agentv1.CallResponse{Steps: []*agentv1.CallStepResult{{Exited: &dsecv1.ExecExited{Status: dsecv1.ExitStatus_EXIT_STATUS_OK}, Stdout: []byte("ok\n")}}}, nil
	}}
}

func (f *fakeSandboxes) Create(ctx context.Context, spec *dsecv1.SandboxSpec) (string, error) {
	f.created.Add(1)
	if f.failCreate != nil {
		return "", f.failCreate
	}
	f.mu.Lock()
	defer f.mu.Unlock()
	f.n++
	id := fmt.Sprintf("sb-%d", f.n)
	f.live[id] = spec
	return id, nil
}

func (f *fakeSandboxes) Delete(ctx context.Context, id string) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	delete(f.live, id)
	return nil
}

func (f *fakeSandboxes) Call(ctx context.Context, id string, req *agentv1.CallRequest) (*agentv1.CallResponse, error) {
	f.mu.Lock()
	f.calls = append(f.calls, req)
	_, ok := f.live[id]
	f.mu.Unlock()
	if !ok {
		return nil, fmt.Errorf("sandbox %s is gone: %w", id, errdefs.ErrNotFound)
	}
	return f.answer(id, req)
}

func (f *fakeSandboxes) liveCount() int {
	f.mu.Lock()
	defer f.mu.Unlock()
	return len(f.live)
}

func newTestService(t *testing.T, sb Sandboxes, pc PoolConfig) *Service {
	t.Helper()
	s := NewService(sb, Config{Node: "n1", Pools: pc})
	s.pools.cpu.readCounts = fakeCPU(1) // an idle node, whatever else runs
	t.Cleanup(s.Close)
	return s
}

// fakeCPU is a node whose CPUs are idle the given share of the time.
func fakeCPU(idleShare float64) func() (uint64, uint64, bool) {
	var all uint64
	return func() (uint64, uint64, bool) {
		all += 1000
		return uint64(float64(all) * idleShare), all, true
	}
}

func TestRunCodeBuildsTheCall(t *testing.T) {
	f := newFake()
	s := newTestService(t, f, PoolConfig{})
	resp, err := s.RunCode(context.Background(), &dsecv1.RunCodeRequest{Language: "cpp", Code: "int main(){}",
		Stdin: []byte("1 2\n"), Files: map[string][]byte{"/tmp/call-7/in/a.txt": []byte("x"), "b.txt": nil},
		FetchFiles: []string{"out.txt"}, MemoryMb: 300, RunTimeoutSeconds: 2})
	if err != nil {
		t.Fatal(err)
	}
	c := f.calls[0]
	if len(c.Steps) != 2 || c.Steps[0].Argv[0] != "g++" || string(c.Steps[1].Stdin) != "1 2\n" || c.Steps[1].TimeoutSeconds != 2 || c.Steps[0].TimeoutSeconds != 10 {
		t.Errorf("steps %v", c.Steps)
	}
	if string(c.Files["tmp_code.cpp"]) != "int main(){}" || string(c.Files["in/a.txt"]) != "x" || len(c.Files) != 3 {
		t.Errorf("files %v", c.Files)
	}
	if c.MemoryBytes != 300<<20 || c.OutputLimitBytes != OutputLimit || c.FetchFiles[0] != "out.txt" {
		t.Errorf("call %v", c)
	}
	if spec := f.live[resp.Container]; spec.GetMemoryMb() != 512 || spec.GetBackend() != dsecv1.Backend_BACKEND_FNCALL || spec.GetEnvironment() != DefaultEnvironment {
		t.Errorf("container spec %v", spec)
	}
	// The fake answered one step: the compile; no run step means no run result.
	if resp.CompileResult == nil || resp.RunResult != nil || resp.Node != "n1" {
		t.Errorf("response %v", resp)
	}

	for _, bad := range []*dsecv1.RunCodeRequest{
		{Language: "cobol", Code: "x"},
		{Language: "python", Code: "x", Files: map[string][]byte{"/etc/passwd": nil}},
		{Language: "python", Code: "x", Files: map[string][]byte{"../x": nil}},
		{Language: "python", Code: "x", Files: map[string][]byte{"tmp_code.py": nil}},
		{Language: "python", Code: "x", FetchFiles: []string{"/tmp/elsewhere"}},
		{Language: "python", Code: "x", RunTimeoutSeconds: -1},
		{Language: "python", Code: "x", MemoryMb: 8},
	} {
		if _, err := s.RunCode(context.Background(), bad); !errors.Is(err, errdefs.ErrInvalidArgument) {
			t.Errorf("%v: %v", bad, err)
		}
	}
}

func TestResultStatuses(t *testing.T) {
	exited := func(st dsecv1.ExitStatus, code, sig int32) *agentv1.CallStepResult {
		return &agentv1.CallStepResult{Exited: &dsecv1.ExecExited{Status: st, ExitCode: code, Signal: sig}, Stderr: []byte("err")}
	}
	ok := exited(dsecv1.ExitStatus_EXIT_STATUS_OK, 0, 0)
	py, cpp := Builtin()["python"], Builtin()["cpp"]
	for _, c := range []struct {
		name   string
		lang   Language
		steps  []*agentv1.CallStepResult
		status dsecv1.RunStatus
		check  func(r *dsecv1.RunCodeResponse) bool
	}{
		{"success", py, []*agentv1.CallStepResult{ok}, dsecv1.RunStatus_RUN_STATUS_SUCCESS,
			func(r *dsecv1.RunCodeResponse) bool {
				return r.RunResult.GetReturnCode() == 0 && r.CompileResult == nil
			}},
		{"runtime error", py, []*agentv1.CallStepResult{exited(dsecv1.ExitStatus_EXIT_STATUS_NONZERO, 1, 0)}, dsecv1.RunStatus_RUN_STATUS_FAILED,
			func(r *dsecv1.RunCodeResponse) bool { return r.RunResult.GetReturnCode() == 1 }},
		{"killed", py, []*agentv1.CallStepResult{exited(dsecv1.ExitStatus_EXIT_STATUS_KILLED, -1, 9)}, dsecv1.RunStatus_RUN_STATUS_FAILED,
			func(r *dsecv1.RunCodeResponse) bool { return r.RunResult.GetReturnCode() == -9 }},
		{"timeout", py, []*agentv1.CallStepResult{exited(dsecv1.ExitStatus_EXIT_STATUS_TIMEOUT, -1, 9)}, dsecv1.RunStatus_RUN_STATUS_FAILED,
			func(r *dsecv1.RunCodeResponse) bool {
				return r.RunResult.ReturnCode == nil && r.RunResult.Status == dsecv1.CommandStatus_COMMAND_STATUS_TIME_LIMIT_EXCEEDED
			}},
		{"could not start", py, []*agentv1.CallStepResult{exited(dsecv1.ExitStatus_EXIT_STATUS_START_ERROR, 127, 0)}, dsecv1.RunStatus_RUN_STATUS_SANDBOX_ERROR,
			func(r *dsecv1.RunCodeResponse) bool { return r.Message == "err" }},
		{"compile error", cpp, []*agentv1.CallStepResult{exited(dsecv1.ExitStatus_EXIT_STATUS_NONZERO, 1, 0)}, dsecv1.RunStatus_RUN_STATUS_FAILED,
			func(r *dsecv1.RunCodeResponse) bool {
				return r.RunResult == nil && r.CompileResult.GetReturnCode() == 1
			}},
		{"compiled and ran", cpp, []*agentv1.CallStepResult{ok, ok}, dsecv1.RunStatus_RUN_STATUS_SUCCESS,
			func(r *dsecv1.RunCodeResponse) bool { return r.RunResult != nil && r.CompileResult != nil }},
	} {
		r := result(c.lang, &agentv1.CallResponse{Steps: c.steps})
		if r.Status != c.status || !c.check(r) {
			t.Errorf("%s: %v", c.name, r)
		}
	}
}

func TestPoolsGrowToTheCeilingAndQueue(t *testing.T) {
	f := newFake()
	release := make(chan struct{})
	var running, peak atomic.Int32
	f.answer = func(string, *agentv1.CallRequest) (*agentv1.CallResponse, error) {
		n := running.Add(1)
		for {
			p := peak.Load()
			if n <= p || peak.CompareAndSwap(p, n) {
				break
			}
		}
		<-release
		running.Add(-1)
		return &agentv1.CallResponse{Steps: []*agentv1.CallStepResult{{Exited: &dsecv1.ExecExited{Status: dsecv1.ExitStatus_EXIT_STATUS_OK}}}}, nil
	}
	s := newTestService(t, f, PoolConfig{MaxPerPool: 3, MaxQueue: 5, MinIdle: 1, IdleRetire: time.Millisecond})
	var wg sync.WaitGroup
	errs := make(chan error, 10)
	call := func() {
		wg.Add(1)
		go func() {
			defer wg.Done()
			_, err := s.RunCode(context.Background(), &dsecv1.RunCodeRequest{Language: "python", Code: "print(1)"})
			errs <- err
		}()
	}
	waitFor := func(what string, cond func() bool) {
		deadline := time.Now().Add(5 * time.Second)
		for !cond() {
			if time.Now().After(deadline) {
				close(release)
				t.Fatalf("timed out waiting for %s", what)
			}
			time.Sleep(time.Millisecond)
		}
	}
	// Three run on the three containers the pool may have, five wait: the
	// queue is full, and one more is refused at once.
	for range 3 {
		call()
	}
	waitFor("3 running", func() bool { return running.Load() == 3 })
	for range 5 {
		call()
	}
	waitFor("5 queued", func() bool { st := s.pools.status(); return len(st) == 1 && st[0].Queue == 5 })
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	if _, err := s.RunCode(ctx, &dsecv1.RunCodeRequest{Language: "python", Code: "print(1)"}); !errors.Is(err, errdefs.ErrResourceExhausted) {
		t.Errorf("a call over the queue bound: %v", err)
	}
	close(release)
	wg.Wait()
	close(errs)
	for err := range errs {
		if err != nil {
			t.Error(err)
		}
	}
	if p := peak.Load(); p != 3 || f.created.Load() != 3 {
		t.Errorf("peak %d calls at once on %d containers; want 3 on 3", p, f.created.Load())
	}
	// Idle containers above the floor retire.
	s.pools.trim(time.Now().Add(time.Hour))
	deadline := time.Now().Add(5 * time.Second)
	for f.liveCount() != 1 && time.Now().Before(deadline) {
		time.Sleep(time.Millisecond)
	}
	if n := f.liveCount(); n != 1 {
		t.Errorf("%d containers left after trim; want the floor of 1", n)
	}
}

func TestDirtyOrBrokenContainersRetired(t *testing.T) {
	f := newFake()
	var n atomic.Int32
	f.answer = func(id string, req *agentv1.CallRequest) (*agentv1.CallResponse, error) {
		switch n.Add(1) {
		case 1:
			return &agentv1.CallResponse{Dirty: true, DirtyReason: "a process survived",
				Steps: []*agentv1.CallStepResult{{Exited: &dsecv1.ExecExited{Status: dsecv1.ExitStatus_EXIT_STATUS_OK}}}}, nil
		case 2:
			return nil, fmt.Errorf("agent stopped answering: %w", errdefs.ErrUnavailable)
		}
		return &agentv1.CallResponse{Steps: []*agentv1.CallStepResult{{Exited: &dsecv1.ExecExited{Status: dsecv1.ExitStatus_EXIT_STATUS_OK}}}}, nil
	}
	s := newTestService(t, f, PoolConfig{})
	req := &dsecv1.RunCodeRequest{Language: "python", Code: "print(1)"}
	r1, err := s.RunCode(context.Background(), req)
	if err != nil || r1.Status != dsecv1.RunStatus_RUN_STATUS_SUCCESS {
		t.Fatalf("first: %v %v", r1, err)
	}
	// The second call breaks its container and runs again on a new one.
	r2, err := s.RunCode(context.Background(), req)
	if err != nil || r2.Status != dsecv1.RunStatus_RUN_STATUS_SUCCESS {
		t.Fatalf("second: %v %v", r2, err)
	}
	if r2.Container == r1.Container || f.created.Load() != 3 {
		t.Errorf("containers %s then %s, %d created; want each retired and 3 made", r1.Container, r2.Container, f.created.Load())
	}
	deadline := time.Now().Add(5 * time.Second)
	for f.liveCount() != 1 && time.Now().Before(deadline) {
		time.Sleep(time.Millisecond)
	}
	if n := f.liveCount(); n != 1 {
		t.Errorf("%d live containers; want 1", n)
	}
}

func TestCreateFailureReachesTheCaller(t *testing.T) {
	f := newFake()
	f.failCreate = fmt.Errorf("environment fncall:latest: %w", errdefs.ErrNotFound)
	s := newTestService(t, f, PoolConfig{})
	_, err := s.RunCode(context.Background(), &dsecv1.RunCodeRequest{Language: "python", Code: "print(1)"})
	if !errors.Is(err, errdefs.ErrNotFound) {
		t.Errorf("got %v", err)
	}
}

func TestCloseRemovesEveryContainer(t *testing.T) {
	f := newFake()
	s := NewService(f, Config{Node: "n1"})
	for range 3 {
		if _, err := s.RunCode(context.Background(), &dsecv1.RunCodeRequest{Language: "python", Code: "print(1)"}); err != nil {
			t.Fatal(err)
		}
	}
	s.Close()
	if n := f.liveCount(); n != 0 {
		t.Errorf("%d containers left after Close", n)
	}
}

// TestPoolsGrowPastTheSoftCeilingOnlyForLongCalls: short calls queue for
// the containers there are (more would only share the CPUs out); calls
// that sleep make the pool grow to its ceiling.
func TestPoolsGrowPastTheSoftCeilingOnlyForLongCalls(t *testing.T) {
	for _, c := range []struct {
		name  string
		delay time.Duration
		want  int32
		busy  bool // the node's CPUs have no time to spare
	}{{"short calls", time.Millisecond, 2, false}, {"long calls", 300 * time.Millisecond, 5, false}, {"long calls on a busy node", 300 * time.Millisecond, 2, true}} {
		t.Run(c.name, func(t *testing.T) {
			f := newFake()
			f.answer = func(string, *agentv1.CallRequest) (*agentv1.CallResponse, error) {
				time.Sleep(c.delay)
				return &agentv1.CallResponse{Steps: []*agentv1.CallStepResult{{Exited: &dsecv1.ExecExited{Status: dsecv1.ExitStatus_EXIT_STATUS_OK}}}}, nil
			}
			s := newTestService(t, f, PoolConfig{SoftMaxPerPool: 2, MaxPerPool: 5, StallAge: 50 * time.Millisecond})
			if c.busy {
				s.pools.cpu.readCounts = fakeCPU(0.05)
			}
			req := &dsecv1.RunCodeRequest{Language: "python", Code: "print(1)"}
			// Two containers first, then a steady stream of 10 callers.
			var wg sync.WaitGroup
			for range 2 {
				wg.Add(1)
				go func() { defer wg.Done(); s.RunCode(context.Background(), req) }()
			}
			wg.Wait()
			deadline := time.Now().Add(time.Second)
			for range 10 {
				wg.Add(1)
				go func() {
					defer wg.Done()
					for time.Now().Before(deadline) {
						if _, err := s.RunCode(context.Background(), req); err != nil {
							t.Error(err)
							return
						}
					}
				}()
			}
			wg.Wait()
			if n := f.created.Load(); n != c.want {
				t.Errorf("%d containers made; want %d", n, c.want)
			}
		})
	}
}

// TestPoolShrinksToTheSoftCeilingForShortCalls: a pool grown past its soft
// ceiling for long calls gives the extra containers up once its calls are
// short again, although calls never stop queueing.
func TestPoolShrinksToTheSoftCeilingForShortCalls(t *testing.T) {
	f := newFake()
	var delay atomic.Int64
	delay.Store(int64(300 * time.Millisecond))
	f.answer = func(string, *agentv1.CallRequest) (*agentv1.CallResponse, error) {
		time.Sleep(time.Duration(delay.Load()))
		return &agentv1.CallResponse{Steps: []*agentv1.CallStepResult{{Exited: &dsecv1.ExecExited{Status: dsecv1.ExitStatus_EXIT_STATUS_OK}}}}, nil
	}
	s := newTestService(t, f, PoolConfig{SoftMaxPerPool: 2, MaxPerPool: 5, StallAge: 20 * time.Millisecond})
	req := &dsecv1.RunCodeRequest{Language: "python", Code: "print(1)"}
	stop := make(chan struct{})
	var wg sync.WaitGroup
	var failed atomic.Int32
	for range 10 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for {
				select {
				case <-stop:
					return
				default:
				}
				if _, err := s.RunCode(context.Background(), req); err != nil {
					failed.Add(1)
					t.Error(err)
					return
				}
			}
		}()
	}
	defer func() { close(stop); wg.Wait() }()
	waitFor := func(what string, ok func(n int) bool) {
		t.Helper()
		for deadline := time.Now().Add(5 * time.Second); !ok(f.liveCount()); time.Sleep(5 * time.Millisecond) {
			if time.Now().After(deadline) {
				t.Fatalf("%s: %d containers live", what, f.liveCount())
			}
		}
	}
	waitFor("long calls grow the pool to its ceiling", func(n int) bool { return n == 5 })
	delay.Store(int64(time.Millisecond))
	waitFor("short calls shrink it to its soft ceiling", func(n int) bool { return n == 2 })
	// And it stays there while the short calls go on queueing.
	time.Sleep(300 * time.Millisecond)
	if n := f.liveCount(); n != 2 {
		t.Errorf("%d containers live under short calls; want the soft ceiling of 2", n)
	}
	if failed.Load() > 0 {
		t.Errorf("%d calls failed while the pool shrank", failed.Load())
	}
}

// TestColdBurstStopsAtTheSoftCeiling: a burst of short calls on a cold
// pool starts the soft ceiling's containers, not one per call.
func TestColdBurstStopsAtTheSoftCeiling(t *testing.T) {
	f := newFake()
	f.answer = func(string, *agentv1.CallRequest) (*agentv1.CallResponse, error) {
		time.Sleep(time.Millisecond)
		return &agentv1.CallResponse{Steps: []*agentv1.CallStepResult{{Exited: &dsecv1.ExecExited{Status: dsecv1.ExitStatus_EXIT_STATUS_OK}}}}, nil
	}
	s := newTestService(t, f, PoolConfig{SoftMaxPerPool: 3, MaxPerPool: 64, StallAge: 50 * time.Millisecond})
	var wg sync.WaitGroup
	for range 40 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			if _, err := s.RunCode(context.Background(), &dsecv1.RunCodeRequest{Language: "python", Code: "print(1)"}); err != nil {
				t.Error(err)
			}
		}()
	}
	wg.Wait()
	if n := f.created.Load(); n != 3 {
		t.Errorf("%d containers made for a burst of 40 short calls; want the soft ceiling of 3", n)
	}
}

func TestCPUIdle(t *testing.T) {
	c := newCPUIdle()
	counts := [][2]uint64{{100, 1000}, {400, 2000}, {400, 3000}}
	i := 0
	c.readCounts = func() (uint64, uint64, bool) { v := counts[i]; i++; return v[0], v[1], true }
	now := time.Now()
	if f := c.fraction(now); f != 0 {
		t.Errorf("first sample: %v, want 0 (no interval yet)", f)
	}
	if f := c.fraction(now.Add(time.Millisecond)); f != 0 || i != 1 {
		t.Errorf("within minPeriod: %v after %d reads", f, i)
	}
	if f := c.fraction(now.Add(time.Second)); f != 0.3 {
		t.Errorf("second interval: %v, want 0.3", f)
	}
	if f := c.fraction(now.Add(2 * time.Second)); f != 0 {
		t.Errorf("third interval: %v, want 0", f)
	}
	if idle, all, ok := procStat(); !ok || idle > all || all == 0 {
		t.Errorf("this node's /proc/stat: idle %d of %d, ok %v", idle, all, ok)
	}
}

// TestCallsOwnFaultIsItsAnswer: an agent refusing a call for the call's
// own sake (its files do not fit) answers SandboxError once, not a retry
// on another container or an overload.
func TestCallsOwnFaultIsItsAnswer(t *testing.T) {
	f := newFake()
	f.answer = func(string, *agentv1.CallRequest) (*agentv1.CallResponse, error) {
		return nil, fmt.Errorf("write file big.bin: no space left on device: %w", errdefs.ErrResourceExhausted)
	}
	s := newTestService(t, f, PoolConfig{})
	r, err := s.RunCode(context.Background(), &dsecv1.RunCodeRequest{Language: "python", Code: "print(1)"})
	if err != nil || r.Status != dsecv1.RunStatus_RUN_STATUS_SANDBOX_ERROR || f.created.Load() != 1 {
		t.Errorf("got %v, %v after %d containers", r, err, f.created.Load())
	}
}

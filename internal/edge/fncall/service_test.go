package fncall

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	agentv1 "dsec.dev/dsec/api/gen/dsec/agent/v1"
	dsecv1 "dsec.dev/dsec/api/gen/dsec/v1"
	"dsec.dev/dsec/internal/errdefs"
	"dsec.dev/dsec/internal/testutil"
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
	s.pools.mem.read = func() (int64, bool) { return 1 << 30, true } // room for any container
	t.Cleanup(s.Close)
	return s
}

// roomFor makes s's node hold n containers for calls of the default
// memory limit: the n-th leaves just room for its call's limit, and each
// of f's live containers takes its overhead.
func roomFor(s *Service, f *fakeSandboxes, n int) {
	base := int64(DefaultMemoryMB) + int64(n)*agentOverheadMB + agentOverheadMB/2
	s.pools.mu.Lock()
	defer s.pools.mu.Unlock()
	s.pools.mem.minPeriod = 0
	s.pools.mem.read = func() (int64, bool) { return base - int64(f.liveCount())*agentOverheadMB, true }
}

func okAnswer() (*agentv1.CallResponse, error) {
	return &agentv1.CallResponse{Steps: []*agentv1.CallStepResult{{Exited: &dsecv1.ExecExited{Status: dsecv1.ExitStatus_EXIT_STATUS_OK}}}}, nil
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
	if len(c.Steps) != 2 || c.Steps[0].Argv[0] != "g++" || string(c.Steps[1].Stdin) != "1 2\n" || c.Steps[1].TimeoutSeconds != 2 || c.Steps[0].TimeoutSeconds > 10 || c.Steps[0].TimeoutSeconds < 9 {
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
	s := newTestService(t, f, PoolConfig{MaxPerPool: 3, MaxQueue: 5, MinIdle: 1, IdleRetire: time.Millisecond, MaxStartDelay: time.Minute})
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
// that sleep make the pool grow to its ceiling, as far as the node's
// memory holds containers.
func TestPoolsGrowPastTheSoftCeilingOnlyForLongCalls(t *testing.T) {
	for _, c := range []struct {
		name  string
		delay time.Duration
		room  int // containers the node's memory holds; 0 = any number
		want  int32
	}{{"short calls", time.Millisecond, 0, 2}, {"long calls", 300 * time.Millisecond, 0, 5}, {"long calls, memory for 3", 300 * time.Millisecond, 3, 3}} {
		t.Run(c.name, func(t *testing.T) {
			f := newFake()
			f.answer = func(string, *agentv1.CallRequest) (*agentv1.CallResponse, error) {
				time.Sleep(c.delay)
				return okAnswer()
			}
			s := newTestService(t, f, PoolConfig{SoftMaxPerPool: 2, MaxPerPool: 5, LookEvery: 10 * time.Millisecond, MaxStartDelay: 200 * time.Millisecond})
			if c.room > 0 {
				roomFor(s, f, c.room)
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
						// A call the pool cannot take in time is refused
						// (TestRefusedPastTheStartBound); this test counts
						// the containers.
						if _, err := s.RunCode(context.Background(), req); err != nil && !errors.Is(err, errdefs.ErrResourceExhausted) {
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

// TestLongCallsStartAtOnce: a burst of calls that hold their containers
// (CPU-bound loops, say) all start, each on a container of its own, as
// SandboxFusion starts every call at once; none waits for another to end,
// however busy the node's CPUs.
func TestLongCallsStartAtOnce(t *testing.T) {
	f := newFake()
	release := make(chan struct{})
	var running atomic.Int32
	var mu sync.Mutex
	var timeouts []float64
	f.answer = func(_ string, req *agentv1.CallRequest) (*agentv1.CallResponse, error) {
		mu.Lock()
		timeouts = append(timeouts, req.Steps[0].TimeoutSeconds)
		mu.Unlock()
		running.Add(1)
		<-release
		return okAnswer()
	}
	s := newTestService(t, f, PoolConfig{SoftMaxPerPool: 2, LookEvery: 10 * time.Millisecond, MaxStartDelay: 400 * time.Millisecond})
	const n = 12
	var wg sync.WaitGroup
	errs := make(chan error, n)
	for i := range n {
		wg.Add(1)
		go func() {
			defer wg.Done()
			// Arrivals spread over a few look periods, as on a busy
			// node: the pool decides their containers over several
			// looks, while the first ones come up.
			time.Sleep(time.Duration(i) * 3 * time.Millisecond)
			_, err := s.RunCode(context.Background(), &dsecv1.RunCodeRequest{Language: "python", Code: "while True: pass", RunTimeoutSeconds: 5})
			errs <- err
		}()
	}
	// Every call runs before any ends: none of them waits for another.
	testutil.WaitFor(t, 10*time.Second, "every call of the burst running", func() bool { return running.Load() == n })
	close(release)
	wg.Wait()
	close(errs)
	for err := range errs {
		if err != nil {
			t.Error(err)
		}
	}
	if c := f.created.Load(); c != n {
		t.Errorf("%d containers for %d calls that hold theirs", c, n)
	}
	// The time they waited for a container came off their run timeout.
	for _, to := range timeouts {
		if to <= 0 || to >= 5 {
			t.Errorf("run timeout %v s handed to the agent; want under the call's 5 s by its wait", to)
		}
	}
}

// TestRefusedPastTheStartBound: a call that no container can take within
// MaxStartDelay (the node's memory holds no more, the long calls hold
// theirs) is refused with ResourceExhausted, saying why, rather than left
// waiting past its caller's patience.
func TestRefusedPastTheStartBound(t *testing.T) {
	f := newFake()
	release := make(chan struct{})
	f.answer = func(string, *agentv1.CallRequest) (*agentv1.CallResponse, error) {
		<-release
		return okAnswer()
	}
	s := newTestService(t, f, PoolConfig{SoftMaxPerPool: 1, LookEvery: 10 * time.Millisecond, MaxStartDelay: 200 * time.Millisecond})
	roomFor(s, f, 2)
	var wg sync.WaitGroup
	errs := make(chan error, 5)
	for range 5 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			_, err := s.RunCode(context.Background(), &dsecv1.RunCodeRequest{Language: "python", Code: "while True: pass"})
			errs <- err
		}()
	}
	var refused []error
	for range 3 {
		refused = append(refused, <-errs)
	}
	close(release)
	wg.Wait()
	close(errs)
	for _, err := range refused {
		if !errors.Is(err, errdefs.ErrResourceExhausted) || !strings.Contains(err.Error(), "memory") {
			t.Errorf("a call past the start bound: %v; want ResourceExhausted naming the node's memory", err)
		}
	}
	for err := range errs {
		if err != nil {
			t.Errorf("a call on one of the 2 containers: %v", err)
		}
	}
	if c := f.created.Load(); c != 2 {
		t.Errorf("%d containers made; the node's memory held 2", c)
	}
}

// TestTimeoutsCountFromArrival: a call's time waiting for a container
// counts against its first step; one whose time ran out while it waited
// exceeded its time limit without reaching a container's agent.
func TestTimeoutsCountFromArrival(t *testing.T) {
	f := newFake()
	hold := make(chan struct{})
	var n atomic.Int32
	f.answer = func(string, *agentv1.CallRequest) (*agentv1.CallResponse, error) {
		if n.Add(1) == 1 {
			<-hold
		}
		return okAnswer()
	}
	s := newTestService(t, f, PoolConfig{MaxPerPool: 1, MaxStartDelay: time.Minute})
	done := make(chan struct{})
	go func() {
		defer close(done)
		s.RunCode(context.Background(), &dsecv1.RunCodeRequest{Language: "python", Code: "import time; time.sleep(1)"})
	}()
	testutil.WaitFor(t, 5*time.Second, "the first call running", func() bool { return n.Load() == 1 })
	type answer struct {
		r   *dsecv1.RunCodeResponse
		err error
	}
	late, later := make(chan answer, 1), make(chan answer, 1)
	go func() {
		r, err := s.RunCode(context.Background(), &dsecv1.RunCodeRequest{Language: "cpp", Code: "int main(){}", CompileTimeoutSeconds: 0.2})
		late <- answer{r, err}
	}()
	go func() {
		r, err := s.RunCode(context.Background(), &dsecv1.RunCodeRequest{Language: "python", Code: "print(1)", RunTimeoutSeconds: 30})
		later <- answer{r, err}
	}()
	testutil.WaitFor(t, 5*time.Second, "two calls queued", func() bool { _, q, _ := s.Load(); return q == 2 })
	time.Sleep(300 * time.Millisecond) // past the first's compile timeout
	close(hold)
	<-done
	a := <-late
	if a.err != nil || a.r.Status != dsecv1.RunStatus_RUN_STATUS_FAILED || a.r.GetCompileResult().GetStatus() != dsecv1.CommandStatus_COMMAND_STATUS_TIME_LIMIT_EXCEEDED || a.r.RunResult != nil {
		t.Errorf("a call that waited past its compile timeout: %v %v; want its compile step over its time limit", a.r, a.err)
	}
	if a.r != nil && !strings.Contains(a.r.Message, "waited") {
		t.Errorf("its message %q does not say it waited", a.r.Message)
	}
	b := <-later
	if b.err != nil || b.r.Status != dsecv1.RunStatus_RUN_STATUS_SUCCESS {
		t.Fatalf("a call that waited within its timeout: %v %v", b.r, b.err)
	}
	f.mu.Lock()
	defer f.mu.Unlock()
	if len(f.calls) != 2 {
		t.Fatalf("the agent got %d calls; want the first and the last (the late one never reached it)", len(f.calls))
	}
	if to := f.calls[1].Steps[0].TimeoutSeconds; to >= 29.7 || to <= 0 {
		t.Errorf("the agent got a run timeout of %v s after a wait of 0.3 s or more; want under 29.7", to)
	}
}

// TestShortCallsAfterABurstKeepToTheSoftCeiling: after long calls grew a
// pool past its soft ceiling, short calls run on the soft ceiling's
// containers, not spread over all (they would only share the CPUs out),
// while the others stay warm for the next burst.
func TestShortCallsAfterABurstKeepToTheSoftCeiling(t *testing.T) {
	f := newFake()
	var delay atomic.Int64
	delay.Store(int64(300 * time.Millisecond))
	var running, peak atomic.Int32
	f.answer = func(string, *agentv1.CallRequest) (*agentv1.CallResponse, error) {
		n := running.Add(1)
		for p := peak.Load(); n > p && !peak.CompareAndSwap(p, n); p = peak.Load() {
		}
		time.Sleep(time.Duration(delay.Load()))
		running.Add(-1)
		return okAnswer()
	}
	s := newTestService(t, f, PoolConfig{SoftMaxPerPool: 2, MaxPerPool: 5, LookEvery: 10 * time.Millisecond, MaxStartDelay: 200 * time.Millisecond})
	req := &dsecv1.RunCodeRequest{Language: "python", Code: "print(1)"}
	stop := make(chan struct{})
	var wg sync.WaitGroup
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
				// Past the pool's ceiling some long calls are refused
				// (TestRefusedPastTheStartBound), and tried again.
				if _, err := s.RunCode(context.Background(), req); err != nil && !errors.Is(err, errdefs.ErrResourceExhausted) {
					t.Error(err)
					return
				}
			}
		}()
	}
	defer func() { close(stop); wg.Wait() }()
	testutil.WaitFor(t, 5*time.Second, "long calls growing the pool to its ceiling", func() bool { return f.liveCount() == 5 })
	delay.Store(int64(time.Millisecond))
	// The long calls end within their 300 ms; then only short ones run.
	time.Sleep(500 * time.Millisecond)
	peak.Store(0)
	time.Sleep(300 * time.Millisecond)
	if p := peak.Load(); p > 2 {
		t.Errorf("%d short calls ran at once; want at most the soft ceiling of 2", p)
	}
	if n := f.liveCount(); n != 5 {
		t.Errorf("%d containers live; want the 5 the burst grew, idle until they retire", n)
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
	s := newTestService(t, f, PoolConfig{SoftMaxPerPool: 3, MaxPerPool: 64, LookEvery: 10 * time.Millisecond})
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

// TestHeldByLong: a pool's containers are held by long calls when at
// least half of its running calls are old; its waiters past the soft
// ceiling get containers of their own once they waited patience() then,
// and not while the running calls are young (short calls, or a storm of
// them slowed down by busy CPUs).
func TestHeldByLong(t *testing.T) {
	ps := newPools(newFake(), PoolConfig{MaxStartDelay: 2 * time.Second}, slog.New(slog.DiscardHandler))
	patience := ps.patience()
	now := time.Now()
	for _, c := range []struct {
		name    string
		running []time.Duration // the running calls' ages
		waited  []time.Duration // the waiters', first to last
		want    int
	}{
		{"loops", []time.Duration{time.Second, time.Second}, []time.Duration{time.Second, patience, patience / 2}, 2},
		{"loops among short calls", []time.Duration{2 * time.Second, 3 * time.Second, 10 * time.Millisecond}, []time.Duration{time.Second}, 1},
		{"short calls", []time.Duration{10 * time.Millisecond, 30 * time.Millisecond}, []time.Duration{time.Second}, 0},
		{"a storm slowed down", []time.Duration{300 * time.Millisecond, 200 * time.Millisecond, time.Second}, []time.Duration{time.Second}, 0},
		{"waiters that have not waited long", []time.Duration{time.Second}, []time.Duration{patience / 2}, 0},
	} {
		t.Run(c.name, func(t *testing.T) {
			p := &pool{busy: map[*member]time.Time{}}
			for _, age := range c.running {
				p.busy[&member{}] = now.Add(-age)
			}
			for _, w := range c.waited {
				p.waiters = append(p.waiters, &waiter{since: now.Add(-w)})
			}
			if got := ps.ownLocked(p, now); got != c.want {
				t.Errorf("%d waiters need a container of their own, want %d", got, c.want)
			}
		})
	}
}

func TestMemAvailable(t *testing.T) {
	m := newMemAvailable()
	reads := 0
	m.read = func() (int64, bool) { reads++; return int64(1000 * reads), true }
	now := time.Now()
	if mb, ok := m.availableMB(now); !ok || mb != 1000 {
		t.Errorf("first read: %d %v", mb, ok)
	}
	if mb, _ := m.availableMB(now.Add(time.Millisecond)); mb != 1000 || reads != 1 {
		t.Errorf("within minPeriod: %d after %d reads", mb, reads)
	}
	if mb, _ := m.availableMB(now.Add(time.Second)); mb != 2000 {
		t.Errorf("after minPeriod: %d", mb)
	}
	if mb, ok := procMemAvailable(); !ok || mb <= 0 {
		t.Errorf("this node's MemAvailable: %d MiB, ok %v", mb, ok)
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

// TestStartsNoLongerNeededAreDropped: starts decided on wait for a start
// slot (MaxCreating), and one whose waiter is gone by then creates
// nothing.
func TestStartsNoLongerNeededAreDropped(t *testing.T) {
	f := newFake()
	gate := make(chan struct{})
	create := f.Create
	sb := createHook{f, func(ctx context.Context, spec *dsecv1.SandboxSpec) (string, error) {
		<-gate
		return create(ctx, spec)
	}}
	s := newTestService(t, sb, PoolConfig{SoftMaxPerPool: 2, MaxCreating: 1, MaxStartDelay: time.Minute})
	req := &dsecv1.RunCodeRequest{Language: "python", Code: "print(1)"}
	first := make(chan error, 1)
	go func() { _, err := s.RunCode(context.Background(), req); first <- err }()
	ctx, cancel := context.WithCancel(context.Background())
	second := make(chan error, 1)
	go func() { _, err := s.RunCode(ctx, req); second <- err }()
	testutil.WaitFor(t, 5*time.Second, "two starts decided on", func() bool {
		st := s.Pools()
		return len(st) == 1 && st[0].Starting == 2
	})
	cancel()
	if err := <-second; !errors.Is(err, context.Canceled) {
		t.Errorf("the call that left: %v", err)
	}
	close(gate)
	if err := <-first; err != nil {
		t.Fatal(err)
	}
	testutil.WaitFor(t, 5*time.Second, "no start left", func() bool { return s.Pools()[0].Starting == 0 })
	if n := f.created.Load(); n != 1 {
		t.Errorf("%d containers made; want 1, the second start dropped with its call gone", n)
	}
}

// createHook is f with its Create replaced.
type createHook struct {
	*fakeSandboxes
	create func(ctx context.Context, spec *dsecv1.SandboxSpec) (string, error)
}

func (h createHook) Create(ctx context.Context, spec *dsecv1.SandboxSpec) (string, error) {
	return h.create(ctx, spec)
}

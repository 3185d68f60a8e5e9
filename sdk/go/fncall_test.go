package dsec

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"net/http/httptest"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"connectrpc.com/connect"
	"github.com/google/go-cmp/cmp"
	"google.golang.org/protobuf/proto"

	dsecv1 "dsec.dev/dsec/api/gen/dsec/v1"
	"dsec.dev/dsec/api/gen/dsec/v1/dsecv1connect"
)

// fakeFnCall answers FnCallService like a runner: run (if set) answers each
// call; by default a call's stdout is its stdin reversed, and language
// "cobol" is unknown. A batch runs its calls at once, as the apiserver does.
type fakeFnCall struct {
	dsecv1connect.UnimplementedFnCallServiceHandler
	run      func(*dsecv1.RunCodeRequest) (*dsecv1.RunCodeResponse, error)
	mu       sync.Mutex
	requests []proto.Message
	deadline []time.Duration
	running  atomic.Int32
	most     atomic.Int32
}

func (f *fakeFnCall) got(ctx context.Context, m proto.Message) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.requests = append(f.requests, m)
	if dl, ok := ctx.Deadline(); ok {
		f.deadline = append(f.deadline, time.Until(dl))
	}
}

func (f *fakeFnCall) one(m *dsecv1.RunCodeRequest) (*dsecv1.RunCodeResponse, error) {
	n := f.running.Add(1)
	defer f.running.Add(-1)
	for {
		most := f.most.Load()
		if n <= most || f.most.CompareAndSwap(most, n) {
			break
		}
	}
	if f.run != nil {
		return f.run(m)
	}
	if m.GetLanguage() == "cobol" {
		return nil, connect.NewError(connect.CodeInvalidArgument, errors.New(`language "cobol" is not known`))
	}
	out := []byte(strings.TrimSpace(string(m.GetStdin())))
	for i, j := 0, len(out)-1; i < j; i, j = i+1, j-1 {
		out[i], out[j] = out[j], out[i]
	}
	return &dsecv1.RunCodeResponse{Status: dsecv1.RunStatus_RUN_STATUS_SUCCESS, Node: "fake",
		RunResult: &dsecv1.CommandResult{Status: dsecv1.CommandStatus_COMMAND_STATUS_FINISHED, ReturnCode: proto.Int32(0),
			Stdout: append(out, '\n')}}, nil
}

func (f *fakeFnCall) RunCode(ctx context.Context, r *connect.Request[dsecv1.RunCodeRequest]) (*connect.Response[dsecv1.RunCodeResponse], error) {
	f.got(ctx, r.Msg)
	resp, err := f.one(r.Msg)
	if err != nil {
		return nil, err
	}
	return connect.NewResponse(resp), nil
}

func (f *fakeFnCall) RunCodeBatch(ctx context.Context, r *connect.Request[dsecv1.RunCodeBatchRequest]) (*connect.Response[dsecv1.RunCodeBatchResponse], error) {
	f.got(ctx, r.Msg)
	out := make([]*dsecv1.RunCodeResponse, len(r.Msg.GetCalls()))
	var wg sync.WaitGroup
	for i, c := range r.Msg.GetCalls() {
		wg.Go(func() {
			resp, err := f.one(c)
			if err != nil {
				resp = &dsecv1.RunCodeResponse{Status: dsecv1.RunStatus_RUN_STATUS_SANDBOX_ERROR, Message: err.Error()}
			}
			out[i] = resp
		})
	}
	wg.Wait()
	return connect.NewResponse(&dsecv1.RunCodeBatchResponse{Results: out}), nil
}

func (f *fakeFnCall) ListLanguages(ctx context.Context, r *connect.Request[dsecv1.ListLanguagesRequest]) (*connect.Response[dsecv1.ListLanguagesResponse], error) {
	f.got(ctx, r.Msg)
	return connect.NewResponse(&dsecv1.ListLanguagesResponse{Languages: []*dsecv1.Language{
		{Name: "python", Environment: "fncall:latest", SourceFile: "tmp_code.py", RunArgv: []string{"python", "tmp_code.py"}, Zygote: true},
		{Name: "cpp", Environment: "fncall:latest", Compiled: true, SourceFile: "tmp_code.cpp",
			CompileArgv: []string{"g++", "tmp_code.cpp", "-o", "test"}, RunArgv: []string{"./test"}},
	}}), nil
}

func (f *fakeFnCall) last() proto.Message {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.requests[len(f.requests)-1]
}

func startFnFake(t *testing.T, f *fakeFnCall) *Client {
	t.Helper()
	noToken(t)
	mux := http.NewServeMux()
	mux.Handle(dsecv1connect.NewFnCallServiceHandler(f))
	srv := httptest.NewServer(mux)
	t.Cleanup(srv.Close)
	c, err := NewClient(srv.URL)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	return c
}

func TestRunCodeRequestAndResult(t *testing.T) {
	f := &fakeFnCall{run: func(*dsecv1.RunCodeRequest) (*dsecv1.RunCodeResponse, error) {
		return &dsecv1.RunCodeResponse{Status: dsecv1.RunStatus_RUN_STATUS_FAILED, Message: "m", Node: "n1", Container: "sb-n1-x",
			Files: map[string][]byte{"out.txt": []byte("o")},
			CompileResult: &dsecv1.CommandResult{Status: dsecv1.CommandStatus_COMMAND_STATUS_FINISHED, ReturnCode: proto.Int32(0),
				ExecutionTimeSeconds: 0.25},
			RunResult: &dsecv1.CommandResult{Status: dsecv1.CommandStatus_COMMAND_STATUS_TIME_LIMIT_EXCEEDED, Stdout: []byte("so far"),
				StdoutTruncated: true, MemoryLimitExceeded: true, ExecutionTimeSeconds: 2}}, nil
	}}
	c := startFnFake(t, f)
	req := RunCodeRequest{Language: "cpp", Code: "int main(){}", Stdin: []byte("in"), Files: map[string][]byte{"a/b": []byte("x")},
		FetchFiles: []string{"out.txt"}, CompileTimeout: 3 * time.Second, RunTimeout: 2500 * time.Millisecond, MemoryMB: 256, CPUs: 0.5,
		NetworkRules: map[string]bool{"pypi": true}, Environment: "fncall:1"}
	r, err := c.RunCode(t.Context(), req)
	if err != nil {
		t.Fatal(err)
	}
	want := &dsecv1.RunCodeRequest{Language: "cpp", Code: "int main(){}", Stdin: []byte("in"), Files: map[string][]byte{"a/b": []byte("x")},
		FetchFiles: []string{"out.txt"}, CompileTimeoutSeconds: 3, RunTimeoutSeconds: 2.5, MemoryMb: 256, Cpus: 0.5,
		NetworkRules: map[string]bool{"pypi": true}, Environment: "fncall:1"}
	if got := f.last(); !proto.Equal(got, want) {
		t.Errorf("sent %v, want %v", got, want)
	}
	zero := 0
	wantRes := &RunCodeResult{Status: RunFailed, Message: "m", Node: "n1", Container: "sb-n1-x", Files: map[string][]byte{"out.txt": []byte("o")},
		Compile: &CommandResult{Status: CommandFinished, ReturnCode: &zero, ExecutionTime: 250 * time.Millisecond},
		Run: &CommandResult{Status: CommandTimeLimitExceeded, Stdout: []byte("so far"), StdoutTruncated: true, MemoryLimitExceeded: true,
			ExecutionTime: 2 * time.Second}}
	if d := cmp.Diff(wantRes, r); d != "" {
		t.Errorf("result (-want +got):\n%s", d)
	}
	if r.OK() || r.Stdout() != "so far" || r.Stderr() != "" {
		t.Errorf("OK %v, Stdout %q", r.OK(), r.Stdout())
	}
	// The default deadline covers both steps: 3 + 2.5 + 30 s.
	if dl := f.deadline[0]; dl < 35*time.Second || dl > 35500*time.Millisecond {
		t.Errorf("deadline %v, want about 35.5s", dl)
	}
	if (&RunCodeResult{}).Stdout() != "" {
		t.Error("Stdout without a run step")
	}
}

func TestRunCodeErrors(t *testing.T) {
	c := startFnFake(t, &fakeFnCall{})
	if _, err := c.RunCode(t.Context(), RunCodeRequest{Language: "cobol", Code: "x"}); !errors.Is(err, ErrInvalidArgument) ||
		!strings.Contains(err.Error(), `language "cobol" is not known`) {
		t.Errorf("unknown language: %v", err)
	}
	for _, req := range []RunCodeRequest{{Code: "x"}, {Language: "python", RunTimeout: -time.Second}, {Language: "python", MemoryMB: -1}} {
		if _, err := c.RunCode(t.Context(), req); !errors.Is(err, ErrInvalidArgument) {
			t.Errorf("RunCode(%+v): %v", req, err)
		}
	}

	var calls atomic.Int32
	full := startFnFake(t, &fakeFnCall{run: func(*dsecv1.RunCodeRequest) (*dsecv1.RunCodeResponse, error) {
		calls.Add(1)
		return nil, connect.NewError(connect.CodeResourceExhausted, errors.New("fncall queue of node n1 is full"))
	}})
	if _, err := full.RunCode(t.Context(), RunCodeRequest{Language: "python"}); !errors.Is(err, ErrOverloaded) || calls.Load() != 1 {
		t.Errorf("full node: %v after %d calls", err, calls.Load())
	}
}

func TestRunCodeRetriesUnlessNetworkRules(t *testing.T) {
	var calls atomic.Int32
	c := startFnFake(t, &fakeFnCall{run: func(*dsecv1.RunCodeRequest) (*dsecv1.RunCodeResponse, error) {
		if calls.Add(1)%2 == 1 {
			return nil, connect.NewError(connect.CodeUnavailable, errors.New("no healthy node runs the fncall backend"))
		}
		return &dsecv1.RunCodeResponse{Status: dsecv1.RunStatus_RUN_STATUS_SUCCESS}, nil
	}})
	if r, err := c.RunCode(t.Context(), RunCodeRequest{Language: "python"}); err != nil || !r.OK() || calls.Load() != 2 {
		t.Fatalf("RunCode: %v after %d calls", err, calls.Load())
	}
	_, err := c.RunCode(t.Context(), RunCodeRequest{Language: "python", NetworkRules: map[string]bool{"pypi": true}})
	if !errors.Is(err, ErrUnavailable) || calls.Load() != 3 {
		t.Fatalf("RunCode with network rules: %v after %d calls", err, calls.Load())
	}
}

func TestRunCodeBatch(t *testing.T) {
	f := &fakeFnCall{}
	c := startFnFake(t, f)
	var reqs []RunCodeRequest
	for i := range 5 {
		reqs = append(reqs, RunCodeRequest{Language: "python", Stdin: []byte(strconv.Itoa(i*10 + 1))})
	}
	reqs = append(reqs, RunCodeRequest{Language: "cobol"})
	rs, err := c.RunCodeBatch(t.Context(), reqs)
	if err != nil {
		t.Fatal(err)
	}
	var got []string
	for _, r := range rs {
		got = append(got, r.Stdout())
	}
	if d := cmp.Diff([]string{"1\n", "11\n", "12\n", "13\n", "14\n", ""}, got); d != "" {
		t.Errorf("stdouts (-want +got):\n%s", d)
	}
	if rs[5].Status != RunSandboxError || !strings.Contains(rs[5].Message, "cobol") {
		t.Errorf("unknown language in a batch: %+v", rs[5])
	}
	if _, err := c.RunCodeBatch(t.Context(), []RunCodeRequest{{Language: "python"}, {}}); !errors.Is(err, ErrInvalidArgument) ||
		!strings.HasPrefix(err.Error(), "call 1: ") {
		t.Errorf("a call without a language: %v", err)
	}
	if rs, err := c.RunCodeBatch(t.Context(), nil); rs != nil || err != nil {
		t.Errorf("empty batch: %v, %v", rs, err)
	}

	// A long batch goes as several, and its results keep their order.
	old := maxBatch
	maxBatch = 3
	t.Cleanup(func() { maxBatch = old })
	f.mu.Lock()
	f.requests = nil
	f.mu.Unlock()
	reqs = reqs[:0]
	for i := range 7 {
		reqs = append(reqs, RunCodeRequest{Language: "python", Stdin: []byte(fmt.Sprint(i))})
	}
	if rs, err = c.RunCodeBatch(t.Context(), reqs); err != nil {
		t.Fatal(err)
	}
	for i, r := range rs {
		if r.Stdout() != fmt.Sprintf("%d\n", i) {
			t.Errorf("result %d: %q", i, r.Stdout())
		}
	}
	var sizes []int
	for _, m := range f.requests {
		sizes = append(sizes, len(m.(*dsecv1.RunCodeBatchRequest).GetCalls()))
	}
	slices.Sort(sizes)
	if d := cmp.Diff([]int{1, 3, 3}, sizes); d != "" {
		t.Errorf("batch sizes (-want +got):\n%s", d)
	}
}

func TestRunTests(t *testing.T) {
	f := &fakeFnCall{}
	c := startFnFake(t, f)
	s := func(v string) *string { return &v }
	cases := []TestCase{{"abc", s("cba")}, {"xy\n", s("yx\n\n")}, {"ab", s("ab")}, {"a", s("a  ")}, {"q", nil}}
	rs, err := c.RunTests(t.Context(), RunCodeRequest{Language: "python", Code: "reverse", Stdin: []byte("ignored"), MemoryMB: 128}, cases)
	if err != nil {
		t.Fatal(err)
	}
	var passed []bool
	for _, r := range rs {
		passed = append(passed, r.Passed)
	}
	if d := cmp.Diff([]bool{true, true, false, false, false}, passed); d != "" {
		t.Errorf("passed (-want +got):\n%s", d)
	}
	calls := f.last().(*dsecv1.RunCodeBatchRequest).GetCalls()
	for i, m := range calls {
		if string(m.GetStdin()) != cases[i].Stdin || m.GetCode() != "reverse" || m.GetMemoryMb() != 128 {
			t.Errorf("call %d: %v", i, m)
		}
	}
	// A program that fails does not pass, whatever it printed.
	failing := startFnFake(t, &fakeFnCall{run: func(*dsecv1.RunCodeRequest) (*dsecv1.RunCodeResponse, error) {
		return &dsecv1.RunCodeResponse{Status: dsecv1.RunStatus_RUN_STATUS_FAILED,
			RunResult: &dsecv1.CommandResult{Status: dsecv1.CommandStatus_COMMAND_STATUS_FINISHED, ReturnCode: proto.Int32(1), Stdout: []byte("cba\n")}}, nil
	}})
	if rs, err := failing.RunTests(t.Context(), RunCodeRequest{Language: "python"}, []TestCase{{"abc", s("cba")}}); err != nil || rs[0].Passed {
		t.Errorf("failing program: %v, %+v", err, rs)
	}
}

func TestRunTestsInParallel(t *testing.T) {
	g := &fakeFnCall{}
	g.run = func(m *dsecv1.RunCodeRequest) (*dsecv1.RunCodeResponse, error) {
		time.Sleep(200 * time.Millisecond)
		return &dsecv1.RunCodeResponse{Status: dsecv1.RunStatus_RUN_STATUS_SUCCESS,
			RunResult: &dsecv1.CommandResult{Status: dsecv1.CommandStatus_COMMAND_STATUS_FINISHED, ReturnCode: proto.Int32(0), Stdout: m.GetStdin()}}, nil
	}
	c := startFnFake(t, g)
	var cases []TestCase
	for i := range 8 {
		v := strconv.Itoa(i)
		cases = append(cases, TestCase{Stdin: v + "\n", Expected: &v})
	}
	rs, err := c.RunTests(t.Context(), RunCodeRequest{Language: "python"}, cases)
	if err != nil {
		t.Fatal(err)
	}
	for i, r := range rs {
		if !r.Passed {
			t.Errorf("case %d did not pass: %+v", i, r.RunCodeResult)
		}
	}
	if most := g.most.Load(); most != 8 {
		t.Errorf("%d calls ran at once, want 8", most)
	}
}

func TestLanguages(t *testing.T) {
	c := startFnFake(t, &fakeFnCall{})
	langs, err := c.Languages(t.Context())
	if err != nil {
		t.Fatal(err)
	}
	want := []Language{
		{Name: "python", Environment: "fncall:latest", SourceFile: "tmp_code.py", RunArgv: []string{"python", "tmp_code.py"}, Zygote: true},
		{Name: "cpp", Environment: "fncall:latest", Compiled: true, SourceFile: "tmp_code.cpp",
			CompileArgv: []string{"g++", "tmp_code.cpp", "-o", "test"}, RunArgv: []string{"./test"}},
	}
	if d := cmp.Diff(want, langs); d != "" {
		t.Errorf("languages (-want +got):\n%s", d)
	}
}

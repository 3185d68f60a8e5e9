package cli

import (
	"context"
	"encoding/json"
	"errors"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"

	"connectrpc.com/connect"
	"google.golang.org/protobuf/proto"

	dsecv1 "dsec.dev/dsec/api/gen/dsec/v1"
	"dsec.dev/dsec/api/gen/dsec/v1/dsecv1connect"
)

// fakeFnCall answers RunCode with answer and keeps the last request.
type fakeFnCall struct {
	dsecv1connect.UnimplementedFnCallServiceHandler
	mu     sync.Mutex
	last   *dsecv1.RunCodeRequest
	answer func(*dsecv1.RunCodeRequest) (*dsecv1.RunCodeResponse, error)
}

func (f *fakeFnCall) RunCode(_ context.Context, r *connect.Request[dsecv1.RunCodeRequest]) (*connect.Response[dsecv1.RunCodeResponse], error) {
	f.mu.Lock()
	f.last = r.Msg
	answer := f.answer
	f.mu.Unlock()
	resp, err := answer(r.Msg)
	if err != nil {
		return nil, err
	}
	return connect.NewResponse(resp), nil
}

func (f *fakeFnCall) ListLanguages(context.Context, *connect.Request[dsecv1.ListLanguagesRequest]) (*connect.Response[dsecv1.ListLanguagesResponse], error) {
	return connect.NewResponse(&dsecv1.ListLanguagesResponse{Languages: []*dsecv1.Language{
		{Name: "python", Environment: "fncall:latest", SourceFile: "tmp_code.py", RunArgv: []string{"python", "tmp_code.py"}, Zygote: true},
		{Name: "cpp", Environment: "fncall:latest", Compiled: true, SourceFile: "tmp_code.cpp",
			CompileArgv: []string{"g++", "-std=c++17", "tmp_code.cpp", "-o", "test"}, RunArgv: []string{"./test"}},
		// A script of several lines, with tabs, as go_test's.
		{Name: "go_test", Environment: "fncall:latest", SourceFile: "tmp_code_test.go",
			RunArgv: []string{"/bin/sh", "-c", "c=${GOCACHE:-$HOME/.cache/go-build}\nif [ ! -e \"$c\" ]; then\n\tmkdir -p \"$c\"\nfi\nexec go test \"$1\"", "go_test", "tmp_code_test.go"}},
	}}), nil
}

func startFnFake(t *testing.T, f *fakeFnCall) string {
	t.Helper()
	mux := http.NewServeMux()
	mux.Handle(dsecv1connect.NewFnCallServiceHandler(f))
	srv := httptest.NewServer(mux)
	t.Cleanup(srv.Close)
	return srv.URL
}

// runCLIIn runs the CLI with stdin and returns stdout, stderr and the exit code Main would give.
func runCLIIn(t *testing.T, addr, stdin string, args ...string) (string, string, int) {
	t.Helper()
	var out, errOut strings.Builder
	a := &app{stdin: strings.NewReader(stdin), stdout: &out, stderr: &errOut}
	root := a.rootCommand()
	root.SetArgs(append([]string{"--addr", addr}, args...))
	root.SetOut(&out)
	root.SetErr(&errOut)
	code := 0
	if err := root.ExecuteContext(t.Context()); err != nil {
		var ec *exitCode
		if errors.As(err, &ec) {
			code = ec.code
			if ec.msg != "" {
				errOut.WriteString("dsec: " + ec.msg + "\n")
			}
		} else {
			code = 1
			errOut.WriteString("dsec: " + describe(err) + "\n")
		}
	}
	return out.String(), errOut.String(), code
}

func finished(rc int32, stdout, stderr string) *dsecv1.CommandResult {
	return &dsecv1.CommandResult{Status: dsecv1.CommandStatus_COMMAND_STATUS_FINISHED, ReturnCode: proto.Int32(rc),
		Stdout: []byte(stdout), Stderr: []byte(stderr)}
}

func TestFnRunRequest(t *testing.T) {
	f := &fakeFnCall{answer: func(r *dsecv1.RunCodeRequest) (*dsecv1.RunCodeResponse, error) {
		return &dsecv1.RunCodeResponse{Status: dsecv1.RunStatus_RUN_STATUS_SUCCESS, RunResult: finished(0, "out\n", "err\n"),
			Files: map[string][]byte{"res/out.txt": []byte("fetched")}}, nil
	}}
	addr := startFnFake(t, f)
	dir := t.TempDir()
	t.Chdir(dir)
	os.WriteFile("prog.py", []byte("print(input())\n"), 0o644)
	os.WriteFile("data.csv", []byte("1,2\n"), 0o644)
	os.WriteFile("in.txt", []byte("from file\n"), 0o644)

	stdout, stderr, code := runCLIIn(t, addr, "the input\n", "fn", "run", "--language", "python", "prog.py",
		"--file", "data/d.csv=data.csv", "--fetch", "res/out.txt", "--fetch", "gone.txt=g.txt",
		"--run-timeout", "2.5", "--compile-timeout", "3", "--memory-mb", "256", "--cpus", "0.5", "--network-rules", `{"pypi": true}`)
	if stdout != "out\n" || code != 0 || stderr != "err\ndsec: warning: gone.txt was not fetched: the call left no such file\n" {
		t.Errorf("stdout %q, stderr %q, exit %d", stdout, stderr, code)
	}
	want := &dsecv1.RunCodeRequest{Language: "python", Code: "print(input())\n", Stdin: []byte("the input\n"),
		Files: map[string][]byte{"data/d.csv": []byte("1,2\n")}, FetchFiles: []string{"res/out.txt", "gone.txt"},
		RunTimeoutSeconds: 2.5, CompileTimeoutSeconds: 3, MemoryMb: 256, Cpus: 0.5, NetworkRules: map[string]bool{"pypi": true}}
	if !proto.Equal(f.last, want) {
		t.Errorf("sent %v, want %v", f.last, want)
	}
	if b, err := os.ReadFile(filepath.Join(dir, "out.txt")); err != nil || string(b) != "fetched" {
		t.Errorf("fetched file: %q, %v", b, err)
	}

	// --stdin-file wins over stdin; with FILE -, the code comes from stdin.
	runCLIIn(t, addr, "ignored", "fn", "run", "-l", "python", "--stdin-file", "in.txt", "prog.py")
	if string(f.last.GetStdin()) != "from file\n" {
		t.Errorf("--stdin-file: sent stdin %q", f.last.GetStdin())
	}
	runCLIIn(t, addr, "print(2)\n", "fn", "run", "-l", "python", "-")
	if f.last.GetCode() != "print(2)\n" || len(f.last.GetStdin()) != 0 {
		t.Errorf("FILE -: sent code %q, stdin %q", f.last.GetCode(), f.last.GetStdin())
	}

	for _, tc := range []struct {
		args []string
		want string
	}{
		{[]string{"fn", "run", "prog.py"}, "--language is required"},
		{[]string{"fn", "run", "-l", "python"}, "name the program's FILE"},
		{[]string{"fn", "run", "-l", "python", "--file", "x", "prog.py"}, `--file "x": want PATH=LOCAL`},
		{[]string{"fn", "run", "-l", "python", "--run-timeout", "-1", "prog.py"}, "--run-timeout"},
		{[]string{"fn", "run", "-l", "python", "missing.py"}, "read the program"},
	} {
		if _, stderr, code := runCLIIn(t, addr, "", tc.args...); code != 1 || !strings.Contains(stderr, tc.want) {
			t.Errorf("dsec %s: exit %d, stderr %q, want %q", strings.Join(tc.args, " "), code, stderr, tc.want)
		}
	}
}

func TestFnRunExitCodes(t *testing.T) {
	tle := &dsecv1.CommandResult{Status: dsecv1.CommandStatus_COMMAND_STATUS_TIME_LIMIT_EXCEEDED, Stdout: []byte("so far\n"), ExecutionTimeSeconds: 1}
	failed, success := dsecv1.RunStatus_RUN_STATUS_FAILED, dsecv1.RunStatus_RUN_STATUS_SUCCESS
	for _, tc := range []struct {
		name           string
		resp           *dsecv1.RunCodeResponse
		stdout, stderr string
		code           int
	}{
		{"success", &dsecv1.RunCodeResponse{Status: success, RunResult: finished(0, "1\n", "")}, "1\n", "", 0},
		{"exit code", &dsecv1.RunCodeResponse{Status: failed, RunResult: finished(3, "partial", "Traceback\n")}, "partial", "Traceback\n", 3},
		{"compile error", &dsecv1.RunCodeResponse{Status: failed, CompileResult: finished(1, "", "x.cpp:1: error: nope\n")},
			"", "x.cpp:1: error: nope\ndsec: the compile step exited with 1\n", 1},
		{"compile ok, run fails", &dsecv1.RunCodeResponse{Status: failed, CompileResult: finished(0, "", "warning\n"), RunResult: finished(2, "", "")},
			"", "", 2},
		{"timeout", &dsecv1.RunCodeResponse{Status: failed, RunResult: tle}, "so far\n", "dsec: the program timed out after 1.0s and was killed\n", 124},
		{"signal", &dsecv1.RunCodeResponse{Status: failed, RunResult: finished(-11, "", "")}, "", "dsec: the program was killed by signal 11\n", 139},
		{"memory", &dsecv1.RunCodeResponse{Status: failed, RunResult: &dsecv1.CommandResult{Status: dsecv1.CommandStatus_COMMAND_STATUS_FINISHED,
			ReturnCode: proto.Int32(-9), MemoryLimitExceeded: true}}, "", "dsec: the program was killed at the call's memory limit (--memory-mb)\n", 137},
		{"sandbox error", &dsecv1.RunCodeResponse{Status: dsecv1.RunStatus_RUN_STATUS_SANDBOX_ERROR, Message: "exec ./test: permission denied"},
			"", "dsec: sandbox error: exec ./test: permission denied\n", 125},
	} {
		t.Run(tc.name, func(t *testing.T) {
			addr := startFnFake(t, &fakeFnCall{answer: func(*dsecv1.RunCodeRequest) (*dsecv1.RunCodeResponse, error) { return tc.resp, nil }})
			stdout, stderr, code := runCLIIn(t, addr, "", "fn", "run", "-l", "python", "-")
			if stdout != tc.stdout || stderr != tc.stderr || code != tc.code {
				t.Errorf("stdout %q, stderr %q, exit %d; want %q, %q, %d", stdout, stderr, code, tc.stdout, tc.stderr, tc.code)
			}
			// --json: the whole response on stdout, nothing on stderr, the same exit code.
			stdout, stderr, code = runCLIIn(t, addr, "", "--json", "fn", "run", "-l", "python", "-")
			var got map[string]any
			if err := json.Unmarshal([]byte(stdout), &got); err != nil || got["status"] != tc.resp.GetStatus().String() || stderr != "" || code != tc.code {
				t.Errorf("--json: stdout %q (%v), stderr %q, exit %d", stdout, err, stderr, code)
			}
		})
	}
	addr := startFnFake(t, &fakeFnCall{answer: func(*dsecv1.RunCodeRequest) (*dsecv1.RunCodeResponse, error) {
		return nil, connect.NewError(connect.CodeInvalidArgument, errors.New(`language "cobol" is not known: invalid argument`))
	}})
	if _, stderr, code := runCLIIn(t, addr, "", "fn", "run", "-l", "cobol", "-"); code != 1 || stderr != "dsec: language \"cobol\" is not known (invalid_argument)\n" {
		t.Errorf("unknown language: exit %d, stderr %q", code, stderr)
	}
}

func TestFnLanguages(t *testing.T) {
	addr := startFnFake(t, &fakeFnCall{})
	stdout, stderr, code := runCLIIn(t, addr, "", "fn", "languages")
	// One row a language, whatever its commands hold.
	want := "NAME     ENVIRONMENT    FILE              COMPILE                              RUN\n" +
		"cpp      fncall:latest  tmp_code.cpp      g++ -std=c++17 tmp_code.cpp -o test  ./test\n" +
		"go_test  fncall:latest  tmp_code_test.go  -                                    /bin/sh -c 'c=${GOCACHE:-$HOME/.cache/go-build} …' go_test tmp_code_test.go\n" +
		"python   fncall:latest  tmp_code.py       -                                    python tmp_code.py (warm interpreter)\n"
	if stdout != want || stderr != "" || code != 0 {
		t.Errorf("stdout:\n%s\nwant:\n%s\nstderr %q, exit %d", stdout, want, stderr, code)
	}
}

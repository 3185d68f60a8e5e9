package sandboxfusion

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"

	"connectrpc.com/connect"
	"github.com/google/go-cmp/cmp"
	"google.golang.org/protobuf/testing/protocmp"

	dsecv1 "dsec.dev/dsec/api/gen/dsec/v1"
	"dsec.dev/dsec/internal/errdefs"
)

func post(t *testing.T, h http.Handler, path, body string) (int, map[string]any, string) {
	t.Helper()
	req := httptest.NewRequest(http.MethodPost, path, strings.NewReader(body))
	req.Header.Set("Content-Type", "application/json")
	w := httptest.NewRecorder()
	h.ServeHTTP(w, req)
	raw := w.Body.String()
	if !json.Valid([]byte(raw)) {
		t.Fatalf("%s answered invalid JSON: %q", path, raw)
	}
	var m map[string]any
	_ = json.Unmarshal([]byte(raw), &m)
	return w.Code, m, raw
}

// TestRunCode drives every case of SandboxFusion's table through the
// handler: the request dsec's runner gets, and the JSON the client gets.
func TestRunCode(t *testing.T) {
	bad := []byte{'o', 'k', 0xff, '\n', 0xe2, 0x82, 'x'}
	for _, tc := range []struct {
		name     string
		body     string
		resp     *dsecv1.RunCodeResponse
		err      error
		wantReq  *dsecv1.RunCodeRequest // nil: the runner is not called
		wantCode int
		want     string // the exact body
	}{
		{
			name:     "success",
			body:     `{"code": "print(1)", "language": "python"}`,
			resp:     success("1\n"),
			wantReq:  &dsecv1.RunCodeRequest{Language: "python", Code: "print(1)", CompileTimeoutSeconds: 10, RunTimeoutSeconds: 10},
			wantCode: 200,
			want:     `{"status":"Success","message":"","compile_result":null,"run_result":{"status":"Finished","execution_time":0.02,"return_code":0,"stdout":"1\n","stderr":""},"executor_pod_name":"node-1","files":{}}`,
		},
		{
			name:     "wrong answer is a success",
			body:     `{"code": "print(2)", "language": "python", "stdin": "1"}`,
			resp:     success("2\n"),
			wantReq:  &dsecv1.RunCodeRequest{Language: "python", Code: "print(2)", Stdin: []byte("1"), CompileTimeoutSeconds: 10, RunTimeoutSeconds: 10},
			wantCode: 200,
			want:     `{"status":"Success","message":"","compile_result":null,"run_result":{"status":"Finished","execution_time":0.02,"return_code":0,"stdout":"2\n","stderr":""},"executor_pod_name":"node-1","files":{}}`,
		},
		{
			name: "compile error",
			body: `{"code": "int main({", "language": "cpp", "compile_timeout": 5, "run_timeout": 2.5}`,
			resp: &dsecv1.RunCodeResponse{Status: dsecv1.RunStatus_RUN_STATUS_FAILED,
				CompileResult: finished(1, "", "tmp_code.cpp:1: error")},
			wantReq:  &dsecv1.RunCodeRequest{Language: "cpp", Code: "int main({", CompileTimeoutSeconds: 5, RunTimeoutSeconds: 2.5},
			wantCode: 200,
			want:     `{"status":"Failed","message":"","compile_result":{"status":"Finished","execution_time":0.02,"return_code":1,"stdout":"","stderr":"tmp_code.cpp:1: error"},"run_result":null,"executor_pod_name":null,"files":{}}`,
		},
		{
			name:     "runtime error",
			body:     `{"code": "1/0", "language": "python"}`,
			resp:     &dsecv1.RunCodeResponse{Status: dsecv1.RunStatus_RUN_STATUS_FAILED, RunResult: finished(1, "", "ZeroDivisionError")},
			wantReq:  &dsecv1.RunCodeRequest{Language: "python", Code: "1/0", CompileTimeoutSeconds: 10, RunTimeoutSeconds: 10},
			wantCode: 200,
			want:     `{"status":"Failed","message":"","compile_result":null,"run_result":{"status":"Finished","execution_time":0.02,"return_code":1,"stdout":"","stderr":"ZeroDivisionError"},"executor_pod_name":null,"files":{}}`,
		},
		{
			name:     "timeout keeps partial output, return_code null",
			body:     `{"code": "print(1); while True: pass", "language": "python", "run_timeout": 1}`,
			resp:     &dsecv1.RunCodeResponse{Status: dsecv1.RunStatus_RUN_STATUS_FAILED, RunResult: timedOut("1\n")},
			wantReq:  &dsecv1.RunCodeRequest{Language: "python", Code: "print(1); while True: pass", CompileTimeoutSeconds: 10, RunTimeoutSeconds: 1},
			wantCode: 200,
			want:     `{"status":"Failed","message":"","compile_result":null,"run_result":{"status":"TimeLimitExceeded","execution_time":1,"return_code":null,"stdout":"1\n","stderr":""},"executor_pod_name":null,"files":{}}`,
		},
		{
			name: "memory limit",
			body: `{"code": "x = ' ' * 10**10", "language": "python", "memory_limit_MB": 256}`,
			resp: &dsecv1.RunCodeResponse{Status: dsecv1.RunStatus_RUN_STATUS_FAILED, RunResult: &dsecv1.CommandResult{
				Status: dsecv1.CommandStatus_COMMAND_STATUS_FINISHED, ReturnCode: rc(-9), MemoryLimitExceeded: true}},
			wantReq:  &dsecv1.RunCodeRequest{Language: "python", Code: "x = ' ' * 10**10", CompileTimeoutSeconds: 10, RunTimeoutSeconds: 10, MemoryMb: 256},
			wantCode: 200,
			want:     `{"status":"Failed","message":"the run step was killed at the call's memory limit (memory_limit_MB)","compile_result":null,"run_result":{"status":"Finished","execution_time":0,"return_code":-9,"stdout":"","stderr":""},"executor_pod_name":null,"files":{}}`,
		},
		{
			name: "files in and out, null file skipped, paths as asked",
			body: `{"code": "c", "language": "bash", "files": {"in.txt": "aGk=", "skip": null, "IGNORE_THIS_FILE_x": "AA=="}, "fetch_files": ["./out.txt", "missing"]}`,
			resp: &dsecv1.RunCodeResponse{Status: dsecv1.RunStatus_RUN_STATUS_SUCCESS, RunResult: finished(0, "", ""),
				Files: map[string][]byte{"out.txt": []byte("\x00\xffbin")}},
			wantReq: &dsecv1.RunCodeRequest{Language: "bash", Code: "c", CompileTimeoutSeconds: 10, RunTimeoutSeconds: 10,
				Files: map[string][]byte{"in.txt": []byte("hi")}, FetchFiles: []string{"./out.txt", "missing"}},
			wantCode: 200,
			want:     `{"status":"Success","message":"","compile_result":null,"run_result":{"status":"Finished","execution_time":0.02,"return_code":0,"stdout":"","stderr":""},"executor_pod_name":null,"files":{"./out.txt":"AP9iaW4="}}`,
		},
		{
			name:     "stdin null is empty input, memory -1 is the default",
			body:     `{"code": "print(input())", "language": "python", "stdin": null, "memory_limit_MB": -1}`,
			resp:     success(""),
			wantReq:  &dsecv1.RunCodeRequest{Language: "python", Code: "print(input())", CompileTimeoutSeconds: 10, RunTimeoutSeconds: 10},
			wantCode: 200,
		},
		{
			name: "invalid UTF-8 in output is replaced, never invalid JSON",
			body: `{"code": "x", "language": "python"}`,
			resp: &dsecv1.RunCodeResponse{Status: dsecv1.RunStatus_RUN_STATUS_SUCCESS, RunResult: &dsecv1.CommandResult{
				Status: dsecv1.CommandStatus_COMMAND_STATUS_FINISHED, ReturnCode: rc(0), Stdout: bad, Stderr: []byte("é\t\x01<>&")}},
			wantReq:  &dsecv1.RunCodeRequest{Language: "python", Code: "x", CompileTimeoutSeconds: 10, RunTimeoutSeconds: 10},
			wantCode: 200,
			want:     `{"status":"Success","message":"","compile_result":null,"run_result":{"status":"Finished","execution_time":0,"return_code":0,"stdout":"ok` + "\uFFFD" + `\n` + "\uFFFD" + `x","stderr":"é\t\u0001<>&"},"executor_pod_name":null,"files":{}}`,
		},
		{
			name:     "an extra field is ignored",
			body:     `{"code": "print(1)", "language": "python", "expected_stdout": "1", "args": []}`,
			resp:     success("1\n"),
			wantReq:  &dsecv1.RunCodeRequest{Language: "python", Code: "print(1)", CompileTimeoutSeconds: 10, RunTimeoutSeconds: 10},
			wantCode: 200,
		},
		{
			name:     "unknown language: the runner's InvalidArgument is 422",
			body:     `{"code": "x", "language": "cobol"}`,
			err:      fmt.Errorf("run code: unknown language \"cobol\" (known: bash, cpp): %w", errdefs.ErrInvalidArgument),
			wantReq:  &dsecv1.RunCodeRequest{Language: "cobol", Code: "x", CompileTimeoutSeconds: 10, RunTimeoutSeconds: 10},
			wantCode: 422,
			want:     `{"detail":[{"loc":["body","language"],"msg":"unknown language \"cobol\" (known: bash, cpp)","type":"enum"}]}`,
		},
		{
			name:     "an absolute path outside the scratch dir, over Connect, is 422",
			body:     `{"code": "x", "language": "python", "files": {"/etc/passwd": "AA=="}}`,
			err:      connect.NewError(connect.CodeInvalidArgument, fmt.Errorf("run code: files: path \"/etc/passwd\" is outside the call's scratch directory")),
			wantReq:  &dsecv1.RunCodeRequest{Language: "python", Code: "x", CompileTimeoutSeconds: 10, RunTimeoutSeconds: 10, Files: map[string][]byte{"/etc/passwd": {0}}},
			wantCode: 422,
			want:     `{"detail":[{"loc":["body","files"],"msg":"files: path \"/etc/passwd\" is outside the call's scratch directory","type":"value_error"}]}`,
		},
		{
			name:     "missing code",
			body:     `{"language": "python"}`,
			wantCode: 422,
			want:     `{"detail":[{"loc":["body","code"],"msg":"Field required","type":"missing"}]}`,
		},
		{
			name:     "wrong types",
			body:     `{"code": 3, "language": "python", "run_timeout": "soon", "fetch_files": "a"}`,
			wantCode: 422,
			want:     `{"detail":[{"loc":["body","code"],"msg":"Input should be a valid string","type":"string_type"},{"loc":["body","run_timeout"],"msg":"Input should be a valid number, unable to parse string as a number","type":"float_parsing"},{"loc":["body","fetch_files"],"msg":"Input should be a valid list","type":"list_type"}]}`,
		},
		{
			name:     "malformed base64",
			body:     `{"code": "x", "language": "python", "files": {"a.bin": "not base64!"}}`,
			wantCode: 422,
		},
		{
			name:     "malformed JSON",
			body:     `{"code": "x", "language": `,
			wantCode: 422,
		},
		{
			name:     "not an object",
			body:     `["code"]`,
			wantCode: 422,
			want:     `{"detail":[{"loc":["body"],"msg":"Input should be a valid dictionary or object to extract fields from","type":"model_attributes_type"}]}`,
		},
		{
			name:     "ResourceExhausted is 504, with the node's reason",
			body:     `{"code": "x", "language": "python"}`,
			err:      connect.NewError(connect.CodeResourceExhausted, fmt.Errorf("run code: no container of pool p could take the call within 1s (memory): %w", errdefs.ErrResourceExhausted)),
			wantReq:  &dsecv1.RunCodeRequest{Language: "python", Code: "x", CompileTimeoutSeconds: 10, RunTimeoutSeconds: 10},
			wantCode: 504,
			want:     `{"detail":"dsec is at capacity: run code: no container of pool p could take the call within 1s (memory); retry later"}`,
		},
		{
			name:     "other runner errors are a SandboxError",
			body:     `{"code": "x", "language": "python"}`,
			err:      connect.NewError(connect.CodeUnavailable, fmt.Errorf("no edge is up")),
			wantReq:  &dsecv1.RunCodeRequest{Language: "python", Code: "x", CompileTimeoutSeconds: 10, RunTimeoutSeconds: 10},
			wantCode: 200,
			want:     `{"status":"SandboxError","message":"infrastructure fault (edge_unreachable): unavailable: no edge is up","compile_result":null,"run_result":null,"executor_pod_name":null,"files":{}}`,
		},
		{
			name:     "a call the platform cut off is a SandboxError naming the fault",
			body:     `{"code": "x", "language": "python"}`,
			err:      connect.NewError(connect.CodeFailedPrecondition, fmt.Errorf("sandbox sb-n1-x is stopped (deleted): deleted")),
			wantReq:  &dsecv1.RunCodeRequest{Language: "python", Code: "x", CompileTimeoutSeconds: 10, RunTimeoutSeconds: 10},
			wantCode: 200,
			want:     `{"status":"SandboxError","message":"infrastructure fault (sandbox_deleted): failed_precondition: sandbox sb-n1-x is stopped (deleted): deleted","compile_result":null,"run_result":null,"executor_pod_name":null,"files":{}}`,
		},
		{
			name:     "a batch's call the platform could not run is a SandboxError naming the fault",
			body:     `{"code": "x", "language": "python"}`,
			resp:     &dsecv1.RunCodeResponse{Status: dsecv1.RunStatus_RUN_STATUS_SANDBOX_ERROR, Message: "node n1: unavailable", Fault: dsecv1.Fault_FAULT_EDGE_UNREACHABLE},
			wantReq:  &dsecv1.RunCodeRequest{Language: "python", Code: "x", CompileTimeoutSeconds: 10, RunTimeoutSeconds: 10},
			wantCode: 200,
			want:     `{"status":"SandboxError","message":"infrastructure fault (edge_unreachable): node n1: unavailable","compile_result":null,"run_result":null,"executor_pod_name":null,"files":{}}`,
		},
		{
			name: "a step that could not start is a SandboxError",
			body: `{"code": "x", "language": "python"}`,
			resp: &dsecv1.RunCodeResponse{Status: dsecv1.RunStatus_RUN_STATUS_SANDBOX_ERROR, Message: "exec python: not found",
				RunResult: &dsecv1.CommandResult{Status: dsecv1.CommandStatus_COMMAND_STATUS_ERROR, Stderr: []byte("exec python: not found")}},
			wantReq:  &dsecv1.RunCodeRequest{Language: "python", Code: "x", CompileTimeoutSeconds: 10, RunTimeoutSeconds: 10},
			wantCode: 200,
			want:     `{"status":"SandboxError","message":"exec python: not found","compile_result":null,"run_result":{"status":"Error","execution_time":0,"return_code":null,"stdout":"","stderr":"exec python: not found"},"executor_pod_name":null,"files":{}}`,
		},
	} {
		t.Run(tc.name, func(t *testing.T) {
			f := canned(tc.resp, tc.err)
			h := NewHandler(f, Config{})
			code, _, raw := post(t, h, "/run_code", tc.body)
			if code != tc.wantCode {
				t.Fatalf("status %d, want %d; body %s", code, tc.wantCode, raw)
			}
			if tc.want != "" {
				if diff := cmp.Diff(tc.want, strings.TrimSpace(raw)); diff != "" {
					t.Errorf("body (-want +got):\n%s", diff)
				}
			}
			reqs := f.requests()
			if tc.wantReq == nil {
				if len(reqs) != 0 {
					t.Errorf("the runner was called: %v", reqs)
				}
				return
			}
			if len(reqs) != 1 {
				t.Fatalf("the runner got %d calls, want 1", len(reqs))
			}
			if diff := cmp.Diff(tc.wantReq, reqs[0], protocmp.Transform()); diff != "" {
				t.Errorf("runner request (-want +got):\n%s", diff)
			}
		})
	}
}

func TestRunCodeBodyLimit(t *testing.T) {
	h := NewHandler(canned(success(""), nil), Config{MaxBodyBytes: 1024})
	body := `{"code": "` + strings.Repeat("x", 2048) + `", "language": "python"}`
	code, m, raw := post(t, h, "/run_code", body)
	if code != http.StatusRequestEntityTooLarge || m["detail"] == nil {
		t.Fatalf("oversized body: %d %s", code, raw)
	}
}

func TestRoutes(t *testing.T) {
	h := NewHandler(canned(success(""), nil), Config{})
	for _, tc := range []struct {
		method, path string
		code         int
		body         string
	}{
		{"GET", "/v1/ping", 200, `"pong"`},
		{"POST", "/v1/ping", 405, `{"detail":"Method Not Allowed"}`},
		{"GET", "/run_code", 405, `{"detail":"Method Not Allowed"}`},
		{"GET", "/nope", 404, `{"detail":"Not Found"}`},
		{"POST", "/list_datasets", 404, `{"detail":"Not Found"}`},
	} {
		w := httptest.NewRecorder()
		h.ServeHTTP(w, httptest.NewRequest(tc.method, tc.path, bytes.NewReader(nil)))
		body, _ := io.ReadAll(w.Body)
		if w.Code != tc.code || strings.TrimSpace(string(body)) != tc.body || w.Header().Get("Content-Type") != "application/json" {
			t.Errorf("%s %s = %d %s (%s), want %d %s", tc.method, tc.path, w.Code, body, w.Header().Get("Content-Type"), tc.code, tc.body)
		}
	}
}

// TestRunCodeCancelled: a client gone mid-call gets no answer written
// and the runner sees the cancellation.
func TestRunCodeCancelled(t *testing.T) {
	seen := make(chan error, 1)
	f := &fakeRunner{fn: func(ctx context.Context, _ *dsecv1.RunCodeRequest) (*dsecv1.RunCodeResponse, error) {
		<-ctx.Done()
		seen <- ctx.Err()
		return nil, ctx.Err()
	}}
	h := NewHandler(f, Config{})
	ctx, cancel := context.WithCancel(context.Background())
	req := httptest.NewRequestWithContext(ctx, http.MethodPost, "/run_code", strings.NewReader(`{"code":"x","language":"python"}`))
	w := httptest.NewRecorder()
	done := make(chan struct{})
	go func() { h.ServeHTTP(w, req); close(done) }()
	cancel()
	<-done
	if err := <-seen; err == nil {
		t.Fatal("the runner's context was not cancelled")
	}
	if w.Body.Len() != 0 {
		t.Errorf("answered a gone client: %q", w.Body.String())
	}
}

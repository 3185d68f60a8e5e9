package sandboxfusion

import (
	"context"
	"encoding/json"
	"fmt"
	"strings"
	"sync"
	"sync/atomic"
	"testing"

	dsecv1 "dsec.dev/dsec/api/gen/dsec/v1"
	"dsec.dev/dsec/internal/errdefs"
)

func TestOutputMatches(t *testing.T) {
	for _, tc := range []struct {
		got, want string
		ok        bool
	}{
		{"3\n", "3", true},
		{"  3  \n\n", "3\n", true},
		{"YES\n", "yes", true},
		{"Hello World\n", "hello world", true},
		{"a \nb\n", "a\n b", true},
		{"3.0000001\n", "3", true},
		{"0.333333\n", "0.3333333333", true},
		{"0.3333\n", "0.33333333", false},
		{"1e-16\n", "0", true}, // relative to max(|want|, 1e-10)
		{"1e-12\n", "0", false},
		{"inf\n", "INF", true},
		{"nan\n", "nan", true}, // equal as text
		{"1 2\n", "1 3", false},
		{"1\n2\n", "1", false},
		{"1\n\n2", "1\n2", false},
		{"", "", true},
		{"0x10", "16", false},
	} {
		if got := outputMatches(tc.got, tc.want); got != tc.ok {
			t.Errorf("outputMatches(%q, %q) = %v, want %v", tc.got, tc.want, got, tc.ok)
		}
	}
}

func TestExtractCode(t *testing.T) {
	for _, tc := range []struct {
		name, completion, lang, code, kind string
	}{
		{"the first block of the language", "text\n```cpp\nint x;\n```\n```python\nprint(1)\n```\n```python\nprint(2)\n```", "python", "print(1)", extractedFenced},
		{"else the first block", "```\nplain\n```\n```rust\nfn main(){}\n```", "python", "plain", extractedFenced},
		{"aliases", "```py\nprint(3)\n```", "python", "print(3)", extractedFenced},
		{"javascript is not nodejs's tag", "```javascript\na\n```\n```js\nb\n```", "nodejs", "b", extractedFenced},
		{"incomplete fence", "here:\n```python\nprint(4)\n", "python", "print(4)\n", extractedIncomplete},
		{"python heuristic", "Use this:\n\ndef f(x):\n    return x\n\nDone.", "python", "def f(x):\n    return x\n", extractedHeuristic},
		{"nothing found: the completion", "print(input())", "python", "print(input())", extractedEmpty},
	} {
		code, kind := extractCode(tc.completion, tc.lang)
		if code != tc.code || kind != tc.kind {
			t.Errorf("%s: got %q (%s), want %q (%s)", tc.name, code, kind, tc.code, tc.kind)
		}
	}
}

// echoUpper is a judge's fake cluster: the program prints its stdin,
// upper-cased for code "upper", and case "bad" gives a wrong answer.
func judgeRunner(sandboxErrors int) (*fakeRunner, *atomic.Int32) {
	var calls atomic.Int32
	var mu sync.Mutex
	left := map[string]int{}
	return &fakeRunner{fn: func(ctx context.Context, req *dsecv1.RunCodeRequest) (*dsecv1.RunCodeResponse, error) {
		calls.Add(1)
		in := string(req.GetStdin())
		mu.Lock()
		n, seen := left[in]
		if !seen {
			n = sandboxErrors
		}
		left[in] = n - 1
		mu.Unlock()
		if n > 0 {
			return &dsecv1.RunCodeResponse{Status: dsecv1.RunStatus_RUN_STATUS_SANDBOX_ERROR, Message: "node lost"}, nil
		}
		switch {
		case in == "bad":
			return success("wrong\n"), nil
		case in == "crash":
			return &dsecv1.RunCodeResponse{Status: dsecv1.RunStatus_RUN_STATUS_FAILED, RunResult: finished(1, "", "boom")}, nil
		case req.GetCode() == "upper":
			return success(strings.ToUpper(in) + "\n"), nil
		}
		return success(in + "\n"), nil
	}}, &calls
}

func submitBody(completion string, cases []string, extra string) string {
	var tests []map[string]any
	for _, c := range cases {
		in, out, _ := strings.Cut(c, "=>")
		tests = append(tests, map[string]any{"input": map[string]string{"stdin": in}, "output": map[string]string{"stdout": out}})
	}
	b, _ := json.Marshal(map[string]any{
		"dataset": "code_contests", "id": 7, "completion": completion,
		"config": map[string]any{"dataset_type": "CommonOJDataset", "language": "python", "provided_data": map[string]any{"test": tests}, "extra": json.RawMessage(extra)},
	})
	return string(b)
}

func TestSubmit(t *testing.T) {
	fenced := "Here:\n```python\nupper\n```\n"
	for _, tc := range []struct {
		name       string
		body       string
		sandboxErr int
		accepted   bool
		tests      int // cases reported
		wantCode   int
	}{
		{"all pass, case-insensitive", submitBody(fenced, []string{"a=>A", "b=>b", "c=>C "}, `{}`), 0, true, 3, 200},
		{"floats and whitespace", submitBody("```python\necho\n```", []string{"3.0000001=>3", " x => x"}, `{}`), 0, true, 2, 200},
		{"stops at the first failure", submitBody(fenced, []string{"a=>A", "bad=>b", "c=>C", "d=>D", "e=>E"}, `{}`), 0, false, 2, 200},
		{"run_all_cases", submitBody(fenced, []string{"a=>A", "bad=>b", "c=>C", "crash=>x", "e=>E"}, `{"run_all_cases": true}`), 0, false, 5, 200},
		{"retried on SandboxError", submitBody(fenced, []string{"a=>A", "b=>B"}, `{}`), 2, true, 2, 200},
		{"a SandboxError after 5 tries fails the case", submitBody(fenced, []string{"a=>A"}, `{}`), 5, false, 1, 200},
		{"no language", `{"dataset": "x", "id": "p1", "completion": "c", "config": {"provided_data": {"test": []}}}`, 0, false, 0, 400},
		{"no cases", `{"dataset": "x", "id": "p1", "completion": "c", "config": {"language": "python"}}`, 0, false, 0, 400},
		{"missing completion", `{"dataset": "x", "id": 1, "config": {}}`, 0, false, 0, 422},
		{"custom extraction", `{"dataset": "x", "id": 1, "completion": "c", "config": {"language": "python", "custom_extract_logic": "submit_code_blocks([])", "provided_data": {"test": []}}}`, 0, false, 0, 400},
	} {
		t.Run(tc.name, func(t *testing.T) {
			f, calls := judgeRunner(tc.sandboxErr)
			h := NewHandler(f, Config{})
			code, m, raw := post(t, h, "/submit", tc.body)
			if code != tc.wantCode {
				t.Fatalf("status %d, want %d: %s", code, tc.wantCode, raw)
			}
			if code != 200 {
				return
			}
			tests, _ := m["tests"].([]any)
			if m["accepted"] != tc.accepted || len(tests) != tc.tests {
				t.Fatalf("accepted %v with %d tests, want %v with %d: %s", m["accepted"], len(tests), tc.accepted, tc.tests, raw)
			}
			if m["id"] != float64(7) {
				t.Errorf("id = %v", m["id"])
			}
			first := tests[0].(map[string]any)
			if ei, _ := first["exec_info"].(map[string]any); ei == nil || ei["status"] == nil {
				t.Errorf("exec_info missing: %v", first)
			}
			if _, ok := first["test_info"].(map[string]any)["input"]; !ok {
				t.Errorf("test_info missing its case: %v", first)
			}
			if tc.sandboxErr >= 5 && calls.Load() != 5 {
				t.Errorf("%d calls for a case that always meets a SandboxError, want 5", calls.Load())
			}
			if tc.sandboxErr == 2 && calls.Load() != 6 {
				t.Errorf("%d calls, want 2 cases × 3 tries", calls.Load())
			}
		})
	}
}

// TestSubmitRequests: the calls a submission makes, with SandboxFusion's
// timeouts and at most 3 at once.
func TestSubmitRequests(t *testing.T) {
	var running, peak atomic.Int32
	f := &fakeRunner{fn: func(ctx context.Context, req *dsecv1.RunCodeRequest) (*dsecv1.RunCodeResponse, error) {
		n := running.Add(1)
		for {
			p := peak.Load()
			if n <= p || peak.CompareAndSwap(p, n) {
				break
			}
		}
		defer running.Add(-1)
		for i := 0; i < 1000 && running.Load() < 3; i++ {
			select {
			case <-ctx.Done():
			default:
			}
		}
		return success(string(req.GetStdin()) + "\n"), nil
	}}
	h := NewHandler(f, Config{})
	var cases []string
	for i := range 9 {
		cases = append(cases, fmt.Sprintf("%d=>%d", i, i))
	}
	body := strings.Replace(submitBody("```cpp\nint main(){}\n```", cases, `{}`), `"language":"python"`, `"language":"cpp","run_timeout":3`, 1)
	code, m, raw := post(t, h, "/submit", body)
	if code != 200 || m["accepted"] != true {
		t.Fatalf("%d %s", code, raw)
	}
	if m["extracted_code"] != "int main(){}" || m["extracted_type"] != "fenced" {
		t.Errorf("extracted %v (%v)", m["extracted_code"], m["extracted_type"])
	}
	reqs := f.requests()
	if len(reqs) != 9 {
		t.Fatalf("%d calls, want 9", len(reqs))
	}
	for _, r := range reqs {
		if r.GetLanguage() != "cpp" || r.GetCode() != "int main(){}" || r.GetCompileTimeoutSeconds() != 10 || r.GetRunTimeoutSeconds() != 3 {
			t.Errorf("call %v", r)
		}
	}
	if p := peak.Load(); p > 3 {
		t.Errorf("%d cases ran at once, want at most 3", p)
	}
}

// TestSubmitShapes: provided_data as a JSON string (SandboxFusion's
// ensure_json) and in the inputs/outputs shape of verl's code data.
func TestSubmitShapes(t *testing.T) {
	f, _ := judgeRunner(0)
	h := NewHandler(f, Config{})
	for _, pd := range []string{
		`{"test": "[{\"input\": {\"stdin\": \"a\"}, \"output\": {\"stdout\": \"a\"}}]"}`,
		`{"test": {"inputs": ["a", "b"], "outputs": ["a\n", "b"]}}`,
		`{"input_output": "{\"inputs\": [\"a\"], \"outputs\": [\"a\"], \"fn_name\": null}"}`,
	} {
		body := `{"dataset": "mine", "id": "q", "completion": "echo", "config": {"language": "python", "provided_data": ` + pd + `}}`
		code, m, raw := post(t, h, "/submit", body)
		if code != 200 || m["accepted"] != true || m["id"] != "q" {
			t.Errorf("provided_data %s: %d %s", pd, code, raw)
		}
	}
	body := `{"dataset": "mine", "id": "q", "completion": "echo", "config": {"language": "python", "provided_data": {"test": {"inputs": [[1]], "outputs": [1], "fn_name": "f"}}}}`
	if code, _, raw := post(t, h, "/submit", body); code != 400 {
		t.Errorf("fn_name: %d %s, want 400", code, raw)
	}
}

// TestSubmitRunnerErrors: an unknown language is the request's fault
// (422); a cluster full on every try is 504.
func TestSubmitRunnerErrors(t *testing.T) {
	body := submitBody("x", []string{"a=>a"}, `{}`)
	h := NewHandler(canned(nil, fmt.Errorf("unknown language \"python\": %w", errdefs.ErrInvalidArgument)), Config{})
	if code, _, raw := post(t, h, "/submit", body); code != 422 {
		t.Errorf("invalid: %d %s", code, raw)
	}
	h = NewHandler(canned(nil, fmt.Errorf("full: %w", errdefs.ErrResourceExhausted)), Config{})
	if code, _, raw := post(t, h, "/submit", body); code != 504 {
		t.Errorf("overloaded: %d %s", code, raw)
	}
}

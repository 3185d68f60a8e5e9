package sandboxfusion

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"

	dsecv1 "dsec.dev/dsec/api/gen/dsec/v1"
	"dsec.dev/dsec/internal/testutil"
)

const hostPython = "/usr/bin/python3"

func requirePython(t *testing.T) {
	t.Helper()
	_, err := os.Stat(hostPython)
	testutil.Require(t, err == nil, hostPython+" is missing")
}

// localPython runs python calls on this host (no isolation: test code
// only), as a node would: a scratch dir with the files, the code in
// tmp_code.py, stdin, a run timeout, and the fetched files read back.
type localPython struct{ t *testing.T }

func (l localPython) RunCode(ctx context.Context, req *dsecv1.RunCodeRequest) (*dsecv1.RunCodeResponse, error) {
	dir := l.t.TempDir()
	for p, data := range req.GetFiles() {
		if err := os.MkdirAll(filepath.Dir(filepath.Join(dir, p)), 0o755); err != nil {
			return nil, err
		}
		if err := os.WriteFile(filepath.Join(dir, p), data, 0o644); err != nil {
			return nil, err
		}
	}
	if err := os.WriteFile(filepath.Join(dir, "tmp_code.py"), []byte(req.GetCode()), 0o644); err != nil {
		return nil, err
	}
	ctx, cancel := context.WithTimeout(ctx, time.Duration(req.GetRunTimeoutSeconds()*float64(time.Second)))
	defer cancel()
	cmd := exec.CommandContext(ctx, hostPython, "tmp_code.py")
	cmd.Dir = dir
	cmd.Stdin = bytes.NewReader(req.GetStdin())
	var stdout, stderr bytes.Buffer
	cmd.Stdout, cmd.Stderr = &stdout, &stderr
	start := time.Now()
	err := cmd.Run()
	res := &dsecv1.CommandResult{ExecutionTimeSeconds: time.Since(start).Seconds(), Stdout: stdout.Bytes(), Stderr: stderr.Bytes()}
	out := &dsecv1.RunCodeResponse{Status: dsecv1.RunStatus_RUN_STATUS_SUCCESS, RunResult: res, Files: map[string][]byte{}, Node: "localhost"}
	var ee *exec.ExitError
	switch {
	case ctx.Err() != nil:
		res.Status = dsecv1.CommandStatus_COMMAND_STATUS_TIME_LIMIT_EXCEEDED
		out.Status = dsecv1.RunStatus_RUN_STATUS_FAILED
	case err == nil:
		res.Status, res.ReturnCode = dsecv1.CommandStatus_COMMAND_STATUS_FINISHED, rc(0)
	case errors.As(err, &ee):
		res.Status, res.ReturnCode = dsecv1.CommandStatus_COMMAND_STATUS_FINISHED, rc(int32(ee.ExitCode()))
		out.Status = dsecv1.RunStatus_RUN_STATUS_FAILED
	default:
		return nil, err
	}
	for _, p := range req.GetFetchFiles() {
		if data, err := os.ReadFile(filepath.Join(dir, p)); err == nil {
			out.Files[p] = data
		}
	}
	return out, nil
}

// TestJupyterDriver runs the driver with the host's python: cells share
// one namespace, each cell's output is its own, a final expression is
// displayed, exceptions are errors that do not stop the notebook, and a
// cell over cell_timeout is stopped.
func TestJupyterDriver(t *testing.T) {
	requirePython(t)
	dir := t.TempDir()
	if err := os.WriteFile(filepath.Join(dir, "main.py"), []byte(jupyterDriver), 0o644); err != nil {
		t.Fatal(err)
	}
	in, _ := json.Marshal(driverInput{Cells: []string{
		"a = 123",
		"a",
		"print(a)\nimport sys; sys.stderr.write('to stderr')",
		"def f():\n    raise RuntimeError('boom')\nf()",
		"print('after the error', a + 1)",
		"x = input()",
		"import time\ntry:\n    while True: time.sleep(0.01)\nexcept Exception:\n    print('swallowed')",
		"display(1, 'two'); None",
		"print('é\\u2028')\n[1, 2]",
		"syntax error here",
		"raise SystemExit(3)",
		"'still running'",
	}, CellTimeout: 0.5, Result: "out.json"})
	cmd := exec.Command(hostPython, "main.py")
	cmd.Dir = dir
	cmd.Stdin = bytes.NewReader(in)
	if out, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("driver: %v\n%s", err, out)
	}
	data, err := os.ReadFile(filepath.Join(dir, "out.json"))
	if err != nil {
		t.Fatal(err)
	}
	var got driverOutput
	if err := json.Unmarshal(data, &got); err != nil {
		t.Fatal(err)
	}
	if got.Status != "Finished" || len(got.Cells) != 12 {
		t.Fatalf("status %s with %d cells: %s", got.Status, len(got.Cells), data)
	}
	c := got.Cells
	plain := func(v any) []map[string]any { return []map[string]any{{"text/plain": v}} }
	if diff := cmp.Diff(CellRunResult{Display: nil}, c[0], cmpCell); diff != "" {
		t.Errorf("cell 0 (-want +got):\n%s", diff)
	}
	if diff := cmp.Diff(plain("123"), c[1].Display); diff != "" {
		t.Errorf("cell 1 display (-want +got):\n%s", diff)
	}
	// write() returns the count, a final expression as in a kernel.
	if c[2].Stdout != "123\n" || c[2].Stderr != "to stderr" || cmp.Diff(plain("9"), c[2].Display) != "" {
		t.Errorf("cell 2: %+v", c[2])
	}
	if len(c[3].Error) != 1 || c[3].Error[0]["ename"] != "RuntimeError" || c[3].Error[0]["evalue"] != "boom" {
		t.Fatalf("cell 3 error: %+v", c[3].Error)
	}
	tb := strings.Join(toStrings(c[3].Error[0]["traceback"]), "")
	if !strings.Contains(tb, `File "<cell-3>", line 2, in f`) || !strings.Contains(tb, "raise RuntimeError('boom')") || strings.Contains(tb, "main.py") {
		t.Errorf("cell 3 traceback shows the cell's lines and not the driver's:\n%s", tb)
	}
	if c[4].Stdout != "after the error 124\n" {
		t.Errorf("cell 4: %+v", c[4])
	}
	if len(c[5].Error) != 1 || c[5].Error[0]["ename"] != "EOFError" {
		t.Errorf("cell 5 (input): %+v", c[5])
	}
	if len(c[6].Error) != 1 || c[6].Error[0]["ename"] != "CellTimeoutError" || c[6].Stdout != "" {
		t.Errorf("cell 6 (timeout): %+v", c[6])
	}
	if diff := cmp.Diff([]map[string]any{{"text/plain": "1"}, {"text/plain": "'two'"}}, c[7].Display); diff != "" {
		t.Errorf("cell 7 display (-want +got):\n%s", diff)
	}
	if c[8].Stdout != "é\u2028\n" || cmp.Diff(plain("[1, 2]"), c[8].Display) != "" {
		t.Errorf("cell 8: %+v", c[8])
	}
	if len(c[9].Error) != 1 || c[9].Error[0]["ename"] != "SyntaxError" {
		t.Errorf("cell 9: %+v", c[9])
	}
	if len(c[10].Error) != 1 || c[10].Error[0]["ename"] != "SystemExit" {
		t.Errorf("cell 10: %+v", c[10])
	}
	if diff := cmp.Diff(plain("'still running'"), c[11].Display); diff != "" {
		t.Errorf("cell 11 (-want +got):\n%s", diff)
	}
}

var cmpCell = cmp.Transformer("emptyNil", func(c CellRunResult) CellRunResult {
	if len(c.Display) == 0 {
		c.Display = nil
	}
	if len(c.Error) == 0 {
		c.Error = nil
	}
	return c
})

func toStrings(v any) []string {
	l, _ := v.([]any)
	var out []string
	for _, e := range l {
		s, _ := e.(string)
		out = append(out, s)
	}
	return out
}

// TestRunJupyter drives /run_jupyter through the handler, the driver
// running as a python call on this host.
func TestRunJupyter(t *testing.T) {
	requirePython(t)
	f := &fakeRunner{fn: localPython{t}.RunCode}
	h := NewHandler(f, Config{})
	body := `{"cells": ["open('out.txt', 'w').write(open('in.txt').read().upper())", "n = 2", "n * 21"],
		"files": {"in.txt": "aGk="}, "fetch_files": ["out.txt"], "total_timeout": 20}`
	code, m, raw := post(t, h, "/run_jupyter", body)
	if code != 200 || m["status"] != "Success" {
		t.Fatalf("%d %s", code, raw)
	}
	var resp RunJupyterResponse
	if err := json.Unmarshal([]byte(raw), &resp); err != nil {
		t.Fatal(err)
	}
	want := []CellRunResult{
		{Stdout: "", Stderr: "", Display: []map[string]any{{"text/plain": "2"}}, Error: []map[string]any{}},
		{Stdout: "", Stderr: "", Display: []map[string]any{}, Error: []map[string]any{}},
		{Stdout: "", Stderr: "", Display: []map[string]any{{"text/plain": "42"}}, Error: []map[string]any{}},
	}
	if diff := cmp.Diff(want, resp.Cells); diff != "" {
		t.Errorf("cells (-want +got):\n%s", diff)
	}
	if diff := cmp.Diff(map[string]string{"out.txt": "SEk="}, resp.Files); diff != "" {
		t.Errorf("files (-want +got):\n%s", diff)
	}
	if resp.Driver == nil || resp.Driver.Status != "Finished" || resp.ExecutorPodName == nil {
		t.Errorf("driver %+v, pod %v", resp.Driver, resp.ExecutorPodName)
	}
	r := f.requests()[0]
	if r.GetLanguage() != "python" || r.GetRunTimeoutSeconds() != 20 || r.GetCode() != jupyterDriver {
		t.Errorf("call: language %s, run timeout %v", r.GetLanguage(), r.GetRunTimeoutSeconds())
	}

	// Over total_timeout: Failed, no cells, the driver's TLE.
	code, m, raw = post(t, h, "/run_jupyter", `{"cells": ["import time; time.sleep(30)"], "total_timeout": 0.5}`)
	if code != 200 || m["status"] != "Failed" || len(m["cells"].([]any)) != 0 || m["driver"].(map[string]any)["status"] != "TimeLimitExceeded" {
		t.Errorf("total timeout: %d %s", code, raw)
	}

	// Validation.
	for _, body := range []string{`{}`, `{"cells": "x"}`, `{"cells": [], "kernel": "ruby"}`, `{"cells": [1]}`} {
		if code, _, raw := post(t, h, "/run_jupyter", body); code != 422 {
			t.Errorf("%s: %d %s, want 422", body, code, raw)
		}
	}
}

package root

import (
	"bytes"
	"context"
	"encoding/base64"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"os"
	"runtime"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"
	"unicode/utf8"

	"connectrpc.com/connect"

	dsecv1 "dsec.dev/dsec/api/gen/dsec/v1"
	"dsec.dev/dsec/api/gen/dsec/v1/dsecv1connect"
	"dsec.dev/dsec/internal/edge/fncall"
	"dsec.dev/dsec/internal/testutil"
)

// fncallEnvTree is the fncall environment's tree (scripts/build-fncall-env.sh);
// CI builds it before the suite.
func fncallEnvTree(t *testing.T) string {
	t.Helper()
	tree := os.Getenv("DSEC_FNCALL_ENV_TREE")
	if tree == "" {
		tree = "/var/cache/dsec/fncall-env"
	}
	testutil.Require(t, fileExists(tree+"/usr/bin/python3"),
		"the fncall environment is not built at "+tree+" (scripts/build-fncall-env.sh "+tree+", or set DSEC_FNCALL_ENV_TREE)")
	return tree
}

func fileExists(p string) bool { _, err := os.Stat(p); return err == nil }

// sfDaemon is a dsecd with the fncall environment imported, and a client of
// its SandboxFusion API.
type sfDaemon struct {
	d   *testutil.Daemon
	url string
	fn  dsecv1connect.FnCallServiceClient
}

// fnCallDaemon imports the fncall environment into d.
func fnCallDaemon(t *testing.T, d *testutil.Daemon) *sfDaemon {
	t.Helper()
	tree := fncallEnvTree(t)
	if out, errOut, code := d.CLI("", "layer", "import", "--kind", "base", "--allow-setuid", "fncall:latest", tree); code != 0 {
		t.Fatalf("import the fncall environment: %s %s", out, errOut)
	}
	return &sfDaemon{d: d, url: "http://" + d.SandboxFusionAddr,
		fn: dsecv1connect.NewFnCallServiceClient(d.Clients.HTTP, d.Clients.BaseURL)}
}

// For is s seen from t (testutil.Daemon.For).
func (s *sfDaemon) For(t *testing.T) *sfDaemon {
	c := *s
	c.d = s.d.For(t)
	return &c
}

// post sends body to path and returns the status and the decoded JSON.
func (s *sfDaemon) post(t *testing.T, path string, body any) (int, map[string]any) {
	t.Helper()
	resp, err := http.Post(s.url+path, "application/json", requestBody(t, body))
	if err != nil {
		t.Fatalf("POST %s: %v", path, err)
	}
	defer resp.Body.Close()
	raw, _ := io.ReadAll(resp.Body)
	if !json.Valid(raw) {
		t.Fatalf("POST %s: invalid JSON (HTTP %d): %q", path, resp.StatusCode, raw)
	}
	var out map[string]any
	json.Unmarshal(raw, &out)
	return resp.StatusCode, out
}

func field(m map[string]any, path ...string) any {
	var v any = m
	for _, p := range path {
		mm, ok := v.(map[string]any)
		if !ok {
			return nil
		}
		v = mm[p]
	}
	return v
}

func str(m map[string]any, path ...string) string { s, _ := field(m, path...).(string); return s }

// TestFnCall runs every test on the fncall environment against one dsecd
// of the pass, which imports the environment once: SandboxFusion's API,
// the network of a call, grading and provenance on its Python. Each of
// those five tests imported the environment's 1.8 GB into a dsecd of its
// own, ~40 s of each in both passes. The dsecd is setupNetwork's (its test
// hosts and services for the network subtests) and offers gVisor where the
// host has runsc ($DSEC_RUNSC); each subtest cleans up what it made.
func TestFnCall(t *testing.T) {
	e := setupNetwork(t)
	s := fnCallDaemon(t, e.d)
	run := func(name string, f func(*sfDaemon, *testing.T)) {
		t.Run(name, func(t *testing.T) { f(s.For(t), t) })
	}
	run("SandboxFusionTable", (*sfDaemon).testTable)
	run("Languages", (*sfDaemon).testLanguages)
	run("Verl", (*sfDaemon).testVerl)
	run("NothingLeaks", (*sfDaemon).testNothingLeaks)
	run("BadInput", (*sfDaemon).testBadInput)
	run("CPUBurst", (*sfDaemon).testCPUBurst)
	run("Storm", (*sfDaemon).testStorm)
	run("Metrics", (*sfDaemon).testMetrics)
	t.Run("Network", func(t *testing.T) { testFnCallNetwork(t, e.For(t)) })
	run("ProvenanceRewardHacks", func(s *sfDaemon, t *testing.T) { testProvenanceRewardHacks(t, s.d) })
	// Before the container grades, as alone: gVisor has no grade pool,
	// and the container grades leave theirs.
	run("GradeGVisor", func(s *sfDaemon, t *testing.T) { testGradeGVisor(t, s.d) })
	run("GradeRewardHacks", func(s *sfDaemon, t *testing.T) { testGradeRewardHacks(t, s) })
}

// testMetrics: the node's /metrics counts calls by language and status,
// their latency, and shows the queue.
func (s *sfDaemon) testMetrics(t *testing.T) {
	ctx := context.Background()
	before := scrapeMetrics(t, s.d)
	for _, code := range []string{"print(1)", "print(2)", "raise SystemExit(3)"} {
		if _, err := s.fn.RunCode(ctx, connect.NewRequest(&dsecv1.RunCodeRequest{Language: "python", Code: code})); err != nil {
			t.Fatal(err)
		}
	}
	if _, err := s.fn.RunCode(ctx, connect.NewRequest(&dsecv1.RunCodeRequest{Language: "cobol", Code: "x"})); err == nil {
		t.Fatal("a call in a language the node lacks ran")
	}
	after := scrapeMetrics(t, s.d)
	for _, c := range []struct {
		name   string
		labels map[string]string
		want   float64
	}{
		{"dsec_fncall_calls_total", map[string]string{"language": "python", "status": "success"}, 2},
		{"dsec_fncall_calls_total", map[string]string{"language": "python", "status": "failed"}, 1},
		{"dsec_fncall_calls_total", map[string]string{"language": "unknown", "status": "error"}, 1},
		{"dsec_fncall_call_seconds", map[string]string{"language": "python"}, 3},
	} {
		if got := testutil.MetricValue(after, c.name, c.labels) - testutil.MetricValue(before, c.name, c.labels); got != c.want {
			t.Errorf("%s%v moved by %v, want %v", c.name, c.labels, got, c.want)
		}
	}
	for _, name := range []string{"dsec_fncall_queue", "dsec_fncall_running", "dsec_fncall_idle_containers"} {
		if after[name] == nil {
			t.Errorf("/metrics lacks %s", name)
		}
	}
	if idle := after["dsec_fncall_idle_containers"].GetMetric(); len(idle) != 1 || idle[0].GetGauge().GetValue() < 1 {
		t.Errorf("dsec_fncall_idle_containers = %v after calls, want at least the container that ran them", idle)
	}
}

func (s *sfDaemon) testTable(t *testing.T) {
	run := func(body map[string]any) map[string]any {
		t.Helper()
		code, r := s.post(t, "/run_code", body)
		if code != 200 {
			t.Fatalf("HTTP %d: %v", code, r)
		}
		return r
	}
	py := func(code string) map[string]any {
		return map[string]any{"language": "python", "code": code, "run_timeout": 5}
	}

	if code, _ := s.post(t, "/v1/ping", ""); code != 405 {
		// ping is a GET
		t.Errorf("POST /v1/ping: %d", code)
	}
	resp, err := http.Get(s.url + "/v1/ping")
	if err != nil {
		t.Fatal(err)
	}
	b, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if strings.TrimSpace(string(b)) != `"pong"` {
		t.Errorf("ping: %q", b)
	}

	r := run(py("print(int(input()) + 1)"))
	if r["status"] != "Failed" { // no stdin: EOFError
		t.Errorf("no stdin: %v", r)
	}
	body := py("print(int(input()) + 1)")
	body["stdin"] = "41\n"
	r = run(body)
	if r["status"] != "Success" || str(r, "run_result", "stdout") != "42\n" || field(r, "run_result", "return_code") != 0.0 || field(r, "compile_result") != nil {
		t.Errorf("success: %v", r)
	}
	// A wrong answer is a success whose stdout differs.
	body["stdin"] = "1\n"
	if r = run(body); r["status"] != "Success" || str(r, "run_result", "stdout") != "2\n" {
		t.Errorf("wrong answer: %v", r)
	}
	r = run(map[string]any{"language": "cpp", "code": "int main( { }", "compile_timeout": 30})
	if r["status"] != "Failed" || field(r, "run_result") != nil || str(r, "compile_result", "status") != "Finished" ||
		field(r, "compile_result", "return_code") == 0.0 || !strings.Contains(str(r, "compile_result", "stderr"), "error") {
		t.Errorf("compile error: %v", r)
	}
	r = run(py("import sys\nprint('before')\nraise ValueError('boom')"))
	if r["status"] != "Failed" || field(r, "run_result", "return_code") != 1.0 || !strings.Contains(str(r, "run_result", "stderr"), "ValueError: boom") ||
		str(r, "run_result", "stdout") != "before\n" {
		t.Errorf("runtime error: %v", r)
	}
	body = py("import time\nprint('partial', flush=True)\ntime.sleep(60)")
	body["run_timeout"] = 1
	t0 := time.Now()
	r = run(body)
	if r["status"] != "Failed" || str(r, "run_result", "status") != "TimeLimitExceeded" || field(r, "run_result", "return_code") != nil ||
		str(r, "run_result", "stdout") != "partial\n" || time.Since(t0) > 10*time.Second {
		t.Errorf("timeout: %v after %s", r, time.Since(t0))
	}
	body = py("x = bytearray(1 << 30)\nprint(len(x))")
	body["memory_limit_MB"] = 128
	if r = run(body); r["status"] != "Failed" || str(r, "run_result", "stdout") != "" {
		t.Errorf("memory limit: %v", r)
	}
	body = py("print(open('data/in.txt').read().upper(), end='')\nopen('out.txt', 'w').write('result')")
	body["files"] = map[string]any{"data/in.txt": base64.StdEncoding.EncodeToString([]byte("hello")), "skipped.txt": nil}
	body["fetch_files"] = []string{"out.txt", "missing.txt"}
	r = run(body)
	files, _ := r["files"].(map[string]any)
	if r["status"] != "Success" || str(r, "run_result", "stdout") != "HELLO" || files["out.txt"] != base64.StdEncoding.EncodeToString([]byte("result")) || len(files) != 1 {
		t.Errorf("files: %v", r)
	}
	body = py("import sys\nprint(len(sys.stdin.read()))")
	body["stdin"] = nil
	if r = run(body); r["status"] != "Success" || str(r, "run_result", "stdout") != "0\n" {
		t.Errorf("stdin null: %v", r)
	}
	if r = run(py("import sys\nsys.stdout.buffer.write(b'ok \\xff\\xfe \\xc3\\xa9\\n')")); r["status"] != "Success" || !utf8.ValidString(str(r, "run_result", "stdout")) ||
		!strings.HasPrefix(str(r, "run_result", "stdout"), "ok ") {
		t.Errorf("odd bytes: %v", r)
	}
	body = py("print('x')")
	body["expected_stdout"] = "x"
	body["some_future_field"] = map[string]any{"a": 1}
	if r = run(body); r["status"] != "Success" {
		t.Errorf("extra fields: %v", r)
	}
	if code, r := s.post(t, "/run_code", map[string]any{"language": "cobol", "code": "x"}); code != 422 {
		t.Errorf("unknown language: HTTP %d %v", code, r)
	}
	if code, r := s.post(t, "/run_code", map[string]any{"language": "python"}); code != 422 {
		t.Errorf("no code: HTTP %d %v", code, r)
	}
	// /submit with ad-hoc cases and /run_jupyter, end to end.
	code, r := s.post(t, "/submit", map[string]any{"dataset": "adhoc", "id": 1, "completion": "```python\nprint(int(input()) * 2)\n```",
		"config": map[string]any{"language": "python", "provided_data": map[string]any{"test": []any{
			map[string]any{"input": map[string]any{"stdin": "2\n"}, "output": map[string]any{"stdout": "4\n"}},
			map[string]any{"input": map[string]any{"stdin": "5\n"}, "output": map[string]any{"stdout": "10"}},
		}}}})
	if code != 200 || r["accepted"] != true {
		t.Errorf("submit: HTTP %d %v", code, r)
	}
	code, r = s.post(t, "/run_jupyter", map[string]any{"cells": []string{"x = 20", "print(x + 1)", "x * 2", "1/0"}})
	cells, _ := r["cells"].([]any)
	if code != 200 || len(cells) != 4 || str(cells[1].(map[string]any), "stdout") != "21\n" {
		t.Errorf("run_jupyter: HTTP %d %v", code, r)
	}
}

func (s *sfDaemon) testLanguages(t *testing.T) {
	hello := map[string]string{
		"python":  "print('hello ' + input())",
		"cpp":     "#include <iostream>\n#include <string>\nint main(){std::string s; std::cin >> s; std::cout << \"hello \" << s << std::endl;}",
		"c":       "#include <stdio.h>\nint main(){char s[64]; scanf(\"%63s\", s); printf(\"hello %s\\n\", s);}",
		"go":      "package main\nimport \"fmt\"\nfunc main(){var s string; fmt.Scan(&s); fmt.Println(\"hello \" + s)}",
		"java":    "import java.util.*;\npublic class Main { public static void main(String[] a){ System.out.println(\"hello \" + new Scanner(System.in).next()); } }",
		"nodejs":  "const s = require('fs').readFileSync(0, 'utf8').trim(); console.log('hello ' + s);",
		"bash":    "read s; echo \"hello $s\"",
		"rust":    "use std::io::*;\nfn main(){ let mut s = String::new(); stdin().read_line(&mut s).unwrap(); println!(\"hello {}\", s.trim()); }",
		"pytest":  "def test_ok():\n    assert 1 + 1 == 2\n",
		"go_test": "package main\nimport \"testing\"\nfunc TestOK(t *testing.T) { if 1+1 != 2 { t.Fatal(\"no\") } }",
	}
	var wg sync.WaitGroup
	for lang, code := range hello {
		wg.Add(1)
		go func() {
			defer wg.Done()
			ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
			defer cancel()
			resp, err := s.fn.RunCode(ctx, connect.NewRequest(&dsecv1.RunCodeRequest{Language: lang, Code: code, Stdin: []byte("world\n"),
				CompileTimeoutSeconds: 60, RunTimeoutSeconds: 30}))
			if err != nil {
				t.Errorf("%s: %v", lang, err)
				return
			}
			r := resp.Msg
			if r.Status != dsecv1.RunStatus_RUN_STATUS_SUCCESS {
				t.Errorf("%s: %v %s; compile %q; run %q", lang, r.Status, r.Message, r.GetCompileResult().GetStderr(), r.GetRunResult().GetStderr())
				return
			}
			if lang != "pytest" && lang != "go_test" && string(r.RunResult.Stdout) != "hello world\n" {
				t.Errorf("%s printed %q", lang, r.RunResult.Stdout)
			}
			t.Logf("%s: compile %.0f ms, run %.0f ms", lang, 1000*r.GetCompileResult().GetExecutionTimeSeconds(), 1000*r.RunResult.ExecutionTimeSeconds)
		}()
	}
	wg.Wait()
	langs, err := s.fn.ListLanguages(context.Background(), connect.NewRequest(&dsecv1.ListLanguagesRequest{}))
	if err != nil || len(langs.Msg.Languages) < len(hello) {
		t.Errorf("languages: %v %v", langs, err)
	}
}

func (s *sfDaemon) testVerl(t *testing.T) {
	c := &testutil.VerlClient{URL: s.url + "/run_code"}
	for _, tc := range []struct {
		name, lang, code string
		want             int
	}{
		{"correct", "python", "print(int(input()) * 2)", 1},
		{"wrong", "python", "print(int(input()) * 3)", 0},
		{"compile error", "cpp", "int main( {", -4},
		{"runtime error", "python", "raise SystemExit(2)", -2},
		{"timeout", "python", "while True: pass", -3},
		{"correct cpp", "cpp", "#include <iostream>\nint main(){int n; std::cin >> n; std::cout << n * 2 << std::endl;}", 1},
	} {
		if got := c.Score(tc.code, "21\n", "42\n", tc.lang, 30, 2); got != tc.want {
			t.Errorf("%s: verl scores %d, want %d", tc.name, got, tc.want)
		}
	}
}

// testNothingLeaks runs two calls on one container (the pool hands back
// the container it just used) and checks the second sees nothing of the
// first: files, processes, /tmp, environment, uid.
func (s *sfDaemon) testNothingLeaks(t *testing.T) {
	ctx := context.Background()
	first := `import os, subprocess, json
open('/tmp/left-in-tmp', 'w').write('x')
open('mine.txt', 'w').write('secret')
os.environ['LEAK'] = '1'
subprocess.Popen(['sleep', '1000'], start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
import ctypes  # System V IPC objects outlive their process
libc = ctypes.CDLL(None, use_errno=True)
ipc = [libc.shmget(0, 4096, 0o1600), libc.semget(0, 1, 0o1600), libc.msgget(0, 0o1600)]
print(json.dumps({'uid': os.getuid(), 'cwd': os.getcwd(), 'ipc': ipc}))
`
	r1, err := s.fn.RunCode(ctx, connect.NewRequest(&dsecv1.RunCodeRequest{Language: "python", Code: first}))
	if err != nil || r1.Msg.Status != dsecv1.RunStatus_RUN_STATUS_SUCCESS {
		t.Fatalf("first call: %v %v", r1, err)
	}
	var prev struct {
		UID int    `json:"uid"`
		Cwd string `json:"cwd"`
		IPC []int  `json:"ipc"`
	}
	json.Unmarshal(r1.Msg.RunResult.Stdout, &prev)
	if len(prev.IPC) != 3 || slices.Min(prev.IPC) < 0 {
		t.Fatalf("the first call could not make its System V objects (shm, sem, msg): %v", prev.IPC)
	}
	second := fmt.Sprintf(`import os, json
procs = []
for p in os.listdir('/proc'):
    if p.isdigit():
        try:
            procs.append(open('/proc/%%s/cmdline' %% p).read().replace('\0', ' '))
        except OSError:
            pass
ipc = sum(len(open('/proc/sysvipc/' + k).read().splitlines()) - 1 for k in ('shm', 'sem', 'msg'))
print(json.dumps({'uid': os.getuid(), 'tmp': sorted(os.listdir('/tmp')), 'prev_dir': os.path.exists(%q),
    'leak': os.environ.get('LEAK'), 'sleep': [p for p in procs if p.startswith('sleep')], 'ipc': ipc}))
`, prev.Cwd)
	var r2 *connect.Response[dsecv1.RunCodeResponse]
	// Calls go to the most recently used idle container: retry until the
	// second lands on the first's (another test's calls may interleave).
	for range 10 {
		r2, err = s.fn.RunCode(ctx, connect.NewRequest(&dsecv1.RunCodeRequest{Language: "python", Code: second}))
		if err != nil {
			t.Fatal(err)
		}
		if r2.Msg.Container == r1.Msg.Container {
			break
		}
	}
	if r2.Msg.Container != r1.Msg.Container {
		t.Fatalf("the second call never ran on the first's container %s", r1.Msg.Container)
	}
	var seen struct {
		UID     int      `json:"uid"`
		Tmp     []string `json:"tmp"`
		PrevDir bool     `json:"prev_dir"`
		Leak    *string  `json:"leak"`
		Sleep   []string `json:"sleep"`
		IPC     int      `json:"ipc"`
	}
	if err := json.Unmarshal(r2.Msg.RunResult.Stdout, &seen); err != nil {
		t.Fatalf("second call printed %q: %v (%q)", r2.Msg.RunResult.Stdout, err, r2.Msg.RunResult.Stderr)
	}
	if seen.UID == prev.UID || len(seen.Sleep) > 0 || seen.PrevDir || seen.Leak != nil || len(seen.Tmp) != 1 || seen.IPC != 0 {
		t.Errorf("the second call saw the first's: uid %d (was %d), processes %v, scratch dir %v, env %v, /tmp %v, %d System V objects",
			seen.UID, prev.UID, seen.Sleep, seen.PrevDir, seen.Leak, seen.Tmp, seen.IPC)
	}
}

func (s *sfDaemon) testBadInput(t *testing.T) {
	ctx := context.Background()
	run := func(lang, code string, timeout float64) *dsecv1.RunCodeResponse {
		t.Helper()
		resp, err := s.fn.RunCode(ctx, connect.NewRequest(&dsecv1.RunCodeRequest{Language: lang, Code: code, RunTimeoutSeconds: timeout}))
		if err != nil {
			t.Fatalf("%s: %v", code, err)
		}
		return resp.Msg
	}
	healthy := func(what string) {
		t.Helper()
		r := run("python", "print('alive')", 5)
		if r.Status != dsecv1.RunStatus_RUN_STATUS_SUCCESS || string(r.RunResult.Stdout) != "alive\n" {
			t.Fatalf("after %s: %v", what, r)
		}
	}
	for _, c := range []struct{ name, lang, code string }{
		{"fork bomb", "bash", "b() { b | b & }; b; sleep 30"},
		{"memory bomb", "python", "x = []\nwhile True: x.append(bytearray(1 << 24))"},
		{"infinite output", "python", "while True: print('y' * 1000)"},
		{"infinite loop", "python", "while True: pass"},
		{"daemon that exits", "bash", "setsid sleep 1000 </dev/null >/dev/null 2>&1 & exit 0"},
		{"10 GB to the scratch dir", "bash", "head -c 10000000000 /dev/zero > big; echo $?"},
	} {
		r := run(c.lang, c.code, 3)
		if r.Status == dsecv1.RunStatus_RUN_STATUS_SANDBOX_ERROR {
			t.Errorf("%s: %v", c.name, r)
		}
		if c.name == "infinite output" && (len(r.RunResult.Stdout) > 1<<20 || !r.RunResult.StdoutTruncated) {
			t.Errorf("infinite output: %d bytes, truncated %v", len(r.RunResult.Stdout), r.RunResult.StdoutTruncated)
		}
		healthy(c.name)
	}
	r := run("python", "import sys\nsys.stdout.buffer.write(bytes(range(256)))", 5)
	if len(r.RunResult.Stdout) != 256 {
		t.Errorf("binary output: %d bytes", len(r.RunResult.Stdout))
	}
	big := map[string][]byte{"big.bin": bytes.Repeat([]byte{7}, 100<<20)}
	resp, err := s.fn.RunCode(ctx, connect.NewRequest(&dsecv1.RunCodeRequest{Language: "bash", Code: "wc -c < big.bin", Files: big, RunTimeoutSeconds: 30}))
	if err != nil || strings.TrimSpace(string(resp.Msg.GetRunResult().GetStdout())) != "104857600" {
		t.Errorf("100 MB file: %v %v", resp, err)
	}
	for _, body := range []string{
		`{"language": "python", "code": "print(1)", "files": {"a.txt": "not base64!"}}`,
		`{"language": "python", "code": "print(1)", "files": {"/etc/passwd": "eA=="}}`,
		`{"language": "python", "code": "print(1)", "files": {"../../x": "eA=="}}`,
		`{"language": "python", "code": `,
	} {
		if code, r := s.post(t, "/run_code", body); code != 422 {
			t.Errorf("%s: HTTP %d %v", body, code, r)
		}
	}
	healthy("bad requests")
}

// testCPUBurst sends a burst of CPU-bound calls, four times as many as
// the node runs short calls at once (4 per core), each with a run_timeout
// of 2 s. SandboxFusion starts every call at once and times it by the
// wall clock, so every one ends at its timeout as TimeLimitExceeded, and
// verl's reward code is written for that. So must dsec: a call is admitted
// by the node's memory, not its cores, and starts within the start bound
// (fncall.DefaultMaxStartDelay) or is refused; a CPU-bound call only runs
// slower beside the others, its timeout counted from its arrival. Each
// must answer TimeLimitExceeded within its run_timeout plus the start
// bound plus a second for the kill and the answer: a call that waited in
// a queue for others to end, or was refused, fails.
func (s *sfDaemon) testCPUBurst(t *testing.T) {
	const runTimeout = 2 * time.Second
	n := 4 * 4 * runtime.NumCPU()
	patience := runTimeout + fncall.DefaultMaxStartDelay + time.Second
	body, _ := json.Marshal(map[string]any{"language": "python", "code": "while True:\n    pass\n",
		"run_timeout": runTimeout.Seconds(), "memory_limit_MB": 1024})
	hc := &http.Client{Transport: &http.Transport{MaxIdleConnsPerHost: n}}
	var mu sync.Mutex
	var wrong []string
	var wg sync.WaitGroup
	for i := range n {
		wg.Add(1)
		go func() {
			defer wg.Done()
			ctx, cancel := context.WithTimeout(context.Background(), patience)
			defer cancel()
			t0 := time.Now()
			got := ""
			req, _ := http.NewRequestWithContext(ctx, "POST", s.url+"/run_code", bytes.NewReader(body))
			req.Header.Set("Content-Type", "application/json")
			resp, err := hc.Do(req)
			switch {
			case ctx.Err() != nil:
				got = fmt.Sprintf("no answer within %s", patience)
			case err != nil:
				got = err.Error()
			default:
				var r map[string]any
				json.NewDecoder(resp.Body).Decode(&r)
				resp.Body.Close()
				if resp.StatusCode != http.StatusOK || str(r, "run_result", "status") != "TimeLimitExceeded" {
					got = fmt.Sprintf("HTTP %d, %v %q", resp.StatusCode, r["status"], str(r, "run_result", "status"))
				}
			}
			if got != "" {
				mu.Lock()
				wrong = append(wrong, fmt.Sprintf("call %d after %s: %s", i, time.Since(t0).Round(time.Millisecond), got))
				mu.Unlock()
			}
		}()
	}
	wg.Wait()
	slices.Sort(wrong)
	for _, w := range wrong {
		t.Error(w)
	}
	if len(wrong) > 0 {
		t.Errorf("%d of %d CPU-bound calls with run_timeout %s did not answer TimeLimitExceeded within %s", len(wrong), n, runTimeout, patience)
	}
}

// testStorm sends 10,000 requests at once: each gets a result or 504, and
// the node serves the next call.
func (s *sfDaemon) testStorm(t *testing.T) {
	const n = 10000
	body, _ := json.Marshal(map[string]any{"language": "python", "code": "print(1)", "run_timeout": 10})
	hc := &http.Client{Transport: &http.Transport{MaxIdleConnsPerHost: n}, Timeout: 5 * time.Minute}
	var mu sync.Mutex
	counts := map[string]int{}
	var wg sync.WaitGroup
	for range n {
		wg.Add(1)
		go func() {
			defer wg.Done()
			key := ""
			resp, err := hc.Post(s.url+"/run_code", "application/json", bytes.NewReader(body))
			if err != nil {
				key = "transport error"
			} else {
				var r map[string]any
				json.NewDecoder(resp.Body).Decode(&r)
				resp.Body.Close()
				key = fmt.Sprintf("%d %v", resp.StatusCode, r["status"])
			}
			mu.Lock()
			counts[key]++
			mu.Unlock()
		}()
	}
	wg.Wait()
	t.Logf("10,000 at once: %v", counts)
	for k, v := range counts {
		if k != "200 Success" && !strings.HasPrefix(k, "504") {
			t.Errorf("%d requests answered %s", v, k)
		}
	}
	if counts["200 Success"] == 0 {
		t.Errorf("no request of the storm ran")
	}
	code, r := s.post(t, "/run_code", map[string]any{"language": "python", "code": "print(2)"})
	if code != 200 || r["status"] != "Success" {
		t.Errorf("after the storm: HTTP %d %v", code, r)
	}
}

// testFnCallNetwork: a call has no network unless its rules allow it, and a
// call's rules do not outlive it on the pooled container.
func testFnCallNetwork(t *testing.T, e *netEnv) {
	fn := dsecv1connect.NewFnCallServiceClient(e.d.Clients.HTTP, e.d.Clients.BaseURL)
	reach := func(rules map[string]bool, addr string) (string, string) {
		t.Helper()
		code := fmt.Sprintf(`import socket
try:
    socket.create_connection((%q, 80), timeout=3).close()
    print("connected")
except OSError as e:
    print("refused", e)
`, addr)
		resp, err := fn.RunCode(context.Background(), connect.NewRequest(&dsecv1.RunCodeRequest{Language: "python", Code: code, NetworkRules: rules, RunTimeoutSeconds: 10}))
		if err != nil {
			t.Fatalf("call with rules %v: %v", rules, err)
		}
		return strings.TrimSpace(string(resp.Msg.GetRunResult().GetStdout())), resp.Msg.Container
	}
	if out, _ := reach(nil, e.pypi.addr); strings.HasPrefix(out, "connected") {
		t.Errorf("a call without rules reached %s", e.pypi.addr)
	}
	out, first := reach(map[string]bool{e.pypi.addr + "/32": true}, e.pypi.addr)
	if out != "connected" {
		t.Errorf("a call allowed %s did not reach it: %q", e.pypi.addr, out)
	}
	if out, _ := reach(map[string]bool{e.pypi.addr + "/32": true}, e.other.addr); strings.HasPrefix(out, "connected") {
		t.Errorf("a call allowed only %s reached %s", e.pypi.addr, e.other.addr)
	}
	// The next call on that container, allowed something else, does not
	// inherit the first call's rules.
	out, second := reach(map[string]bool{e.other.addr + "/32": true}, e.pypi.addr)
	if strings.HasPrefix(out, "connected") {
		t.Errorf("a call reached %s on rules of an earlier call (containers %s, %s)", e.pypi.addr, first, second)
	}
}

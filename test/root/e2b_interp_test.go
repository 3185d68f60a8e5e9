package root

import (
	"bufio"
	"context"
	"encoding/json"
	"io"
	"net/http"
	"strings"
	"testing"
	"time"

	"connectrpc.com/connect"

	dsecv1 "dsec.dev/dsec/api/gen/dsec/v1"
	"dsec.dev/dsec/internal/e2b"
	"dsec.dev/dsec/internal/testutil"
)

// interpClient calls a sandbox's code interpreter (E2B's port 49999) the
// way @e2b/code-interpreter does: plain HTTP to the E2B address, routed by
// the E2b-Sandbox-Id and E2b-Sandbox-Port headers.
type interpClient struct {
	t       *testing.T
	url     string
	e2bID   string
	token   string // the sandbox's envd access token
	traffic string // its traffic access token, which the SDK sends with /contexts
}

func newInterpClient(t *testing.T, d *testutil.Daemon, id string) *interpClient {
	t.Helper()
	signer := e2b.NewSigner(d.E2BSecret())
	return &interpClient{t: t, url: "http://" + d.E2BAddr, e2bID: e2b.SandboxID(id), token: signer.AccessToken(id), traffic: signer.TrafficToken(id)}
}

// do sends a request; body is JSON-encoded unless it is a string. With
// token it carries the envd access token, without it the traffic access
// token, as the SDK sends them.
func (c *interpClient) do(ctx context.Context, method, path string, body any, token bool) *http.Response {
	c.t.Helper()
	req, err := http.NewRequestWithContext(ctx, method, c.url+path, requestBody(c.t, body))
	if err != nil {
		c.t.Fatal(err)
	}
	req.Header.Set("Content-Type", "application/json")
	req.Header.Set("E2b-Sandbox-Id", c.e2bID)
	req.Header.Set("E2b-Sandbox-Port", e2b.InterpreterPort)
	if token {
		req.Header.Set("X-Access-Token", c.token)
	} else {
		req.Header.Set("E2B-Traffic-Access-Token", c.traffic)
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		c.t.Fatalf("%s %s: %v", method, path, err)
	}
	return resp
}

// call sends a request and returns the status and the body.
func (c *interpClient) call(method, path string, body any, token bool) (int, []byte) {
	c.t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	resp := c.do(ctx, method, path, body, token)
	defer resp.Body.Close()
	data, _ := io.ReadAll(resp.Body)
	return resp.StatusCode, data
}

// execution is what an /execute stream said, as the SDK's Execution.
type execution struct {
	stdout, stderr []string
	results        []map[string]any
	err            map[string]any
	count          int
	ended          bool // end_of_execution came last
}

// main is the main result's text, "" without one.
func (e execution) main() string {
	for _, r := range e.results {
		if r["is_main_result"] == true {
			s, _ := r["text"].(string)
			return s
		}
	}
	return ""
}

// execute runs code (body fields beyond code in extra) and parses the
// NDJSON answer as the SDK's parseOutput does.
func (c *interpClient) execute(code string, extra map[string]any) execution {
	c.t.Helper()
	body := map[string]any{"code": code}
	for k, v := range extra {
		body[k] = v
	}
	ctx, cancel := context.WithTimeout(context.Background(), 90*time.Second)
	defer cancel()
	resp := c.do(ctx, "POST", "/execute", body, true)
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		data, _ := io.ReadAll(resp.Body)
		c.t.Fatalf("execute %q: HTTP %d: %s", code, resp.StatusCode, data)
	}
	var e execution
	sc := bufio.NewScanner(resp.Body)
	sc.Buffer(nil, 16<<20)
	for sc.Scan() {
		if e.ended {
			c.t.Fatalf("execute %q: a line after end_of_execution: %s", code, sc.Text())
		}
		var m map[string]any
		if err := json.Unmarshal(sc.Bytes(), &m); err != nil {
			c.t.Fatalf("execute %q: a line that is not JSON: %q", code, sc.Text())
		}
		switch m["type"] {
		case "stdout":
			e.stdout = append(e.stdout, m["text"].(string))
		case "stderr":
			e.stderr = append(e.stderr, m["text"].(string))
		case "result":
			e.results = append(e.results, m)
		case "error":
			e.err = m
		case "number_of_executions":
			e.count = int(m["execution_count"].(float64))
		case "end_of_execution":
			e.ended = true
		}
	}
	if err := sc.Err(); err != nil {
		c.t.Fatalf("execute %q: read the stream: %v", code, err)
	}
	if !e.ended {
		c.t.Fatalf("execute %q: the stream ended without end_of_execution", code)
	}
	return e
}

// contexts is GET /contexts.
func (c *interpClient) contexts() []map[string]string {
	c.t.Helper()
	code, body := c.call("GET", "/contexts", nil, false)
	if code != http.StatusOK {
		c.t.Fatalf("list contexts: HTTP %d: %s", code, body)
	}
	var out []map[string]string
	if err := json.Unmarshal(body, &out); err != nil {
		c.t.Fatalf("list contexts: %v: %s", err, body)
	}
	return out
}

// createContext is POST /contexts, as createCodeContext sends it (no
// access token).
func (c *interpClient) createContext(body map[string]any) map[string]string {
	c.t.Helper()
	code, data := c.call("POST", "/contexts", body, false)
	if code != http.StatusOK {
		c.t.Fatalf("create context %v: HTTP %d: %s", body, code, data)
	}
	var ctx map[string]string
	if err := json.Unmarshal(data, &ctx); err != nil || ctx["id"] == "" {
		c.t.Fatalf("create context: %v: %s", err, data)
	}
	return ctx
}

// interpDrivers counts the sandbox's running context drivers.
func interpDrivers(t *testing.T, d *testutil.Daemon, id string) int {
	t.Helper()
	resp, err := d.Clients.Sandboxes.ListProcesses(context.Background(), connect.NewRequest(&dsecv1.ListProcessesRequest{SandboxId: id}))
	if err != nil {
		t.Fatal(err)
	}
	n := 0
	for _, p := range resp.Msg.GetProcesses() {
		if strings.HasPrefix(p.GetTag(), "e2b-interp:") && p.GetRunning() {
			n++
		}
	}
	return n
}

// testE2BInterpreter (TestE2BBase/Interpreter): E2B's code interpreter on
// its base environment.
func testE2BInterpreter(t *testing.T, d *testutil.Daemon) {
	// As E2B's creates ask (their templates give user sudo).
	sb := create(t, d, &dsecv1.SandboxSpec{Environment: testutil.E2BBaseEnv, Env: map[string]string{"DSEC_SANDBOX_VAR": "from-spec"},
		AllowPrivilegeEscalation: true})
	id := sb.GetId()
	c := newInterpClient(t, d, id)

	t.Run("BaseEnvironment", func(t *testing.T) {
		if r := execReq(t, d, &dsecv1.ExecRequest{SandboxId: id, Command: "id user"}); r.exit.GetExitCode() != 0 ||
			!strings.Contains(r.stdout, "uid=1000(user)") || !strings.Contains(r.stdout, "(sudo)") {
			t.Errorf("id user: %s", r)
		}
		if r := execReq(t, d, &dsecv1.ExecRequest{SandboxId: id, User: "user", Command: "echo $HOME; getent passwd user"}); r.exit.GetExitCode() != 0 ||
			r.stdout != "/home/user\nuser:x:1000:1000::/home/user:/bin/bash\n" {
			t.Errorf("user's home and shell: %s", r)
		}
		if r := execReq(t, d, &dsecv1.ExecRequest{SandboxId: id, Argv: []string{"python3", "-c", "import sys; print(sys.version_info[0])"}}); r.stdout != "3\n" {
			t.Errorf("python3: %s", r)
		}
		for _, cmd := range []string{"bash", "ps", "ls"} {
			if r := execReq(t, d, &dsecv1.ExecRequest{SandboxId: id, Command: "command -v " + cmd}); r.exit.GetExitCode() != 0 {
				t.Errorf("%s is missing: %s", cmd, r)
			}
		}
	})

	// E2B's templates run `sudo apt-get ...` as user.
	t.Run("SudoAsUser", func(t *testing.T) {
		if r := execReq(t, d, &dsecv1.ExecRequest{SandboxId: id, User: "user", Command: "sudo -n true && sudo -n id -u"}); r.exit.GetExitCode() != 0 || r.stdout != "0\n" {
			t.Errorf("sudo -n as user: %s", r)
		}
		// Without allow_privilege_escalation, dsec's default, setuid
		// programs raise nothing.
		plain := create(t, d, &dsecv1.SandboxSpec{Environment: testutil.E2BBaseEnv})
		r := execReq(t, d, &dsecv1.ExecRequest{SandboxId: plain.GetId(), User: "user", Command: "sudo -n true"})
		if r.exit.GetExitCode() == 0 || !strings.Contains(r.stderr, "no new privileges") {
			t.Errorf("sudo -n as user without allow_privilege_escalation: %s", r)
		}
	})

	t.Run("PrintIsStdout", func(t *testing.T) {
		e := c.execute("print('hello')", nil)
		if strings.Join(e.stdout, "") != "hello\n" || len(e.results) != 0 || e.err != nil {
			t.Errorf("got %+v", e)
		}
		e = c.execute("import sys; print('oops', file=sys.stderr)", nil)
		if strings.Join(e.stderr, "") != "oops\n" || len(e.stdout) != 0 {
			t.Errorf("stderr: got %+v", e)
		}
	})

	t.Run("ExpressionIsMainResult", func(t *testing.T) {
		e := c.execute("x = 1; x", nil)
		if e.main() != "1" || len(e.results) != 1 || e.err != nil {
			t.Errorf("got %+v", e)
		}
		if e.count < 1 {
			t.Errorf("number_of_executions %d", e.count)
		}
		if e := c.execute("'a string'", nil); e.main() != "a string" {
			t.Errorf("a string's text: %+v", e)
		}
		if e := c.execute("y = 2", nil); len(e.results) != 0 {
			t.Errorf("a statement has results: %+v", e)
		}
	})

	t.Run("StateAcrossCalls", func(t *testing.T) {
		c.execute("counter = 41", nil)
		before := c.execute("counter", nil).count
		e := c.execute("counter += 1; counter", nil)
		if e.main() != "42" {
			t.Errorf("got %+v", e)
		}
		if e.count != before+1 {
			t.Errorf("execution count %d after %d", e.count, before)
		}
		if e := c.execute("from pathlib import Path; print(Path.cwd())", map[string]any{"language": "python"}); strings.Join(e.stdout, "") != "/home/user\n" {
			t.Errorf("the default context's cwd: %+v", e)
		}
		if e := c.execute("import os; os.environ.get('DSEC_SANDBOX_VAR')", nil); e.main() != "from-spec" {
			t.Errorf("the sandbox's environment: %+v", e)
		}
		e = c.execute("import os; os.getenv('FOO')", map[string]any{"env_vars": map[string]string{"FOO": "bar"}})
		if e.main() != "bar" {
			t.Errorf("env_vars: %+v", e)
		}
		if e := c.execute("os.getenv('FOO', 'default')", nil); e.main() != "default" {
			t.Errorf("env_vars leaked into the next execution: %+v", e)
		}
	})

	t.Run("ErrorWithTraceback", func(t *testing.T) {
		e := c.execute("def f():\n    return 1 / 0\nprint('before')\nf()", nil)
		if e.err == nil || e.err["name"] != "ZeroDivisionError" || e.err["value"] != "division by zero" {
			t.Fatalf("got %+v", e)
		}
		tb, _ := e.err["traceback"].(string)
		if !strings.Contains(tb, "return 1 / 0") || !strings.Contains(tb, "ZeroDivisionError") {
			t.Errorf("traceback:\n%s", tb)
		}
		if strings.Join(e.stdout, "") != "before\n" {
			t.Errorf("output before the error: %q", e.stdout)
		}
		if e := c.execute("undefined_name", nil); e.err == nil || e.err["name"] != "NameError" || e.err["value"] != "name 'undefined_name' is not defined" {
			t.Errorf("NameError: %+v", e.err)
		}
		if e := c.execute("if True print(1)", nil); e.err == nil || e.err["name"] != "SyntaxError" {
			t.Errorf("SyntaxError: %+v", e.err)
		}
	})

	t.Run("ContextsAreIsolated", func(t *testing.T) {
		a := c.createContext(map[string]any{"language": "python"})
		b := c.createContext(map[string]any{"cwd": "/tmp"})
		if a["language"] != "python" || a["cwd"] != "/home/user" || b["cwd"] != "/tmp" || a["id"] == b["id"] {
			t.Fatalf("contexts %v and %v", a, b)
		}
		listed := map[string]map[string]string{}
		for _, x := range c.contexts() {
			listed[x["id"]] = x
		}
		if listed[a["id"]]["cwd"] != "/home/user" || listed[b["id"]]["cwd"] != "/tmp" || listed[b["id"]]["language"] != "python" {
			t.Errorf("GET /contexts: %v", listed)
		}
		c.execute("v = 'a'", map[string]any{"context_id": a["id"]})
		c.execute("v = 'b'", map[string]any{"context_id": b["id"]})
		if e := c.execute("v", map[string]any{"context_id": a["id"]}); e.main() != "a" {
			t.Errorf("context a: %+v", e)
		}
		if e := c.execute("v", map[string]any{"context_id": b["id"]}); e.main() != "b" {
			t.Errorf("context b: %+v", e)
		}
		if e := c.execute("v", nil); e.err == nil || e.err["name"] != "NameError" {
			t.Errorf("the default context sees another's variable: %+v", e)
		}
		if e := c.execute("import os; os.getcwd()", map[string]any{"context_id": b["id"]}); e.main() != "/tmp" {
			t.Errorf("context b's cwd: %+v", e)
		}

		// Removed: gone from the list, its process ended, executions 404.
		if code, body := c.call("DELETE", "/contexts/"+a["id"], nil, false); code != http.StatusNoContent {
			t.Fatalf("remove context: HTTP %d: %s", code, body)
		}
		for _, x := range c.contexts() {
			if x["id"] == a["id"] {
				t.Errorf("a removed context is listed: %v", x)
			}
		}
		if code, body := c.call("POST", "/execute", map[string]any{"code": "1", "context_id": a["id"]}, true); code != http.StatusNotFound {
			t.Errorf("execute in a removed context: HTTP %d: %s", code, body)
		}
		if code, _ := c.call("DELETE", "/contexts/"+a["id"], nil, false); code != http.StatusNotFound {
			t.Errorf("remove a removed context: HTTP %d", code)
		}
		c.call("DELETE", "/contexts/"+b["id"], nil, false)
	})

	t.Run("RestartClearsState", func(t *testing.T) {
		x := c.createContext(nil)
		c.execute("kept = 1", map[string]any{"context_id": x["id"]})
		if code, body := c.call("POST", "/contexts/"+x["id"]+"/restart", nil, false); code != http.StatusNoContent {
			t.Fatalf("restart: HTTP %d: %s", code, body)
		}
		e := c.execute("kept", map[string]any{"context_id": x["id"]})
		if e.err == nil || e.err["name"] != "NameError" || e.err["value"] != "name 'kept' is not defined" {
			t.Errorf("after a restart: %+v", e)
		}
		if e := c.execute("1 + 1", map[string]any{"context_id": x["id"]}); e.main() != "2" {
			t.Errorf("a restarted context runs: %+v", e)
		}
		if code, _ := c.call("POST", "/contexts/no-such-context/restart", nil, false); code != http.StatusNotFound {
			t.Errorf("restart an unknown context: HTTP %d", code)
		}
		c.call("DELETE", "/contexts/"+x["id"], nil, false)
	})

	t.Run("TimeoutInterrupts", func(t *testing.T) {
		// dsec's own timeout field: the cell is interrupted and says so.
		start := time.Now()
		e := c.execute("import time\nprint('start', flush=True)\ntime.sleep(60)", map[string]any{"timeout": 1})
		if took := time.Since(start); took > 20*time.Second {
			t.Errorf("a 1 s timeout took %s", took)
		}
		if e.err == nil || e.err["name"] != "TimeoutError" || strings.Join(e.stdout, "") != "start\n" {
			t.Errorf("got %+v", e)
		}
		// The SDK's timeout: it closes the request; the cell is interrupted
		// and the next one runs at once, in the same state.
		c.execute("survivor = 'yes'", nil)
		ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
		resp := c.do(ctx, "POST", "/execute", map[string]any{"code": "import time; time.sleep(300)"}, true)
		io.Copy(io.Discard, resp.Body)
		resp.Body.Close()
		cancel()
		start = time.Now()
		if e := c.execute("survivor", nil); e.main() != "yes" {
			t.Errorf("after an abandoned execution: %+v", e)
		}
		if took := time.Since(start); took > 15*time.Second {
			t.Errorf("the next execution waited %s for the abandoned one", took)
		}
	})

	// A driver that dies (os._exit, the OOM killer) fails the execution
	// in flight; the context starts afresh on its next one, as a kernel
	// restarts.
	t.Run("DeadContextRestarts", func(t *testing.T) {
		x := c.createContext(nil)
		c.execute("lost = 1", map[string]any{"context_id": x["id"]})
		e := c.execute("import os; os._exit(1)", map[string]any{"context_id": x["id"]})
		if e.err == nil || e.err["name"] != "ExecutionInterrupted" {
			t.Errorf("the execution that ended its driver: %+v", e)
		}
		e = c.execute("'lost' in globals()", map[string]any{"context_id": x["id"]})
		if e.main() != "False" {
			t.Errorf("after the driver died: %+v", e)
		}
		c.call("DELETE", "/contexts/"+x["id"], nil, false)
	})

	t.Run("NoToken", func(t *testing.T) {
		for _, path := range []string{"/execute", "/contexts"} {
			req, _ := http.NewRequest("POST", c.url+path, strings.NewReader(`{"code": "1"}`))
			req.Header.Set("E2b-Sandbox-Id", c.e2bID)
			req.Header.Set("E2b-Sandbox-Port", e2b.InterpreterPort)
			req.Header.Set("E2B-Traffic-Access-Token", "0123") // a wrong one
			resp, err := http.DefaultClient.Do(req)
			if err != nil {
				t.Fatal(err)
			}
			resp.Body.Close()
			if resp.StatusCode != http.StatusUnauthorized {
				t.Errorf("POST %s without a valid token: HTTP %d, want 401", path, resp.StatusCode)
			}
		}
	})

	t.Run("BadInput", func(t *testing.T) {
		for _, tc := range []struct {
			name         string
			method, path string
			body         any
			token        bool
			want         int
		}{
			{"malformed JSON", "POST", "/execute", "{", true, http.StatusBadRequest},
			{"no code", "POST", "/execute", map[string]any{"language": "python"}, true, http.StatusBadRequest},
			{"code not a string", "POST", "/execute", map[string]any{"code": 1}, true, http.StatusBadRequest},
			{"context and language", "POST", "/execute", map[string]any{"code": "1", "context_id": "x", "language": "python"}, true, http.StatusBadRequest},
			{"unknown context", "POST", "/execute", map[string]any{"code": "1", "context_id": "no-such-context"}, true, http.StatusNotFound},
			{"malformed context ID", "POST", "/execute", map[string]any{"code": "1", "context_id": "../x"}, true, http.StatusNotFound},
			{"context in another language", "POST", "/contexts", map[string]any{"language": "r"}, false, http.StatusBadRequest},
			{"context cwd missing", "POST", "/contexts", map[string]any{"cwd": "/no/such/dir"}, false, http.StatusBadRequest},
			{"remove unknown context", "DELETE", "/contexts/no-such-context", nil, false, http.StatusNotFound},
			{"unknown path", "GET", "/nothing", nil, false, http.StatusNotFound},
			{"oversized body", "POST", "/execute", map[string]any{"code": strings.Repeat("#", 17<<20)}, true, http.StatusRequestEntityTooLarge},
		} {
			t.Run(tc.name, func(t *testing.T) {
				code, body := c.call(tc.method, tc.path, tc.body, tc.token)
				if code != tc.want {
					t.Errorf("HTTP %d, want %d: %s", code, tc.want, body)
				}
				var eb struct {
					Code    int    `json:"code"`
					Message string `json:"message"`
				}
				if json.Unmarshal(body, &eb) != nil || eb.Code != code || eb.Message == "" {
					t.Errorf("not E2B's error shape: %s", body)
				}
			})
		}
		// Another language: the execution's error says so.
		e := c.execute("console.log(1)", map[string]any{"language": "javascript"})
		if e.err == nil || !strings.Contains(e.err["value"].(string), "Python only") {
			t.Errorf("javascript: %+v", e)
		}
		// Unknown fields are ignored.
		if e := c.execute("3", map[string]any{"some_future_field": true}); e.main() != "3" {
			t.Errorf("with an unknown field: %+v", e)
		}
	})

	t.Run("RemovedContextsLeaveNoProcess", func(t *testing.T) {
		x := c.createContext(nil)
		before := interpDrivers(t, d, id)
		c.call("DELETE", "/contexts/"+x["id"], nil, false)
		if after := interpDrivers(t, d, id); after != before-1 {
			t.Errorf("%d context drivers before the removal, %d after", before, after)
		}
	})
}

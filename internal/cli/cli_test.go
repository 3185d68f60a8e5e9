package cli

import (
	"context"
	"errors"
	"net"
	"net/http"
	"net/http/httptest"
	"slices"
	"strings"
	"sync"
	"testing"

	"connectrpc.com/connect"

	dsecv1 "dsec.dev/dsec/api/gen/dsec/v1"
	"dsec.dev/dsec/api/gen/dsec/v1/dsecv1connect"
)

// fakeSandboxes answers the sandbox calls the CLI makes like a node would,
// and keeps every request it got.
type fakeSandboxes struct {
	dsecv1connect.UnimplementedSandboxServiceHandler
	mu       sync.Mutex
	requests []any
	warnings []string
	listed   []*dsecv1.Sandbox // what List answers
	down     []string          // the nodes List says it could not reach
	// execHangs, if set, makes Exec say so on it and wait for its caller
	// to go away.
	execHangs chan struct{}
}

func (f *fakeSandboxes) got(m any) {
	f.mu.Lock()
	f.requests = append(f.requests, m)
	f.mu.Unlock()
}

func (f *fakeSandboxes) Create(ctx context.Context, r *connect.Request[dsecv1.CreateRequest]) (*connect.Response[dsecv1.CreateResponse], error) {
	f.got(r.Msg)
	n := max(1, int(r.Msg.GetCount()))
	resp := &dsecv1.CreateResponse{}
	for i := range n {
		resp.Sandboxes = append(resp.Sandboxes, &dsecv1.Sandbox{Id: "sb-n1-" + string(rune('a'+i)), Spec: r.Msg.GetSpec(),
			State: dsecv1.State_STATE_RUNNING, Warnings: f.warnings})
	}
	return connect.NewResponse(resp), nil
}

func (f *fakeSandboxes) Delete(ctx context.Context, r *connect.Request[dsecv1.DeleteRequest]) (*connect.Response[dsecv1.DeleteResponse], error) {
	f.got(r.Msg)
	return connect.NewResponse(&dsecv1.DeleteResponse{}), nil
}

func (f *fakeSandboxes) List(ctx context.Context, r *connect.Request[dsecv1.ListRequest]) (*connect.Response[dsecv1.ListResponse], error) {
	f.got(r.Msg)
	return connect.NewResponse(&dsecv1.ListResponse{Sandboxes: f.listed, UnreachableNodes: f.down}), nil
}

func (f *fakeSandboxes) Exec(ctx context.Context, r *connect.Request[dsecv1.ExecRequest], s *connect.ServerStream[dsecv1.ExecEvent]) error {
	f.got(r.Msg)
	if f.execHangs != nil {
		f.execHangs <- struct{}{}
		<-ctx.Done()
		return ctx.Err()
	}
	return s.Send(&dsecv1.ExecEvent{Event: &dsecv1.ExecEvent_Exited{Exited: &dsecv1.ExecExited{Status: dsecv1.ExitStatus_EXIT_STATUS_OK}}})
}

func (f *fakeSandboxes) SetNetworkRules(ctx context.Context, r *connect.Request[dsecv1.SetNetworkRulesRequest]) (*connect.Response[dsecv1.SetNetworkRulesResponse], error) {
	f.got(r.Msg)
	return connect.NewResponse(&dsecv1.SetNetworkRulesResponse{Warnings: f.warnings}), nil
}

func (f *fakeSandboxes) Signal(ctx context.Context, r *connect.Request[dsecv1.SignalRequest]) (*connect.Response[dsecv1.SignalResponse], error) {
	f.got(r.Msg)
	return connect.NewResponse(&dsecv1.SignalResponse{}), nil
}

// lastOf is the last request that match says yes to, or nil.
func (f *fakeSandboxes) lastOf(match func(any) bool) any {
	f.mu.Lock()
	defer f.mu.Unlock()
	for i := len(f.requests) - 1; i >= 0; i-- {
		if match(f.requests[i]) {
			return f.requests[i]
		}
	}
	return nil
}

func (f *fakeSandboxes) last() any {
	f.mu.Lock()
	defer f.mu.Unlock()
	if len(f.requests) == 0 {
		return nil
	}
	return f.requests[len(f.requests)-1]
}

func startFake(t *testing.T) (*fakeSandboxes, string) {
	t.Helper()
	f := &fakeSandboxes{}
	return f, startHandler(t, f)
}

// startHandler serves h as a SandboxService and returns its URL.
func startHandler(t *testing.T, h dsecv1connect.SandboxServiceHandler) string {
	t.Helper()
	mux := http.NewServeMux()
	mux.Handle(dsecv1connect.NewSandboxServiceHandler(h))
	srv := httptest.NewUnstartedServer(mux)
	srv.Config.Protocols = new(http.Protocols)
	srv.Config.Protocols.SetHTTP1(true)
	srv.Config.Protocols.SetUnencryptedHTTP2(true)
	srv.Start()
	t.Cleanup(srv.Close)
	return srv.URL
}

// runCLIErr runs the CLI and returns stdout, stderr and its error.
func runCLIErr(t *testing.T, addr string, args ...string) (string, string, error) {
	t.Helper()
	var out, errOut strings.Builder
	a := &app{stdin: strings.NewReader(""), stdout: &out, stderr: &errOut}
	root := a.rootCommand()
	root.SetArgs(append([]string{"--addr", addr}, args...))
	root.SetOut(&out)
	root.SetErr(&errOut)
	err := root.ExecuteContext(t.Context())
	return out.String(), errOut.String(), err
}

// TestNetworkRulesMustBeBooleans: a rule's value is true or false; "false"
// as a string is refused by name before anything is sent.
func TestNetworkRulesMustBeBooleans(t *testing.T) {
	f, addr := startFake(t)
	for _, args := range [][]string{
		{"create", "--network-rules", `{"github": true, "pypi": "false"}`, "b:1"},
		{"run", "--network-rules", `{"pypi": "false"}`, "b:1", "--", "true"},
		{"net", "set", "sb-n1-a", `{"pypi": "false"}`},
	} {
		_, _, err := runCLIErr(t, addr, args...)
		if err == nil || !strings.Contains(err.Error(), `network rule "pypi": want true or false (a JSON boolean), not "false"`) {
			t.Errorf("dsec %s: %v", strings.Join(args, " "), err)
		}
	}
	for _, args := range [][]string{
		{"create", "--network-rules", `{"pypi": 0}`, "b:1"},
		{"create", "--network-rules", `{"pypi": null}`, "b:1"},
	} {
		if _, _, err := runCLIErr(t, addr, args...); err == nil || !strings.Contains(err.Error(), `network rule "pypi"`) {
			t.Errorf("dsec %s: %v", strings.Join(args, " "), err)
		}
	}
	if r := f.last(); r != nil {
		t.Fatalf("a refused rule set was sent: %v", r)
	}
	if _, _, err := runCLIErr(t, addr, "create", "--network-rules", `{"pypi": false, "github": true}`, "b:1"); err != nil {
		t.Fatal(err)
	}
	rules := f.last().(*dsecv1.CreateRequest).GetSpec().GetNetworkRules()
	if len(rules) != 2 || rules["pypi"] || !rules["github"] {
		t.Errorf("sent rules %v", rules)
	}
}

// TestCreateWarnings: what the node warned about at create reaches stderr,
// once per batch, while the IDs go to stdout.
func TestCreateWarnings(t *testing.T) {
	f, addr := startFake(t)
	f.warnings = []string{`service "pypi" has no domains or CIDRs on this node; allowing it allows nothing`}
	out, errOut, err := runCLIErr(t, addr, "create", "-n", "3", "--network-rules", `{"pypi": true}`, "b:1")
	if err != nil {
		t.Fatal(err)
	}
	if strings.Count(out, "sb-n1-") != 3 || strings.Contains(out, "warning") {
		t.Errorf("stdout %q", out)
	}
	if want := "dsec: warning: " + f.warnings[0] + "\n"; errOut != want {
		t.Errorf("stderr %q, want %q", errOut, want)
	}
	if _, errOut, err = runCLIErr(t, addr, "run", "--network-rules", `{"pypi": true}`, "b:1", "--", "true"); err != nil ||
		!strings.Contains(errOut, "allowing it allows nothing") {
		t.Errorf("run: stderr %q, %v", errOut, err)
	}
}

// TestCommandArgs: run and exec say what is missing.
func TestCommandArgs(t *testing.T) {
	_, addr := startFake(t)
	for _, tc := range []struct {
		args []string
		want string
	}{
		{[]string{"run"}, "name the ENV and the command to run: dsec run ENV -- CMD [ARGS...]"},
		{[]string{"run", "busybox:1"}, "no command to run in busybox:1: dsec run busybox:1 -- CMD [ARGS...]"},
		{[]string{"exec", "sb-n1-a"}, "no command to run in sb-n1-a: dsec exec sb-n1-a -- CMD [ARGS...]"},
		{[]string{"exec"}, "name the ID and the command to run"},
	} {
		_, _, err := runCLIErr(t, addr, tc.args...)
		if err == nil || err.Error() != tc.want && !strings.HasPrefix(err.Error(), tc.want) {
			t.Errorf("dsec %s: %v, want %q", strings.Join(tc.args, " "), err, tc.want)
		}
	}
}

// TestExecEnvFlag: exec takes --env (-e) like run and create; the old
// --exec-env still works.
func TestExecEnvFlag(t *testing.T) {
	f, addr := startFake(t)
	for _, args := range [][]string{
		{"exec", "--env", "A=1", "-e", "B=2", "sb-n1-a", "--", "env"},
		{"exec", "--exec-env", "A=1", "--exec-env", "B=2", "sb-n1-a", "--", "env"},
	} {
		if _, _, err := runCLIErr(t, addr, args...); err != nil {
			t.Fatalf("dsec %s: %v", strings.Join(args, " "), err)
		}
		env := f.last().(*dsecv1.ExecRequest).GetEnv()
		if len(env) != 2 || env["A"] != "1" || env["B"] != "2" {
			t.Errorf("dsec %s: sent env %v", strings.Join(args, " "), env)
		}
	}
}

// TestExecFlagsEndAtTheID: as with docker exec, what follows the ID is the
// command, its own flags included; "--" before it still works.
func TestExecFlagsEndAtTheID(t *testing.T) {
	f, addr := startFake(t)
	for _, tc := range []struct {
		args []string
		argv []string
	}{
		{[]string{"exec", "sb-n1-a", "ls", "-la"}, []string{"ls", "-la"}},
		{[]string{"exec", "-e", "A=1", "sb-n1-a", "--", "ls", "-la", "--", "x"}, []string{"ls", "-la", "--", "x"}},
		{[]string{"exec", "sb-n1-a", "sh", "-c", "echo --json"}, []string{"sh", "-c", "echo --json"}},
	} {
		if _, _, err := runCLIErr(t, addr, tc.args...); err != nil {
			t.Errorf("dsec %s: %v", strings.Join(tc.args, " "), err)
			continue
		}
		if got := f.last().(*dsecv1.ExecRequest).GetArgv(); !slices.Equal(got, tc.argv) {
			t.Errorf("dsec %s sent argv %q, want %q", strings.Join(tc.args, " "), got, tc.argv)
		}
	}
	if _, _, err := runCLIErr(t, addr, "exec", "sb-n1-a", "--"); err == nil || !strings.Contains(err.Error(), "no command to run in sb-n1-a") {
		t.Errorf("dsec exec ID --: %v", err)
	}
	// run's flags end at the environment, as docker run's at the image.
	for _, tc := range []struct {
		args []string
		argv []string
	}{
		{[]string{"run", "b:1", "ls", "-la"}, []string{"ls", "-la"}},
		{[]string{"run", "--memory-mb", "64", "b:1", "--", "ls", "--json"}, []string{"ls", "--json"}},
	} {
		if _, _, err := runCLIErr(t, addr, tc.args...); err != nil {
			t.Errorf("dsec %s: %v", strings.Join(tc.args, " "), err)
			continue
		}
		if got := f.lastOf(func(m any) bool { _, ok := m.(*dsecv1.ExecRequest); return ok }).(*dsecv1.ExecRequest).GetArgv(); !slices.Equal(got, tc.argv) {
			t.Errorf("dsec %s sent argv %q, want %q", strings.Join(tc.args, " "), got, tc.argv)
		}
	}
}

// TestLsShowsLiveByDefault: ls asks for live sandboxes; --all and --state
// for the rest.
func TestLsShowsLiveByDefault(t *testing.T) {
	f, addr := startFake(t)
	for _, tc := range []struct {
		args   []string
		all    bool
		states []dsecv1.State
	}{
		{[]string{"ls"}, false, nil},
		{[]string{"ls", "--all"}, true, nil},
		{[]string{"ls", "--state", "stopped", "--state", "failed"}, false, []dsecv1.State{dsecv1.State_STATE_STOPPED, dsecv1.State_STATE_FAILED}},
	} {
		if _, _, err := runCLIErr(t, addr, tc.args...); err != nil {
			t.Fatal(err)
		}
		req := f.last().(*dsecv1.ListRequest)
		if req.GetAll() != tc.all || len(req.GetStates()) != len(tc.states) {
			t.Errorf("dsec %s sent %v", strings.Join(tc.args, " "), req)
		}
	}
	if _, _, err := runCLIErr(t, addr, "ls", "--page-size", "50", "--page-token", "tok"); err != nil {
		t.Fatal(err)
	}
	if req := f.last().(*dsecv1.ListRequest); req.GetPageSize() != 50 || req.GetPageToken() != "tok" {
		t.Errorf("dsec ls --page-size 50 --page-token tok sent %v", req)
	}
	for _, args := range [][]string{{"ls", "--all", "--state", "stopped"}, {"ls", "--state", "unspecified"}, {"ls", "--state", "zombie"}} {
		if _, _, err := runCLIErr(t, addr, args...); err == nil {
			t.Errorf("dsec %s: no error", strings.Join(args, " "))
		}
	}
}

func TestKillSignals(t *testing.T) {
	f, addr := startFake(t)
	for _, tc := range []struct {
		args []string
		want int32
	}{
		{[]string{"kill", "sb-n1-a", "p-1"}, 0},
		{[]string{"kill", "-s", "TERM", "sb-n1-a", "p-1"}, 15},
		{[]string{"kill", "--signal", "SIGINT", "sb-n1-a", "build"}, 2},
		{[]string{"kill", "-s", "9", "sb-n1-a", "p-1"}, 9},
	} {
		if _, _, err := runCLIErr(t, addr, tc.args...); err != nil {
			t.Fatal(err)
		}
		req := f.last().(*dsecv1.SignalRequest)
		if req.GetSignal() != tc.want || req.GetProcessId() != tc.args[len(tc.args)-1] {
			t.Errorf("dsec %s sent %v", strings.Join(tc.args, " "), req)
		}
	}
	if _, _, err := runCLIErr(t, addr, "kill", "-s", "NOPE", "sb-n1-a", "p-1"); err == nil {
		t.Error("kill -s NOPE: no error")
	}
}

// TestDescribeSaysTheKindOnce: "…: not found (not_found)" becomes "… (not_found)".
func TestDescribeSaysTheKindOnce(t *testing.T) {
	for _, tc := range []struct {
		err  error
		want string
	}{
		{connect.NewError(connect.CodeResourceExhausted, errors.New("node t1 holds its maximum of 1 sandboxes (dsecd --max-sandboxes raises it): resource exhausted")),
			"node t1 holds its maximum of 1 sandboxes (dsecd --max-sandboxes raises it) (resource_exhausted)"},
		{connect.NewError(connect.CodeNotFound, errors.New("no layer or image is named x:1: not found")), "no layer or image is named x:1 (not_found)"},
		{connect.NewError(connect.CodeInvalidArgument, errors.New("bad: want true")), "bad: want true (invalid_argument)"},
	} {
		if got := describe(tc.err); got != tc.want {
			t.Errorf("describe(%v) = %q, want %q", tc.err, got, tc.want)
		}
	}
}

// TestAddressListAndToken: --addr takes a list and goes past an address
// that refuses; --token goes on every call; an Unauthenticated answer says
// where the token came from, not what it is.
func TestAddressListAndToken(t *testing.T) {
	t.Setenv("DSEC_TOKEN", "")
	t.Setenv("DSEC_TOKEN_FILE", "")
	f := &fakeSandboxes{}
	var (
		mu   sync.Mutex
		auth []string
	)
	mux := http.NewServeMux()
	mux.Handle(dsecv1connect.NewSandboxServiceHandler(f))
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		mu.Lock()
		auth = append(auth, r.Header.Get("Authorization"))
		mu.Unlock()
		mux.ServeHTTP(w, r)
	}))
	t.Cleanup(srv.Close)
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	closed := ln.Addr().String()
	ln.Close()

	for _, args := range [][]string{{"create", "b:1"}, {"exec", "sb-n1-a", "--", "true"}, {"rm", "sb-n1-a"}} {
		if _, _, err := runCLIErr(t, closed+","+srv.URL, append([]string{"--token", "tok-1"}, args...)...); err != nil {
			t.Fatalf("dsec %s: %v", strings.Join(args, " "), err)
		}
	}
	mu.Lock()
	defer mu.Unlock()
	if len(auth) != 3 {
		t.Fatalf("the server got %d calls, want 3", len(auth))
	}
	for _, a := range auth {
		if a != "Bearer tok-1" {
			t.Fatalf("Authorization %q", a)
		}
	}

	refuse := connect.UnaryInterceptorFunc(func(connect.UnaryFunc) connect.UnaryFunc {
		return func(context.Context, connect.AnyRequest) (connect.AnyResponse, error) {
			return nil, connect.NewError(connect.CodeUnauthenticated, errors.New("bad token: unauthenticated"))
		}
	})
	mux2 := http.NewServeMux()
	mux2.Handle(dsecv1connect.NewSandboxServiceHandler(f, connect.WithInterceptors(refuse)))
	srv2 := httptest.NewServer(mux2)
	t.Cleanup(srv2.Close)
	_, _, err = runCLIErr(t, srv2.URL, "--token", "s3cret", "ls")
	if got, want := describe(err), "bad token (token from --token) (unauthenticated)"; got != want {
		t.Fatalf("describe = %q, want %q", got, want)
	}
}

// TestUnavailableNodeIsNotAnUnreachableServer: an apiserver that answers
// Unavailable because a node is down was reached; its message is shown as
// it is, not as "cannot reach dsecd …; is it running? (address from
// --addr …)", which sent an operator to check the client's address.
func TestUnavailableNodeIsNotAnUnreachableServer(t *testing.T) {
	down := connect.UnaryInterceptorFunc(func(connect.UnaryFunc) connect.UnaryFunc {
		return func(context.Context, connect.AnyRequest) (connect.AnyResponse, error) {
			return nil, connect.NewError(connect.CodeUnavailable, errors.New("node e2 is unreachable (last answered 9.5s ago: dial tcp 127.0.0.1:18602: connect: connection refused)"))
		}
	})
	mux := http.NewServeMux()
	mux.Handle(dsecv1connect.NewSandboxServiceHandler(&fakeSandboxes{}, connect.WithInterceptors(down)))
	srv := httptest.NewServer(mux)
	t.Cleanup(srv.Close)
	_, _, err := runCLIErr(t, srv.URL, "inspect", "sb-e2-a")
	got := describe(err)
	if strings.Contains(got, "cannot reach dsecd") || !strings.Contains(got, "node e2 is unreachable") {
		t.Errorf("an apiserver's node down reads %q", got)
	}

	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	closed := ln.Addr().String()
	ln.Close()
	_, _, err = runCLIErr(t, closed, "inspect", "sb-e2-a")
	if got := describe(err); !strings.Contains(got, "cannot reach dsecd") {
		t.Errorf("an address nothing listens on reads %q", got)
	}
}

// TestLsNamesUnreachableNodes: dsec ls says which nodes the apiserver
// could not reach, whose sandboxes its list lacks (it listed the rest and
// exited 0 as if that were all); --json carries them as unreachableNodes.
func TestLsNamesUnreachableNodes(t *testing.T) {
	f, addr := startFake(t)
	f.listed = []*dsecv1.Sandbox{{Id: "sb-e1-a", State: dsecv1.State_STATE_RUNNING, Spec: &dsecv1.SandboxSpec{}}}
	f.down = []string{"e2"}
	out, errOut, err := runCLIErr(t, addr, "ls")
	if err != nil || !strings.Contains(out, "sb-e1-a") || errOut != "dsec: node e2 is unreachable: its sandboxes are not listed (dsec nodes)\n" {
		t.Errorf("dsec ls with e2 down: %v, %q, stderr %q", err, out, errOut)
	}
	f.down = []string{"e2", "e3"}
	if _, errOut, _ := runCLIErr(t, addr, "ls"); !strings.Contains(errOut, "nodes e2, e3 are unreachable: their sandboxes") {
		t.Errorf("two down: stderr %q", errOut)
	}
	out, _, err = runCLIErr(t, addr, "--json", "ls")
	if err != nil || !strings.Contains(out, `"unreachableNodes": [`) || !strings.Contains(out, `"e3"`) {
		t.Errorf("dsec --json ls: %v, %s", err, out)
	}
	f.down = nil
	if _, errOut, _ := runCLIErr(t, addr, "ls"); errOut != "" {
		t.Errorf("every node up: stderr %q", errOut)
	}
}

// TestCreateProject: create and run --project put the sandbox in a project
// by its label, as dsec events, usage and webhook take --project; a
// --label naming another project too is refused before anything is sent.
func TestCreateProject(t *testing.T) {
	f, addr := startFake(t)
	if _, _, err := runCLIErr(t, addr, "create", "--project", "ml/rl", "--label", "run=r1", "b:1"); err != nil {
		t.Fatal(err)
	}
	labels := f.last().(*dsecv1.CreateRequest).GetSpec().GetLabels()
	if labels[projectLabel] != "ml/rl" || labels["run"] != "r1" {
		t.Errorf("create --project ml/rl sent labels %v", labels)
	}
	_, _, err := runCLIErr(t, addr, "run", "-p", "ml", "--label", projectLabel+"=web", "b:1", "--", "true")
	if err == nil || !strings.Contains(err.Error(), "name the project once") {
		t.Errorf("--project and another project's label: %v", err)
	}
}

// TestListProject: dsec ls shows each sandbox's project (the root's as
// /); --project narrows it to a project's own sandboxes by their label,
// and / to the root's own, which carry none; its QOS column shows each
// sandbox's CPU class (latency where the record names none).
func TestListProject(t *testing.T) {
	f, addr := startFake(t)
	f.listed = []*dsecv1.Sandbox{
		{Id: "sb-n1-root", State: dsecv1.State_STATE_RUNNING, Spec: &dsecv1.SandboxSpec{Environment: "b:1"}},
		{Id: "sb-n1-ml", State: dsecv1.State_STATE_RUNNING, Spec: &dsecv1.SandboxSpec{Environment: "b:1", Qos: "best_effort", Labels: map[string]string{projectLabel: "ml"}}},
	}
	out, err := runCLI(t, addr, "ls")
	if err != nil {
		t.Fatal(err)
	}
	lines := strings.Split(strings.TrimSpace(out), "\n")
	if len(lines) != 3 || !strings.Contains(lines[0], "PROJECT") || strings.Fields(lines[1])[2] != "/" || strings.Fields(lines[2])[2] != "ml" {
		t.Errorf("ls printed\n%s", out)
	}
	// QOS: the class, latency where the record names none.
	if col := slices.Index(strings.Fields(lines[0]), "QOS"); col < 0 || strings.Fields(lines[1])[col] != "latency" || strings.Fields(lines[2])[col] != "best_effort" {
		t.Errorf("ls printed no QOS column, or the wrong class:\n%s", out)
	}
	out, err = runCLI(t, addr, "ls", "--project", "/")
	if err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(out, "sb-n1-root") || strings.Contains(out, "sb-n1-ml") {
		t.Errorf("ls --project / printed\n%s", out)
	}
	if _, err := runCLI(t, addr, "ls", "-p", "/ml"); err != nil {
		t.Fatal(err)
	}
	if got := f.last().(*dsecv1.ListRequest).GetLabels()[projectLabel]; got != "ml" {
		t.Errorf("ls -p /ml asked for the label %q, want ml", got)
	}
}

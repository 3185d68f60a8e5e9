package cli

import (
	"bytes"
	"context"
	"encoding/json"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"testing"

	"connectrpc.com/connect"

	dsecv1 "dsec.dev/dsec/api/gen/dsec/v1"
	"dsec.dev/dsec/api/gen/dsec/v1/dsecv1connect"
)

// poolServer answers the warm-pool calls like a node would, keeping the
// pools it was told about.
type poolServer struct {
	dsecv1connect.UnimplementedSandboxServiceHandler
	mu    sync.Mutex
	last  *dsecv1.SetWarmPoolRequest
	pools map[string]*dsecv1.WarmPool
}

func (s *poolServer) SetWarmPool(ctx context.Context, r *connect.Request[dsecv1.SetWarmPoolRequest]) (*connect.Response[dsecv1.WarmPool], error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.last = r.Msg
	key := "k-" + r.Msg.GetSpec().GetEnvironment() + "-0123456789abcdef"
	p := &dsecv1.WarmPool{Key: key, Spec: r.Msg.GetSpec(), Size: r.Msg.GetSize(), Starting: r.Msg.GetSize(), Node: "n1"}
	if r.Msg.GetSize() == 0 {
		delete(s.pools, key)
	} else {
		s.pools[key] = p
	}
	return connect.NewResponse(p), nil
}

func (s *poolServer) ListWarmPools(ctx context.Context, r *connect.Request[dsecv1.ListWarmPoolsRequest]) (*connect.Response[dsecv1.ListWarmPoolsResponse], error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	res := &dsecv1.ListWarmPoolsResponse{}
	for _, p := range s.pools {
		res.Pools = append(res.Pools, p)
	}
	return connect.NewResponse(res), nil
}

func startPoolServer(t *testing.T) (*poolServer, string) {
	t.Helper()
	ps := &poolServer{pools: map[string]*dsecv1.WarmPool{}}
	mux := http.NewServeMux()
	mux.Handle(dsecv1connect.NewSandboxServiceHandler(ps))
	srv := httptest.NewUnstartedServer(mux)
	srv.Config.Protocols = new(http.Protocols)
	srv.Config.Protocols.SetHTTP1(true) // as dsecd speaks
	srv.Config.Protocols.SetUnencryptedHTTP2(true)
	srv.Start()
	t.Cleanup(srv.Close)
	return ps, srv.URL
}

// runCLI runs the CLI against addr and returns its output and error.
func runCLI(t *testing.T, addr string, args ...string) (string, error) {
	t.Helper()
	var out, errOut bytes.Buffer
	a := &app{stdin: strings.NewReader(""), stdout: &out, stderr: &errOut}
	root := a.rootCommand()
	root.SetArgs(append([]string{"--addr", addr}, args...))
	root.SetOut(&out)
	root.SetErr(&errOut)
	err := root.ExecuteContext(t.Context())
	return out.String(), err
}

func TestPoolCommands(t *testing.T) {
	ps, addr := startPoolServer(t)

	out, err := runCLI(t, addr, "pool", "set", "--cpus", "0.5", "--memory-mb", "256", "--env", "A=b", "--workdir", "/tmp",
		"--size", "2", "--qos", "best_effort", "busybox:test")
	if err != nil {
		t.Fatal(err)
	}
	spec := ps.last.GetSpec()
	if ps.last.GetSize() != 2 || spec.GetEnvironment() != "busybox:test" || spec.GetCpus() != 0.5 || spec.GetMemoryMb() != 256 ||
		spec.GetEnv()["A"] != "b" || spec.GetWorkdir() != "/tmp" {
		t.Fatalf("request = %v", ps.last)
	}
	lines := strings.Split(strings.TrimSpace(out), "\n")
	if len(lines) != 2 || !strings.HasPrefix(lines[0], "NODE") || !strings.Contains(lines[0], "LAST ERROR") {
		t.Fatalf("set printed %q", out)
	}
	if f := strings.Fields(lines[1]); len(f) != 11 || f[0] != "n1" || f[1] != "busybox:test" || f[2] != "k-busybox:te" ||
		f[3] != "0.5" || f[4] != "256" || f[5] != "best_effort" || f[6] != "2" || f[8] != "2" {
		t.Fatalf("set row = %q", lines[1])
	}

	out, err = runCLI(t, addr, "pool", "set", "--json", "alpine:3")
	if err != nil {
		t.Fatal(err)
	}
	if ps.last.GetSize() != 1 {
		t.Fatalf("default size = %d, want 1", ps.last.GetSize())
	}
	var pool map[string]any
	if err := json.Unmarshal([]byte(out), &pool); err != nil || pool["node"] != "n1" || pool["size"] != float64(1) {
		t.Fatalf("set --json printed %q (%v)", out, err)
	}

	out, err = runCLI(t, addr, "pool", "ls", "--json")
	if err != nil {
		t.Fatal(err)
	}
	var list struct{ Pools []map[string]any }
	if err := json.Unmarshal([]byte(out), &list); err != nil || len(list.Pools) != 2 {
		t.Fatalf("ls --json printed %q (%v)", out, err)
	}

	if _, err := runCLI(t, addr, "pool", "rm", "alpine:3"); err != nil {
		t.Fatal(err)
	}
	if ps.last.GetSize() != 0 || ps.last.GetSpec().GetEnvironment() != "alpine:3" {
		t.Fatalf("rm sent %v", ps.last)
	}
	out, err = runCLI(t, addr, "pool", "ls")
	if err != nil {
		t.Fatal(err)
	}
	if lines := strings.Split(strings.TrimSpace(out), "\n"); len(lines) != 2 || !strings.Contains(lines[1], "busybox:test") {
		t.Fatalf("ls printed %q", out)
	}
}

func TestPoolSetRejects(t *testing.T) {
	ps, addr := startPoolServer(t)
	tests := [][]string{
		{"pool", "set", "--size", "-1", "busybox:test"},
		{"pool", "set", "--ttl", "1m", "busybox:test"},           // not part of a shape
		{"pool", "set", "--network-rules", "{}", "busybox:test"}, // pools hold no networked sandboxes
		{"pool", "set", "--env", "novalue", "busybox:test"},
		{"pool", "set"},
	}
	for _, args := range tests {
		if _, err := runCLI(t, addr, args...); err == nil {
			t.Errorf("%v succeeded", args)
		}
	}
	if ps.last != nil {
		t.Errorf("a rejected command reached the server: %v", ps.last)
	}
}

// Package root holds dsec's end-to-end tests: each starts a real dsecd with
// real runc containers on EROFS and overlay mounts. They need root, and
// skip without it unless DSEC_TEST_ROOT=1, where they fail instead.
package root

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"connectrpc.com/connect"

	dsecv1 "dsec.dev/dsec/api/gen/dsec/v1"
	"dsec.dev/dsec/internal/edge/claims"
	"dsec.dev/dsec/internal/testutil"
	dsec "dsec.dev/dsec/sdk/go"
)

func TestMain(m *testing.M) {
	code := m.Run()
	testutil.RemoveBinaries()
	if code == 0 && os.Geteuid() == 0 {
		if leaks := leftovers(); len(leaks) > 0 {
			fmt.Fprintf(os.Stderr, "the suite left resources behind:\n  %s\n", strings.Join(leaks, "\n  "))
			code = 1
		}
	}
	os.Exit(code)
}

// leftovers lists mounts, cgroups and processes of dsec test roots that are
// still there after every test ended.
func leftovers() []string {
	var out []string
	out = append(out, testutil.Mounts("dsec-test-root-")...)
	for _, ctrl := range []string{"freezer", "memory", "pids", "cpu"} {
		parents, _ := os.ReadDir("/sys/fs/cgroup/" + ctrl)
		for _, p := range parents {
			if !p.IsDir() || !strings.HasPrefix(p.Name(), "dsec") {
				continue
			}
			// The cgroups of a cluster test's edges (testutil.StartCluster).
			if strings.HasPrefix(p.Name(), "dsec-te") {
				out = append(out, "cgroup "+ctrl+"/"+p.Name())
				continue
			}
			// A test daemon's sandboxes, under whichever parent its
			// root took (package claims).
			entries, _ := os.ReadDir("/sys/fs/cgroup/" + ctrl + "/" + p.Name())
			for _, e := range entries {
				if e.IsDir() && strings.HasPrefix(e.Name(), "sb-t1-") {
					out = append(out, "cgroup "+ctrl+"/"+p.Name()+"/"+e.Name())
				}
			}
		}
	}
	// Host names still registered for a test root: its teardown releases
	// them.
	entries, _ := os.ReadDir(claims.DefaultDir)
	for _, e := range entries {
		if b, err := os.ReadFile(filepath.Join(claims.DefaultDir, e.Name())); err == nil && strings.Contains(string(b), "dsec-test-root-") {
			out = append(out, "host name "+e.Name()+" registered for "+strings.TrimSpace(string(b)))
		}
	}
	procs, _ := os.ReadDir("/proc")
	for _, p := range procs {
		cmdline, err := os.ReadFile("/proc/" + p.Name() + "/cmdline")
		if err == nil && strings.Contains(string(cmdline), "dsec-test-root-") {
			out = append(out, "process "+p.Name()+" "+strings.ReplaceAll(string(cmdline), "\x00", " "))
		}
	}
	return out
}

// env is the busybox base every test here runs on.
const env = "busybox:test"

func startDaemon(t *testing.T, args ...string) *testutil.Daemon {
	t.Helper()
	d := testutil.StartDaemon(t, args...)
	d.ImportBusybox(env)
	return d
}

func create(t *testing.T, d *testutil.Daemon, spec *dsecv1.SandboxSpec) *dsecv1.Sandbox {
	t.Helper()
	if spec == nil {
		spec = &dsecv1.SandboxSpec{}
	}
	if spec.Environment == "" {
		spec.Environment = env
	}
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	resp, err := d.Clients.Sandboxes.Create(ctx, connect.NewRequest(&dsecv1.CreateRequest{Spec: spec}))
	if err != nil {
		t.Fatalf("create: %v", err)
	}
	sb := resp.Msg.GetSandboxes()[0]
	t.Cleanup(func() {
		d.Clients.Sandboxes.Delete(context.Background(), connect.NewRequest(&dsecv1.DeleteRequest{Id: sb.GetId()}))
	})
	return sb
}

// result is one finished command.
type result struct {
	stdout, stderr string
	exit           *dsecv1.ExecExited
}

func (r result) String() string {
	return fmt.Sprintf("status=%s code=%d stdout=%q stderr=%q msg=%q", r.exit.GetStatus(), r.exit.GetExitCode(), r.stdout, r.stderr, r.exit.GetMessage())
}

func execReq(t *testing.T, d *testutil.Daemon, req *dsecv1.ExecRequest) result {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 120*time.Second)
	defer cancel()
	stream, err := d.Clients.Sandboxes.Exec(ctx, connect.NewRequest(req))
	if err != nil {
		t.Fatalf("exec %v: %v", req, err)
	}
	defer stream.Close()
	var r result
	var so, se strings.Builder
	for stream.Receive() {
		switch e := stream.Msg().Event.(type) {
		case *dsecv1.ExecEvent_Stdout:
			so.Write(e.Stdout)
		case *dsecv1.ExecEvent_Stderr:
			se.Write(e.Stderr)
		case *dsecv1.ExecEvent_Exited:
			r.exit = e.Exited
		}
	}
	if err := stream.Err(); err != nil {
		t.Fatalf("exec %v: %v", req, err)
	}
	if r.exit == nil {
		t.Fatalf("exec %v: no exit event", req)
	}
	r.stdout, r.stderr = so.String(), se.String()
	return r
}

// sh runs a shell command line in the sandbox.
func sh(t *testing.T, d *testutil.Daemon, id, command string) result {
	t.Helper()
	return execReq(t, d, &dsecv1.ExecRequest{SandboxId: id, Command: command})
}

func mustSh(t *testing.T, d *testutil.Daemon, id, command string) string {
	t.Helper()
	r := sh(t, d, id, command)
	if r.exit.GetStatus() != dsecv1.ExitStatus_EXIT_STATUS_OK {
		t.Fatalf("%q in %s: %s", command, id, r)
	}
	return r.stdout
}

// requestBody is an HTTP request's body: none for nil, a string as it is,
// anything else encoded as JSON.
func requestBody(t testing.TB, body any) io.Reader {
	t.Helper()
	switch b := body.(type) {
	case nil:
		return nil
	case string:
		return strings.NewReader(b)
	}
	data, err := json.Marshal(body)
	if err != nil {
		t.Fatalf("encode a request body: %v", err)
	}
	return bytes.NewReader(data)
}

// allInOneOnly skips t in the cluster pass (DSEC_TEST_CLUSTER=1) of a
// suite whose every step happens on the edge: a microVM's boot, faults,
// pause or network are the same behind an apiserver, whose routing of
// isolations TestIsolationsSideBySide and TestMicroVMSandbox prove in
// both passes. Each TCG boot costs seconds of both of CI's cores.
func allInOneOnly(t *testing.T) {
	t.Helper()
	if testutil.ClusterMode() {
		t.Skip("runs in the all-in-one pass only: nothing it checks goes through the apiserver but the routing TestMicroVMSandbox covers")
	}
}

// onePassOnly skips t in the cluster pass (DSEC_TEST_CLUSTER=1) of a test
// that never starts the pass's daemon (startDaemon): it starts a cluster
// of its own (testutil.StartCluster) or a dsecd by hand, so the second
// pass would run exactly what the first did.
func onePassOnly(t *testing.T) {
	t.Helper()
	if testutil.ClusterMode() {
		t.Skip("runs in the all-in-one pass only: it starts no daemon of the pass, so the cluster pass would run it again unchanged")
	}
}

// sdkClient is a Go SDK client of the API at addr holding token, closed
// when t ends.
func sdkClient(t *testing.T, addr, token string) *dsec.Client {
	t.Helper()
	c, err := dsec.NewClient(addr, dsec.WithToken(token))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	return c
}

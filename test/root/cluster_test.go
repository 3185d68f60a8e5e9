package root

import (
	"context"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"connectrpc.com/connect"

	dsecv1 "dsec.dev/dsec/api/gen/dsec/v1"
	"dsec.dev/dsec/internal/testutil"
)

// TestClusterEndToEnd: the main flows through a cluster on this machine,
// two apiservers in front of two edges with real runc sandboxes, through
// the CLI and the API as a user drives them: a layer imported through an
// apiserver is usable on every edge, a batch spreads, commands, files,
// sessions and background processes work on each edge's sandboxes through
// either apiserver, a warm pool on every edge serves creates, and removal
// leaves nothing.
func TestClusterEndToEnd(t *testing.T) {
	c := testutil.StartCluster(t, testutil.ClusterOptions{APIServers: 2, Edges: 2, RealEdges: true,
		DB: testutil.StartPostgres(t), Registry: true})
	cli := func(i int, args ...string) (string, string, int) {
		t.Helper()
		cmd := exec.Command(filepath.Join(c.Bin, "dsec"), append([]string{"--addr", c.APIServers[i].Addr}, args...)...)
		cmd.Env = append(os.Environ(), "DSEC_TOKEN="+c.APIServers[i].Token)
		var out, errb strings.Builder
		cmd.Stdout, cmd.Stderr = &out, &errb
		err := cmd.Run()
		code := 0
		if ee, ok := err.(*exec.ExitError); ok {
			code = ee.ExitCode()
		} else if err != nil {
			t.Fatal(err)
		}
		return out.String(), errb.String(), code
	}
	tree := t.TempDir()
	if out, err := exec.Command(filepath.Join(testutil.RepoRoot(), "scripts", "build-busybox-base.sh"), tree).CombinedOutput(); err != nil {
		t.Fatalf("build busybox base: %v\n%s", err, out)
	}
	// Sent from the client, as from another machine: each edge gets it.
	if out, errOut, code := cli(0, "layer", "import", "--upload", "--kind", "base", env, tree); code != 0 {
		t.Fatalf("layer import --upload through an apiserver: %s %s", out, errOut)
	}
	if out, _, _ := cli(1, "layer", "ls"); !strings.Contains(out, env) {
		t.Fatalf("the other apiserver does not list the layer:\n%s", out)
	}

	out, errOut, code := cli(0, "create", "-n", "6", env)
	if code != 0 {
		t.Fatalf("create -n 6: %s", errOut)
	}
	ids := strings.Fields(out)
	nodes := map[string]int{}
	for _, id := range ids {
		for _, n := range []string{"e1", "e2"} {
			if strings.HasPrefix(id, "sb-"+n+"-") {
				nodes[n]++
			}
		}
	}
	if nodes["e1"] == 0 || nodes["e2"] == 0 {
		t.Errorf("a batch of 6 over 2 edges: %v", nodes)
	}
	for i, id := range ids {
		via := i % 2 // each sandbox through either apiserver
		if out, errOut, code := cli(via, "exec", "--env", "X="+id, id, "--", "sh", "-c", "echo $X; hostname"); code != 0 || out != id+"\n"+id+"\n" {
			t.Errorf("exec in %s through api%d: %q %q %d", id, via+1, out, errOut, code)
		}
	}
	// Files, a session and a background process on one edge's sandbox,
	// through the API of the other apiserver.
	id := ids[0]
	cl := c.Client(1)
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	if _, err := cl.Sandboxes.WriteFile(ctx, connect.NewRequest(&dsecv1.WriteFileRequest{SandboxId: id, Path: "/tmp/x", Data: []byte("hi")})); err != nil {
		t.Fatal(err)
	}
	rf, err := cl.Sandboxes.ReadFile(ctx, connect.NewRequest(&dsecv1.ReadFileRequest{SandboxId: id, Path: "/tmp/x"}))
	if err != nil || string(rf.Msg.GetData()) != "hi" {
		t.Fatalf("read back: %v %q", err, rf.Msg.GetData())
	}
	if out, _, code := cli(1, "exec", "-d", "--tag", "bg", id, "--", "sh", "-c", "echo bg; sleep 30"); code != 0 || !strings.HasPrefix(out, "p-") {
		t.Fatalf("exec -d: %q", out)
	}
	waitFor(t, 10*time.Second, "the background process to print", func() bool {
		out, _, _ := cli(0, "attach", "--no-follow", id, "bg")
		return out == "bg\n"
	})
	if _, errOut, code := cli(0, "kill", id, "bg"); code != 0 {
		t.Fatalf("kill: %s", errOut)
	}

	// A warm pool on every edge serves creates of its shape.
	if out, errOut, code := cli(0, "pool", "set", "--size", "1", env); code != 0 {
		t.Fatalf("pool set: %s %s", out, errOut)
	}
	waitFor(t, 60*time.Second, "both edges' pools to fill", func() bool {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		resp, err := cl.Sandboxes.ListWarmPools(ctx, connect.NewRequest(&dsecv1.ListWarmPoolsRequest{}))
		if err != nil {
			return false
		}
		ready := map[string]bool{}
		for _, p := range resp.Msg.GetPools() {
			ready[p.GetNode()] = p.GetReady() >= 1
		}
		return ready["e1"] && ready["e2"]
	})
	out, _, code = cli(1, "create", "--json", env)
	if code != 0 || !strings.Contains(out, `"fromWarmPool": true`) {
		t.Errorf("create of the pool's shape: %s", out)
	}
	cli(0, "pool", "rm", env)

	if _, errOut, code := cli(0, append([]string{"rm", firstID(out)}, ids...)...); code != 0 {
		t.Fatalf("rm: %s", errOut)
	}
	if out, _, _ := cli(1, "ls"); strings.Count(out, "sb-") != 0 {
		t.Errorf("sandboxes left after rm:\n%s", out)
	}
}

// firstID is the first sandbox ID in a create's JSON.
func firstID(js string) string {
	i := strings.Index(js, `"id": "`)
	if i < 0 {
		return ""
	}
	rest := js[i+len(`"id": "`):]
	return rest[:strings.IndexByte(rest, '"')]
}

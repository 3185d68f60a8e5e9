package root

import (
	"context"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"connectrpc.com/connect"

	dsecv1 "dsec.dev/dsec/api/gen/dsec/v1"
	"dsec.dev/dsec/internal/sandboxid"
	"dsec.dev/dsec/internal/testutil"
	dsec "dsec.dev/dsec/sdk/go"
	"dsec.dev/dsec/sdk/go/receipt"
)

// startRealCluster starts an apiserver (with apiserverArgs) in front of
// edges real edges and imports the busybox base through it, as a client
// on another machine would (an upload).
func startRealCluster(t *testing.T, edges int, apiserverArgs ...string) *testutil.Cluster {
	t.Helper()
	c := testutil.StartCluster(t, testutil.ClusterOptions{APIServers: 1, Edges: edges, RealEdges: true, APIServerArgs: apiserverArgs})
	tree := t.TempDir()
	if out, err := exec.Command(filepath.Join(testutil.RepoRoot(), "scripts", "build-busybox-base.sh"), tree).CombinedOutput(); err != nil {
		t.Fatalf("build busybox base: %v\n%s", err, out)
	}
	imp := exec.Command(filepath.Join(c.Bin, "dsec"), "--addr", c.APIServers[0].Addr, "layer", "import", "--upload", "--kind", "base", env, tree)
	imp.Env = append(imp.Environ(), "DSEC_TOKEN="+c.APIServers[0].Token)
	if out, err := imp.CombinedOutput(); err != nil {
		t.Fatalf("layer import --upload: %v\n%s", err, out)
	}
	return c
}

// TestBatchSpreadsOverRealEdges: one batch of 300 real sandboxes through an
// apiserver in front of three edges with real runc sandboxes gives no edge
// more than 1.5× its share, and every sandbox runs a command.
func TestBatchSpreadsOverRealEdges(t *testing.T) {
	onePassOnly(t)
	c := startRealCluster(t, 3)

	cl := c.Client(0)
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	const n = 300
	start := time.Now()
	resp, err := cl.Sandboxes.Create(ctx, connect.NewRequest(&dsecv1.CreateRequest{
		Spec: &dsecv1.SandboxSpec{Environment: env, MemoryMb: 32, Cpus: 0.1}, Count: n}))
	if err != nil {
		t.Fatalf("create %d: %v", n, err)
	}
	sbs := resp.Msg.GetSandboxes()
	t.Logf("%d real sandboxes over 3 edges in %s", len(sbs), time.Since(start).Round(time.Millisecond))
	ids := make([]string, len(sbs))
	per := map[string]int{}
	for i, sb := range sbs {
		ids[i] = sb.GetId()
		node, err := sandboxid.Node(sb.GetId())
		if err != nil || node != sb.GetNode() {
			t.Fatalf("sandbox %s says node %s: %v", sb.GetId(), sb.GetNode(), err)
		}
		per[node]++
	}
	defer func() {
		dctx, dcancel := context.WithTimeout(context.Background(), 2*time.Minute)
		defer dcancel()
		for _, id := range ids {
			if _, err := cl.Sandboxes.Delete(dctx, connect.NewRequest(&dsecv1.DeleteRequest{Id: id})); err != nil {
				t.Errorf("delete %s: %v", id, err)
			}
		}
	}()
	if len(sbs) != n {
		t.Fatalf("created %d sandboxes, want %d", len(sbs), n)
	}
	t.Logf("per edge: %v", per)
	for _, e := range c.Edges {
		if per[e.Name] > n/3*3/2 {
			t.Errorf("edge %s got %d of %d (share %d, at most %d)", e.Name, per[e.Name], n, n/3, n/3*3/2)
		}
	}
	// Each edge's sandboxes are real: one per edge runs a command.
	seen := map[string]bool{}
	for _, sb := range sbs {
		if seen[sb.GetNode()] {
			continue
		}
		seen[sb.GetNode()] = true
		st, err := cl.Sandboxes.Exec(ctx, connect.NewRequest(&dsecv1.ExecRequest{SandboxId: sb.GetId(), Argv: []string{"cat", "/etc/hostname"}}))
		if err != nil {
			t.Fatal(err)
		}
		var out []byte
		for st.Receive() {
			out = append(out, st.Msg().GetStdout()...)
		}
		st.Close()
		if err := st.Err(); err != nil || len(out) == 0 {
			t.Errorf("exec in %s on %s: %v, output %q", sb.GetId(), sb.GetNode(), err, out)
		}
	}
}

// TestSnapshotAcrossEdges: a snapshot taken on one real edge starts
// sandboxes on the other (it shares the blob store), and a fork spread over
// both edges gives every child the source's files. A grade of the source
// whose clean room lands on the other edge (no grade pools keep rooms on
// the source's node) returns a receipt that edge signed, vouching for the
// source's trajectory hash and provenance flags on the word of the
// source's node (its attestation).
func TestSnapshotAcrossEdges(t *testing.T) {
	onePassOnly(t)
	c := startRealCluster(t, 2, "--grade-pool", "0")
	cl := c.Client(0)
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	resp, err := cl.Sandboxes.Create(ctx, connect.NewRequest(&dsecv1.CreateRequest{Spec: &dsecv1.SandboxSpec{Environment: env}}))
	if err != nil {
		t.Fatal(err)
	}
	src := resp.Msg.GetSandboxes()[0]
	defer cl.Sandboxes.Delete(context.Background(), connect.NewRequest(&dsecv1.DeleteRequest{Id: src.GetId()}))
	run := func(id, command string) string {
		t.Helper()
		st, err := cl.Sandboxes.Exec(ctx, connect.NewRequest(&dsecv1.ExecRequest{SandboxId: id, Command: command}))
		if err != nil {
			t.Fatal(err)
		}
		defer st.Close()
		var out []byte
		for st.Receive() {
			out = append(out, st.Msg().GetStdout()...)
		}
		if err := st.Err(); err != nil {
			t.Fatalf("exec in %s: %v", id, err)
		}
		return string(out)
	}
	run(src.GetId(), "mkdir -p /work && echo carried > /work/state && rm /bin/vi")
	gradeAcrossNodes(ctx, t, c, src)
	fork, err := cl.Sandboxes.Fork(ctx, connect.NewRequest(&dsecv1.ForkRequest{SandboxId: src.GetId(), Count: 6}))
	if err != nil {
		t.Fatalf("fork: %v", err)
	}
	per := map[string]int{}
	for i, ch := range fork.Msg.GetChildren() {
		if ch.GetError() != "" {
			t.Fatalf("fork child %d: %s", i, ch.GetError())
		}
		kid := ch.GetSandbox()
		defer cl.Sandboxes.Delete(context.Background(), connect.NewRequest(&dsecv1.DeleteRequest{Id: kid.GetId()}))
		per[kid.GetNode()]++
		if out := run(kid.GetId(), "cat /work/state; ls /bin | grep -cx vi"); out != "carried\n0\n" {
			t.Errorf("child %d on %s: %q", i, kid.GetNode(), out)
		}
	}
	t.Logf("fork of 6 from a sandbox on %s: %v", src.GetNode(), per)
	if len(per) < 2 {
		t.Errorf("the fork's children all landed on one edge (%v): the snapshot was not used on the other", per)
	}
}

// gradeAcrossNodes grades src, the one sandbox of a cluster of two real
// edges: its clean room goes to the other, emptier, edge. That edge signs
// the receipt, and vouches for src's trajectory hash and provenance flags
// (it checked its node's attestation of them against the cluster's CA).
func gradeAcrossNodes(ctx context.Context, t *testing.T, c *testutil.Cluster, src *dsecv1.Sandbox) {
	t.Helper()
	res, err := c.Client(0).Sandboxes.Grade(ctx, connect.NewRequest(&dsecv1.GradeRequest{
		SandboxId: src.GetId(), Paths: []string{"/work"}, Command: "sh /grade-tests/check.sh",
		Tests: &dsecv1.GradeTests{Files: map[string][]byte{"/grade-tests/check.sh": []byte("test \"$(cat /work/state)\" = carried\n")}},
	}))
	if err != nil {
		t.Fatalf("grade: %v", err)
	}
	g := res.Msg
	room, err := sandboxid.Node(g.GetGraderSandboxId())
	if err != nil || room == src.GetNode() {
		t.Fatalf("the clean room %s ran on %s, the graded sandbox's node (%v): want the other", g.GetGraderSandboxId(), room, err)
	}
	v, err := receipt.NewVerifierFile(filepath.Join(c.Dir, "pki", "ca.crt"))
	if err != nil {
		t.Fatal(err)
	}
	r, err := v.Verify(g.GetReceipt())
	if err != nil {
		t.Fatalf("the grade's receipt: %v", err)
	}
	if g.GetReward() != 1 || r.Node != room || r.Sandbox != src.GetId() || !strings.HasPrefix(r.Trajectory, "sha256:") ||
		r.Trajectory != g.GetTrajectoryHash() || g.GetProvenance() == nil || !slices.Equal(r.Provenance, dsec.ProvenanceFlagNames(g.GetProvenance().GetFlags())) {
		t.Errorf("reward %v; receipt of node %s for %s, trajectory %q and flags %v; want reward 1, node %s, %s, the grade's trajectory %q and flags %v",
			g.GetReward(), r.Node, r.Sandbox, r.Trajectory, r.Provenance, room, src.GetId(), g.GetTrajectoryHash(), g.GetProvenance().GetFlags())
	}
	for _, f := range []string{"trajectory_hash", "provenance_flags", "grader_digest", "reward"} {
		if !slices.Contains(r.Vouched, f) {
			t.Errorf("the receipt signed by %s for a sandbox of %s: vouched %v leaves out %s", room, src.GetNode(), r.Vouched, f)
		}
	}
}

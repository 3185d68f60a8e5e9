package cluster

import (
	"bytes"
	"context"
	"os"
	"path/filepath"
	"testing"
	"time"

	"connectrpc.com/connect"

	dsecv1 "dsec.dev/dsec/api/gen/dsec/v1"
	"dsec.dev/dsec/internal/testutil"
)

// TestTrajectoryOutlivesNode: a sandbox's trajectory lands in the cluster's
// blob store when the sandbox is deleted, and once its node is killed the
// apiserver reads it from another node, ended, with the calls recorded.
func TestTrajectoryOutlivesNode(t *testing.T) {
	begun := time.Now()
	blobs := t.TempDir()
	c := testutil.StartCluster(t, testutil.ClusterOptions{APIServers: 1, Edges: 2,
		EdgeArgs: append([]string{"--blob-store", blobs}, hollow...)})
	sbs, err := c.Create(0, &dsecv1.SandboxSpec{Environment: "base:1"}, 10)
	if err != nil {
		t.Fatal(err)
	}
	var id string
	for _, sb := range sbs {
		if sb.GetNode() == "e1" {
			id = sb.GetId()
		}
	}
	if id == "" {
		t.Fatal("no sandbox landed on e1")
	}
	ctx := context.Background()
	cl := c.Client(0)
	if _, err := cl.Sandboxes.SetNetworkRules(ctx, connect.NewRequest(&dsecv1.SetNetworkRulesRequest{SandboxId: id, Rules: map[string]bool{"pypi": true}})); err != nil {
		t.Fatal(err)
	}
	if _, err := cl.Sandboxes.Delete(ctx, connect.NewRequest(&dsecv1.DeleteRequest{Id: id})); err != nil {
		t.Fatal(err)
	}
	live, err := cl.Sandboxes.Trajectory(ctx, connect.NewRequest(&dsecv1.TrajectoryRequest{SandboxId: id}))
	if err != nil {
		t.Fatalf("read from its node: %v", err)
	}
	// The copy is made in the background once the trajectory ends.
	copyPath := filepath.Join(blobs, "trajectories", id+".jsonl")
	for deadline := time.Now().Add(10 * time.Second); ; time.Sleep(50 * time.Millisecond) {
		if data, err := os.ReadFile(copyPath); err == nil && bytes.Equal(data, live.Msg.GetLines()) {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("no copy of the trajectory at %s after 10 s", copyPath)
		}
	}
	start := time.Now()
	t.Logf("the copy is there; up to the kill: %s", time.Since(begun).Round(time.Millisecond))
	c.Edges[0].Kill()
	var got *dsecv1.TrajectoryResponse
	for deadline := time.Now().Add(15 * time.Second); ; time.Sleep(100 * time.Millisecond) {
		rctx, cancel := context.WithTimeout(ctx, time.Second)
		resp, err := cl.Sandboxes.Trajectory(rctx, connect.NewRequest(&dsecv1.TrajectoryRequest{SandboxId: id}))
		cancel()
		if err == nil {
			got = resp.Msg
			t.Logf("read through another node %s after the kill", time.Since(start).Round(time.Millisecond))
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("the trajectory of a sandbox of a killed node: %v after 15 s", err)
		}
	}
	if !got.GetEnded() || got.GetSha256() != live.Msg.GetSha256() || !bytes.Contains(got.GetLines(), []byte(`"call":"set_network_rules"`)) ||
		!bytes.Contains(got.GetLines(), []byte(`"call":"delete"`)) {
		t.Errorf("read through another node: ended %v, sha256 %s (want %s):\n%s", got.GetEnded(), got.GetSha256(), live.Msg.GetSha256(), got.GetLines())
	}
}

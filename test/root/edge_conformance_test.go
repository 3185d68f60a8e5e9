package root

import (
	"os/exec"
	"path/filepath"
	"sync"
	"testing"

	"connectrpc.com/connect"

	"dsec.dev/dsec/api/gen/dsec/edge/v1/edgev1connect"
	dsecv1 "dsec.dev/dsec/api/gen/dsec/v1"
	"dsec.dev/dsec/internal/clustertls"
	"dsec.dev/dsec/internal/edgeclient"
	"dsec.dev/dsec/internal/edgetest"
	"dsec.dev/dsec/internal/testutil"
)

// TestEdgeConformance runs the apiserver ↔ edge seam's conformance suite
// against a real edge: `dsecd edge` with runc sandboxes, reached as an
// apiserver reaches it (package edgeclient over the cluster's mutual TLS).
// One edge serves every group of checks, the busybox base imported once.
func TestEdgeConformance(t *testing.T) {
	if testutil.ClusterMode() {
		t.Skip("runs in the all-in-one pass only: it starts an edge of its own")
	}
	c := testutil.StartCluster(t, testutil.ClusterOptions{APIServers: 1, Edges: 1, RealEdges: true})
	pki := filepath.Join(c.Dir, "pki")
	tc, err := clustertls.ClientConfig(clustertls.ComponentFiles(pki, clustertls.RoleAPIServer, "api1"), clustertls.RoleEdge, c.Edges[0].Name)
	if err != nil {
		t.Fatal(err)
	}
	edge := edgeclient.Dial(tc, "https://"+c.Edges[0].Addr, nil)
	const env = "busybox:edgetest"
	var once sync.Once
	edgetest.Run(t, edgetest.Options{
		New: func(t *testing.T) edgev1connect.EdgeServiceHandler {
			once.Do(func() {
				tree := c.Dir + "/busybox"
				if out, err := exec.Command(filepath.Join(testutil.RepoRoot(), "scripts", "build-busybox-base.sh"), tree).CombinedOutput(); err != nil {
					t.Fatalf("build busybox base: %v\n%s", err, out)
				}
				if _, err := edge.ImportLayer(t.Context(), connect.NewRequest(&dsecv1.ImportLayerRequest{Ref: env, Kind: dsecv1.LayerKind_LAYER_KIND_BASE, Path: tree})); err != nil {
					t.Fatalf("import the busybox base: %v", err)
				}
			})
			return edge
		},
		Environment: env,
		ReceiptCA:   filepath.Join(pki, "ca.crt"),
	})
}

//go:build linux

package daemon

import (
	"context"
	"log/slog"
	"os"
	"os/exec"
	"path/filepath"
	"sync"
	"testing"

	"connectrpc.com/connect"

	"dsec.dev/dsec/api/gen/dsec/edge/v1/edgev1connect"
	dsecv1 "dsec.dev/dsec/api/gen/dsec/v1"
	"dsec.dev/dsec/internal/edge/edgesvc"
	"dsec.dev/dsec/internal/edge/layers"
	"dsec.dev/dsec/internal/edge/trajectory"
	"dsec.dev/dsec/internal/edgetest"
	"dsec.dev/dsec/internal/receipt"
	"dsec.dev/dsec/internal/testutil"
	sdkreceipt "dsec.dev/dsec/sdk/go/receipt"
)

// TestEdgeConformance runs the apiserver ↔ edge seam's conformance suite
// against a real node's edge service called in process, as the all-in-one
// dsecd's apiserver calls it: the node opened as Run opens it (runc
// sandboxes, local layers, no sandbox networks), torn down as `dsecd
// teardown` does. One node serves every group of checks.
func TestEdgeConformance(t *testing.T) {
	if len(os.Args) > 1 && os.Args[1] == "lazyfs" {
		// Never a node inside a helper the node started: the test binary
		// is not dsecd (and the node below starts none: local layers).
		t.Skip("the test binary run as a node's helper")
	}
	testutil.RequireRoot(t)
	testutil.RequireCommand(t, "runc")
	testutil.RequireCommand(t, "mkfs.erofs")
	bin := testutil.Binaries(t)
	root, err := os.MkdirTemp("", "dsec-test-root-edgetest-")
	if err != nil {
		t.Fatal(err)
	}
	log := slog.New(slog.DiscardHandler)
	// Local layers: on demand, the node would start `dsecd lazyfs` as
	// os.Executable, which here is the test binary.
	cfg := Config{Root: root, Node: "et1", AgentPath: filepath.Join(bin, "dsec-agent"), Runsc: NoRunsc,
		Network: NetworkConfig{Disabled: true}, Storage: StorageConfig{Mode: "local"}}
	n, err := open(t.Context(), cfg, log)
	if err != nil {
		os.RemoveAll(root)
		t.Fatalf("open the node: %v", err)
	}
	t.Cleanup(func() {
		n.edge.Shutdown()
		n.close()
		if err := Teardown(context.Background(), cfg, log); err != nil {
			t.Errorf("tear down the node: %v", err)
		}
		os.RemoveAll(root)
	})
	if err := n.edge.Recover(t.Context()); err != nil {
		t.Fatal(err)
	}
	svc := edgesvc.New(n.edge, layers.NewHandler(n.layers, n.layerInUse), log)
	rec, err := trajectory.New(trajectory.Config{Dir: filepath.Join(root, "trajectories")}, n.edge)
	if err != nil {
		t.Fatal(err)
	}
	svc.SetRecorder(rec)
	// The all-in-one's node key, as Run gives its edge.
	signer, err := receipt.NodeSigner(root, cfg.Node)
	if err != nil {
		t.Fatal(err)
	}
	svc.SetReceipts(func() (*sdkreceipt.Signer, error) { return signer, nil })
	svc.SetEvents(n.events)
	svc.SetLedger(n.ledger)
	const env = "busybox:edgetest"
	var once sync.Once
	edgetest.Run(t, edgetest.Options{
		New: func(t *testing.T) edgev1connect.EdgeServiceHandler {
			once.Do(func() {
				tree := filepath.Join(t.TempDir(), "busybox")
				if out, err := exec.Command(filepath.Join(testutil.RepoRoot(), "scripts", "build-busybox-base.sh"), tree).CombinedOutput(); err != nil {
					t.Fatalf("build busybox base: %v\n%s", err, out)
				}
				if _, err := svc.ImportLayer(t.Context(), connect.NewRequest(&dsecv1.ImportLayerRequest{Ref: env, Kind: dsecv1.LayerKind_LAYER_KIND_BASE, Path: tree})); err != nil {
					t.Fatalf("import the busybox base: %v", err)
				}
			})
			return svc
		},
		Environment: env,
		ReceiptCA:   filepath.Join(root, receipt.Dir, "node.crt"),
	})
}

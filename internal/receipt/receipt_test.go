package receipt

import (
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"dsec.dev/dsec/internal/clustertls"
	sdkreceipt "dsec.dev/dsec/sdk/go/receipt"
)

func sample() sdkreceipt.Receipt {
	now := time.Now().UTC()
	return sdkreceipt.Receipt{Sandbox: "sb-1", Layers: []string{"sha256:aa"}, Workspace: "sha256:bb",
		GraderCommand: []string{"pytest"}, Reward: 1, Outcome: "task", Started: now, Finished: now}
}

// TestEdgeSigner signs with an edge's certificate from `dsecd
// init-cluster`'s CA and verifies against the CA bundle; another cluster's
// CA refuses it.
func TestEdgeSigner(t *testing.T) {
	dir, other := t.TempDir(), t.TempDir()
	if err := clustertls.InitCluster(dir, []string{"api-1"}, []clustertls.EdgeSpec{{Name: "node-3"}}); err != nil {
		t.Fatal(err)
	}
	if err := clustertls.InitCluster(other, nil, []clustertls.EdgeSpec{{Name: "node-3"}}); err != nil {
		t.Fatal(err)
	}
	files := clustertls.ComponentFiles(dir, clustertls.RoleEdge, "node-3")
	s, err := EdgeSigner(files)
	if err != nil {
		t.Fatal(err)
	}
	signed, err := s.Sign(sample())
	if err != nil {
		t.Fatal(err)
	}
	v, err := sdkreceipt.NewVerifierFile(files.CABundle)
	if err != nil {
		t.Fatal(err)
	}
	r, err := v.Verify(signed)
	if err != nil {
		t.Fatal(err)
	}
	if r.Node != "node-3" {
		t.Fatalf("receipt of node %q, want node-3", r.Node)
	}
	ov, err := sdkreceipt.NewVerifierFile(filepath.Join(other, "ca.crt"))
	if err != nil {
		t.Fatal(err)
	}
	if _, err := ov.Verify(signed); err == nil || !strings.Contains(err.Error(), "not issued by the given CA") {
		t.Fatalf("verify against another cluster's CA: %v", err)
	}
	// An apiserver's certificate names no node: it cannot sign receipts.
	if _, err := EdgeSigner(clustertls.ComponentFiles(dir, clustertls.RoleAPIServer, "api-1")); err == nil {
		t.Fatal("an apiserver's certificate made a receipt signer")
	}
}

// TestNodeSigner makes the all-in-one's node key once and keeps it: a second
// load signs with the same certificate, and receipts verify against it.
func TestNodeSigner(t *testing.T) {
	root := t.TempDir()
	s1, err := NodeSigner(root, "local")
	if err != nil {
		t.Fatal(err)
	}
	s2, err := NodeSigner(root, "local")
	if err != nil {
		t.Fatal(err)
	}
	if !s1.Certificate().Equal(s2.Certificate()) {
		t.Fatal("the node key was made again on the second load")
	}
	fi, err := os.Stat(filepath.Join(root, Dir, "node.key"))
	if err != nil {
		t.Fatal(err)
	}
	if fi.Mode().Perm() != 0o600 {
		t.Fatalf("node.key mode %v, want 0600", fi.Mode().Perm())
	}
	signed, err := s2.Sign(sample())
	if err != nil {
		t.Fatal(err)
	}
	v, err := sdkreceipt.NewVerifierFile(filepath.Join(root, Dir, "node.crt"))
	if err != nil {
		t.Fatal(err)
	}
	if _, err := v.Verify(signed); err != nil {
		t.Fatal(err)
	}
	// Renamed, the node gets a new key; the old pair is kept beside, and the
	// new key's receipts do not verify against the old certificate.
	s3, err := NodeSigner(root, "renamed")
	if err != nil {
		t.Fatal(err)
	}
	if s3.Node() != "renamed" || s3.Certificate().Equal(s1.Certificate()) {
		t.Fatalf("renamed node signs as %q with the old certificate %v", s3.Node(), s3.Certificate().Equal(s1.Certificate()))
	}
	if _, err := os.Stat(filepath.Join(root, Dir, "node.crt.old")); err != nil {
		t.Fatal(err)
	}
	signed, err = s3.Sign(sample())
	if err != nil {
		t.Fatal(err)
	}
	if _, err := v.Verify(signed); err == nil {
		t.Fatal("a receipt of the new node key verified against the old certificate")
	}
}

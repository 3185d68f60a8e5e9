package cli

import (
	"bytes"
	"encoding/json"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"dsec.dev/dsec/internal/receipt"
	sdkreceipt "dsec.dev/dsec/sdk/go/receipt"
)

// TestReceiptVerify signs a receipt with an all-in-one node key and checks
// it with `dsec receipt verify`, offline (the address is nobody's): it
// verifies, an edited reward fails naming the signature, and another node's
// certificate refuses it.
func TestReceiptVerify(t *testing.T) {
	root, otherRoot, dir := t.TempDir(), t.TempDir(), t.TempDir()
	s, err := receipt.NodeSigner(root, "local")
	if err != nil {
		t.Fatal(err)
	}
	if _, err := receipt.NodeSigner(otherRoot, "local"); err != nil {
		t.Fatal(err)
	}
	now := time.Now().UTC()
	signed, err := s.Sign(sdkreceipt.Receipt{Sandbox: "sb-7", Layers: []string{"sha256:aa"}, Workspace: "sha256:bb",
		GraderCommand: []string{"pytest"}, Reward: 0.5, Exit: 1, Outcome: "task", Started: now, Finished: now})
	if err != nil {
		t.Fatal(err)
	}
	good := filepath.Join(dir, "good.json")
	if err := os.WriteFile(good, signed, 0o644); err != nil {
		t.Fatal(err)
	}
	var env sdkreceipt.Envelope
	if err := json.Unmarshal(signed, &env); err != nil {
		t.Fatal(err)
	}
	env.Payload = bytes.Replace(env.Payload, []byte(`"reward":0.5`), []byte(`"reward":1`), 1)
	edited, _ := json.Marshal(env)
	bad := filepath.Join(dir, "edited.json")
	if err := os.WriteFile(bad, edited, 0o644); err != nil {
		t.Fatal(err)
	}
	cert := filepath.Join(root, receipt.Dir, "node.crt")
	const nobody = "unix:///nonexistent/dsec.sock"

	out, _, err := runCLIErr(t, nobody, "receipt", "verify", "--ca", cert, good)
	if err != nil || !strings.Contains(out, "sandbox sb-7 graded on node local, reward 0.5 (exit 1)") {
		t.Fatalf("verify: %q, %v", out, err)
	}
	out, _, err = runCLIErr(t, nobody, "--json", "receipt", "verify", "--ca", cert, good)
	var rs []sdkreceipt.Receipt
	if err != nil || json.Unmarshal([]byte(out), &rs) != nil || len(rs) != 1 || rs[0].Reward != 0.5 {
		t.Fatalf("verify --json: %q, %v", out, err)
	}
	_, _, err = runCLIErr(t, nobody, "receipt", "verify", "--ca", cert, good, bad)
	if err == nil || !strings.Contains(err.Error(), "edited.json: verify receipt: the signature does not match") || strings.Contains(err.Error(), "good.json") {
		t.Fatalf("verify an edited receipt: %v", err)
	}
	_, _, err = runCLIErr(t, nobody, "receipt", "verify", "--ca", filepath.Join(otherRoot, receipt.Dir, "node.crt"), good)
	if err == nil || !strings.Contains(err.Error(), "not the given node certificate") {
		t.Fatalf("verify against another node's certificate: %v", err)
	}
	if _, _, err := runCLIErr(t, nobody, "receipt", "verify", good); err == nil || !strings.Contains(err.Error(), "--ca is required") {
		t.Fatalf("verify without --ca: %v", err)
	}
}

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
}

// TestReceiptVerifyLocalNode: without --ca, dsec receipt verify trusts the
// all-in-one dsecd's node certificate, found in the root its socket or
// token file is in, and the one before a renewal (node.crt.old), so a
// receipt signed before the renewal still verifies; with no such root it
// says --ca is needed. Before, it always asked for --ca.
func TestReceiptVerifyLocalNode(t *testing.T) {
	if nodeReceiptDir != receipt.Dir {
		t.Fatalf("the CLI looks for the node certificate in ROOT/%s, dsecd keeps it in ROOT/%s", nodeReceiptDir, receipt.Dir)
	}
	root, dir := t.TempDir(), t.TempDir()
	t.Setenv("DSEC_TOKEN_FILE", "")
	sign := func(s *sdkreceipt.Signer, name string) string {
		t.Helper()
		now := time.Now().UTC()
		signed, err := s.Sign(sdkreceipt.Receipt{Sandbox: "sb-" + name, Layers: []string{"sha256:aa"}, Workspace: "sha256:bb",
			GraderCommand: []string{"pytest"}, Reward: 1, Outcome: "task", Started: now, Finished: now})
		if err != nil {
			t.Fatal(err)
		}
		path := filepath.Join(dir, name+".json")
		if err := os.WriteFile(path, signed, 0o644); err != nil {
			t.Fatal(err)
		}
		return path
	}
	s, err := receipt.NodeSigner(root, "local")
	if err != nil {
		t.Fatal(err)
	}
	before := sign(s, "before")
	// Renamed, the node gets a new pair and keeps the old one beside.
	if s, err = receipt.NodeSigner(root, "renamed"); err != nil {
		t.Fatal(err)
	}
	after := sign(s, "after")
	cert := filepath.Join(root, receipt.Dir, "node.crt")

	out, errOut, err := runCLIErr(t, "unix://"+filepath.Join(root, "dsecd.sock"), "receipt", "verify", before, after)
	if err != nil || !strings.Contains(out, "sandbox sb-before graded on node local") || !strings.Contains(out, "sandbox sb-after graded on node renamed") ||
		!strings.Contains(errOut, "trusting the all-in-one's node certificate "+cert+" and "+cert+".old") {
		t.Fatalf("verify without --ca against the socket's root: %q %q, %v", out, errOut, err)
	}
	// A TCP address: the root the token file is in.
	t.Setenv("DSEC_TOKEN_FILE", filepath.Join(root, "admin.token"))
	if out, _, err := runCLIErr(t, "127.0.0.1:1", "--json", "receipt", "verify", after); err != nil || !strings.Contains(out, "sb-after") {
		t.Fatalf("verify without --ca against the token file's root: %q, %v", out, err)
	}
	t.Setenv("DSEC_TOKEN_FILE", "")
	// No all-in-one here (the default root may hold one: it is not this
	// node's, and refuses the receipt).
	_, _, err = runCLIErr(t, "unix:///nonexistent/dsec.sock", "receipt", "verify", after)
	if _, serr := os.Stat("/var/lib/dsec/receipt/node.crt"); err == nil || serr != nil && !strings.Contains(err.Error(), "pass --ca") {
		t.Fatalf("verify without --ca and no all-in-one to trust: %v", err)
	}
}

package root

import (
	"bytes"
	"encoding/json"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"dsec.dev/dsec/internal/clustertls"
	ireceipt "dsec.dev/dsec/internal/receipt"
	"dsec.dev/dsec/internal/testutil"
	"dsec.dev/dsec/sdk/go/receipt"
)

// receiptTrust is what a verifier of the daemon's receipts is given: in
// the cluster pass the cluster's CA bundle (its edge signs with its leaf
// key from that CA), in the all-in-one the node's own certificate.
func receiptTrust(root string) string {
	if testutil.ClusterMode() {
		return filepath.Join(root, "pki", "ca.crt")
	}
	return filepath.Join(root, ireceipt.Dir, "node.crt")
}

// TestGradeReceiptVerify grades a sandbox through the CLI (dsec grade
// --receipt) and checks the signed receipt offline with dsec receipt
// verify against the trust a verifier is given (receiptTrust): in the
// cluster pass it was signed by the edge that ran the clean room, with its
// key from the cluster CA. An edited field fails; the same receipt signed
// by a key not from that trust (another CA's edge of the same name, or
// another self-issued node key) fails.
func TestGradeReceiptVerify(t *testing.T) {
	d := startDaemon(t)
	out, errOut, code := d.CLI("", "create", env)
	if code != 0 {
		t.Fatalf("dsec create: %s %s", out, errOut)
	}
	id := strings.TrimSpace(out)
	t.Cleanup(func() { d.CLI("", "rm", id) })
	if out, errOut, code := d.CLI("", "exec", id, "--", "sh", "-c", "mkdir -p /work && echo 42 > /work/answer"); code != 0 {
		t.Fatalf("dsec exec: %s %s", out, errOut)
	}
	dir := t.TempDir()
	file := filepath.Join(dir, "receipt.json")
	// The trusted tests, laid in the clean room from a local file: the
	// node hashes them there itself.
	check := []byte("test \"$(cat /work/answer)\" = 42\n")
	if err := os.WriteFile(filepath.Join(dir, "check.sh"), check, 0o644); err != nil {
		t.Fatal(err)
	}
	out, errOut, code = d.CLI("", "grade", id, "--path", "/work", "--receipt", file,
		"--tests", filepath.Join(dir, "check.sh")+":/grade-tests/check.sh", "-c", "sh /grade-tests/check.sh")
	if code != 0 || strings.TrimSpace(out) != "1" {
		t.Fatalf("dsec grade: exit %d, reward %q; %s", code, out, errOut)
	}
	trust := receiptTrust(d.Root)
	out, errOut, code = d.CLI("", "--json", "receipt", "verify", "--ca", trust, file)
	if code != 0 {
		t.Fatalf("dsec receipt verify: exit %d: %s %s", code, out, errOut)
	}
	// Without --ca: the all-in-one's own node certificate is trusted (in
	// the root its token file is in); a cluster's receipts need --ca.
	o2, e2, c2 := d.CLI("", "receipt", "verify", file)
	if testutil.ClusterMode() {
		if c2 == 0 {
			t.Errorf("dsec receipt verify without --ca verified a cluster's receipt against a file of this machine: %s %s", o2, e2)
		}
	} else if c2 != 0 || !strings.Contains(e2, "trusting the all-in-one's node certificate "+trust) || !strings.Contains(o2, "verified") {
		t.Errorf("dsec receipt verify without --ca on the all-in-one: exit %d: %s %s", c2, o2, e2)
	}
	var verified []receipt.Receipt
	if err := json.Unmarshal([]byte(out), &verified); err != nil {
		t.Fatalf("dsec receipt verify --json: %v\n%s", err, out)
	}
	if len(verified) != 1 {
		t.Fatalf("dsec receipt verify --json: %d receipts, want 1", len(verified))
	}
	r := verified[0]
	if r.Node != "t1" || r.Sandbox != id || r.Reward != 1 || r.Exit != 0 || r.Outcome != "task" || r.Workspace == "" ||
		!strings.Contains(strings.Join(r.GraderCommand, " "), "/grade-tests/check.sh") {
		t.Errorf("the receipt says %+v; want node t1, sandbox %s, reward 1, exit 0, the grader's command", r, id)
	}
	// The node hashed the tests itself; the graded sandbox is its own (one
	// node in both passes), so it checked its trajectory and provenance too.
	if want := receipt.TestsDigest("", map[string][]byte{"/grade-tests/check.sh": check}); r.GraderDigest != want {
		t.Errorf("the receipt's grader digest %q, want %q", r.GraderDigest, want)
	}
	for _, f := range []string{"grader_digest", "trajectory_hash", "provenance_flags", "workspace_digest", "reward"} {
		if !slices.Contains(r.Vouched, f) {
			t.Errorf("the receipt's vouched %v leaves out %s", r.Vouched, f)
		}
	}
	if r.Trajectory == "" {
		t.Error("the receipt holds no trajectory hash")
	}

	raw, err := os.ReadFile(file)
	if err != nil {
		t.Fatal(err)
	}
	var env receipt.Envelope
	if err := json.Unmarshal(raw, &env); err != nil {
		t.Fatal(err)
	}
	// An edited field fails.
	edited := env
	edited.Payload = bytes.Replace(env.Payload, []byte(`"reward":1`), []byte(`"reward":0`), 1)
	if bytes.Equal(edited.Payload, env.Payload) {
		t.Fatalf("the receipt's payload holds no reward of 1: %s", env.Payload)
	}
	checkRefused(t, d, dir, "edited", edited, "does not match the payload")
	// So does a grader digest edited, or a field taken out of vouched.
	for name, e := range map[string][2]string{
		"edited tests":   {`"grader_digest":"files:sha256:`, `"grader_digest":"files:sha256:0`},
		"edited vouched": {`"grader_digest",`, ``},
	} {
		edited := env
		edited.Payload = bytes.Replace(env.Payload, []byte(e[0]), []byte(e[1]), 1)
		if bytes.Equal(edited.Payload, env.Payload) {
			t.Fatalf("the receipt's payload holds no %s: %s", e[0], env.Payload)
		}
		checkRefused(t, d, dir, name, edited, "does not match the payload")
	}

	// The same receipt, signed by a key not from the trust.
	var foreign *receipt.Signer
	var want string
	if testutil.ClusterMode() {
		pki := filepath.Join(dir, "other-pki")
		if err := clustertls.InitCluster(pki, []string{"api"}, []clustertls.EdgeSpec{{Name: "t1", Hosts: []string{"127.0.0.1"}}}); err != nil {
			t.Fatal(err)
		}
		foreign, err = ireceipt.EdgeSigner(clustertls.ComponentFiles(pki, clustertls.RoleEdge, "t1"))
		want = "not issued by the given CA"
	} else {
		foreign, err = ireceipt.NodeSigner(filepath.Join(dir, "other-node"), "t1")
		want = "not the given node certificate"
	}
	if err != nil {
		t.Fatal(err)
	}
	var payload receipt.Receipt
	if err := json.Unmarshal(env.Payload, &payload); err != nil {
		t.Fatal(err)
	}
	resigned, err := foreign.Sign(payload)
	if err != nil {
		t.Fatal(err)
	}
	var other receipt.Envelope
	if err := json.Unmarshal(resigned, &other); err != nil {
		t.Fatal(err)
	}
	checkRefused(t, d, dir, "signed by a foreign key", other, want)
}

// checkRefused writes env and checks dsec receipt verify refuses it (exit
// 1), saying want.
func checkRefused(t *testing.T, d *testutil.Daemon, dir, name string, env receipt.Envelope, want string) {
	t.Helper()
	data, err := json.Marshal(env)
	if err != nil {
		t.Fatal(err)
	}
	file := filepath.Join(dir, strings.ReplaceAll(name, " ", "-")+".json")
	if err := os.WriteFile(file, data, 0o644); err != nil {
		t.Fatal(err)
	}
	out, errOut, code := d.CLI("", "receipt", "verify", "--ca", receiptTrust(d.Root), file)
	if code != 1 || !strings.Contains(out+errOut, want) {
		t.Errorf("dsec receipt verify of the receipt %s: exit %d, %s %s; want exit 1 saying %q", name, code, out, errOut, want)
	}
}

package receipt

import (
	"bytes"
	"encoding/json"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"dsec.dev/dsec/internal/clustertls"
	"dsec.dev/dsec/internal/sandboxid"
	sdkreceipt "dsec.dev/dsec/sdk/go/receipt"
)

// TestAttestation: a node's attestation of its sandbox, verified against
// the cluster's CA, vouches for a receipt's trajectory hash and provenance
// flags when it says the same, reported since the grade began; an edited
// one, one signed by another cluster's node of the same name, by another
// node of the cluster (for a sandbox that is not its own, or naming the
// sandbox's node), or signed before the grade began vouches for nothing.
func TestAttestation(t *testing.T) {
	dir, other := t.TempDir(), t.TempDir()
	edges := []clustertls.EdgeSpec{{Name: "e1"}, {Name: "e2"}}
	if err := clustertls.InitCluster(dir, nil, edges); err != nil {
		t.Fatal(err)
	}
	if err := clustertls.InitCluster(other, nil, edges); err != nil {
		t.Fatal(err)
	}
	signer := func(pki, node string) *sdkreceipt.Signer {
		s, err := EdgeSigner(clustertls.ComponentFiles(pki, clustertls.RoleEdge, node))
		if err != nil {
			t.Fatal(err)
		}
		return s
	}
	e1, e2, foreign := signer(dir, "e1"), signer(dir, "e2"), signer(other, "e2")
	v, err := sdkreceipt.NewVerifierFile(filepath.Join(dir, "ca.crt"))
	if err != nil {
		t.Fatal(err)
	}

	sb := sandboxid.New("e2", 2, 1)
	started := time.Now().UTC()
	r := sample()
	r.Sandbox = sb
	r.Trajectory = "sha256:" + strings.Repeat("ab", 32) + "@123"
	r.Provenance = []string{"tests_modified", "network_denied"}
	r.Started = started
	a := Attestation{Sandbox: sb, Trajectory: r.Trajectory, Provenance: []string{"network_denied", "tests_modified"}, Reported: started.Add(time.Second)}
	since := started.Add(-2 * time.Second)

	good, err := Attest(e2, a)
	if err != nil {
		t.Fatal(err)
	}
	fields, err := Vouches(v, good, r, since)
	if err != nil || !slices.Equal(fields, []string{"trajectory_hash", "provenance_flags"}) {
		t.Fatalf("the sandbox's node's attestation vouches for %v (%v), want trajectory_hash and provenance_flags", fields, err)
	}

	// Each of these vouches for nothing, saying why.
	var env sdkreceipt.Envelope
	if err := json.Unmarshal(good, &env); err != nil {
		t.Fatal(err)
	}
	edited := env
	edited.Payload = bytes.Replace(env.Payload, []byte(`"tests_modified"`), []byte(`"none_of_them"`), 1)
	if bytes.Equal(edited.Payload, env.Payload) {
		t.Fatalf("no flag to edit in %s", env.Payload)
	}
	editedJSON, _ := json.Marshal(edited)
	fromForeign, err := Attest(foreign, a)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := Attest(e1, a); err == nil {
		t.Error("node e1 attested a sandbox of node e2")
	}
	// Another node of the cluster signing as if it held the sandbox:
	// naming itself, or naming the sandbox's node.
	signedAs := func(s *sdkreceipt.Signer, node string, at time.Time) []byte {
		b := a
		b.Version, b.Node, b.AttestedAt = 1, node, at
		p, err := json.Marshal(b)
		if err != nil {
			t.Fatal(err)
		}
		env, err := s.SignPayload(AttestationType, p)
		if err != nil {
			t.Fatal(err)
		}
		return env
	}
	payload := func(node string) []byte { return signedAs(e1, node, time.Now().UTC()) }
	// The sandbox's own node, but signed before this grade began: an
	// earlier grade's attestation, replayed.
	earlier := signedAs(e2, "e2", started.Add(-time.Minute))
	otherSandbox := a
	otherSandbox.Sandbox = sandboxid.New("e2", 2, 1)
	ofOther, err := Attest(e2, otherSandbox)
	if err != nil {
		t.Fatal(err)
	}
	for _, c := range []struct {
		name, data, want string
	}{
		{"an edited attestation", string(editedJSON), "does not match the payload"},
		{"another cluster's node", string(fromForeign), "not issued by the given CA"},
		{"another node's certificate, naming itself", string(payload("e1")), "not its own"},
		{"another node's certificate, naming the sandbox's node", string(payload("e2")), `signed by node "e1"'s certificate`},
		{"an attestation of another sandbox", string(ofOther), "not the graded"},
		{"a receipt", string(mustSign(t, e2, r)), "payload type"},
		{"an attestation from before the grade", string(earlier), "before the grade began"},
	} {
		fields, err := Vouches(v, []byte(c.data), r, since)
		if len(fields) != 0 || err == nil || !strings.Contains(err.Error(), c.want) {
			t.Errorf("%s vouches for %v (%v), want nothing and an error saying %q", c.name, fields, err, c.want)
		}
	}

	// What it says that the receipt does not is not vouched for.
	for _, c := range []struct {
		name string
		edit func(a *Attestation)
		want []string
	}{
		{"another trajectory", func(a *Attestation) { a.Trajectory = "sha256:" + strings.Repeat("cd", 32) + "@123" }, []string{"provenance_flags"}},
		{"a longer trajectory", func(a *Attestation) { a.Trajectory = strings.TrimSuffix(a.Trajectory, "123") + "124" }, []string{"provenance_flags"}},
		{"no trajectory", func(a *Attestation) { a.Trajectory = "" }, []string{"provenance_flags"}},
		{"other flags", func(a *Attestation) { a.Provenance = a.Provenance[:1] }, []string{"trajectory_hash"}},
		{"a report from before the grade", func(a *Attestation) { a.Reported = started.Add(-time.Minute) }, []string{"trajectory_hash"}},
		{"no report", func(a *Attestation) { a.Reported, a.Provenance = time.Time{}, nil }, []string{"trajectory_hash"}},
	} {
		b := a
		c.edit(&b)
		data, err := Attest(e2, b)
		if err != nil {
			t.Fatal(err)
		}
		fields, err := Vouches(v, data, r, since)
		if !slices.Equal(fields, c.want) || err == nil {
			t.Errorf("an attestation of %s vouches for %v (%v), want %v and why not the rest", c.name, fields, err, c.want)
		}
	}
}

func mustSign(t *testing.T, s *sdkreceipt.Signer, r sdkreceipt.Receipt) []byte {
	t.Helper()
	env, err := s.Sign(r)
	if err != nil {
		t.Fatal(err)
	}
	return env
}

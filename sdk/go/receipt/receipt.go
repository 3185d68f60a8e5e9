// Package receipt holds dsec's signed grade receipts: what a grade ran on,
// what it ran and what it found, signed by the node that ran it, so a reward
// can be checked offline, long after, by someone who trusts only the
// cluster's CA (or the all-in-one node's certificate).
//
// A signed receipt is a DSSE envelope (the in-toto/Sigstore "Dead Simple
// Signing Envelope"): the receipt's JSON, base64 in payload, its payload type
// PayloadType, and one ECDSA P-256 signature (ASN.1 DER over the SHA-256 of
// DSSE's pre-authentication encoding of type and payload), with the signer's
// certificate (PEM) beside it in certificates. The signature covers the
// payload's exact bytes, so no canonical JSON is needed: any edit of any
// field changes those bytes and fails Verify.
//
// The package lives beside the SDK, not under internal, so a user's Go
// program verifies receipts without server code; the edge signs through
// internal/receipt, which loads its key.
package receipt

import (
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"slices"
	"strconv"
	"strings"
	"time"
)

// PayloadType is the DSSE payload type of a dsec receipt.
const PayloadType = "application/vnd.dsec.receipt.v1+json"

// Version is the receipt format this package writes and reads.
const Version = 1

// Receipt is what one grade attests. Empty fields are ones the grade did not
// have (docs/receipts.md says which each grade fills).
type Receipt struct {
	// Version is the receipt format, Version.
	Version int `json:"version"`
	// Sandbox is the graded sandbox; GradeSandbox the clean room the grader
	// ran in.
	Sandbox      string `json:"sandbox"`
	GradeSandbox string `json:"grade_sandbox,omitempty"`
	// Image names the environment; Layers are its layers' digests, bottom
	// first.
	Image  string   `json:"image,omitempty"`
	Layers []string `json:"layers"`
	// Workspace is the digest of the workspace capture the grade ran on, and
	// Paths the paths it captured.
	Workspace string   `json:"workspace_digest"`
	Paths     []string `json:"paths,omitempty"`
	// Trajectory is the hash of the sandbox's trajectory, when it has one.
	Trajectory string `json:"trajectory_hash,omitempty"`
	// GraderCommand is the grader's command line; GraderDigest the digest of
	// the trusted tests it ran with (a layer digest, or of the files).
	GraderCommand []string `json:"grader_command"`
	GraderDigest  string   `json:"grader_digest,omitempty"`
	// Exit is the grader's exit code and Reward the reward read from it.
	Exit   int     `json:"exit"`
	Reward float64 `json:"reward"`
	// Provenance are the provenance flags raised on the graded sandbox.
	Provenance []string `json:"provenance_flags"`
	// Outcome is "task" when the grader ran to its end, or "fault" when the
	// platform ended it; Fault then names the fault (internal/outcome's
	// names, as the API's Fault), and Reward means nothing.
	Outcome string `json:"outcome"`
	Fault   string `json:"fault,omitempty"`
	// Started and Finished bound the grade.
	Started  time.Time `json:"started"`
	Finished time.Time `json:"finished"`
	// Node is the node that ran the grade and signed this; its certificate
	// names it (dsec://edge/NODE).
	Node string `json:"node"`
	// SignedAt is when the node signed; the certificate must be valid then.
	SignedAt time.Time `json:"signed_at"`
	// Vouched names the fields (by their JSON names, in Fields' order) the
	// node checked against what it saw itself before it signed; the others
	// it signed as the apiserver composed them. docs/receipts.md says which
	// a node can check and when.
	Vouched []string `json:"vouched,omitempty"`
}

// Fields are a receipt's fields by their JSON names, in order.
var Fields = []string{
	"version", "sandbox", "grade_sandbox", "image", "layers", "workspace_digest", "paths",
	"trajectory_hash", "grader_command", "grader_digest", "exit", "reward", "provenance_flags",
	"outcome", "fault", "started", "finished", "node", "signed_at", "vouched",
}

// TestsDigest is the digest of a grade's trusted tests, as a receipt's
// GraderDigest names them: the tests' layer as the grade named it (its ref
// or digest), and "files:sha256:" and the SHA-256 of the files, each path
// and content length-prefixed ("LEN:PATH" then "LEN:" and the bytes), in
// path order, joined by "+"; "" for no tests. A verifier holding the test
// files computes it again.
func TestsDigest(layer string, files map[string][]byte) string {
	if len(files) == 0 {
		return layer
	}
	paths := make([]string, 0, len(files))
	for p := range files {
		paths = append(paths, p)
	}
	slices.Sort(paths)
	h := sha256.New()
	for _, p := range paths {
		fmt.Fprintf(h, "%d:%s%d:", len(p), p, len(files[p]))
		h.Write(files[p])
	}
	d := "files:sha256:" + hex.EncodeToString(h.Sum(nil))
	if layer != "" {
		d = layer + "+" + d
	}
	return d
}

// TestsLayer is the layer part of a GraderDigest TestsDigest made: "" when
// it names files only.
func TestsLayer(digest string) string {
	if strings.HasPrefix(digest, "files:sha256:") {
		return ""
	}
	if i := strings.LastIndex(digest, "+files:sha256:"); i >= 0 {
		return digest[:i]
	}
	return digest
}

// Envelope is a signed receipt as it is stored and sent: DSSE's envelope
// with the signer's certificate chain, leaf first, in PEM.
type Envelope struct {
	PayloadType  string      `json:"payloadType"`
	Payload      []byte      `json:"payload"`
	Signatures   []Signature `json:"signatures"`
	Certificates []string    `json:"certificates"`
}

// Signature is one DSSE signature; KeyID is the hex SHA-256 of the signing
// certificate's DER.
type Signature struct {
	KeyID string `json:"keyid"`
	Sig   []byte `json:"sig"`
}

// pae is DSSE's pre-authentication encoding of a payload type and body:
// "DSSEv1 LEN(type) type LEN(body) body", lengths in ASCII decimal.
func pae(payloadType string, body []byte) []byte {
	b := make([]byte, 0, len(payloadType)+len(body)+32)
	b = append(b, "DSSEv1 "...)
	b = strconv.AppendInt(b, int64(len(payloadType)), 10)
	b = append(b, ' ')
	b = append(b, payloadType...)
	b = append(b, ' ')
	b = strconv.AppendInt(b, int64(len(body)), 10)
	b = append(b, ' ')
	return append(b, body...)
}

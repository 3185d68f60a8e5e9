package receipt

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"slices"
	"time"

	"dsec.dev/dsec/internal/sandboxid"
	sdkreceipt "dsec.dev/dsec/sdk/go/receipt"
)

// AttestationType is the DSSE payload type of a node's attestation.
const AttestationType = "application/vnd.dsec.attestation.v1+json"

// Attestation is what a node says, signed with its receipt key, of one of
// its sandboxes at one moment (EdgeService.Attest): the evidence a receipt
// carries of a graded sandbox, for a clean room's node that does not hold
// that sandbox to check (docs/receipts.md).
type Attestation struct {
	Version int    `json:"version"`
	Sandbox string `json:"sandbox"`
	// Node is the node that holds the sandbox and signed; its certificate
	// names it, and so does the sandbox's ID.
	Node string `json:"node"`
	// Trajectory is the hash of the first SIZE bytes of the sandbox's
	// trajectory, sha256:HEX@SIZE as a receipt's; "" when the node records
	// none.
	Trajectory string `json:"trajectory_hash"`
	// Provenance are the flags of the newest provenance report the node
	// made of the sandbox, at Reported; a zero Reported means it made none
	// it still keeps, and Provenance then says nothing.
	Provenance []string  `json:"provenance_flags"`
	Reported   time.Time `json:"reported_at"`
	// AttestedAt is when the node signed; its certificate must have been
	// valid then.
	AttestedAt time.Time `json:"attested_at"`
}

// Attest stamps a with the signer's node, the format's version and the
// time and signs it, refusing a sandbox that is not the signer's node's.
func Attest(s *sdkreceipt.Signer, a Attestation) ([]byte, error) {
	if node, err := sandboxid.Node(a.Sandbox); err != nil || node != s.Node() {
		return nil, fmt.Errorf("attest sandbox %s: not a sandbox of node %s", a.Sandbox, s.Node())
	}
	a.Version = 1
	a.Node = s.Node()
	a.AttestedAt = time.Now().UTC().Truncate(time.Microsecond)
	if a.Provenance == nil {
		a.Provenance = []string{}
	}
	payload, err := json.Marshal(a)
	if err != nil {
		return nil, fmt.Errorf("attest sandbox %s: encode: %w", a.Sandbox, err)
	}
	env, err := s.SignPayload(AttestationType, payload)
	if err != nil {
		return nil, fmt.Errorf("attest sandbox %s: %w", a.Sandbox, err)
	}
	return env, nil
}

// VerifyAttestation checks a signed attestation against the trust v
// holds (the cluster's CA; the all-in-one's node certificate) and returns
// what it says. It fails unless the signature matches the payload with the
// key of the envelope's certificate, that certificate is trusted and was
// valid when the attestation says it was signed, and the node it names is
// both the attestation's and the one that holds the sandbox (the node its
// ID names): a node attests only its own sandboxes.
func VerifyAttestation(v *sdkreceipt.Verifier, data []byte) (*Attestation, error) {
	o, err := v.Open(data, AttestationType)
	if err != nil {
		return nil, fmt.Errorf("verify attestation: %w", err)
	}
	var a Attestation
	d := json.NewDecoder(bytes.NewReader(o.Payload))
	d.DisallowUnknownFields()
	if err := d.Decode(&a); err != nil {
		return nil, fmt.Errorf("verify attestation: payload: %w", err)
	}
	if o.Err != nil {
		return nil, fmt.Errorf("verify attestation: %w", o.Err)
	}
	if a.Version != 1 {
		return nil, fmt.Errorf("verify attestation: format version %d, want 1", a.Version)
	}
	if a.Node != o.Node {
		return nil, fmt.Errorf("verify attestation: it names node %q but is signed by node %q's certificate", a.Node, o.Node)
	}
	if node, err := sandboxid.Node(a.Sandbox); err != nil || node != o.Node {
		return nil, fmt.Errorf("verify attestation: node %s attests sandbox %s, which is not its own", o.Node, a.Sandbox)
	}
	if err := o.ValidAt(a.AttestedAt); err != nil {
		return nil, fmt.Errorf("verify attestation: %w", err)
	}
	return &a, nil
}

// Vouches returns the fields of receipt r that a signed attestation of its
// graded sandbox vouches for, in the receipt's field order: its
// trajectory_hash when the attestation's is the same (and not empty), its
// provenance_flags when the node reported exactly those flags at or after
// since (the grade's start, less the clocks' skew). None, with the reason,
// when the attestation does not verify (VerifyAttestation), is of another
// sandbox, or was signed before since: an attestation of an earlier grade
// of the sandbox, replayed, is not this grade's.
func Vouches(v *sdkreceipt.Verifier, data []byte, r sdkreceipt.Receipt, since time.Time) ([]string, error) {
	a, err := VerifyAttestation(v, data)
	if err != nil {
		return nil, err
	}
	if a.Sandbox != r.Sandbox {
		return nil, fmt.Errorf("the attestation is of sandbox %s, not the graded %s", a.Sandbox, r.Sandbox)
	}
	if a.AttestedAt.Before(since) {
		return nil, fmt.Errorf("node %s attested %s at %s, before the grade began (%s): an earlier grade's attestation, not this one's",
			a.Node, a.Sandbox, a.AttestedAt.Format(time.RFC3339Nano), since.Format(time.RFC3339Nano))
	}
	var fields []string
	var why []error
	switch {
	case r.Trajectory == "":
	case a.Trajectory != r.Trajectory:
		why = append(why, fmt.Errorf("node %s attests trajectory %q, not %q", a.Node, a.Trajectory, r.Trajectory))
	default:
		fields = append(fields, "trajectory_hash")
	}
	switch {
	case a.Reported.IsZero():
		why = append(why, fmt.Errorf("node %s keeps no provenance report of %s", a.Node, a.Sandbox))
	case a.Reported.Before(since):
		why = append(why, fmt.Errorf("node %s's newest provenance report of %s is from %s, before the grade began", a.Node, a.Sandbox, a.Reported.Format(time.RFC3339Nano)))
	case !slices.Equal(slices.Sorted(slices.Values(a.Provenance)), slices.Sorted(slices.Values(r.Provenance))):
		why = append(why, fmt.Errorf("node %s attests provenance flags %v, not %v", a.Node, a.Provenance, r.Provenance))
	default:
		fields = append(fields, "provenance_flags")
	}
	return fields, errors.Join(why...)
}

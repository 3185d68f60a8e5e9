package receipt

import (
	"bytes"
	"crypto"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/sha256"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/json"
	"math/big"
	"net/url"
	"reflect"
	"strings"
	"testing"
	"time"
)

// testCA is a CA made for a test, issuing node certificates as the
// cluster's CA does (a dsec://edge/NODE URI SAN).
type testCA struct {
	cert *x509.Certificate
	key  *ecdsa.PrivateKey
}

func newKey(t testing.TB) *ecdsa.PrivateKey {
	t.Helper()
	k, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	return k
}

func newCA(t testing.TB) *testCA {
	t.Helper()
	key := newKey(t)
	tmpl := &x509.Certificate{
		SerialNumber:          big.NewInt(1),
		Subject:               pkix.Name{CommonName: "test CA"},
		NotBefore:             time.Now().Add(-24 * time.Hour),
		NotAfter:              time.Now().Add(24 * time.Hour),
		KeyUsage:              x509.KeyUsageCertSign | x509.KeyUsageDigitalSignature,
		BasicConstraintsValid: true,
		IsCA:                  true,
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, key.Public(), key)
	if err != nil {
		t.Fatal(err)
	}
	cert, err := x509.ParseCertificate(der)
	if err != nil {
		t.Fatal(err)
	}
	return &testCA{cert: cert, key: key}
}

// signer issues a node certificate valid from notBefore to notAfter and
// returns its Signer and certificate.
func (ca *testCA) signer(t testing.TB, node string, notBefore, notAfter time.Time) (*Signer, *x509.Certificate) {
	t.Helper()
	key := newKey(t)
	tmpl := &x509.Certificate{
		SerialNumber: big.NewInt(time.Now().UnixNano()),
		Subject:      pkix.Name{CommonName: node},
		NotBefore:    notBefore,
		NotAfter:     notAfter,
		KeyUsage:     x509.KeyUsageDigitalSignature,
		ExtKeyUsage:  []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth, x509.ExtKeyUsageClientAuth},
		URIs:         []*url.URL{{Scheme: "dsec", Host: "edge", Path: "/" + node}},
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, ca.cert, key.Public(), ca.key)
	if err != nil {
		t.Fatal(err)
	}
	s, err := NewSigner(key, [][]byte{der})
	if err != nil {
		t.Fatal(err)
	}
	return s, s.Certificate()
}

func (ca *testCA) validSigner(t testing.TB, node string) *Signer {
	s, _ := ca.signer(t, node, time.Now().Add(-time.Hour), time.Now().Add(time.Hour))
	return s
}

func sample() Receipt {
	start := time.Date(2026, 12, 6, 7, 0, 0, 0, time.UTC)
	return Receipt{
		Sandbox:       "sb-1",
		GradeSandbox:  "sb-2",
		Image:         "python",
		Layers:        []string{"sha256:aaaa", "sha256:bbbb"},
		Workspace:     "sha256:cccc",
		Paths:         []string{"/work/src"},
		Trajectory:    "sha256:dddd",
		GraderCommand: []string{"pytest", "-q"},
		GraderDigest:  "sha256:eeee",
		Exit:          0,
		Reward:        1,
		Provenance:    []string{"tests_edited"},
		Outcome:       "task",
		Started:       start,
		Finished:      start.Add(3 * time.Second),
	}
}

func verifier(t testing.TB, certs ...*x509.Certificate) *Verifier {
	t.Helper()
	v, err := NewVerifier(certs)
	if err != nil {
		t.Fatal(err)
	}
	return v
}

func sign(t testing.TB, s *Signer, r Receipt) []byte {
	t.Helper()
	out, err := s.Sign(r)
	if err != nil {
		t.Fatal(err)
	}
	return out
}

func TestSignVerify(t *testing.T) {
	ca := newCA(t)
	s := ca.validSigner(t, "node-1")
	r, err := verifier(t, ca.cert).Verify(sign(t, s, sample()))
	if err != nil {
		t.Fatal(err)
	}
	want := sample()
	if r.Node != "node-1" || r.Version != Version || r.SignedAt.IsZero() || r.Reward != want.Reward ||
		r.Workspace != want.Workspace || strings.Join(r.Layers, ",") != strings.Join(want.Layers, ",") {
		t.Fatalf("verified receipt %+v, want %+v with node-1 and a signing time", r, want)
	}
	// The node's own certificate, given instead of the CA, is trusted too.
	if _, err := verifier(t, s.Certificate()).Verify(sign(t, s, sample())); err != nil {
		t.Fatalf("verify against the node certificate: %v", err)
	}
}

// edit replaces one field's value in a signed receipt's payload bytes (all
// else byte for byte as signed), leaving the signature as it was.
func edit(t *testing.T, signed []byte, name string, val any) []byte {
	t.Helper()
	var env Envelope
	if err := json.Unmarshal(signed, &env); err != nil {
		t.Fatal(err)
	}
	var r map[string]json.RawMessage
	if err := json.Unmarshal(env.Payload, &r); err != nil {
		t.Fatal(err)
	}
	newVal, err := json.Marshal(val)
	if err != nil {
		t.Fatal(err)
	}
	if old, ok := r[name]; ok {
		from := []byte(`"` + name + `":` + string(old))
		to := []byte(`"` + name + `":` + string(newVal))
		if bytes.Count(env.Payload, from) != 1 {
			t.Fatalf("field %s not found once in %s", name, env.Payload)
		}
		env.Payload = bytes.Replace(env.Payload, from, to, 1)
	} else {
		env.Payload = append(env.Payload[:len(env.Payload)-1], []byte(`,"`+name+`":`+string(newVal)+`}`)...)
	}
	out, err := json.Marshal(env)
	if err != nil {
		t.Fatal(err)
	}
	return out
}

// fields is a signed receipt's payload as a JSON object.
func fields(t *testing.T, signed []byte) map[string]any {
	t.Helper()
	var env Envelope
	if err := json.Unmarshal(signed, &env); err != nil {
		t.Fatal(err)
	}
	var r map[string]any
	if err := json.Unmarshal(env.Payload, &r); err != nil {
		t.Fatal(err)
	}
	return r
}

// TestEditedFieldFails edits each field of a signed receipt in turn; every
// edit fails verification, saying the signature does not match.
func TestEditedFieldFails(t *testing.T) {
	ca := newCA(t)
	v := verifier(t, ca.cert)
	// A fault's receipt, so every field is present (a task's has no fault).
	r := sample()
	r.Outcome, r.Fault = "fault", "node_lost"
	r.Vouched = []string{"grader_digest", "trajectory_hash"}
	signed := sign(t, ca.validSigner(t, "node-1"), r)
	all := fields(t, signed)
	if len(all) != reflect.TypeFor[Receipt]().NumField() {
		t.Fatalf("the receipt has %d fields, want all of Receipt's: %v", len(all), all)
	}
	for name, val := range all {
		// Unchanged, the rewritten envelope still verifies: the edit below
		// fails for what it changes, not for the rewriting.
		if _, err := v.Verify(edit(t, signed, name, val)); err != nil {
			t.Fatalf("verify receipt with %s rewritten unchanged: %v", name, err)
		}
		t.Run(name, func(t *testing.T) {
			var changed any
			switch x := val.(type) {
			case string:
				changed = x + "0"
				if ts, err := time.Parse(time.RFC3339Nano, x); err == nil {
					changed = ts.Add(time.Second).Format(time.RFC3339Nano)
				}
			case float64:
				changed = x + 1
			case []any:
				changed = append(x, "x")
			default:
				t.Fatalf("field %s is a %T", name, val)
			}
			_, err := v.Verify(edit(t, signed, name, changed))
			if err == nil || !strings.Contains(err.Error(), "signature does not match") {
				t.Fatalf("verify with %s edited: %v, want the signature not matching", name, err)
			}
		})
	}
	t.Run("added field", func(t *testing.T) {
		_, err := v.Verify(edit(t, signed, "bonus", 1))
		if err == nil {
			t.Fatal("a field added to the payload verified")
		}
	})
	t.Run("signature", func(t *testing.T) {
		other := sign(t, ca.validSigner(t, "node-1"), sample())
		var a, b map[string]any
		_ = json.Unmarshal(signed, &a)
		_ = json.Unmarshal(other, &b)
		a["signatures"] = b["signatures"]
		out, _ := json.Marshal(a)
		if _, err := v.Verify(out); err == nil {
			t.Fatal("another signature verified")
		}
	})
}

// TestFields: Fields names every field of a Receipt, by its JSON name, in
// order; a receipt whose vouched names anything else, or a field twice,
// is refused though its signature holds.
func TestFields(t *testing.T) {
	rt := reflect.TypeFor[Receipt]()
	var names []string
	for i := range rt.NumField() {
		name, _, _ := strings.Cut(rt.Field(i).Tag.Get("json"), ",")
		names = append(names, name)
	}
	if !reflect.DeepEqual(names, Fields) {
		t.Errorf("Fields %v, want Receipt's %v", Fields, names)
	}
	ca := newCA(t)
	v := verifier(t, ca.cert)
	for _, vouched := range [][]string{{"reward", "bonus"}, {"reward", "reward"}} {
		r := sample()
		r.Vouched = vouched
		_, err := v.Verify(sign(t, ca.validSigner(t, "node-1"), r))
		if err == nil || !strings.Contains(err.Error(), "not a receipt field or is named twice") {
			t.Errorf("verify a receipt vouching %v: %v, want refused", vouched, err)
		}
	}
}

func TestWrongCA(t *testing.T) {
	ca, other := newCA(t), newCA(t)
	signed := sign(t, ca.validSigner(t, "node-1"), sample())
	_, err := verifier(t, other.cert).Verify(signed)
	if err == nil || !strings.Contains(err.Error(), "not issued by the given CA") {
		t.Fatalf("verify against another CA: %v, want not issued by it", err)
	}
	// Another node's certificate pinned does not vouch for node-1's.
	_, err = verifier(t, ca.validSigner(t, "node-2").Certificate()).Verify(signed)
	if err == nil || !strings.Contains(err.Error(), "not the given node certificate") {
		t.Fatalf("verify against another node's certificate: %v", err)
	}
}

// TestSwappedCertificate puts another node's certificate (of the same CA)
// in the envelope: the signature is not its key's.
func TestSwappedCertificate(t *testing.T) {
	ca := newCA(t)
	signed := sign(t, ca.validSigner(t, "node-1"), sample())
	other := sign(t, ca.validSigner(t, "node-2"), sample())
	var a, b map[string]any
	_ = json.Unmarshal(signed, &a)
	_ = json.Unmarshal(other, &b)
	a["certificates"] = b["certificates"]
	out, _ := json.Marshal(a)
	_, err := verifier(t, ca.cert).Verify(out)
	if err == nil {
		t.Fatal("a receipt with another node's certificate verified")
	}
	// With the key id fixed up too, the signature still fails.
	a["signatures"].([]any)[0].(map[string]any)["keyid"] = b["signatures"].([]any)[0].(map[string]any)["keyid"]
	out, _ = json.Marshal(a)
	_, err = verifier(t, ca.cert).Verify(out)
	if err == nil || !strings.Contains(err.Error(), "signature does not match") {
		t.Fatalf("verify with another node's certificate and key id: %v", err)
	}
}

func TestExpiredCertificate(t *testing.T) {
	ca := newCA(t)
	now := time.Now()
	// A certificate that expired before the signing: refused.
	s, _ := ca.signer(t, "node-1", now.Add(-3*time.Hour), now.Add(-time.Hour))
	_, err := verifier(t, ca.cert).Verify(sign(t, s, sample()))
	if err == nil || !strings.Contains(err.Error(), "was not valid") {
		t.Fatalf("verify a receipt signed with an expired certificate: %v", err)
	}
	// Not yet valid at the signing: refused alike.
	s, _ = ca.signer(t, "node-1", now.Add(time.Hour), now.Add(3*time.Hour))
	_, err = verifier(t, ca.cert).Verify(sign(t, s, sample()))
	if err == nil || !strings.Contains(err.Error(), "was not valid") {
		t.Fatalf("verify a receipt signed before its certificate was valid: %v", err)
	}
	// A receipt signed while valid still verifies after the certificate
	// expires: the verifier checks the signing time. Shown by a certificate
	// valid for a second around the signing, checked after it.
	s, _ = ca.signer(t, "node-1", now.Add(-time.Minute), time.Now().Add(time.Second))
	signed := sign(t, s, sample())
	time.Sleep(1100 * time.Millisecond)
	if _, err := verifier(t, ca.cert).Verify(signed); err != nil {
		t.Fatalf("verify a receipt whose certificate has expired since: %v", err)
	}
}

// TestOtherNode signs, with node-1's key, a payload naming node-2: the
// signature holds but the certificate names another node.
func TestOtherNode(t *testing.T) {
	ca := newCA(t)
	s := ca.validSigner(t, "node-1")
	r := sample()
	r.Version, r.Node, r.SignedAt = Version, "node-2", time.Now().UTC()
	payload, err := json.Marshal(r)
	if err != nil {
		t.Fatal(err)
	}
	sum := sha256.Sum256(pae(PayloadType, payload))
	sig, err := s.key.Sign(rand.Reader, sum[:], crypto.SHA256)
	if err != nil {
		t.Fatal(err)
	}
	out, err := json.Marshal(Envelope{PayloadType: PayloadType, Payload: payload,
		Signatures: []Signature{{KeyID: s.keyID, Sig: sig}}, Certificates: s.chain})
	if err != nil {
		t.Fatal(err)
	}
	_, err = verifier(t, ca.cert).Verify(out)
	if err == nil || !strings.Contains(err.Error(), `names node "node-2" but is signed by node "node-1"`) {
		t.Fatalf("verify a receipt naming another node than its signer: %v", err)
	}
}

func TestMalformed(t *testing.T) {
	ca := newCA(t)
	v := verifier(t, ca.cert)
	for name, data := range map[string]string{
		"empty":    "",
		"not json": "receipt",
		"no certs": `{"payloadType":"` + PayloadType + `","payload":"e30=","signatures":[{"keyid":"","sig":""}],"certificates":[]}`,
		"type":     `{"payloadType":"text/plain","payload":"e30=","signatures":[],"certificates":[]}`,
	} {
		if _, err := v.Verify([]byte(data)); err == nil {
			t.Errorf("%s verified", name)
		}
	}
	if _, err := NewVerifier(nil); err == nil {
		t.Error("a verifier trusting nothing was made")
	}
}

// BenchmarkSign signs one receipt per iteration with a node's ECDSA P-256
// key (target: ≤ 1 ms each).
func BenchmarkSign(b *testing.B) {
	s := newCA(b).validSigner(b, "node-1")
	r := sample()
	for b.Loop() {
		if _, err := s.Sign(r); err != nil {
			b.Fatal(err)
		}
	}
	b.ReportMetric(float64(b.Elapsed().Microseconds())/float64(b.N), "µs/sign")
}

// BenchmarkVerify10k verifies 10,000 distinct receipts of one node per
// iteration with one Verifier, as a trainer checks a run's receipts (target:
// ≤ 1 s), one by one and with VerifyAll. Beside each it times the floor in
// the same iteration: 10,000 bare ECDSA P-256 verifications of a digest, what
// no receipt format can go below with the edges' keys; floor-x is the ratio.
func BenchmarkVerify10k(b *testing.B) {
	ca := newCA(b)
	s := ca.validSigner(b, "node-1")
	signed := make([][]byte, 10000)
	digests := make([][32]byte, len(signed))
	sigs := make([][]byte, len(signed))
	pub := s.leaf.PublicKey.(*ecdsa.PublicKey)
	for i := range signed {
		r := sample()
		r.Reward = float64(i)
		signed[i] = sign(b, s, r)
		digests[i] = sha256.Sum256(signed[i])
		sig, err := s.key.Sign(rand.Reader, digests[i][:], crypto.SHA256)
		if err != nil {
			b.Fatal(err)
		}
		sigs[i] = sig
	}
	v := verifier(b, ca.cert)
	floor := func() time.Duration {
		start := time.Now()
		for i := range digests {
			if !ecdsa.VerifyASN1(pub, digests[i][:], sigs[i]) {
				b.Fatal("floor signature does not verify")
			}
		}
		return time.Since(start)
	}
	run := func(b *testing.B, verify func()) {
		var took, floors time.Duration
		for b.Loop() {
			start := time.Now()
			verify()
			took += time.Since(start)
			floors += floor()
		}
		b.ReportMetric(took.Seconds()/float64(b.N), "s/10k")
		b.ReportMetric(floors.Seconds()/float64(b.N), "floor-s/10k")
		b.ReportMetric(took.Seconds()/floors.Seconds(), "floor-x")
	}
	b.Run("one by one", func(b *testing.B) {
		run(b, func() {
			for _, data := range signed {
				if _, err := v.Verify(data); err != nil {
					b.Fatal(err)
				}
			}
		})
	})
	b.Run("VerifyAll", func(b *testing.B) {
		run(b, func() {
			_, errs := v.VerifyAll(signed)
			for _, err := range errs {
				if err != nil {
					b.Fatal(err)
				}
			}
		})
	})
}

package receipt

import (
	"bytes"
	"crypto/ecdsa"
	"crypto/sha256"
	"crypto/x509"
	"encoding/json"
	"encoding/pem"
	"errors"
	"fmt"
	"os"
	"runtime"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"time"
)

// Verifier checks signed receipts against the certificates it trusts: CA
// certificates (a receipt's certificate must be issued by one) or node
// certificates (a receipt must be signed by one of them exactly). It keeps
// each certificate chain it has checked, so verifying many receipts of one
// node checks the chain once. It is safe for concurrent use.
type Verifier struct {
	roots  *x509.CertPool
	nroots int
	pinned map[string]bool // raw DER of trusted node certificates

	mu     sync.Mutex
	chains map[string]*chain // by the envelope's certificates, joined
}

// chain is a checked certificate chain: its leaf's key and node, and the
// window in which every certificate of it is valid; err is why it is not
// trusted, when it is not.
type chain struct {
	leaf     *x509.Certificate
	pub      *ecdsa.PublicKey
	node     string
	keyID    string
	from, to time.Time
	err      error
}

// NewVerifier makes a Verifier trusting the given certificates: each a CA
// certificate (trusted to issue node certificates) or a node's own (a leaf,
// as the all-in-one's self-issued one). It needs at least one.
func NewVerifier(certs []*x509.Certificate) (*Verifier, error) {
	v := &Verifier{roots: x509.NewCertPool(), pinned: map[string]bool{}, chains: map[string]*chain{}}
	for _, c := range certs {
		if c.IsCA && c.BasicConstraintsValid {
			v.roots.AddCert(c)
			v.nroots++
		} else {
			v.pinned[string(c.Raw)] = true
		}
	}
	if v.nroots == 0 && len(v.pinned) == 0 {
		return nil, errors.New("make receipt verifier: no CA or node certificate to trust")
	}
	return v, nil
}

// NewVerifierFile is NewVerifier with the PEM certificates of a file (a CA
// bundle, or a node's certificate).
func NewVerifierFile(path string) (*Verifier, error) {
	data, err := os.ReadFile(path)
	if err != nil {
		return nil, fmt.Errorf("make receipt verifier: %w", err)
	}
	certs, err := parsePEM(data)
	if err != nil {
		return nil, fmt.Errorf("make receipt verifier: %s: %w", path, err)
	}
	return NewVerifier(certs)
}

// VerifyFile reads a signed receipt from a file and verifies it.
func (v *Verifier) VerifyFile(path string) (*Receipt, error) {
	data, err := os.ReadFile(path)
	if err != nil {
		return nil, fmt.Errorf("verify receipt: %w", err)
	}
	return v.Verify(data)
}

// Verify checks a signed receipt (an Envelope's JSON) and returns the receipt
// it signs. It fails, saying why, unless: the signature verifies over the
// payload's exact bytes with the key of the envelope's certificate; that
// certificate is trusted (issued by a trusted CA, or a trusted node
// certificate itself) and was valid when the receipt says it was signed; the
// receipt names the node the certificate names; and the receipt is well
// formed. A certificate that has expired since the signing does not fail it:
// a receipt is a record of what was true then.
func (v *Verifier) Verify(data []byte) (*Receipt, error) {
	o, err := v.open(data, PayloadType, "receipt")
	if err != nil {
		return nil, fmt.Errorf("verify receipt: %w", err)
	}
	var r Receipt
	if err := strictDecode(o.Payload, &r); err != nil {
		return nil, fmt.Errorf("verify receipt: payload: %w", err)
	}
	if err := o.Err; err != nil {
		return nil, fmt.Errorf("verify receipt: %w", err)
	}
	if r.Node != o.Node {
		return nil, fmt.Errorf("verify receipt: it names node %q but is signed by node %q's certificate", r.Node, o.Node)
	}
	if err := o.ValidAt(r.SignedAt); err != nil {
		return nil, fmt.Errorf("verify receipt: %w", err)
	}
	if err := r.check(); err != nil {
		return nil, fmt.Errorf("verify receipt: %w", err)
	}
	return &r, nil
}

// Opened is a signed envelope whose signature matches its payload: the
// payload, the node the signing certificate names, and the window in
// which that certificate (and its chain) is valid. Err, when not nil, is
// why the certificate is not trusted: the payload is then anyone's word.
type Opened struct {
	Payload  []byte
	Node     string
	From, To time.Time
	Err      error
}

// ValidAt says whether the signing certificate was valid at t, the time
// the payload says it was signed.
func (o *Opened) ValidAt(t time.Time) error {
	if t.Before(o.From) || t.After(o.To) {
		return fmt.Errorf("signed at %s, when node %s's certificate was not valid (valid %s to %s)",
			t.Format(time.RFC3339), o.Node, o.From.UTC().Format(time.RFC3339), o.To.UTC().Format(time.RFC3339))
	}
	return nil
}

// Open checks the signature of an envelope of payload type payloadType
// against the key of its certificate and returns the payload with the
// certificate's node and trust (Opened.Err), for a caller that decodes
// the payload and checks its time against the certificate (ValidAt), as
// Verify does for a receipt. It fails for an envelope of another type,
// not one signature, or a signature that does not match the payload.
func (v *Verifier) Open(data []byte, payloadType string) (*Opened, error) {
	return v.open(data, payloadType, "statement")
}

// open is Open, its errors naming what the envelope signs.
func (v *Verifier) open(data []byte, payloadType, what string) (*Opened, error) {
	var env Envelope
	if err := strictDecode(data, &env); err != nil {
		return nil, fmt.Errorf("not a signed %s envelope: %w", what, err)
	}
	if env.PayloadType != payloadType {
		return nil, fmt.Errorf("payload type %q, want %q", env.PayloadType, payloadType)
	}
	if len(env.Signatures) != 1 {
		return nil, fmt.Errorf("%d signatures, want one", len(env.Signatures))
	}
	if len(env.Certificates) == 0 {
		return nil, errors.New("no signer certificate in the envelope")
	}
	c, err := v.chain(env.Certificates)
	if err != nil {
		return nil, err
	}
	sig := env.Signatures[0]
	if sig.KeyID != c.keyID {
		return nil, fmt.Errorf("signature key id %s is not the certificate's %s", sig.KeyID, c.keyID)
	}
	sum := sha256.Sum256(pae(env.PayloadType, env.Payload))
	if !ecdsa.VerifyASN1(c.pub, sum[:], sig.Sig) {
		return nil, fmt.Errorf("the signature does not match the payload: the %s was edited after node %s signed it, or another key signed it", what, c.node)
	}
	return &Opened{Payload: env.Payload, Node: c.node, From: c.from, To: c.to, Err: c.err}, nil
}

// VerifyAll verifies many signed receipts on every CPU (GOMAXPROCS
// goroutines) and returns, for each, its receipt or why it failed.
func (v *Verifier) VerifyAll(signed [][]byte) ([]*Receipt, []error) {
	receipts, errs := make([]*Receipt, len(signed)), make([]error, len(signed))
	var next atomic.Int64
	var wg sync.WaitGroup
	for range min(runtime.GOMAXPROCS(0), len(signed)) {
		wg.Go(func() {
			for i := int(next.Add(1) - 1); i < len(signed); i = int(next.Add(1) - 1) {
				receipts[i], errs[i] = v.Verify(signed[i])
			}
		})
	}
	wg.Wait()
	return receipts, errs
}

// check refuses a receipt whose fields contradict each other.
func (r *Receipt) check() error {
	if r.Version != Version {
		return fmt.Errorf("format version %d, want %d", r.Version, Version)
	}
	switch {
	case r.Outcome == "task" && r.Fault == "":
	case r.Outcome == "fault" && r.Fault != "":
	default:
		return fmt.Errorf("outcome %q with fault %q: want task with no fault, or fault with one", r.Outcome, r.Fault)
	}
	seen := map[string]bool{}
	for _, f := range r.Vouched {
		if !slices.Contains(Fields, f) || seen[f] {
			return fmt.Errorf("vouched names %q, which is not a receipt field or is named twice", f)
		}
		seen[f] = true
	}
	if r.Finished.Before(r.Started) {
		return fmt.Errorf("finished %s before it started %s", r.Finished.Format(time.RFC3339Nano), r.Started.Format(time.RFC3339Nano))
	}
	return nil
}

// chain returns the checked chain of an envelope's certificates, checking
// it the first time. An untrusted chain is returned with its err set, so the
// caller still says whether the signature itself holds.
func (v *Verifier) chain(pems []string) (*chain, error) {
	key := strings.Join(pems, "")
	v.mu.Lock()
	c := v.chains[key]
	v.mu.Unlock()
	if c != nil {
		return c, nil
	}
	certs, err := parsePEM([]byte(key))
	if err != nil {
		return nil, fmt.Errorf("signer certificates: %w", err)
	}
	leaf := certs[0]
	pub, ok := leaf.PublicKey.(*ecdsa.PublicKey)
	if !ok {
		return nil, fmt.Errorf("signer certificate holds a %T key, want ECDSA", leaf.PublicKey)
	}
	node, err := nodeOf(leaf)
	if err != nil {
		return nil, err
	}
	c = &chain{leaf: leaf, pub: pub, node: node, keyID: fingerprint(leaf), from: leaf.NotBefore, to: leaf.NotAfter}
	c.err = v.trust(c, certs)
	v.mu.Lock()
	v.chains[key] = c
	v.mu.Unlock()
	return c, nil
}

// trust checks the chain against the trusted certificates, at a time when
// every certificate of it is valid, and narrows c's window to that of the
// whole chain; each receipt's signing time is checked against the window.
func (v *Verifier) trust(c *chain, certs []*x509.Certificate) error {
	if v.pinned[string(c.leaf.Raw)] {
		return nil
	}
	if v.nroots == 0 {
		return fmt.Errorf("node %s's certificate (%s) is not the given node certificate", c.node, c.keyID)
	}
	inter := x509.NewCertPool()
	for _, ic := range certs[1:] {
		inter.AddCert(ic)
	}
	chains, err := c.leaf.Verify(x509.VerifyOptions{
		Roots:         v.roots,
		Intermediates: inter,
		CurrentTime:   c.leaf.NotBefore,
		KeyUsages:     []x509.ExtKeyUsage{x509.ExtKeyUsageAny},
	})
	if err != nil {
		return fmt.Errorf("node %s's certificate is not issued by the given CA: %w", c.node, err)
	}
	for _, ic := range chains[0][1:] {
		if ic.NotBefore.After(c.from) {
			c.from = ic.NotBefore
		}
		if ic.NotAfter.Before(c.to) {
			c.to = ic.NotAfter
		}
	}
	return nil
}

func strictDecode(data []byte, v any) error {
	d := json.NewDecoder(bytes.NewReader(data))
	d.DisallowUnknownFields()
	if err := d.Decode(v); err != nil {
		return err
	}
	if d.More() {
		return errors.New("trailing data after the JSON value")
	}
	return nil
}

// parsePEM reads every CERTIFICATE block of PEM data; it refuses data with
// none, or with blocks of another type.
func parsePEM(data []byte) ([]*x509.Certificate, error) {
	var certs []*x509.Certificate
	for rest := data; ; {
		var block *pem.Block
		block, rest = pem.Decode(rest)
		if block == nil {
			break
		}
		if block.Type != "CERTIFICATE" {
			return nil, fmt.Errorf("PEM block %q, want CERTIFICATE", block.Type)
		}
		c, err := x509.ParseCertificate(block.Bytes)
		if err != nil {
			return nil, fmt.Errorf("parse certificate: %w", err)
		}
		certs = append(certs, c)
	}
	if len(certs) == 0 {
		return nil, errors.New("no PEM certificate")
	}
	return certs, nil
}

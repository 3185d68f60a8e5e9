package receipt

import (
	"crypto"
	"crypto/ecdsa"
	"crypto/rand"
	"crypto/sha256"
	"crypto/x509"
	"encoding/hex"
	"encoding/json"
	"encoding/pem"
	"errors"
	"fmt"
	"time"
)

// Signer signs receipts with a node's key. It is safe for concurrent use.
type Signer struct {
	key   crypto.Signer
	leaf  *x509.Certificate
	chain []string // PEM, leaf first
	keyID string
	node  string
}

// NewSigner makes a Signer from a key and its certificate chain (DER, leaf
// first). The leaf must hold the key's public half, an ECDSA P-256 key, and
// name its node in a dsec://edge/NODE URI SAN; receipts it signs carry that
// node.
func NewSigner(key crypto.Signer, chain [][]byte) (*Signer, error) {
	if len(chain) == 0 {
		return nil, errors.New("make receipt signer: no certificate")
	}
	leaf, err := x509.ParseCertificate(chain[0])
	if err != nil {
		return nil, fmt.Errorf("make receipt signer: parse certificate: %w", err)
	}
	pub, ok := key.Public().(*ecdsa.PublicKey)
	if !ok {
		return nil, fmt.Errorf("make receipt signer: a %T key, want ECDSA P-256", key.Public())
	}
	if !pub.Equal(leaf.PublicKey) {
		return nil, errors.New("make receipt signer: the key is not the certificate's")
	}
	node, err := nodeOf(leaf)
	if err != nil {
		return nil, fmt.Errorf("make receipt signer: %w", err)
	}
	s := &Signer{key: key, leaf: leaf, keyID: fingerprint(leaf), node: node}
	for _, der := range chain {
		s.chain = append(s.chain, string(pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der})))
	}
	return s, nil
}

// Node is the node the signer's certificate names.
func (s *Signer) Node() string { return s.node }

// Certificate is the signer's certificate; callers must not modify it.
func (s *Signer) Certificate() *x509.Certificate { return s.leaf }

// Sign stamps r with the signer's node, the format's version and the time,
// and returns the signed envelope's JSON.
func (s *Signer) Sign(r Receipt) ([]byte, error) {
	r.Version = Version
	r.Node = s.node
	r.SignedAt = time.Now().UTC().Truncate(time.Microsecond)
	if r.Layers == nil {
		r.Layers = []string{}
	}
	if r.GraderCommand == nil {
		r.GraderCommand = []string{}
	}
	if r.Provenance == nil {
		r.Provenance = []string{}
	}
	payload, err := json.Marshal(r)
	if err != nil {
		return nil, fmt.Errorf("sign receipt: encode: %w", err)
	}
	out, err := s.SignPayload(PayloadType, payload)
	if err != nil {
		return nil, fmt.Errorf("sign receipt: %w", err)
	}
	return out, nil
}

// SignPayload signs payload, of DSSE payload type payloadType, as Sign
// signs a receipt's, and returns the envelope's JSON. It is for the other
// statements a node signs with its receipt key (a node's attestation of
// a sandbox it holds); a verifier opens them with Verifier.Open.
func (s *Signer) SignPayload(payloadType string, payload []byte) ([]byte, error) {
	sum := sha256.Sum256(pae(payloadType, payload))
	sig, err := s.key.Sign(rand.Reader, sum[:], crypto.SHA256)
	if err != nil {
		return nil, fmt.Errorf("sign: %w", err)
	}
	env := Envelope{
		PayloadType:  payloadType,
		Payload:      payload,
		Signatures:   []Signature{{KeyID: s.keyID, Sig: sig}},
		Certificates: s.chain,
	}
	out, err := json.MarshalIndent(env, "", "  ")
	if err != nil {
		return nil, fmt.Errorf("encode envelope: %w", err)
	}
	return append(out, '\n'), nil
}

func fingerprint(c *x509.Certificate) string {
	sum := sha256.Sum256(c.Raw)
	return hex.EncodeToString(sum[:])
}

// nodeOf reads the node from a certificate's dsec://edge/NODE URI SAN.
func nodeOf(c *x509.Certificate) (string, error) {
	var nodes []string
	for _, u := range c.URIs {
		if u.Scheme == "dsec" && u.Host == "edge" && len(u.Path) > 1 {
			nodes = append(nodes, u.Path[1:])
		}
	}
	if len(nodes) != 1 {
		return "", fmt.Errorf("certificate %q names %d nodes (dsec://edge/NODE URI SANs), want one", c.Subject.CommonName, len(nodes))
	}
	return nodes[0], nil
}

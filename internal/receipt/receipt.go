// Package receipt gives a node the key it signs grade receipts with: an
// edge's certificate and key from the cluster CA (internal/clustertls), or,
// for the all-in-one, which has no cluster CA, a node key made once and kept
// in its root with a certificate it issues itself. The receipt format,
// signing and verification are in sdk/go/receipt, so users verify without
// server code.
package receipt

import (
	"crypto"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"errors"
	"fmt"
	"io/fs"
	"math/big"
	"net/url"
	"os"
	"path/filepath"
	"time"

	"dsec.dev/dsec/internal/clustertls"
	sdkreceipt "dsec.dev/dsec/sdk/go/receipt"
)

// Dir is the directory under an all-in-one's root that holds its node key
// (node.key, 0600) and self-issued certificate (node.crt, 0644).
const Dir = "receipt"

// nodeValidity is how long an all-in-one's self-issued certificate is valid.
// Its receipts verify after it expires (a receipt is checked at its signing
// time); a node past it makes a new key (NodeSigner).
const nodeValidity = 10 * 365 * 24 * time.Hour

// EdgeSigner is the signer of an edge of a cluster: its leaf certificate and
// key from the cluster CA, as the edge serves TLS with.
func EdgeSigner(files clustertls.Files) (*sdkreceipt.Signer, error) {
	pair, err := tls.LoadX509KeyPair(files.Cert, files.Key)
	if err != nil {
		return nil, fmt.Errorf("load edge receipt key: %w", err)
	}
	key, ok := pair.PrivateKey.(crypto.Signer)
	if !ok {
		return nil, fmt.Errorf("load edge receipt key: a %T key cannot sign", pair.PrivateKey)
	}
	s, err := sdkreceipt.NewSigner(key, pair.Certificate)
	if err != nil {
		return nil, fmt.Errorf("load edge receipt key: %w", err)
	}
	return s, nil
}

// NodeSigner is the signer of an all-in-one node named node whose root is
// root: the key and certificate in root/receipt, made there the first time
// (and again if the certificate has expired or names another node; the old
// pair is kept beside as node.crt.old/node.key.old, so receipts it signed
// still verify against it).
func NodeSigner(root, node string) (*sdkreceipt.Signer, error) {
	dir := filepath.Join(root, Dir)
	certPath, keyPath := filepath.Join(dir, "node.crt"), filepath.Join(dir, "node.key")
	s, err := EdgeSigner(clustertls.Files{Cert: certPath, Key: keyPath})
	switch {
	case err == nil && s.Node() == node && time.Now().Before(s.Certificate().NotAfter):
		return s, nil
	case err == nil:
		for _, p := range []string{certPath, keyPath} {
			if err := os.Rename(p, p+".old"); err != nil {
				return nil, fmt.Errorf("make node receipt key: keep the old one: %w", err)
			}
		}
	case !errors.Is(err, fs.ErrNotExist):
		return nil, err
	}
	if err := makeNodeKey(dir, node); err != nil {
		return nil, err
	}
	return EdgeSigner(clustertls.Files{Cert: certPath, Key: keyPath})
}

// makeNodeKey writes a new ECDSA P-256 key and a self-issued certificate
// naming dsec://edge/NODE into dir.
func makeNodeKey(dir, node string) error {
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return fmt.Errorf("make node receipt key: %w", err)
	}
	serial, err := rand.Int(rand.Reader, new(big.Int).Lsh(big.NewInt(1), 127))
	if err != nil {
		return fmt.Errorf("make node receipt key: serial: %w", err)
	}
	now := time.Now()
	tmpl := &x509.Certificate{
		SerialNumber:          serial.Add(serial, big.NewInt(1)),
		Subject:               pkix.Name{CommonName: node, OrganizationalUnit: []string{"receipts"}, Organization: []string{"dsec"}},
		NotBefore:             now.Add(-5 * time.Minute),
		NotAfter:              now.Add(nodeValidity),
		KeyUsage:              x509.KeyUsageDigitalSignature,
		BasicConstraintsValid: true,
		URIs:                  []*url.URL{{Scheme: "dsec", Host: string(clustertls.RoleEdge), Path: "/" + node}},
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, key.Public(), key)
	if err != nil {
		return fmt.Errorf("make node receipt key: certificate: %w", err)
	}
	keyDER, err := x509.MarshalPKCS8PrivateKey(key)
	if err != nil {
		return fmt.Errorf("make node receipt key: encode: %w", err)
	}
	certPEM := pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der})
	keyPEM := pem.EncodeToMemory(&pem.Block{Type: "PRIVATE KEY", Bytes: keyDER})
	if err := clustertls.WriteCert(dir, "node", certPEM, keyPEM); err != nil {
		return fmt.Errorf("make node receipt key: %w", err)
	}
	return nil
}

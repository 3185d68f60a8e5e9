package clustertls

import (
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
	"net"
	"net/url"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"time"

	"dsec.dev/dsec/internal/errdefs"
)

// File names of the CA inside its directory.
const (
	caCertFile = "ca.crt"
	caKeyFile  = "ca.key"
)

// backdate is how far before now a certificate becomes valid, so a peer whose
// clock runs a little behind accepts a certificate issued a moment ago.
const backdate = 5 * time.Minute

// CA is a loaded cluster certificate authority: its certificate and private
// key. It is safe for concurrent use.
type CA struct {
	cert *x509.Certificate
	key  *ecdsa.PrivateKey
}

// Certificate is the CA's certificate; callers must not modify it.
func (ca *CA) Certificate() *x509.Certificate { return ca.cert }

// CertPEM is the CA's certificate in PEM, as it goes into a CA bundle.
func (ca *CA) CertPEM() []byte {
	return pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: ca.cert.Raw})
}

// InitCA creates a CA named name in dir: dir/ca.crt (0644) and dir/ca.key
// (0600), an ECDSA P-256 key and a self-signed certificate valid for
// validity. dir is created 0700 if missing; an existing dir keeps its mode.
// InitCA never overwrites: if either file exists it returns an error wrapping
// errdefs.ErrAlreadyExists and leaves both alone.
func InitCA(dir, name string, validity time.Duration) error {
	if strings.TrimSpace(name) == "" {
		return fmt.Errorf("init CA in %s: empty name: %w", dir, errdefs.ErrInvalidArgument)
	}
	if validity <= 0 {
		return fmt.Errorf("init CA %q: validity %s is not positive: %w", name, validity, errdefs.ErrInvalidArgument)
	}
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return fmt.Errorf("init CA %q: create directory: %w", name, err)
	}
	keyPath, certPath := filepath.Join(dir, caKeyFile), filepath.Join(dir, caCertFile)
	for _, p := range []string{keyPath, certPath} {
		if _, err := os.Lstat(p); err == nil {
			return fmt.Errorf("init CA %q: %s already exists; a CA is never overwritten, use another directory to make a new one: %w", name, p, errdefs.ErrAlreadyExists)
		} else if !errors.Is(err, fs.ErrNotExist) {
			return fmt.Errorf("init CA %q: %w", name, err)
		}
	}

	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return fmt.Errorf("init CA %q: generate key: %w", name, err)
	}
	now := time.Now()
	tmpl := &x509.Certificate{
		SerialNumber:          newSerial(),
		Subject:               pkix.Name{CommonName: name, Organization: []string{"dsec"}},
		NotBefore:             now.Add(-backdate),
		NotAfter:              now.Add(validity),
		KeyUsage:              x509.KeyUsageCertSign | x509.KeyUsageCRLSign | x509.KeyUsageDigitalSignature,
		BasicConstraintsValid: true,
		IsCA:                  true,
		// Leaves only: the cluster has no intermediate CAs.
		MaxPathLen:     0,
		MaxPathLenZero: true,
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, key.Public(), key)
	if err != nil {
		return fmt.Errorf("init CA %q: create certificate: %w", name, err)
	}
	keyPEM, err := encodeKey(key)
	if err != nil {
		return fmt.Errorf("init CA %q: %w", name, err)
	}
	if err := writeNew(keyPath, keyPEM, 0o600); err != nil {
		return fmt.Errorf("init CA %q: %w", name, err)
	}
	if err := writeNew(certPath, pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der}), 0o644); err != nil {
		_ = os.Remove(keyPath) // ours: writeNew just created it
		return fmt.Errorf("init CA %q: %w", name, err)
	}
	return syncDir(dir)
}

// LoadCA loads the CA that InitCA made in dir. ca.crt must hold exactly the
// CA's own certificate (a bundle of several CAs is for peers, not for the CA
// directory) and ca.key its matching key.
func LoadCA(dir string) (*CA, error) {
	certPath, keyPath := filepath.Join(dir, caCertFile), filepath.Join(dir, caKeyFile)
	certs, err := readCerts(certPath)
	if err != nil {
		return nil, fmt.Errorf("load CA: %w", err)
	}
	if len(certs) != 1 {
		return nil, fmt.Errorf("load CA: %s holds %d certificates, want only the CA's own: %w", certPath, len(certs), errdefs.ErrInvalidArgument)
	}
	cert := certs[0]
	if !cert.IsCA || !cert.BasicConstraintsValid {
		return nil, fmt.Errorf("load CA: %s is not a CA certificate: %w", certPath, errdefs.ErrInvalidArgument)
	}
	keyPEM, err := os.ReadFile(keyPath)
	if err != nil {
		return nil, fmt.Errorf("load CA: %w", notFound(err))
	}
	key, err := decodeKey(keyPEM)
	if err != nil {
		return nil, fmt.Errorf("load CA: %s: %w", keyPath, err)
	}
	if !key.PublicKey.Equal(cert.PublicKey) {
		return nil, fmt.Errorf("load CA: %s is not the key of %s: %w", keyPath, certPath, errdefs.ErrInvalidArgument)
	}
	return &CA{cert: cert, key: key}, nil
}

// Issue makes a leaf certificate and its new ECDSA P-256 key for the
// component name of role, valid from now for validity. The identity goes into
// the URI SAN dsec://ROLE/NAME; hosts (DNS names and IP addresses) go into
// the DNS and IP SANs, for the addresses the component serves on; they may be
// empty. Every leaf can serve and dial (server and client extended key
// usage). The validity may not run past the CA's own.
func (ca *CA) Issue(role Role, name string, hosts []string, validity time.Duration) (certPEM, keyPEM []byte, err error) {
	if validity <= 0 {
		return nil, nil, fmt.Errorf("issue certificate for %s %s: validity %s is not positive: %w", role, name, validity, errdefs.ErrInvalidArgument)
	}
	now := time.Now()
	return ca.issue(role, name, hosts, now.Add(-backdate), now.Add(validity))
}

// issue is Issue with explicit bounds, so tests can make certificates that
// are expired or not yet valid.
func (ca *CA) issue(role Role, name string, hosts []string, notBefore, notAfter time.Time) (certPEM, keyPEM []byte, err error) {
	if err := checkRole(role); err != nil {
		return nil, nil, fmt.Errorf("issue certificate for %s: %w", name, err)
	}
	if err := checkName(name); err != nil {
		return nil, nil, fmt.Errorf("issue certificate for %s: %w", role, err)
	}
	id := Identity{Role: role, Name: name}
	dnsNames, ips, err := splitHosts(hosts)
	if err != nil {
		return nil, nil, fmt.Errorf("issue certificate for %s: %w", id, err)
	}
	if notAfter.After(ca.cert.NotAfter) {
		return nil, nil, fmt.Errorf("issue certificate for %s: it would be valid until %s, after the CA %q expires at %s; make a new CA: %w",
			id, notAfter.UTC().Format(time.RFC3339), ca.cert.Subject.CommonName, ca.cert.NotAfter.UTC().Format(time.RFC3339), errdefs.ErrInvalidArgument)
	}
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return nil, nil, fmt.Errorf("issue certificate for %s: generate key: %w", id, err)
	}
	tmpl := &x509.Certificate{
		SerialNumber: newSerial(),
		// For people reading the certificate; peers go by the URI SAN.
		Subject:               pkix.Name{CommonName: name, OrganizationalUnit: []string{string(role)}, Organization: []string{"dsec"}},
		NotBefore:             notBefore,
		NotAfter:              notAfter,
		KeyUsage:              x509.KeyUsageDigitalSignature,
		ExtKeyUsage:           []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth, x509.ExtKeyUsageClientAuth},
		BasicConstraintsValid: true,
		URIs:                  []*url.URL{identityURI(role, name)},
		DNSNames:              dnsNames,
		IPAddresses:           ips,
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, ca.cert, key.Public(), ca.key)
	if err != nil {
		return nil, nil, fmt.Errorf("issue certificate for %s: %w", id, err)
	}
	keyPEM, err = encodeKey(key)
	if err != nil {
		return nil, nil, fmt.Errorf("issue certificate for %s: %w", id, err)
	}
	return pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der}), keyPEM, nil
}

// WriteCert writes a leaf and its key as dir/base.crt (0644) and dir/base.key
// (0600), creating dir 0700 if missing. Each file is replaced atomically
// (written aside, then renamed), so a running component that reloads them
// never reads half a file; the key is written first. certPEM and keyPEM must
// be a pair.
func WriteCert(dir, base string, certPEM, keyPEM []byte) error {
	if err := checkName(base); err != nil {
		return fmt.Errorf("write certificate: base %w", err)
	}
	if _, err := tls.X509KeyPair(certPEM, keyPEM); err != nil {
		return fmt.Errorf("write certificate %s: the key does not match the certificate: %v: %w", base, err, errdefs.ErrInvalidArgument)
	}
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return fmt.Errorf("write certificate %s: create directory: %w", base, err)
	}
	if err := writeReplace(filepath.Join(dir, base+".key"), keyPEM, 0o600); err != nil {
		return fmt.Errorf("write certificate %s: %w", base, err)
	}
	if err := writeReplace(filepath.Join(dir, base+".crt"), certPEM, 0o644); err != nil {
		return fmt.Errorf("write certificate %s: %w", base, err)
	}
	return syncDir(dir)
}

// splitHosts sorts hosts into DNS names and IP addresses, refusing anything
// that is neither, and drops duplicates.
func splitHosts(hosts []string) (dnsNames []string, ips []net.IP, err error) {
	for _, h := range hosts {
		if ip := net.ParseIP(h); ip != nil {
			if !slices.ContainsFunc(ips, ip.Equal) {
				ips = append(ips, ip)
			}
			continue
		}
		if !validDNSName(h) {
			return nil, nil, fmt.Errorf("check host %q: neither an IP address nor a DNS name: %w", h, errdefs.ErrInvalidArgument)
		}
		h = strings.ToLower(strings.TrimSuffix(h, "."))
		if !slices.Contains(dnsNames, h) {
			dnsNames = append(dnsNames, h)
		}
	}
	return dnsNames, ips, nil
}

func validDNSName(h string) bool {
	h = strings.TrimSuffix(h, ".")
	if h == "" || len(h) > 253 {
		return false
	}
	labels := strings.Split(h, ".")
	for i, l := range labels {
		if l == "*" && i == 0 && len(labels) > 1 {
			continue
		}
		if l == "" || len(l) > 63 || l[0] == '-' || l[len(l)-1] == '-' {
			return false
		}
		for _, c := range l {
			if !(c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z' || c >= '0' && c <= '9' || c == '-') {
				return false
			}
		}
	}
	return true
}

func newSerial() *big.Int {
	// 128 random bits; rand.Int does not fail with crypto/rand's reader.
	n, _ := rand.Int(rand.Reader, new(big.Int).Lsh(big.NewInt(1), 128))
	return n.Add(n, big.NewInt(1)) // serials are positive
}

func encodeKey(key *ecdsa.PrivateKey) ([]byte, error) {
	der, err := x509.MarshalPKCS8PrivateKey(key)
	if err != nil {
		return nil, fmt.Errorf("encode key: %w", err)
	}
	return pem.EncodeToMemory(&pem.Block{Type: "PRIVATE KEY", Bytes: der}), nil
}

// decodeKey reads an ECDSA key in PKCS#8 or SEC 1 PEM.
func decodeKey(data []byte) (*ecdsa.PrivateKey, error) {
	block, _ := pem.Decode(data)
	if block == nil {
		return nil, fmt.Errorf("decode key: no PEM block: %w", errdefs.ErrInvalidArgument)
	}
	switch block.Type {
	case "PRIVATE KEY":
		k, err := x509.ParsePKCS8PrivateKey(block.Bytes)
		if err != nil {
			return nil, fmt.Errorf("decode key: %v: %w", err, errdefs.ErrInvalidArgument)
		}
		ek, ok := k.(*ecdsa.PrivateKey)
		if !ok {
			return nil, fmt.Errorf("decode key: a %T, want ECDSA: %w", k, errdefs.ErrInvalidArgument)
		}
		return ek, nil
	case "EC PRIVATE KEY":
		k, err := x509.ParseECPrivateKey(block.Bytes)
		if err != nil {
			return nil, fmt.Errorf("decode key: %v: %w", err, errdefs.ErrInvalidArgument)
		}
		return k, nil
	}
	return nil, fmt.Errorf("decode key: PEM block %q, want PRIVATE KEY: %w", block.Type, errdefs.ErrInvalidArgument)
}

// readCerts reads every CERTIFICATE block of a PEM file; it refuses a file
// with none, or with blocks of another type.
func readCerts(path string) ([]*x509.Certificate, error) {
	data, err := os.ReadFile(path)
	if err != nil {
		return nil, notFound(err)
	}
	var certs []*x509.Certificate
	for rest := data; ; {
		var block *pem.Block
		block, rest = pem.Decode(rest)
		if block == nil {
			break
		}
		if block.Type != "CERTIFICATE" {
			return nil, fmt.Errorf("read %s: PEM block %q, want CERTIFICATE: %w", path, block.Type, errdefs.ErrInvalidArgument)
		}
		c, err := x509.ParseCertificate(block.Bytes)
		if err != nil {
			return nil, fmt.Errorf("read %s: %v: %w", path, err, errdefs.ErrInvalidArgument)
		}
		certs = append(certs, c)
	}
	if len(certs) == 0 {
		return nil, fmt.Errorf("read %s: no PEM certificate: %w", path, errdefs.ErrInvalidArgument)
	}
	return certs, nil
}

// notFound adds errdefs.ErrNotFound to a missing-file error.
func notFound(err error) error {
	if errors.Is(err, fs.ErrNotExist) {
		return fmt.Errorf("%w: %w", err, errdefs.ErrNotFound)
	}
	return err
}

// writeNew creates path with perm and data; it fails with
// errdefs.ErrAlreadyExists if path exists, and removes what it wrote if the
// write fails.
func writeNew(path string, data []byte, perm os.FileMode) error {
	f, err := os.OpenFile(path, os.O_WRONLY|os.O_CREATE|os.O_EXCL, perm)
	if errors.Is(err, fs.ErrExist) {
		return fmt.Errorf("create %s: %w", path, errdefs.ErrAlreadyExists)
	}
	if err != nil {
		return fmt.Errorf("create %s: %w", path, err)
	}
	err = f.Chmod(perm) // the umask must not loosen or tighten it
	if err == nil {
		_, err = f.Write(data)
	}
	if err == nil {
		err = f.Sync()
	}
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	if err != nil {
		_ = os.Remove(path)
		return fmt.Errorf("write %s: %w", path, err)
	}
	return nil
}

// writeReplace writes data to a temporary file beside path and renames it over
// path, so readers see the old file or the new one, never a mix.
func writeReplace(path string, data []byte, perm os.FileMode) error {
	f, err := os.CreateTemp(filepath.Dir(path), "."+filepath.Base(path)+".tmp-*")
	if err != nil {
		return fmt.Errorf("write %s: %w", path, err)
	}
	tmp := f.Name()
	err = f.Chmod(perm)
	if err == nil {
		_, err = f.Write(data)
	}
	if err == nil {
		err = f.Sync()
	}
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	if err == nil {
		err = os.Rename(tmp, path)
	}
	if err != nil {
		_ = os.Remove(tmp)
		return fmt.Errorf("write %s: %w", path, err)
	}
	return nil
}

// syncDir makes new directory entries durable.
func syncDir(dir string) error {
	d, err := os.Open(dir)
	if err != nil {
		return fmt.Errorf("sync directory %s: %w", dir, err)
	}
	defer d.Close()
	if err := d.Sync(); err != nil && !errors.Is(err, errors.ErrUnsupported) {
		return fmt.Errorf("sync directory %s: %w", dir, err)
	}
	return nil
}

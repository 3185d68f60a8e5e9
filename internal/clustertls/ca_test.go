package clustertls

import (
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/x509"
	"encoding/pem"
	"errors"
	"net"
	"net/url"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"dsec.dev/dsec/internal/errdefs"
)

func TestInitCA(t *testing.T) {
	dir := filepath.Join(t.TempDir(), "pki")
	if err := InitCA(dir, "test CA", time.Hour); err != nil {
		t.Fatal(err)
	}
	for path, want := range map[string]os.FileMode{
		dir:                          0o700,
		filepath.Join(dir, "ca.key"): 0o600,
		filepath.Join(dir, "ca.crt"): 0o644,
	} {
		if got := mode(t, path); got != want {
			t.Errorf("%s has mode %v, want %v", filepath.Base(path), got, want)
		}
	}
	ca, err := LoadCA(dir)
	if err != nil {
		t.Fatal(err)
	}
	c := ca.Certificate()
	if !c.IsCA || c.Subject.CommonName != "test CA" || c.PublicKeyAlgorithm != x509.ECDSA {
		t.Errorf("CA certificate: IsCA %v, CN %q, key %v", c.IsCA, c.Subject.CommonName, c.PublicKeyAlgorithm)
	}
	if k := ca.key; k.Curve != elliptic.P256() {
		t.Errorf("CA key on %v, want P-256", k.Curve.Params().Name)
	}
	if d := time.Until(c.NotAfter); d <= 0 || d > time.Hour {
		t.Errorf("CA valid for %v more, want up to an hour", d)
	}

	before, _ := os.ReadFile(filepath.Join(dir, "ca.key"))
	if err := InitCA(dir, "again", time.Hour); !errors.Is(err, errdefs.ErrAlreadyExists) {
		t.Errorf("second InitCA: %v, want already exists", err)
	}
	after, _ := os.ReadFile(filepath.Join(dir, "ca.key"))
	if string(before) != string(after) {
		t.Error("second InitCA changed ca.key")
	}
}

func TestInitCARefusesEitherFile(t *testing.T) {
	for _, file := range []string{"ca.crt", "ca.key"} {
		t.Run(file, func(t *testing.T) {
			dir := t.TempDir()
			if err := os.WriteFile(filepath.Join(dir, file), []byte("keep me"), 0o600); err != nil {
				t.Fatal(err)
			}
			if err := InitCA(dir, "CA", time.Hour); !errors.Is(err, errdefs.ErrAlreadyExists) {
				t.Fatalf("InitCA: %v, want already exists", err)
			}
			entries, _ := os.ReadDir(dir)
			if len(entries) != 1 {
				t.Errorf("InitCA left %d files, want only %s", len(entries), file)
			}
		})
	}
}

func TestInitCAArguments(t *testing.T) {
	for _, tt := range []struct {
		name     string
		ca       string
		validity time.Duration
	}{
		{"empty name", " ", time.Hour},
		{"zero validity", "CA", 0},
		{"negative validity", "CA", -time.Hour},
	} {
		t.Run(tt.name, func(t *testing.T) {
			dir := filepath.Join(t.TempDir(), "pki")
			if err := InitCA(dir, tt.ca, tt.validity); !errors.Is(err, errdefs.ErrInvalidArgument) {
				t.Errorf("InitCA: %v, want invalid argument", err)
			}
			if _, err := os.Stat(dir); err == nil {
				t.Error("InitCA created the directory for a refused call")
			}
		})
	}
}

func TestLoadCAErrors(t *testing.T) {
	a, b := t.TempDir(), t.TempDir()
	for _, d := range []string{a, b} {
		if err := InitCA(d, "CA", 24*time.Hour); err != nil {
			t.Fatal(err)
		}
	}
	copyFile := func(t *testing.T, from, to string) {
		data, err := os.ReadFile(from)
		if err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(to, data, 0o600); err != nil {
			t.Fatal(err)
		}
	}
	caA, err := LoadCA(a)
	if err != nil {
		t.Fatal(err)
	}
	leaf := issue(t, caA, RoleEdge, "node-1")

	tests := []struct {
		name  string
		setup func(t *testing.T, dir string)
		want  string
		kind  error
	}{
		{"missing", func(t *testing.T, dir string) {}, "ca.crt", errdefs.ErrNotFound},
		{"key missing", func(t *testing.T, dir string) {
			copyFile(t, filepath.Join(a, "ca.crt"), filepath.Join(dir, "ca.crt"))
		}, "ca.key", errdefs.ErrNotFound},
		{"key of another CA", func(t *testing.T, dir string) {
			copyFile(t, filepath.Join(a, "ca.crt"), filepath.Join(dir, "ca.crt"))
			copyFile(t, filepath.Join(b, "ca.key"), filepath.Join(dir, "ca.key"))
		}, "is not the key of", errdefs.ErrInvalidArgument},
		{"a bundle", func(t *testing.T, dir string) {
			if err := os.WriteFile(filepath.Join(dir, "ca.crt"), bundleOf(caA, caA), 0o644); err != nil {
				t.Fatal(err)
			}
			copyFile(t, filepath.Join(a, "ca.key"), filepath.Join(dir, "ca.key"))
		}, "holds 2 certificates", errdefs.ErrInvalidArgument},
		{"a leaf", func(t *testing.T, dir string) {
			if err := WriteCert(dir, "ca", leaf.cert, leaf.key); err != nil {
				t.Fatal(err)
			}
		}, "not a CA certificate", errdefs.ErrInvalidArgument},
		{"not PEM", func(t *testing.T, dir string) {
			if err := os.WriteFile(filepath.Join(dir, "ca.crt"), []byte("hello"), 0o644); err != nil {
				t.Fatal(err)
			}
		}, "no PEM certificate", errdefs.ErrInvalidArgument},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			dir := t.TempDir()
			tt.setup(t, dir)
			_, err := LoadCA(dir)
			if err == nil || !strings.Contains(err.Error(), tt.want) || !errors.Is(err, tt.kind) {
				t.Errorf("LoadCA: %v, want %v containing %q", err, tt.kind, tt.want)
			}
		})
	}
}

func TestIssue(t *testing.T) {
	ca := testCA(t, "CA")
	certPEM, keyPEM, err := ca.Issue(RoleEdge, "node-3", []string{"10.0.0.3", "node-3.internal", "Node-3.Internal.", "::1", "10.0.0.3"}, 2*time.Hour)
	if err != nil {
		t.Fatal(err)
	}
	b, _ := pem.Decode(certPEM)
	c, err := x509.ParseCertificate(b.Bytes)
	if err != nil {
		t.Fatal(err)
	}
	if len(c.URIs) != 1 || c.URIs[0].String() != "dsec://edge/node-3" {
		t.Errorf("URI SANs %v, want [dsec://edge/node-3]", c.URIs)
	}
	if !slices.Equal(c.ExtKeyUsage, []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth, x509.ExtKeyUsageClientAuth}) {
		t.Errorf("extended key usage %v, want server and client", c.ExtKeyUsage)
	}
	if !slices.Equal(c.DNSNames, []string{"node-3.internal"}) {
		t.Errorf("DNS SANs %v", c.DNSNames)
	}
	if len(c.IPAddresses) != 2 || !c.IPAddresses[0].Equal(net.ParseIP("10.0.0.3")) || !c.IPAddresses[1].Equal(net.IPv6loopback) {
		t.Errorf("IP SANs %v", c.IPAddresses)
	}
	if c.IsCA {
		t.Error("a leaf is a CA")
	}
	if err := c.CheckSignatureFrom(ca.Certificate()); err != nil {
		t.Error(err)
	}
	if d := c.NotAfter.Sub(c.NotBefore); d != 2*time.Hour+backdate {
		t.Errorf("valid for %v, want 2h and the backdating", d)
	}
	id, err := ParseIdentity(c)
	if err != nil || id.Role != RoleEdge || id.Name != "node-3" || id.URI() != "dsec://edge/node-3" || len(id.Fingerprint) != 64 {
		t.Errorf("identity %+v, %v", id, err)
	}
	kb, _ := pem.Decode(keyPEM)
	k, err := x509.ParsePKCS8PrivateKey(kb.Bytes)
	if err != nil {
		t.Fatal(err)
	}
	if ek, ok := k.(*ecdsa.PrivateKey); !ok || ek.Curve != elliptic.P256() || !ek.PublicKey.Equal(c.PublicKey) {
		t.Errorf("key %T does not match the certificate or is not P-256", k)
	}
}

func TestIssueArguments(t *testing.T) {
	ca := testCA(t, "CA")
	tests := []struct {
		name     string
		role     Role
		cn       string
		hosts    []string
		validity time.Duration
		want     string
	}{
		{"unknown role", Role("root"), "x", nil, time.Hour, `check role "root"`},
		{"empty name", RoleEdge, "", nil, time.Hour, "check component name"},
		{"slash in name", RoleEdge, "a/b", nil, time.Hour, "check component name"},
		{"dot first", RoleEdge, ".hidden", nil, time.Hour, "check component name"},
		{"bad host", RoleEdge, "n", []string{"not a host"}, time.Hour, `check host "not a host"`},
		{"zero validity", RoleEdge, "n", nil, 0, "not positive"},
		{"past the CA", RoleEdge, "n", nil, 48 * time.Hour, "after the CA \"CA\" expires"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			_, _, err := ca.Issue(tt.role, tt.cn, tt.hosts, tt.validity)
			if err == nil || !strings.Contains(err.Error(), tt.want) || !errors.Is(err, errdefs.ErrInvalidArgument) {
				t.Errorf("Issue: %v, want invalid argument containing %q", err, tt.want)
			}
		})
	}
}

func TestWriteCert(t *testing.T) {
	ca := testCA(t, "CA")
	p := issue(t, ca, RoleAPIServer, "api-1")
	dir := filepath.Join(t.TempDir(), "tls")
	if err := WriteCert(dir, "apiserver", p.cert, p.key); err != nil {
		t.Fatal(err)
	}
	for path, want := range map[string]os.FileMode{
		dir:                                 0o700,
		filepath.Join(dir, "apiserver.key"): 0o600,
		filepath.Join(dir, "apiserver.crt"): 0o644,
	} {
		if got := mode(t, path); got != want {
			t.Errorf("%s has mode %v, want %v", filepath.Base(path), got, want)
		}
	}
	// Replacing keeps the modes and leaves no temporary files.
	q := issue(t, ca, RoleAPIServer, "api-1")
	if err := WriteCert(dir, "apiserver", q.cert, q.key); err != nil {
		t.Fatal(err)
	}
	if got := mode(t, filepath.Join(dir, "apiserver.key")); got != 0o600 {
		t.Errorf("replaced key has mode %v", got)
	}
	got, _ := os.ReadFile(filepath.Join(dir, "apiserver.crt"))
	if string(got) != string(q.cert) {
		t.Error("the certificate was not replaced")
	}
	if entries, _ := os.ReadDir(dir); len(entries) != 2 {
		t.Errorf("%d files in the directory, want 2", len(entries))
	}

	if err := WriteCert(dir, "mixed", p.cert, q.key); !errors.Is(err, errdefs.ErrInvalidArgument) {
		t.Errorf("a mismatched pair: %v, want invalid argument", err)
	}
	if err := WriteCert(dir, "../up", p.cert, p.key); !errors.Is(err, errdefs.ErrInvalidArgument) {
		t.Errorf("a base with a slash: %v, want invalid argument", err)
	}
}

func TestParseIdentity(t *testing.T) {
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	certWith := func(t *testing.T, uris ...string) *x509.Certificate {
		tmpl := &x509.Certificate{SerialNumber: newSerial(), NotBefore: time.Now(), NotAfter: time.Now().Add(time.Hour)}
		for _, u := range uris {
			pu, err := url.Parse(u)
			if err != nil {
				t.Fatal(err)
			}
			tmpl.URIs = append(tmpl.URIs, pu)
		}
		der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, key.Public(), key)
		if err != nil {
			t.Fatal(err)
		}
		c, err := x509.ParseCertificate(der)
		if err != nil {
			t.Fatal(err)
		}
		return c
	}
	tests := []struct {
		name string
		uris []string
		want Identity // zero: an error
	}{
		{"edge", []string{"dsec://edge/node-3"}, Identity{Role: RoleEdge, Name: "node-3"}},
		{"apiserver beside other URIs", []string{"spiffe://x/y", "dsec://apiserver/api-1"}, Identity{Role: RoleAPIServer, Name: "api-1"}},
		{"none", nil, Identity{}},
		{"only another scheme", []string{"spiffe://edge/node-3"}, Identity{}},
		{"two", []string{"dsec://edge/a", "dsec://edge/b"}, Identity{}},
		{"unknown role", []string{"dsec://root/x"}, Identity{}},
		{"nested path", []string{"dsec://edge/a/b"}, Identity{}},
		{"no name", []string{"dsec://edge/"}, Identity{}},
		{"query", []string{"dsec://edge/a?x=1"}, Identity{}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			got, err := ParseIdentity(certWith(t, tt.uris...))
			if tt.want == (Identity{}) {
				if !errors.Is(err, errdefs.ErrUnauthenticated) {
					t.Errorf("ParseIdentity = %+v, %v; want unauthenticated", got, err)
				}
				return
			}
			got.Fingerprint = ""
			if err != nil || got != tt.want {
				t.Errorf("ParseIdentity = %+v, %v; want %+v", got, err, tt.want)
			}
		})
	}
}

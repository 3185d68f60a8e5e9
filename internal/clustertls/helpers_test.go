package clustertls

import (
	"bytes"
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"encoding/pem"
	"net"
	"os"
	"path/filepath"
	"testing"
	"time"
)

// testCA makes a CA valid for a day in a new directory and loads it.
func testCA(t *testing.T, name string) *CA {
	t.Helper()
	dir := filepath.Join(t.TempDir(), "ca")
	if err := InitCA(dir, name, 24*time.Hour); err != nil {
		t.Fatal(err)
	}
	ca, err := LoadCA(dir)
	if err != nil {
		t.Fatal(err)
	}
	return ca
}

// pair is a leaf certificate and its key, in PEM.
type pair struct{ cert, key []byte }

func issue(t *testing.T, ca *CA, role Role, name string, hosts ...string) pair {
	t.Helper()
	c, k, err := ca.Issue(role, name, hosts, time.Hour)
	if err != nil {
		t.Fatal(err)
	}
	return pair{c, k}
}

// issueAt issues a leaf valid from notBefore to notAfter relative to now.
func issueAt(t *testing.T, ca *CA, role Role, name string, notBefore, notAfter time.Duration) pair {
	t.Helper()
	now := time.Now()
	c, k, err := ca.issue(role, name, []string{"127.0.0.1"}, now.Add(notBefore), now.Add(notAfter))
	if err != nil {
		t.Fatal(err)
	}
	return pair{c, k}
}

func bundleOf(cas ...*CA) []byte {
	var b bytes.Buffer
	for _, ca := range cas {
		b.Write(ca.CertPEM())
	}
	return b.Bytes()
}

// component writes p and a bundle of cas to a new directory and returns their
// Files.
func component(t *testing.T, p pair, cas ...*CA) Files {
	t.Helper()
	dir := t.TempDir()
	if err := WriteCert(dir, "leaf", p.cert, p.key); err != nil {
		t.Fatal(err)
	}
	f := Files{Cert: filepath.Join(dir, "leaf.crt"), Key: filepath.Join(dir, "leaf.key"), CABundle: filepath.Join(dir, "bundle.crt")}
	writeBundle(t, f, cas...)
	return f
}

// writeBundle replaces f's bundle with cas, atomically as an operator should.
func writeBundle(t *testing.T, f Files, cas ...*CA) {
	t.Helper()
	if err := writeReplace(f.CABundle, bundleOf(cas...), 0o644); err != nil {
		t.Fatal(err)
	}
}

func serverConfig(t *testing.T, f Files, accept Role) *tls.Config {
	t.Helper()
	cfg, err := ServerConfig(f, accept)
	if err != nil {
		t.Fatal(err)
	}
	return cfg
}

func clientConfig(t *testing.T, f Files, expect Role, name string) *tls.Config {
	t.Helper()
	cfg, err := ClientConfig(f, expect, name)
	if err != nil {
		t.Fatal(err)
	}
	return cfg
}

// result is what each side of one handshake saw.
type result struct {
	serverErr, clientErr error
	peerOfServer         Identity // the client, as the server identified it
	peerOfClient         Identity // the server, as the client identified it
	resumed              bool
}

// handshake runs one TLS handshake over a 127.0.0.1 TCP connection and a
// byte of application data each way after it, so a client certificate the
// server refuses (TLS 1.3 reports that after the client's handshake returns)
// shows up on the client too.
func handshake(t *testing.T, server, client *tls.Config) result {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()

	var res result
	done := make(chan struct{})
	go func() {
		defer close(done)
		conn, err := ln.Accept()
		if err != nil {
			res.serverErr = err
			return
		}
		defer conn.Close()
		_ = conn.SetDeadline(time.Now().Add(10 * time.Second))
		tc := tls.Server(conn, server)
		if res.serverErr = tc.HandshakeContext(ctx); res.serverErr != nil {
			return
		}
		res.peerOfServer, res.serverErr = PeerIdentity(tc.ConnectionState())
		if res.serverErr != nil {
			return
		}
		if _, res.serverErr = tc.Write([]byte{1}); res.serverErr != nil {
			return
		}
		_, res.serverErr = tc.Read(make([]byte, 1))
	}()

	conn, err := net.Dial("tcp", ln.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	_ = conn.SetDeadline(time.Now().Add(10 * time.Second))
	tc := tls.Client(conn, client)
	res.clientErr = tc.HandshakeContext(ctx)
	if res.clientErr == nil {
		_, res.clientErr = tc.Read(make([]byte, 1))
	}
	if res.clientErr == nil {
		_, res.clientErr = tc.Write([]byte{1})
	}
	if res.clientErr == nil {
		st := tc.ConnectionState()
		res.resumed = st.DidResume
		res.peerOfClient, res.clientErr = PeerIdentity(st)
	}
	conn.Close()
	<-done
	return res
}

func mode(t *testing.T, path string) os.FileMode {
	t.Helper()
	fi, err := os.Stat(path)
	if err != nil {
		t.Fatal(err)
	}
	return fi.Mode().Perm()
}

// issueRaw signs tmpl with ca, for certificates Issue would never make.
func issueRaw(t *testing.T, ca *CA, tmpl *x509.Certificate) pair {
	t.Helper()
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	tmpl.SerialNumber = newSerial()
	tmpl.NotBefore, tmpl.NotAfter = time.Now().Add(-time.Minute), time.Now().Add(time.Hour)
	der, err := x509.CreateCertificate(rand.Reader, tmpl, ca.cert, key.Public(), ca.key)
	if err != nil {
		t.Fatal(err)
	}
	keyPEM, err := encodeKey(key)
	if err != nil {
		t.Fatal(err)
	}
	return pair{pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der}), keyPEM}
}

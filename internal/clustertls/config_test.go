package clustertls

import (
	"crypto/sha256"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/hex"
	"encoding/pem"
	"errors"
	"fmt"
	"io"
	"log"
	"net"
	"net/http"
	"net/url"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"dsec.dev/dsec/internal/errdefs"
	"dsec.dev/dsec/internal/testutil"
)

func fingerprint(t *testing.T, certPEM []byte) string {
	t.Helper()
	b, _ := pem.Decode(certPEM)
	if b == nil {
		t.Fatal("no PEM")
	}
	sum := sha256.Sum256(b.Bytes)
	return hex.EncodeToString(sum[:])
}

func identityOf(t *testing.T, certPEM []byte) Identity {
	t.Helper()
	b, _ := pem.Decode(certPEM)
	c, err := x509.ParseCertificate(b.Bytes)
	if err != nil {
		t.Fatal(err)
	}
	id, err := ParseIdentity(c)
	if err != nil {
		t.Fatal(err)
	}
	return id
}

func TestHandshake(t *testing.T) {
	caA, caB := testCA(t, "CA A"), testCA(t, "CA B")
	edge1 := issue(t, caA, RoleEdge, "node-1", "127.0.0.1", "::1", "node-1.internal")
	api1 := issue(t, caA, RoleAPIServer, "api-1")

	type side struct {
		pair   pair
		bundle []*CA
	}
	tests := []struct {
		name   string
		server side
		accept Role
		client side
		expect Role
		want   string // the server's expected name; "" for any
		// present, if set, is the client certificate actually sent.
		present pair
		// What each side's error must contain, and its kind; "" for success.
		serverErr, clientErr string
		kind                 error
	}{
		{
			name:   "apiserver to edge",
			server: side{edge1, []*CA{caA}}, accept: RoleAPIServer,
			client: side{api1, []*CA{caA}}, expect: RoleEdge, want: "node-1",
		},
		{
			name:   "apiserver to any edge",
			server: side{edge1, []*CA{caA}}, accept: RoleAPIServer,
			client: side{api1, []*CA{caA}}, expect: RoleEdge,
		},
		{
			name:   "bundle of two CAs",
			server: side{edge1, []*CA{caB, caA}}, accept: RoleAPIServer,
			client: side{issue(t, caB, RoleAPIServer, "api-b"), []*CA{caA}}, expect: RoleEdge,
		},
		{
			name:   "client from another CA",
			server: side{edge1, []*CA{caA}}, accept: RoleAPIServer,
			client: side{issue(t, caB, RoleAPIServer, "api-1"), []*CA{caA}}, expect: RoleEdge,
			serverErr: `client certificate of apiserver api-1 is signed by an unknown authority "CA B": the CA bundle`,
			clientErr: "bad certificate", kind: errdefs.ErrUnauthenticated,
		},
		{
			name:   "server from another CA",
			server: side{issue(t, caB, RoleEdge, "node-1"), []*CA{caA}}, accept: RoleAPIServer,
			client: side{api1, []*CA{caA}}, expect: RoleEdge, want: "node-1",
			clientErr: `server certificate of edge node-1 is signed by an unknown authority "CA B"`,
			serverErr: "bad certificate", kind: errdefs.ErrUnauthenticated,
		},
		{
			name:   "edge dials edge",
			server: side{edge1, []*CA{caA}}, accept: RoleAPIServer,
			client: side{issue(t, caA, RoleEdge, "node-2"), []*CA{caA}}, expect: RoleEdge,
			serverErr: "client certificate of role edge is not accepted here: want apiserver, got edge node-2",
			clientErr: "bad certificate", kind: errdefs.ErrPermissionDenied,
		},
		{
			name:   "server is not an edge",
			server: side{issue(t, caA, RoleAPIServer, "api-2"), []*CA{caA}}, accept: RoleAPIServer,
			client: side{api1, []*CA{caA}}, expect: RoleEdge,
			clientErr: "server certificate of role apiserver is not accepted here: want edge, got apiserver api-2",
			serverErr: "bad certificate", kind: errdefs.ErrPermissionDenied,
		},
		{
			name:   "another edge than the one dialed",
			server: side{edge1, []*CA{caA}}, accept: RoleAPIServer,
			client: side{api1, []*CA{caA}}, expect: RoleEdge, want: "node-2",
			clientErr: "server certificate is edge node-1's: want edge node-2",
			serverErr: "bad certificate", kind: errdefs.ErrPermissionDenied,
		},
		{
			name:   "expired client",
			server: side{edge1, []*CA{caA}}, accept: RoleAPIServer,
			client: side{issueAt(t, caA, RoleAPIServer, "api-1", -2*time.Hour, -time.Hour), []*CA{caA}}, expect: RoleEdge,
			serverErr: "client certificate of apiserver api-1 expired at ",
			clientErr: "bad certificate", kind: errdefs.ErrUnauthenticated,
		},
		{
			name:   "expired server",
			server: side{issueAt(t, caA, RoleEdge, "node-1", -2*time.Hour, -time.Hour), []*CA{caA}}, accept: RoleAPIServer,
			client: side{api1, []*CA{caA}}, expect: RoleEdge,
			clientErr: "server certificate of edge node-1 expired at ",
			serverErr: "bad certificate", kind: errdefs.ErrUnauthenticated,
		},
		{
			name:   "client without an identity",
			server: side{edge1, []*CA{caA}}, accept: RoleAPIServer,
			// A config will not load such a certificate as its own, so it
			// is presented behind the config's back.
			client: side{api1, []*CA{caA}}, expect: RoleEdge,
			present: issueRaw(t, caA, &x509.Certificate{
				Subject:     pkix.Name{CommonName: "apiserver api-1"},
				ExtKeyUsage: []x509.ExtKeyUsage{x509.ExtKeyUsageClientAuth},
			}),
			serverErr: `client certificate "CN=apiserver api-1" carries no dsec identity: it has no dsec:// URI SAN`,
			clientErr: "bad certificate", kind: errdefs.ErrUnauthenticated,
		},
		{
			name:   "client certificate for servers only",
			server: side{edge1, []*CA{caA}}, accept: RoleAPIServer,
			client: side{issueRaw(t, caA, &x509.Certificate{
				URIs:        []*url.URL{identityURI(RoleAPIServer, "api-1")},
				ExtKeyUsage: []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth},
			}), []*CA{caA}}, expect: RoleEdge,
			serverErr: "client certificate of apiserver api-1 may not be used by a client (extended key usage)",
			clientErr: "bad certificate", kind: errdefs.ErrUnauthenticated,
		},
		{
			name:   "client not yet valid",
			server: side{edge1, []*CA{caA}}, accept: RoleAPIServer,
			client: side{issueAt(t, caA, RoleAPIServer, "api-1", time.Hour, 2*time.Hour), []*CA{caA}}, expect: RoleEdge,
			serverErr: "client certificate of apiserver api-1 is not valid until ",
			clientErr: "bad certificate", kind: errdefs.ErrUnauthenticated,
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			srv := serverConfig(t, component(t, tt.server.pair, tt.server.bundle...), tt.accept)
			cli := clientConfig(t, component(t, tt.client.pair, tt.client.bundle...), tt.expect, tt.want)
			if tt.present.cert != nil {
				c, err := tls.X509KeyPair(tt.present.cert, tt.present.key)
				if err != nil {
					t.Fatal(err)
				}
				cli.GetClientCertificate = func(*tls.CertificateRequestInfo) (*tls.Certificate, error) { return &c, nil }
			}
			res := handshake(t, srv, cli)
			if tt.serverErr == "" && tt.clientErr == "" {
				if res.serverErr != nil || res.clientErr != nil {
					t.Fatalf("handshake: server: %v; client: %v", res.serverErr, res.clientErr)
				}
				if want := identityOf(t, tt.client.pair.cert); res.peerOfServer != want {
					t.Errorf("server saw %+v, want %+v", res.peerOfServer, want)
				}
				if want := identityOf(t, tt.server.pair.cert); res.peerOfClient != want {
					t.Errorf("client saw %+v, want %+v", res.peerOfClient, want)
				}
				return
			}
			for _, c := range []struct {
				who  string
				err  error
				want string
			}{{"server", res.serverErr, tt.serverErr}, {"client", res.clientErr, tt.clientErr}} {
				if c.err == nil || !strings.Contains(c.err.Error(), c.want) {
					t.Errorf("%s error %v, want one containing %q", c.who, c.err, c.want)
				}
			}
			// The verifying side's error carries the kind.
			verr := res.serverErr
			if strings.HasPrefix(tt.clientErr, "server certificate") {
				verr = res.clientErr
			}
			if !errors.Is(verr, tt.kind) {
				t.Errorf("error %v is not %v", verr, tt.kind)
			}
		})
	}
}

// TestHandshakeIdentity checks that the server learns exactly which client it
// talks to.
func TestHandshakeIdentity(t *testing.T) {
	ca := testCA(t, "CA")
	api := issue(t, ca, RoleAPIServer, "api-7")
	srv := serverConfig(t, component(t, issue(t, ca, RoleEdge, "node-3", "127.0.0.1"), ca), RoleAPIServer)
	cli := clientConfig(t, component(t, api, ca), RoleEdge, "node-3")
	res := handshake(t, srv, cli)
	if res.serverErr != nil || res.clientErr != nil {
		t.Fatalf("handshake: server: %v; client: %v", res.serverErr, res.clientErr)
	}
	want := Identity{Role: RoleAPIServer, Name: "api-7", Fingerprint: fingerprint(t, api.cert)}
	if res.peerOfServer != want {
		t.Errorf("server saw %+v, want %+v", res.peerOfServer, want)
	}
	if got := res.peerOfClient; got.Role != RoleEdge || got.Name != "node-3" {
		t.Errorf("client saw %+v, want edge node-3", got)
	}
}

// TestHTTP2 serves HTTP/2 on 127.0.0.1, as the edge's Connect API will, and
// checks that a handler sees the apiserver that called it.
func TestHTTP2(t *testing.T) {
	ca := testCA(t, "CA")
	srvCfg := serverConfig(t, component(t, issue(t, ca, RoleEdge, "node-1", "127.0.0.1"), ca), RoleAPIServer)
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	srv := &http.Server{
		TLSConfig: srvCfg,
		ErrorLog:  log.New(io.Discard, "", 0),
		Handler: http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			id, err := PeerIdentity(*r.TLS)
			if err != nil {
				http.Error(w, err.Error(), http.StatusUnauthorized)
				return
			}
			fmt.Fprintf(w, "%s %s", r.Proto, id)
		}),
	}
	go srv.ServeTLS(ln, "", "")
	t.Cleanup(func() { srv.Close() })

	get := func(p pair) (string, error) {
		tr := &http.Transport{TLSClientConfig: clientConfig(t, component(t, p, ca), RoleEdge, "node-1"), ForceAttemptHTTP2: true}
		defer tr.CloseIdleConnections()
		resp, err := (&http.Client{Transport: tr, Timeout: 10 * time.Second}).Get("https://" + ln.Addr().String() + "/")
		if err != nil {
			return "", err
		}
		defer resp.Body.Close()
		b, err := io.ReadAll(resp.Body)
		return string(b), err
	}
	got, err := get(issue(t, ca, RoleAPIServer, "api-1"))
	if err != nil {
		t.Fatal(err)
	}
	if want := "HTTP/2.0 apiserver api-1"; got != want {
		t.Errorf("handler said %q, want %q", got, want)
	}
	if _, err := get(issue(t, ca, RoleEdge, "node-2")); err == nil {
		t.Error("an edge's request was served")
	}
}

// TestRotation rolls a new CA out to a running server without restarting it,
// as docs/cluster.md tells an operator to.
func TestRotation(t *testing.T) {
	ca1, ca2 := testCA(t, "CA 1"), testCA(t, "CA 2")
	srvFiles := component(t, issue(t, ca1, RoleEdge, "node-1", "127.0.0.1"), ca1)
	srv := serverConfig(t, srvFiles, RoleAPIServer)
	// The apiservers already trust both CAs (step 1 done on their side).
	old := clientConfig(t, component(t, issue(t, ca1, RoleAPIServer, "api-1"), ca1, ca2), RoleEdge, "node-1")
	neu := clientConfig(t, component(t, issue(t, ca2, RoleAPIServer, "api-2"), ca1, ca2), RoleEdge, "node-1")

	if res := handshake(t, srv, old); res.serverErr != nil || res.clientErr != nil {
		t.Fatalf("CA 1 client before rotation: server: %v; client: %v", res.serverErr, res.clientErr)
	}
	if res := handshake(t, srv, neu); res.serverErr == nil || !strings.Contains(res.serverErr.Error(), "unknown authority") {
		t.Fatalf("CA 2 client before the server trusts CA 2: server error %v, want an unknown authority", res.serverErr)
	}

	// Step 1 on the server: trust both CAs. Step 2: a leaf from CA 2.
	writeBundle(t, srvFiles, ca1, ca2)
	p := issue(t, ca2, RoleEdge, "node-1", "127.0.0.1")
	if err := writeReplace(srvFiles.Key, p.key, 0o600); err != nil {
		t.Fatal(err)
	}
	if err := writeReplace(srvFiles.Cert, p.cert, 0o644); err != nil {
		t.Fatal(err)
	}
	var res result
	// The three files may be picked up at different checks; wait for all.
	testutil.WaitFor(t, 10*time.Second, "CA 2 client accepted by the CA 2 certificate", func() bool {
		res = handshake(t, srv, neu)
		return res.serverErr == nil && res.clientErr == nil && res.peerOfClient.Fingerprint == fingerprint(t, p.cert)
	})
	if res.peerOfServer.String() != "apiserver api-2" {
		t.Errorf("after rotation the server saw %v", res.peerOfServer)
	}
	if res := handshake(t, srv, old); res.serverErr != nil || res.clientErr != nil {
		t.Fatalf("CA 1 client while both are trusted: server: %v; client: %v", res.serverErr, res.clientErr)
	}

	// Step 3: drop CA 1.
	writeBundle(t, srvFiles, ca2)
	testutil.WaitFor(t, 10*time.Second, "CA 1 client refused", func() bool {
		res = handshake(t, srv, old)
		return res.serverErr != nil
	})
	if !errors.Is(res.serverErr, errdefs.ErrUnauthenticated) || !strings.Contains(res.serverErr.Error(), `signed by an unknown authority "CA 1"`) {
		t.Errorf("CA 1 client after CA 1 was dropped: %v", res.serverErr)
	}
	if res := handshake(t, srv, neu); res.serverErr != nil || res.clientErr != nil {
		t.Fatalf("CA 2 client after rotation: server: %v; client: %v", res.serverErr, res.clientErr)
	}
}

// TestResumedSessionReverified checks that a client whose CA was dropped
// cannot come back on a session ticket issued while it was trusted.
func TestResumedSessionReverified(t *testing.T) {
	ca1, ca2 := testCA(t, "CA 1"), testCA(t, "CA 2")
	srvFiles := component(t, issue(t, ca2, RoleEdge, "node-1"), ca1, ca2)
	srv := serverConfig(t, srvFiles, RoleAPIServer)
	cli := clientConfig(t, component(t, issue(t, ca1, RoleAPIServer, "api-1"), ca1, ca2), RoleEdge, "")
	cli.ClientSessionCache = tls.NewLRUClientSessionCache(4)
	cli.ServerName = "node-1" // the cache key; each handshake has a new port

	if res := handshake(t, srv, cli); res.serverErr != nil || res.clientErr != nil {
		t.Fatalf("first handshake: server: %v; client: %v", res.serverErr, res.clientErr)
	}
	if res := handshake(t, srv, cli); res.serverErr != nil || res.clientErr != nil || !res.resumed {
		t.Fatalf("second handshake: server: %v; client: %v; resumed %v, want a resumed session", res.serverErr, res.clientErr, res.resumed)
	}
	writeBundle(t, srvFiles, ca2)
	testutil.WaitFor(t, 10*time.Second, "resuming CA 1 client refused", func() bool {
		return handshake(t, srv, cli).serverErr != nil
	})
}

// TestReloadFailureKeepsServing writes a key that does not match the
// certificate (as an operator copying the key first would, for a moment): the
// server keeps its old material, says why when it refuses someone, and takes
// the new material once the pair is whole.
func TestReloadFailureKeepsServing(t *testing.T) {
	ca, other := testCA(t, "CA"), testCA(t, "other CA")
	srvFiles := component(t, issue(t, ca, RoleEdge, "node-1"), ca)
	srv := serverConfig(t, srvFiles, RoleAPIServer)
	good := clientConfig(t, component(t, issue(t, ca, RoleAPIServer, "api-1"), ca), RoleEdge, "")
	stranger := clientConfig(t, component(t, issue(t, other, RoleAPIServer, "api-1"), ca), RoleEdge, "")

	next := issue(t, ca, RoleEdge, "node-1")
	if err := writeReplace(srvFiles.Key, next.key, 0o600); err != nil {
		t.Fatal(err)
	}
	testutil.WaitFor(t, 10*time.Second, "a refusal naming the failed reload", func() bool {
		err := handshake(t, srv, stranger).serverErr
		return err != nil && strings.Contains(err.Error(), "were not reloaded") && strings.Contains(err.Error(), "private key does not match")
	})
	if res := handshake(t, srv, good); res.serverErr != nil || res.clientErr != nil {
		t.Fatalf("handshake with half-written files: server: %v; client: %v", res.serverErr, res.clientErr)
	}
	if err := writeReplace(srvFiles.Cert, next.cert, 0o644); err != nil {
		t.Fatal(err)
	}
	testutil.WaitFor(t, 10*time.Second, "the new certificate served", func() bool {
		res := handshake(t, srv, good)
		return res.clientErr == nil && res.peerOfClient.Fingerprint == fingerprint(t, next.cert)
	})
}

func TestConfigErrors(t *testing.T) {
	ca := testCA(t, "CA")
	good := component(t, issue(t, ca, RoleEdge, "node-1"), ca)
	other := component(t, issue(t, ca, RoleEdge, "node-2"), ca)
	leafBundle := good
	leafBundle.CABundle = good.Cert
	mismatched := good
	mismatched.Key = other.Key
	missing := good
	missing.CABundle = good.CABundle + ".missing"
	tests := []struct {
		name   string
		files  Files
		role   Role
		want   string
		kind   error
		server bool
	}{
		{"unknown role", good, Role("client"), `check role "client"`, errdefs.ErrInvalidArgument, true},
		{"leaf as bundle", leafBundle, RoleAPIServer, "which is not a CA certificate", errdefs.ErrInvalidArgument, true},
		{"key of another cert", mismatched, RoleAPIServer, "private key does not match", errdefs.ErrInvalidArgument, false},
		{"missing bundle", missing, RoleEdge, "bundle.crt.missing", errdefs.ErrNotFound, false},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			var err error
			if tt.server {
				_, err = ServerConfig(tt.files, tt.role)
			} else {
				_, err = ClientConfig(tt.files, tt.role, "")
			}
			if err == nil || !strings.Contains(err.Error(), tt.want) || !errors.Is(err, tt.kind) {
				t.Errorf("error %v, want %v containing %q", err, tt.kind, tt.want)
			}
		})
	}
	if _, err := ClientConfig(good, RoleEdge, "no/slash"); !errors.Is(err, errdefs.ErrInvalidArgument) {
		t.Errorf("bad expected name: %v", err)
	}
}

// TestReloadSymlinkSwap replaces the files the way a Kubernetes secret volume
// does: the names are symlinks through a ..data link that is swapped in one
// rename.
func TestReloadSymlinkSwap(t *testing.T) {
	ca := testCA(t, "CA")
	dir := t.TempDir()
	put := func(gen string, p pair) {
		t.Helper()
		gdir := filepath.Join(dir, gen)
		if err := WriteCert(gdir, "tls", p.cert, p.key); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(filepath.Join(gdir, "ca.crt"), ca.CertPEM(), 0o644); err != nil {
			t.Fatal(err)
		}
		if err := os.Symlink(gen, filepath.Join(dir, "..data_tmp")); err != nil {
			t.Fatal(err)
		}
		if err := os.Rename(filepath.Join(dir, "..data_tmp"), filepath.Join(dir, "..data")); err != nil {
			t.Fatal(err)
		}
	}
	first, second := issue(t, ca, RoleEdge, "node-1"), issue(t, ca, RoleEdge, "node-1")
	put("gen-1", first)
	for _, n := range []string{"tls.crt", "tls.key", "ca.crt"} {
		if err := os.Symlink(filepath.Join("..data", n), filepath.Join(dir, n)); err != nil {
			t.Fatal(err)
		}
	}
	srv := serverConfig(t, Files{Cert: filepath.Join(dir, "tls.crt"), Key: filepath.Join(dir, "tls.key"), CABundle: filepath.Join(dir, "ca.crt")}, RoleAPIServer)
	cli := clientConfig(t, component(t, issue(t, ca, RoleAPIServer, "api-1"), ca), RoleEdge, "node-1")
	if res := handshake(t, srv, cli); res.clientErr != nil || res.peerOfClient.Fingerprint != fingerprint(t, first.cert) {
		t.Fatalf("before the swap: %v, %+v", res.clientErr, res.peerOfClient)
	}
	put("gen-2", second)
	testutil.WaitFor(t, 10*time.Second, "the swapped-in certificate served", func() bool {
		res := handshake(t, srv, cli)
		return res.clientErr == nil && res.peerOfClient.Fingerprint == fingerprint(t, second.cert)
	})
}

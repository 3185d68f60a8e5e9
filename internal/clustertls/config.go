package clustertls

import (
	"crypto/tls"
	"crypto/x509"
	"errors"
	"fmt"
	"os"
	"strings"
	"sync"
	"time"

	"dsec.dev/dsec/internal/errdefs"
)

// Files are the paths a component's TLS material is read from: its leaf
// certificate and key, and the bundle of CA certificates it trusts (one or
// more PEM certificates, every one a CA).
type Files struct {
	Cert     string
	Key      string
	CABundle string
}

// reloadEvery is how often, at most, a config looks at its files' mtimes.
const reloadEvery = time.Second

// ServerConfig is the TLS configuration a component serves with (an edge's
// listener: accept is RoleAPIServer). It speaks TLS 1.3 only, presents
// files.Cert, and requires a client certificate that chains to a CA in
// files.CABundle, is within its validity, has the client extended key usage
// and carries role accept; anything else fails the handshake with an error
// saying why (errdefs.ErrUnauthenticated for an unverifiable certificate,
// errdefs.ErrPermissionDenied for a verified one of the wrong role). Use
// PeerIdentity on the connection to learn which component it is.
//
// The files are read now (an error here is returned) and again whenever they
// change on disk, looked at no more than once a second at a handshake; a
// reload that fails (a key written before its certificate, a half-copied
// bundle) keeps the previous material and is tried again at the next check,
// and its error is added to the message of any handshake refused meanwhile.
// NextProtos is left empty for the HTTP server to fill in (h2).
func ServerConfig(files Files, accept Role) (*tls.Config, error) {
	if err := checkRole(accept); err != nil {
		return nil, fmt.Errorf("make server TLS config: %w", err)
	}
	src, err := newSource(files, reloadEvery)
	if err != nil {
		return nil, fmt.Errorf("make server TLS config: %w", err)
	}
	return &tls.Config{
		MinVersion: tls.VersionTLS13,
		// Verification is VerifyConnection's, against the current bundle; it
		// also runs on resumed sessions, so a client whose CA was dropped
		// cannot come back on an old ticket.
		ClientAuth: tls.RequireAnyClientCert,
		GetCertificate: func(*tls.ClientHelloInfo) (*tls.Certificate, error) {
			return src.get().cert, nil
		},
		VerifyConnection: func(cs tls.ConnectionState) error {
			m := src.get()
			id, err := m.verify(cs.PeerCertificates, "client", x509.ExtKeyUsageClientAuth)
			if err != nil {
				return err
			}
			if id.Role != accept {
				return m.refuse(errdefs.ErrPermissionDenied, "client certificate of role %s is not accepted here: want %s, got %s", id.Role, accept, id)
			}
			return nil
		},
	}, nil
}

// ClientConfig is the TLS configuration a component dials with (an
// apiserver dialing an edge: expect is RoleEdge). It speaks TLS 1.3 only,
// presents files.Cert when the server asks, and accepts a server whose
// certificate chains to a CA in files.CABundle, is within its validity, has
// the server extended key usage and carries role expect and, unless
// expectName is "", name expectName. The server is identified by its
// certificate's dsec:// URI, not by the address dialed, so a caller that
// knows which node it means to reach should name it. Files are reloaded as
// for ServerConfig.
func ClientConfig(files Files, expect Role, expectName string) (*tls.Config, error) {
	if err := checkRole(expect); err != nil {
		return nil, fmt.Errorf("make client TLS config: %w", err)
	}
	if expectName != "" {
		if err := checkName(expectName); err != nil {
			return nil, fmt.Errorf("make client TLS config: expected %w", err)
		}
	}
	src, err := newSource(files, reloadEvery)
	if err != nil {
		return nil, fmt.Errorf("make client TLS config: %w", err)
	}
	return &tls.Config{
		MinVersion: tls.VersionTLS13,
		// Not skipped: VerifyConnection verifies the chain against the
		// current bundle and the identity against expect; the standard
		// verification could do neither with a bundle that changes.
		InsecureSkipVerify: true,
		GetClientCertificate: func(*tls.CertificateRequestInfo) (*tls.Certificate, error) {
			return src.get().cert, nil
		},
		VerifyConnection: func(cs tls.ConnectionState) error {
			m := src.get()
			id, err := m.verify(cs.PeerCertificates, "server", x509.ExtKeyUsageServerAuth)
			if err != nil {
				return err
			}
			if id.Role != expect {
				return m.refuse(errdefs.ErrPermissionDenied, "server certificate of role %s is not accepted here: want %s, got %s", id.Role, expect, id)
			}
			if expectName != "" && id.Name != expectName {
				return m.refuse(errdefs.ErrPermissionDenied, "server certificate is %s's: want %s %s", id, expect, expectName)
			}
			return nil
		},
	}, nil
}

// source holds a component's TLS material and reloads it when its files
// change. It is safe for concurrent use.
type source struct {
	files Files
	every time.Duration

	mu      sync.Mutex
	cur     *material
	loaded  [3]os.FileInfo // the files as they were when cur was read
	checked time.Time
}

// material is one consistent reading of Files.
type material struct {
	cert   *tls.Certificate
	pool   *x509.CertPool
	cas    []string // the bundle's CA names, for messages
	bundle string
	// reloadErr is why the files' newer contents were not taken, if they
	// were not; it is reported with refused handshakes.
	reloadErr error
}

func newSource(files Files, every time.Duration) (*source, error) {
	stats, err := statFiles(files)
	if err != nil {
		return nil, err
	}
	m, err := loadMaterial(files)
	if err != nil {
		return nil, err
	}
	return &source{files: files, every: every, cur: m, loaded: stats, checked: time.Now()}, nil
}

// get is the current material, reloaded first if a check is due and the
// files changed.
func (s *source) get() *material {
	s.mu.Lock()
	defer s.mu.Unlock()
	now := time.Now()
	if now.Sub(s.checked) < s.every {
		return s.cur
	}
	s.checked = now
	stats, err := statFiles(s.files)
	if err != nil {
		s.keep(err)
		return s.cur
	}
	if sameFiles(stats, s.loaded) {
		if s.cur.reloadErr != nil { // the files were put back as they were
			m := *s.cur
			m.reloadErr = nil
			s.cur = &m
		}
		return s.cur
	}
	m, err := loadMaterial(s.files)
	if err != nil {
		// Keep serving what worked; s.loaded stays, so the next check
		// tries again.
		s.keep(err)
		return s.cur
	}
	s.cur, s.loaded = m, stats
	return s.cur
}

// keep records why a reload was not taken, on a copy of the current material
// (handshakes in flight may hold the old one).
func (s *source) keep(err error) {
	m := *s.cur
	m.reloadErr = err
	s.cur = &m
}

func statFiles(f Files) ([3]os.FileInfo, error) {
	var out [3]os.FileInfo
	for i, p := range []string{f.Cert, f.Key, f.CABundle} {
		fi, err := os.Stat(p)
		if err != nil {
			return out, fmt.Errorf("reload TLS files: %w", notFound(err))
		}
		out[i] = fi
	}
	return out, nil
}

// sameFiles reports whether no file was replaced or written since a.
func sameFiles(a, b [3]os.FileInfo) bool {
	for i := range a {
		if a[i] == nil || b[i] == nil || !os.SameFile(a[i], b[i]) ||
			!a[i].ModTime().Equal(b[i].ModTime()) || a[i].Size() != b[i].Size() {
			return false
		}
	}
	return true
}

func loadMaterial(f Files) (*material, error) {
	pair, err := tls.LoadX509KeyPair(f.Cert, f.Key)
	if err != nil {
		return nil, fmt.Errorf("load TLS certificate %s and key %s: %v: %w", f.Cert, f.Key, err, kindOf(err))
	}
	if _, err := ParseIdentity(pair.Leaf); err != nil {
		return nil, fmt.Errorf("load TLS certificate %s: %w", f.Cert, err)
	}
	cas, err := readCerts(f.CABundle)
	if err != nil {
		return nil, fmt.Errorf("load CA bundle: %w", err)
	}
	m := &material{cert: &pair, pool: x509.NewCertPool(), bundle: f.CABundle}
	for _, c := range cas {
		if !c.IsCA || !c.BasicConstraintsValid {
			return nil, fmt.Errorf("load CA bundle %s: it holds %q, which is not a CA certificate: %w", f.CABundle, c.Subject.String(), errdefs.ErrInvalidArgument)
		}
		m.pool.AddCert(c)
		m.cas = append(m.cas, fmt.Sprintf("%q", c.Subject.CommonName))
	}
	return m, nil
}

func kindOf(err error) error {
	if errors.Is(err, os.ErrNotExist) {
		return errdefs.ErrNotFound
	}
	return errdefs.ErrInvalidArgument
}

// verify checks a peer's chain (leaf first) against m's bundle for usage and
// returns the identity it carries. side is "client" or "server", for messages.
func (m *material) verify(chain []*x509.Certificate, side string, usage x509.ExtKeyUsage) (Identity, error) {
	if len(chain) == 0 {
		return Identity{}, m.refuse(errdefs.ErrUnauthenticated, "the %s presented no certificate", side)
	}
	leaf := chain[0]
	id, why := parseIdentity(leaf)
	who := fmt.Sprintf("%s certificate %q", side, leaf.Subject.String())
	if why == "" {
		who = fmt.Sprintf("%s certificate of %s", side, id)
	}
	now := time.Now()
	if now.After(leaf.NotAfter) {
		return Identity{}, m.refuse(errdefs.ErrUnauthenticated, "%s expired at %s", who, leaf.NotAfter.UTC().Format(time.RFC3339))
	}
	if now.Before(leaf.NotBefore) {
		return Identity{}, m.refuse(errdefs.ErrUnauthenticated, "%s is not valid until %s", who, leaf.NotBefore.UTC().Format(time.RFC3339))
	}
	opts := x509.VerifyOptions{
		Roots:         m.pool,
		Intermediates: x509.NewCertPool(),
		CurrentTime:   now,
		KeyUsages:     []x509.ExtKeyUsage{usage},
	}
	for _, c := range chain[1:] {
		opts.Intermediates.AddCert(c)
	}
	if _, err := leaf.Verify(opts); err != nil {
		var unknown x509.UnknownAuthorityError
		var invalid x509.CertificateInvalidError
		switch {
		case errors.As(err, &unknown):
			return Identity{}, m.refuse(errdefs.ErrUnauthenticated, "%s is signed by an unknown authority %q: the CA bundle %s holds only %s",
				who, leaf.Issuer.CommonName, m.bundle, strings.Join(m.cas, ", "))
		case errors.As(err, &invalid) && invalid.Reason == x509.IncompatibleUsage:
			return Identity{}, m.refuse(errdefs.ErrUnauthenticated, "%s may not be used by a %s (extended key usage)", who, side)
		default:
			return Identity{}, m.refuse(errdefs.ErrUnauthenticated, "verify %s: %v", who, err)
		}
	}
	if why != "" {
		return Identity{}, m.refuse(errdefs.ErrUnauthenticated, "%s carries no dsec identity: %s", who, why)
	}
	return id, nil
}

// refuse is a handshake refusal wrapping kind. A pending reload failure is
// named in it: the newer files that were not taken may be why the peer is not
// let in.
func (m *material) refuse(kind error, format string, args ...any) error {
	msg := fmt.Sprintf(format, args...)
	if m.reloadErr != nil {
		msg += fmt.Sprintf(" (the TLS files changed but were not reloaded: %v)", m.reloadErr)
	}
	return fmt.Errorf("%s: %w", msg, kind)
}

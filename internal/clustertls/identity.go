package clustertls

import (
	"crypto/sha256"
	"crypto/tls"
	"crypto/x509"
	"encoding/hex"
	"fmt"
	"net/url"
	"regexp"
	"strings"

	"dsec.dev/dsec/internal/errdefs"
)

// Role is what a cluster component is, as its certificate says.
type Role string

const (
	// RoleAPIServer is a stateless apiserver; it dials edges.
	RoleAPIServer Role = "apiserver"
	// RoleEdge is a node's edge; it serves apiservers only.
	RoleEdge Role = "edge"
)

// uriScheme is the scheme of the URI SAN that carries a leaf's identity.
const uriScheme = "dsec"

func (r Role) valid() bool { return r == RoleAPIServer || r == RoleEdge }

func checkRole(r Role) error {
	if !r.valid() {
		return fmt.Errorf("check role %q: want %s or %s: %w", string(r), RoleAPIServer, RoleEdge, errdefs.ErrInvalidArgument)
	}
	return nil
}

// namePattern is what a component's name may look like: it becomes the path
// of a URI and part of a file name (edge-NAME.crt), so it has no slashes,
// spaces or leading dots.
var namePattern = regexp.MustCompile(`^[A-Za-z0-9][A-Za-z0-9._-]{0,62}$`)

func checkName(name string) error {
	if !namePattern.MatchString(name) {
		return fmt.Errorf("check component name %q: want 1-63 letters, digits, '.', '_' or '-', starting with a letter or digit: %w", name, errdefs.ErrInvalidArgument)
	}
	return nil
}

// Identity is who a verified peer is, read from its leaf certificate.
type Identity struct {
	Role Role
	Name string
	// Fingerprint is the lowercase hex SHA-256 of the leaf's DER encoding;
	// it changes whenever the certificate is reissued.
	Fingerprint string
}

// String is "ROLE NAME", as error messages name a peer.
func (id Identity) String() string { return string(id.Role) + " " + id.Name }

// URI is the identity as the certificate's URI SAN spells it.
func (id Identity) URI() string { return identityURI(id.Role, id.Name).String() }

func identityURI(role Role, name string) *url.URL {
	return &url.URL{Scheme: uriScheme, Host: string(role), Path: "/" + name}
}

// ParseIdentity reads the dsec identity from cert's URI SAN. It does not
// verify cert: call it on certificates a config from this package accepted, or
// for display.
func ParseIdentity(cert *x509.Certificate) (Identity, error) {
	id, why := parseIdentity(cert)
	if why != "" {
		return Identity{}, fmt.Errorf("read identity of certificate %q: %s: %w", cert.Subject.String(), why, errdefs.ErrUnauthenticated)
	}
	return id, nil
}

// parseIdentity is ParseIdentity, saying why not in words rather than an
// error, for callers that make their own.
func parseIdentity(cert *x509.Certificate) (Identity, string) {
	var found []*url.URL
	for _, u := range cert.URIs {
		if u.Scheme == uriScheme {
			found = append(found, u)
		}
	}
	switch len(found) {
	case 0:
		return Identity{}, "it has no " + uriScheme + ":// URI SAN"
	case 1:
	default:
		return Identity{}, fmt.Sprintf("it has %d %s:// URI SANs, want one", len(found), uriScheme)
	}
	u := found[0]
	role, name := Role(u.Host), strings.TrimPrefix(u.Path, "/")
	if !role.valid() || checkName(name) != nil || u.RawQuery != "" || u.Fragment != "" || u.User != nil {
		return Identity{}, fmt.Sprintf("malformed URI SAN %q, want %s://ROLE/NAME with ROLE %s or %s", u.String(), uriScheme, RoleAPIServer, RoleEdge)
	}
	sum := sha256.Sum256(cert.Raw)
	return Identity{Role: role, Name: name, Fingerprint: hex.EncodeToString(sum[:])}, ""
}

// PeerIdentity is the identity of the peer of a connection made with a
// ServerConfig or ClientConfig (on a server, from http.Request.TLS). It reads
// the peer's leaf and relies on the config's verification having passed.
func PeerIdentity(state tls.ConnectionState) (Identity, error) {
	if len(state.PeerCertificates) == 0 {
		return Identity{}, fmt.Errorf("read peer identity: the peer presented no certificate: %w", errdefs.ErrUnauthenticated)
	}
	return ParseIdentity(state.PeerCertificates[0])
}

// FileIdentity is the identity of the leaf certificate in a PEM file (its
// first certificate): a component reads its own this way, to register
// under it.
func FileIdentity(path string) (Identity, error) {
	certs, err := readCerts(path)
	if err != nil {
		return Identity{}, err
	}
	return ParseIdentity(certs[0])
}

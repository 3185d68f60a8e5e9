package metrics

import (
	"crypto/subtle"
	"errors"
	"fmt"
	"net"
	"net/http"
	"net/netip"
	"os"
	"strings"

	"dsec.dev/dsec/internal/errdefs"
)

// ErrNoToken is a scrape's refusal when it came from off loopback with no
// bearer token: Guard answers it 401.
var ErrNoToken = errors.New("a scrape from off loopback needs a bearer token (a viewer's on the root project, or the scrape token: dsecd --metrics-token-file)")

// Guard serves h to scrapes from loopback or a Unix socket, and to others
// only when allow accepts their request (it checks the bearer token;
// ErrNoToken when there is none). A refused scrape gets 401 with the
// reason, which never echoes the token, or 403 when allow's error is
// errdefs.ErrPermissionDenied (a valid token whose principal may not read
// the metrics). A nil allow accepts none from off loopback.
func Guard(h http.Handler, allow func(r *http.Request) error) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if Local(r) {
			h.ServeHTTP(w, r)
			return
		}
		err := ErrNoToken
		if allow != nil {
			err = allow(r)
		}
		if errors.Is(err, errdefs.ErrPermissionDenied) {
			http.Error(w, "metrics: "+err.Error(), http.StatusForbidden)
			return
		}
		if err != nil {
			w.Header().Set("WWW-Authenticate", `Bearer realm="dsec metrics"`)
			http.Error(w, "metrics: "+err.Error(), http.StatusUnauthorized)
			return
		}
		h.ServeHTTP(w, r)
	})
}

// Local reports whether r came from loopback, or over a connection with no
// IP peer (a Unix socket, an in-process pipe).
func Local(r *http.Request) bool {
	host, _, err := net.SplitHostPort(r.RemoteAddr)
	if err != nil {
		return true // not TCP: no address off the machine
	}
	ip, err := netip.ParseAddr(host)
	if err != nil {
		return host == "" || host == "@"
	}
	return ip.Unmap().IsLoopback()
}

// BearerToken is r's bearer token, "" when it has none.
func BearerToken(r *http.Request) string {
	tok, ok := strings.CutPrefix(r.Header.Get("Authorization"), "Bearer ")
	if !ok {
		return ""
	}
	return strings.TrimSpace(tok)
}

// ScrapeToken is a dedicated token that lets a scraper read /metrics off
// loopback and nothing else. The zero value matches no token.
type ScrapeToken struct{ token []byte }

// ReadScrapeToken reads the scrape token from path ("" : none), refusing
// an empty file or one other users can read.
func ReadScrapeToken(path string) (ScrapeToken, error) {
	if path == "" {
		return ScrapeToken{}, nil
	}
	fi, err := os.Stat(path)
	if err != nil {
		return ScrapeToken{}, fmt.Errorf("read the scrape token: %w", err)
	}
	if fi.Mode().Perm()&0o077 != 0 {
		return ScrapeToken{}, fmt.Errorf("read the scrape token: %s is readable by others (mode %v): chmod 600 it", path, fi.Mode().Perm())
	}
	b, err := os.ReadFile(path)
	if err != nil {
		return ScrapeToken{}, fmt.Errorf("read the scrape token: %w", err)
	}
	tok := strings.TrimSpace(string(b))
	if len(tok) < 16 {
		return ScrapeToken{}, fmt.Errorf("read the scrape token: %s holds %d characters, want at least 16", path, len(tok))
	}
	return ScrapeToken{token: []byte(tok)}, nil
}

// Matches reports whether tok is the scrape token.
func (s ScrapeToken) Matches(tok string) bool {
	return len(s.token) > 0 && subtle.ConstantTimeCompare(s.token, []byte(tok)) == 1
}

// Allow is a Guard's allow that accepts the scrape token only (a process
// without IAM: an edge).
func (s ScrapeToken) Allow(r *http.Request) error {
	tok := BearerToken(r)
	switch {
	case tok == "":
		return ErrNoToken
	case s.Matches(tok):
		return nil
	}
	return errors.New("the bearer token is not this process's scrape token")
}

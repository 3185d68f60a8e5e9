package console

import (
	"crypto/rand"
	"crypto/subtle"
	"encoding/base64"
	"net/http"
	"net/url"
	"sync"
	"time"
)

const (
	// sessionCookie names a signed-in browser's session; preCookie holds
	// the sign-in form's CSRF token before there is a session.
	sessionCookie = "dsec_console"
	preCookie     = "dsec_console_signin"
	// sessionLife bounds a session; a token that expires sooner ends it
	// sooner, and a revoked one ends it at its next request.
	sessionLife = 12 * time.Hour
	// maxSessions bounds the table: past it the oldest session goes.
	maxSessions = 10000
)

// session is one signed-in browser: the token it signed in with (never
// sent back to the browser) and the CSRF token its forms carry.
type session struct {
	id      string
	token   string
	csrf    string
	expires time.Time
}

// sessions maps session IDs (the cookie's value) to sessions. It lives in
// the apiserver's memory: a replica that did not sign a browser in does
// not know its session.
type sessions struct {
	mu sync.Mutex
	m  map[string]*session
}

func newSessions() *sessions { return &sessions{m: map[string]*session{}} }

// randomToken is 32 random bytes, URL-safe base64.
func randomToken() string {
	b := make([]byte, 32)
	rand.Read(b) // never fails (crypto/rand)
	return base64.RawURLEncoding.EncodeToString(b)
}

// add starts a session for token, ending no later than expires (zero:
// the session's own life).
func (s *sessions) add(token string, expires time.Time, now time.Time) *session {
	end := now.Add(sessionLife)
	if !expires.IsZero() && expires.Before(end) {
		end = expires
	}
	se := &session{id: randomToken(), token: token, csrf: randomToken(), expires: end}
	s.mu.Lock()
	defer s.mu.Unlock()
	for id, o := range s.m {
		if !o.expires.After(now) {
			delete(s.m, id)
		}
	}
	if len(s.m) >= maxSessions {
		var oldest *session
		for _, o := range s.m {
			if oldest == nil || o.expires.Before(oldest.expires) {
				oldest = o
			}
		}
		delete(s.m, oldest.id)
	}
	s.m[se.id] = se
	return se
}

// get returns the live session id names.
func (s *sessions) get(id string, now time.Time) (*session, bool) {
	s.mu.Lock()
	defer s.mu.Unlock()
	se, ok := s.m[id]
	if !ok {
		return nil, false
	}
	if !se.expires.After(now) {
		delete(s.m, id)
		return nil, false
	}
	return se, true
}

func (s *sessions) remove(id string) {
	s.mu.Lock()
	defer s.mu.Unlock()
	delete(s.m, id)
}

// cookie is one of the console's cookies: HttpOnly, SameSite=Strict,
// Secure when the request came over TLS, scoped to the console's path.
func cookie(r *http.Request, name, value string, expires time.Time) *http.Cookie {
	c := &http.Cookie{Name: name, Value: value, Path: Prefix, HttpOnly: true,
		SameSite: http.SameSiteStrictMode, Secure: r.TLS != nil}
	if expires.IsZero() {
		c.MaxAge = -1
	} else {
		c.Expires = expires
	}
	return c
}

// sameToken compares two CSRF tokens in constant time; empty never matches.
func sameToken(a, b string) bool {
	return a != "" && subtle.ConstantTimeCompare([]byte(a), []byte(b)) == 1
}

// sameOrigin reports whether a POST's Origin header, when the browser
// sent one, names this host: a cross-site form fails here even before its
// CSRF token is checked.
func sameOrigin(r *http.Request) bool {
	o := r.Header.Get("Origin")
	if o == "" {
		return true
	}
	u, err := url.Parse(o)
	return err == nil && u.Host == r.Host
}

package console

import (
	"context"
	"crypto/aes"
	"crypto/cipher"
	"crypto/hmac"
	"crypto/rand"
	"crypto/sha256"
	"crypto/subtle"
	"encoding/base64"
	"encoding/hex"
	"errors"
	"fmt"
	"net/http"
	"net/url"
	"sync"
	"time"

	"dsec.dev/dsec/internal/errdefs"
	"dsec.dev/dsec/internal/store"
)

const (
	// sessionCookie names a signed-in browser's session; preCookie holds
	// the sign-in form's CSRF token before there is a session.
	sessionCookie = "dsec_console"
	preCookie     = "dsec_console_signin"
	// sessionLife bounds a session; a token that expires sooner ends it
	// sooner, and a revoked one ends it at its next request.
	sessionLife = 12 * time.Hour
	// maxMemSessions bounds the in-memory table: past it the session
	// nearest its end goes.
	maxMemSessions = 10000
)

// session is one signed-in browser: the ID it is stored under, the token
// it signed in with (never sent back to the browser) and the CSRF token
// its forms carry.
//
// The cookie's value is 32 random bytes; everything else is derived from
// it: the stored ID (so the store never holds a cookie), the key the
// token is sealed with (so the store never holds a token in the clear)
// and the CSRF token. Any apiserver given the cookie finds and opens the
// session; none can without it.
type session struct {
	id      string
	token   string
	csrf    string
	expires time.Time
}

// secrets are what a cookie's value gives.
type secrets struct {
	id   string // the stored ID, hex
	key  []byte // AES-256 key sealing the token
	csrf string
}

func derive(cookie string) (secrets, bool) {
	raw, err := base64.RawURLEncoding.DecodeString(cookie)
	if err != nil || len(raw) != 32 {
		return secrets{}, false
	}
	mac := func(label string) []byte {
		h := hmac.New(sha256.New, raw)
		h.Write([]byte("dsec console session " + label))
		return h.Sum(nil)
	}
	return secrets{id: hex.EncodeToString(mac("id")), key: mac("key"),
		csrf: base64.RawURLEncoding.EncodeToString(mac("csrf"))}, true
}

// randomToken is 32 random bytes, URL-safe base64.
func randomToken() string {
	b := make([]byte, 32)
	rand.Read(b) // never fails (crypto/rand)
	return base64.RawURLEncoding.EncodeToString(b)
}

func seal(key []byte, id, token string) string {
	gcm := newGCM(key)
	nonce := make([]byte, gcm.NonceSize())
	rand.Read(nonce)
	return base64.RawStdEncoding.EncodeToString(gcm.Seal(nonce, nonce, []byte(token), []byte(id)))
}

func unseal(key []byte, id, sealed string) (string, error) {
	b, err := base64.RawStdEncoding.DecodeString(sealed)
	gcm := newGCM(key)
	if err != nil || len(b) < gcm.NonceSize() {
		return "", errors.New("the sealed token is malformed")
	}
	tok, err := gcm.Open(nil, b[:gcm.NonceSize()], b[gcm.NonceSize():], []byte(id))
	if err != nil {
		return "", fmt.Errorf("open the sealed token: %w", err)
	}
	return string(tok), nil
}

func newGCM(key []byte) cipher.AEAD {
	blk, err := aes.NewCipher(key)
	if err != nil {
		panic(err) // a 32-byte key always makes a cipher
	}
	gcm, err := cipher.NewGCM(blk)
	if err != nil {
		panic(err)
	}
	return gcm
}

// sessions keeps sessions in a store (Config.Sessions).
type sessions struct {
	st store.ConsoleSessions
}

// add starts a session for token (of token ID tokenID), ending no later
// than expires (zero: the session's own life), and returns it with the
// cookie's value.
func (s sessions) add(ctx context.Context, token, tokenID string, expires, now time.Time) (*session, string, error) {
	end := now.Add(sessionLife)
	if !expires.IsZero() && expires.Before(end) {
		end = expires
	}
	cookie := randomToken()
	sec, _ := derive(cookie)
	err := s.st.PutConsoleSession(ctx, store.ConsoleSession{ID: sec.id, TokenID: tokenID, Sealed: seal(sec.key, sec.id, token),
		Created: now, Expires: end})
	if err != nil {
		return nil, "", err
	}
	return &session{id: sec.id, token: token, csrf: sec.csrf, expires: end}, cookie, nil
}

// get returns the live session a cookie names; nil when there is none
// (unknown, ended, or not a cookie of ours).
func (s sessions) get(ctx context.Context, cookie string, now time.Time) (*session, error) {
	sec, ok := derive(cookie)
	if !ok {
		return nil, nil
	}
	rec, err := s.st.ConsoleSession(ctx, sec.id, now)
	if errors.Is(err, errdefs.ErrNotFound) {
		return nil, nil
	}
	if err != nil {
		return nil, err
	}
	tok, err := unseal(sec.key, sec.id, rec.Sealed)
	if err != nil {
		return nil, nil // not this cookie's session: never opened
	}
	return &session{id: sec.id, token: tok, csrf: sec.csrf, expires: rec.Expires}, nil
}

// memSessions is the store of a console given none: the process's memory,
// so a restart signs everyone out and another apiserver knows none of them.
type memSessions struct {
	mu sync.Mutex
	m  map[string]store.ConsoleSession
}

func newMemSessions() *memSessions { return &memSessions{m: map[string]store.ConsoleSession{}} }

func (s *memSessions) PutConsoleSession(ctx context.Context, se store.ConsoleSession) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	if _, ok := s.m[se.ID]; ok {
		return fmt.Errorf("put console session: its ID is taken: %w", errdefs.ErrAlreadyExists)
	}
	if len(s.m) >= maxMemSessions {
		var oldest store.ConsoleSession
		for _, o := range s.m {
			if oldest.ID == "" || o.Expires.Before(oldest.Expires) {
				oldest = o
			}
		}
		delete(s.m, oldest.ID)
	}
	s.m[se.ID] = se
	return nil
}

func (s *memSessions) ConsoleSession(ctx context.Context, id string, now time.Time) (store.ConsoleSession, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	se, ok := s.m[id]
	if !ok || !se.Expires.After(now) {
		return store.ConsoleSession{}, fmt.Errorf("no such console session: %w", errdefs.ErrNotFound)
	}
	return se, nil
}

func (s *memSessions) DeleteConsoleSession(ctx context.Context, id string) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	delete(s.m, id)
	return nil
}

func (s *memSessions) ExpireConsoleSessions(ctx context.Context, now time.Time) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	n := 0
	for id, se := range s.m {
		if !se.Expires.After(now) {
			delete(s.m, id)
			n++
		}
	}
	return n, nil
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

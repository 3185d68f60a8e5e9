package e2b

import (
	"crypto/hmac"
	"crypto/sha256"
	"crypto/subtle"
	"encoding/base64"
	"encoding/hex"
	"strconv"
	"time"
)

// Signer makes and checks envd access tokens: the HMAC-SHA256 of a sandbox
// ID under a secret every apiserver of the cluster holds, so any of them
// checks a token with no lookup. A token lives as long as its sandbox.
type Signer struct{ secret []byte }

// NewSigner signs with secret (at least 32 random bytes; dsecd keeps one
// in e2b.secret under its root).
func NewSigner(secret []byte) Signer { return Signer{secret: secret} }

// AccessToken is the envd access token of the dsec sandbox id.
func (s Signer) AccessToken(id string) string { return s.token("envd-access-token", id) }

// CheckAccessToken reports whether tok is the access token of id.
func (s Signer) CheckAccessToken(id, tok string) bool {
	return subtle.ConstantTimeCompare([]byte(s.AccessToken(id)), []byte(tok)) == 1
}

// TrafficToken is the traffic access token of the dsec sandbox id: the
// code interpreter's SDK sends it (E2B-Traffic-Access-Token) with the calls
// that carry no envd access token.
func (s Signer) TrafficToken(id string) string { return s.token("traffic-access-token", id) }

// token is the hex HMAC of "purpose:id" under the secret: one kind of
// token per purpose.
func (s Signer) token(purpose, id string) string {
	m := hmac.New(sha256.New, s.secret)
	m.Write([]byte(purpose + ":" + id))
	return hex.EncodeToString(m.Sum(nil))
}

// CheckTrafficToken reports whether tok is the traffic access token of id.
func (s Signer) CheckTrafficToken(id, tok string) bool {
	return subtle.ConstantTimeCompare([]byte(s.TrafficToken(id)), []byte(tok)) == 1
}

// FileSignature is the signature E2B's SDKs put in a download or upload
// URL: "v1_" and the unpadded base64 of SHA-256("path:op:user:token"),
// ":expiry" (Unix seconds) appended when the URL expires.
func FileSignature(path, op, user, token string, expires int64) string {
	raw := path + ":" + op + ":" + user + ":" + token
	if expires != 0 {
		raw += ":" + strconv.FormatInt(expires, 10)
	}
	sum := sha256.Sum256([]byte(raw))
	return "v1_" + base64.RawStdEncoding.EncodeToString(sum[:])
}

// CheckFileSignature reports whether sig signs (path, op, user) for the
// sandbox whose access token is token, and has not expired at now.
func CheckFileSignature(sig, path, op, user, token string, expires int64, now time.Time) bool {
	if expires != 0 && now.Unix() > expires {
		return false
	}
	want := FileSignature(path, op, user, token, expires)
	return subtle.ConstantTimeCompare([]byte(want), []byte(sig)) == 1
}

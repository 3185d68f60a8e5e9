package console

import (
	"net/http/httptest"
	"testing"
)

// TestSafeNext: a sign-in's way back stays inside the console, whatever
// the link that sent the browser there says.
func TestSafeNext(t *testing.T) {
	for next, want := range map[string]string{
		"":                              "/console/sandboxes",
		"/console/sandboxes/sb-1":       "/console/sandboxes/sb-1",
		"/console/sandboxes?state=all":  "/console/sandboxes?state=all",
		"https://evil.example/console/": "/console/sandboxes",
		"//evil.example/console/":       "/console/sandboxes",
		"/console/\\evil":               "/console/sandboxes",
		"/metrics":                      "/console/sandboxes",
	} {
		if got := safeNext(next); got != want {
			t.Errorf("safeNext(%q) = %q, want %q", next, got, want)
		}
	}
}

// TestSameOrigin: a POST whose Origin names another host (or "null") is
// not this console's; one without an Origin (an older client) is left to
// the CSRF token.
func TestSameOrigin(t *testing.T) {
	for origin, want := range map[string]bool{
		"":                      true,
		"http://127.0.0.1:8675": true,
		"http://evil.example":   false,
		"null":                  false,
		"http://127.0.0.1:8676": false,
	} {
		r := httptest.NewRequest("POST", "http://127.0.0.1:8675/console/signin", nil)
		if origin != "" {
			r.Header.Set("Origin", origin)
		}
		if got := sameOrigin(r); got != want {
			t.Errorf("Origin %q: %v, want %v", origin, got, want)
		}
	}
}

package apiserver

import (
	"errors"
	"slices"
	"testing"

	"dsec.dev/dsec/internal/edge/eventlog"
	"dsec.dev/dsec/internal/errdefs"
)

// TestCheckWebhookURL: by default only https to a public host; with
// --webhook-allow-private, http and loopback or private addresses too.
func TestCheckWebhookURL(t *testing.T) {
	for _, tc := range []struct {
		url          string
		allowPrivate bool
		ok           bool
	}{
		{"https://hooks.example.com/dsec", false, true},
		{"https://203.0.113.7/hook", false, true},
		{"http://hooks.example.com/dsec", false, false},
		{"https://127.0.0.1:8443/hook", false, false},
		{"https://[::1]/hook", false, false},
		{"https://10.1.2.3/hook", false, false},
		{"https://192.168.0.9/hook", false, false},
		{"https://169.254.169.254/latest", false, false},
		{"https://localhost/hook", false, false},
		{"ftp://hooks.example.com/x", false, false},
		{"not a url", false, false},
		{"http://127.0.0.1:8080/hook", true, true},
		{"https://10.1.2.3/hook", true, true},
		{"ftp://127.0.0.1/x", true, false},
	} {
		err := checkWebhookURL(tc.url, tc.allowPrivate)
		if tc.ok != (err == nil) || (err != nil && !errors.Is(err, errdefs.ErrInvalidArgument)) {
			t.Errorf("checkWebhookURL(%q, allowPrivate %v) = %v, want ok %v", tc.url, tc.allowPrivate, err, tc.ok)
		}
	}
	if !slices.Equal(eventKinds, eventlog.Kinds) {
		t.Errorf("the apiserver's event kinds %q differ from the edge's %q", eventKinds, eventlog.Kinds)
	}
}

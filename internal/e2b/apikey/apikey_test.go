package apikey

import (
	"errors"
	"regexp"
	"testing"

	"dsec.dev/dsec/internal/errdefs"
)

func TestRoundTrip(t *testing.T) {
	const token = "dsec_3q2-7wAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA"
	key, err := Of(token)
	if err != nil {
		t.Fatal(err)
	}
	// The form E2B's SDKs check.
	if !regexp.MustCompile(`^e2b_[0-9a-f]+$`).MatchString(key) {
		t.Errorf("key %q is not e2b_ and hex", key)
	}
	if back, err := Token(key); err != nil || back != token {
		t.Errorf("Token(%q) = %q, %v; want %q", key, back, err, token)
	}
	if back, err := Token(token); err != nil || back != token {
		t.Errorf("a dsec token as a key: %q, %v", back, err)
	}
	for _, bad := range []string{"", "e2b_", "e2b_xyz", "sk_123"} {
		if _, err := Token(bad); !errors.Is(err, errdefs.ErrUnauthenticated) {
			t.Errorf("Token(%q): %v, want unauthenticated", bad, err)
		}
	}
	if _, err := Of("not-a-token"); !errors.Is(err, errdefs.ErrInvalidArgument) {
		t.Errorf("Of of a non-token: %v", err)
	}
}

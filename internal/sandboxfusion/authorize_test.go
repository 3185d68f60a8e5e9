package sandboxfusion

import (
	"bytes"
	"context"
	"fmt"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"

	"dsec.dev/dsec/internal/errdefs"
)

// TestAuthorize: with Config.Authorize a call's bearer token decides it: a
// refused token answers 401, a role too low 403, and neither reaches the
// runner; ping needs none.
func TestAuthorize(t *testing.T) {
	f := canned(success(""), nil)
	h := NewHandler(f, Config{Authorize: func(ctx context.Context, token, peer string) (context.Context, error) {
		switch token {
		case "viewer":
			return nil, fmt.Errorf("RunCode needs runner: %w", errdefs.ErrPermissionDenied)
		case "runner", "":
			return ctx, nil
		}
		return nil, fmt.Errorf("refused: %w", errdefs.ErrUnauthenticated)
	}})
	for _, tc := range []struct {
		token string
		code  int
	}{{"forged", 401}, {"viewer", 403}, {"runner", 200}, {"", 200}} {
		r := httptest.NewRequest("POST", "/run_code", strings.NewReader(`{"code": "x", "language": "python"}`))
		if tc.token != "" {
			r.Header.Set("Authorization", "Bearer "+tc.token)
		}
		w := httptest.NewRecorder()
		h.ServeHTTP(w, r)
		if w.Code != tc.code {
			t.Errorf("token %q: %d %s, want %d", tc.token, w.Code, w.Body, tc.code)
		}
	}
	if n := len(f.requests()); n != 2 {
		t.Errorf("the runner got %d calls, want 2 (the runner's and the untokened)", n)
	}
	w := httptest.NewRecorder()
	r := httptest.NewRequest("GET", "/v1/ping", bytes.NewReader(nil))
	r.Header.Set("Authorization", "Bearer forged")
	h.ServeHTTP(w, r)
	if w.Code != http.StatusOK {
		t.Errorf("ping with a forged token: %d", w.Code)
	}
}

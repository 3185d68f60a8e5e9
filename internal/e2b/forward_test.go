package e2b

import (
	"context"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"testing"

	"connectrpc.com/connect"

	dsecv1 "dsec.dev/dsec/api/gen/dsec/v1"
	"dsec.dev/dsec/api/gen/dsec/v1/dsecv1connect"
	"dsec.dev/dsec/internal/errdefs"
	"dsec.dev/dsec/internal/memconn"
)

// headerDsec answers List, recording the Authorization header it came with,
// and refuses it as the apiserver refuses a role too low.
type headerDsec struct {
	dsecv1connect.UnimplementedSandboxServiceHandler
	mu    sync.Mutex
	seen  []string
	peers []string
}

func (d *headerDsec) List(ctx context.Context, req *connect.Request[dsecv1.ListRequest]) (*connect.Response[dsecv1.ListResponse], error) {
	d.mu.Lock()
	defer d.mu.Unlock()
	d.seen = append(d.seen, req.Header().Get("Authorization"))
	d.peers = append(d.peers, req.Header().Get(memconn.PeerHeader))
	return nil, errdefs.ToConnect(errdefs.ErrPermissionDenied)
}

// TestForwardToken: the control plane's calls reach dsec with the caller's
// API key as its dsec bearer token, so the apiserver decides them with the
// key's authority, and its refusal reaches the caller as E2B's 403; the
// caller's address goes with them for the audit trail.
func TestForwardToken(t *testing.T) {
	const token = "dsec_BBBBBBBBBBBBBBBBBBBBBBBBBBBBBBBBBBBBBBBBBBA"
	key, err := APIKey(token)
	if err != nil {
		t.Fatal(err)
	}
	d := &headerDsec{}
	mux := http.NewServeMux()
	mux.Handle(dsecv1connect.NewSandboxServiceHandler(d))
	ds := httptest.NewServer(mux)
	defer ds.Close()
	h, err := NewHandler(Config{API: dsecv1connect.NewSandboxServiceClient(ds.Client(), ds.URL, connect.WithInterceptors(ForwardToken{})),
		Auth: fakeAuth{token}, Signer: NewSigner([]byte(strings.Repeat("s", 32)))})
	if err != nil {
		t.Fatal(err)
	}
	srv := httptest.NewServer(h)
	defer srv.Close()
	req, err := http.NewRequest("GET", srv.URL+"/sandboxes", nil)
	if err != nil {
		t.Fatal(err)
	}
	req.Header.Set("X-API-KEY", key)
	resp, err := srv.Client().Do(req)
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != http.StatusForbidden {
		t.Errorf("a call dsec refused: %d, want 403", resp.StatusCode)
	}
	d.mu.Lock()
	defer d.mu.Unlock()
	if len(d.seen) == 0 || d.seen[0] != "Bearer "+token {
		t.Errorf("dsec saw Authorization %q, want the key's token", d.seen)
	}
	if len(d.peers) == 0 || !strings.HasPrefix(d.peers[0], "127.0.0.1:") {
		t.Errorf("dsec saw the caller's address as %q, want the E2B client's", d.peers)
	}
}

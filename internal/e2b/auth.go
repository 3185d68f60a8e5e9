package e2b

import (
	"context"
	"crypto/sha256"
	"errors"
	"fmt"
	"net/http"
	"sync"
	"time"

	"connectrpc.com/connect"

	dsecv1 "dsec.dev/dsec/api/gen/dsec/v1"
	"dsec.dev/dsec/internal/errdefs"
	"dsec.dev/dsec/internal/memconn"
)

// keyCache remembers API keys the store accepted, by their SHA-256, as the
// apiserver's own token check does: a revocation takes effect within
// keyTTL.
type keyCache struct {
	mu sync.Mutex
	m  map[[32]byte]time.Time
}

const (
	keyTTL      = 10 * time.Second
	keyCacheMax = 10000
)

func (c *keyCache) ok(key string, now time.Time) bool {
	k := sha256.Sum256([]byte(key))
	c.mu.Lock()
	defer c.mu.Unlock()
	at, ok := c.m[k]
	return ok && now.Sub(at) <= keyTTL
}

func (c *keyCache) put(key string, now time.Time) {
	k := sha256.Sum256([]byte(key))
	c.mu.Lock()
	defer c.mu.Unlock()
	if len(c.m) >= keyCacheMax {
		c.m = map[[32]byte]time.Time{}
	}
	c.m[k] = now
}

// checkKey checks the request's X-API-KEY (or a bearer token, which E2B's
// SDKs send when given an access token instead of a key) and returns the
// dsec token it stands for.
func (h *Handler) checkKey(r *http.Request) (string, error) {
	key := r.Header.Get("X-API-KEY")
	if key == "" {
		if tok, ok := cutBearer(r.Header.Get("Authorization")); ok {
			key = tok
		}
	}
	if key == "" {
		return "", fmt.Errorf("an API key is required (X-API-KEY; set E2B_API_KEY to the output of `dsec token --e2b`): %w", errdefs.ErrUnauthenticated)
	}
	tok, err := TokenOf(key)
	if err != nil {
		return "", err
	}
	now := time.Now()
	if h.keys.ok(key, now) {
		return tok, nil
	}
	if _, err := h.cfg.Auth.Authenticate(r.Context(), tok); err != nil {
		if errors.Is(err, errdefs.ErrUnauthenticated) {
			h.log.Warn("E2B API key refused", "peer", r.RemoteAddr, "path", r.URL.Path)
			return "", fmt.Errorf("the API key was refused (unknown, expired or revoked): %w", errdefs.ErrUnauthenticated)
		}
		return "", fmt.Errorf("check the API key: %w", err)
	}
	h.keys.put(key, now)
	return tok, nil
}

type callerKey struct{}

// caller is who a control plane call came from: the dsec token of its API
// key and its address.
type caller struct{ token, peer string }

// withCaller is ctx carrying the dsec token of the API key a control plane
// call came with and the caller's address, which ForwardToken passes on to
// the apiserver.
func withCaller(ctx context.Context, tok, peer string) context.Context {
	return context.WithValue(ctx, callerKey{}, caller{tok, peer})
}

// ForwardToken is the interceptor of Config.API's client: it sends the
// dsec token behind the caller's API key as the call's bearer token, so the
// apiserver decides the call with the key's authority (a sandbox of
// another project is NotFound through E2B as through dsec's own API). The
// data plane's calls carry no key (a sandbox's access token, which the
// control plane gave out to a caller who could see the sandbox, admits
// them) and go as the adapter's own.
// The caller's address goes too (memconn.PeerHeader), for the audit trail.
type ForwardToken struct{}

func (ForwardToken) WrapUnary(next connect.UnaryFunc) connect.UnaryFunc {
	return func(ctx context.Context, req connect.AnyRequest) (connect.AnyResponse, error) {
		forward(ctx, req.Header())
		return next(ctx, req)
	}
}

func (ForwardToken) WrapStreamingClient(next connect.StreamingClientFunc) connect.StreamingClientFunc {
	return func(ctx context.Context, spec connect.Spec) connect.StreamingClientConn {
		conn := next(ctx, spec)
		forward(ctx, conn.RequestHeader())
		return conn
	}
}

func forward(ctx context.Context, h http.Header) {
	if c, ok := ctx.Value(callerKey{}).(caller); ok {
		h.Set("Authorization", "Bearer "+c.token)
		if c.peer != "" {
			h.Set(memconn.PeerHeader, c.peer)
		}
	}
}

func (ForwardToken) WrapStreamingHandler(next connect.StreamingHandlerFunc) connect.StreamingHandlerFunc {
	return next
}

func cutBearer(v string) (string, bool) {
	const p = "Bearer "
	if len(v) > len(p) && v[:len(p)] == p {
		return v[len(p):], true
	}
	return "", false
}

// liveCache remembers for a moment that a sandbox serves, so the data
// plane's calls (an exec, a file read) do not each cost a Get.
type liveCache struct {
	mu sync.Mutex
	m  map[string]time.Time
}

const liveTTL = time.Second

// live reports an error unless the dsec sandbox id runs or is paused (a
// call resumes it, as its spec says).
func (h *Handler) live(ctx context.Context, id string) error {
	now := time.Now()
	h.alive.mu.Lock()
	at, ok := h.alive.m[id]
	h.alive.mu.Unlock()
	if ok && now.Sub(at) < liveTTL {
		return nil
	}
	sb, err := h.get(ctx, id)
	if err != nil {
		return err
	}
	switch sb.GetState() {
	case dsecv1.State_STATE_RUNNING, dsecv1.State_STATE_PAUSED, dsecv1.State_STATE_PAUSING, dsecv1.State_STATE_RESUMING:
	default:
		return fmt.Errorf("it is %s", stateName(sb.GetState()))
	}
	h.markLive(id, now)
	return nil
}

// markLive records that id serves as of now: the control plane calls it
// when a create or connect answers, so the first data-plane call that
// follows costs no Get.
func (h *Handler) markLive(id string, now time.Time) {
	h.alive.mu.Lock()
	if len(h.alive.m) >= keyCacheMax {
		h.alive.m = map[string]time.Time{}
	}
	h.alive.m[id] = now
	h.alive.mu.Unlock()
}

// forget drops id from the live cache (it was killed or paused here).
func (h *Handler) forget(id string) {
	h.alive.mu.Lock()
	delete(h.alive.m, id)
	h.alive.mu.Unlock()
}

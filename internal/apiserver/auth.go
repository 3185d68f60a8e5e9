package apiserver

import (
	"context"
	"crypto/sha256"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"strings"
	"sync"
	"time"

	"connectrpc.com/connect"

	"dsec.dev/dsec/internal/errdefs"
	"dsec.dev/dsec/internal/iam"
)

// Authenticator checks a bearer token; the metadata store is one.
type Authenticator interface {
	Authenticate(ctx context.Context, token string) (iam.Authority, error)
}

type trustedKey struct{}

// ConnContext marks the calls of a connection on a Unix socket as trusted:
// the socket's file mode already says who may connect (the local node's
// users). So are in-process connections (package memconn), by which the
// compatibility adapters, which check their own callers' keys, reach the
// apiserver. Every other connection must carry a bearer token. Set it as
// the http.Server's ConnContext.
func ConnContext(ctx context.Context, c net.Conn) context.Context {
	if c.LocalAddr().Network() == "unix" {
		return context.WithValue(ctx, trustedKey{}, true)
	}
	if ip, ok := c.(interface{ InProcess() bool }); ok && ip.InProcess() {
		return context.WithValue(ctx, trustedKey{}, true)
	}
	return ctx
}

// PrincipalOf is who made the call, when a token said so.
func PrincipalOf(ctx context.Context) (iam.Authority, bool) {
	return iam.AuthorityFrom(ctx)
}

// authInterceptor refuses calls from untrusted connections without a valid
// bearer token. The refusal never echoes the token; forged, expired and
// revoked tokens are logged with the peer's address. A token the store
// accepted is trusted again for authCacheTTL without asking the store (a
// round trip to PostgreSQL on every exec would cost more than the exec's own
// hop to its edge), so a revocation takes effect within that time.
type authInterceptor struct {
	auth  Authenticator
	log   *slog.Logger
	cache *authCache
}

// authCacheTTL bounds how long a revoked token may still be let in.
const authCacheTTL = 10 * time.Second

// authCache remembers tokens the store accepted, by their SHA-256.
type authCache struct {
	mu sync.Mutex
	m  map[[32]byte]authEntry
}

type authEntry struct {
	p  iam.Authority
	at time.Time
}

const authCacheMax = 10000

func (c *authCache) get(tok string, now time.Time) (iam.Authority, bool) {
	k := sha256.Sum256([]byte(tok))
	c.mu.Lock()
	defer c.mu.Unlock()
	e, ok := c.m[k]
	if !ok || now.Sub(e.at) > authCacheTTL {
		return iam.Authority{}, false
	}
	return e.p, true
}

func (c *authCache) put(tok string, p iam.Authority, now time.Time) {
	k := sha256.Sum256([]byte(tok))
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.m == nil || len(c.m) >= authCacheMax {
		c.m = map[[32]byte]authEntry{} // a flood of tokens: start over
	}
	c.m[k] = authEntry{p: p, at: now}
}

func (a authInterceptor) check(ctx context.Context, spec connect.Spec, peer connect.Peer, h interface{ Get(string) string }) (context.Context, error) {
	if trusted, _ := ctx.Value(trustedKey{}).(bool); trusted {
		return ctx, nil
	}
	raw := h.Get("Authorization")
	tok, ok := strings.CutPrefix(raw, "Bearer ")
	if !ok || strings.TrimSpace(tok) == "" {
		return nil, fmt.Errorf("%s needs a bearer token on this address (set DSEC_TOKEN, or DSEC_TOKEN_FILE to a file holding one): %w",
			spec.Procedure, errdefs.ErrUnauthenticated)
	}
	tok = strings.TrimSpace(tok)
	now := time.Now()
	if p, ok := a.cache.get(tok, now); ok {
		return iam.WithAuthority(ctx, p), nil
	}
	p, err := a.auth.Authenticate(ctx, tok)
	if err != nil {
		if errors.Is(err, errdefs.ErrUnauthenticated) {
			a.log.Warn("token refused", "peer", peer.Addr, "procedure", spec.Procedure, "err", err)
			return nil, fmt.Errorf("the bearer token was refused (unknown, expired or revoked): %w", errdefs.ErrUnauthenticated)
		}
		return nil, fmt.Errorf("check the bearer token: %w", err) // the store is away: Unavailable
	}
	a.cache.put(tok, p, now)
	return iam.WithAuthority(ctx, p), nil
}

func (a authInterceptor) WrapUnary(next connect.UnaryFunc) connect.UnaryFunc {
	return func(ctx context.Context, req connect.AnyRequest) (connect.AnyResponse, error) {
		ctx, err := a.check(ctx, req.Spec(), req.Peer(), req.Header())
		if err != nil {
			return nil, errdefs.ToConnect(err)
		}
		return next(ctx, req)
	}
}

func (a authInterceptor) WrapStreamingClient(next connect.StreamingClientFunc) connect.StreamingClientFunc {
	return next
}

func (a authInterceptor) WrapStreamingHandler(next connect.StreamingHandlerFunc) connect.StreamingHandlerFunc {
	return func(ctx context.Context, conn connect.StreamingHandlerConn) error {
		ctx, err := a.check(ctx, conn.Spec(), conn.Peer(), conn.RequestHeader())
		if err != nil {
			return errdefs.ToConnect(err)
		}
		return next(ctx, conn)
	}
}

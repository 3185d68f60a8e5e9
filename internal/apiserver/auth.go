package apiserver

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"strings"

	"connectrpc.com/connect"

	"dsec.dev/dsec/internal/errdefs"
	"dsec.dev/dsec/internal/iam"
	"dsec.dev/dsec/internal/memconn"
)

// Authenticator checks bearer tokens: the metadata store is one. The
// apiserver keeps what it answers in an iam.Cache, so a check costs no
// round trip; Generation is how revocations reach the cache.
type Authenticator = iam.Source

type connKind int

const (
	connRemote connKind = iota
	// connUnix: a Unix socket, whose file mode already says who may
	// connect (the local node's users): the node's administrator.
	connUnix
	// connInProcess: package memconn, by which the compatibility adapters
	// reach the apiserver. They forward their caller's token as a bearer
	// token; a call without one is the adapter's own, the node's.
	connInProcess
)

type connKindKey struct{}

// ConnContext records what kind of connection a call came on: a Unix
// socket's calls are the node administrator's, an in-process connection's
// (package memconn) too unless they carry a token, and every other
// connection's must carry a bearer token. Set it as the http.Server's
// ConnContext.
func ConnContext(ctx context.Context, c net.Conn) context.Context {
	if c.LocalAddr().Network() == "unix" {
		return context.WithValue(ctx, connKindKey{}, connUnix)
	}
	if ip, ok := c.(interface{ InProcess() bool }); ok && ip.InProcess() {
		return context.WithValue(ctx, connKindKey{}, connInProcess)
	}
	return ctx
}

// authInterceptor authenticates every call and authorises its operation
// (iam.Allow with the role ops.go names for the procedure, on the token's
// project; an operation on a layer, image, snapshot or pool only needs the
// role somewhere, and its handler decides on the object's project), then
// puts the caller's authority in the context (iam.WithAuthority) for the
// handlers. The refusal never echoes the token; forged, expired and
// revoked tokens and refused operations are logged with the peer's
// address, and audited.
type authInterceptor struct {
	cache *iam.Cache // nil: every caller is the node's administrator
	log   *slog.Logger
	audit *auditLog // nil: no audit trail
	// projects are the sandboxes' projects this apiserver has looked up,
	// which a call on a sandbox is audited under (nil: none known).
	projects *sandboxProjects
}

// authority is who makes the call.
func (a authInterceptor) authority(ctx context.Context, spec connect.Spec, peer connect.Peer, h interface{ Get(string) string }) (iam.Authority, error) {
	if a.cache == nil {
		return iam.NodeAdmin(), nil
	}
	kind, _ := ctx.Value(connKindKey{}).(connKind)
	raw := h.Get("Authorization")
	switch {
	case kind == connUnix:
		return iam.NodeAdmin(), nil
	case kind == connInProcess && raw == "":
		return iam.NodeAdmin(), nil
	}
	tok, ok := strings.CutPrefix(raw, "Bearer ")
	if !ok || strings.TrimSpace(tok) == "" {
		// How to send one is the client's to say (the SDKs and the CLI
		// name their variables and flags), so the answer does not.
		return iam.Authority{}, fmt.Errorf("%s needs a bearer token on this address: %w", spec.Procedure, errdefs.ErrUnauthenticated)
	}
	au, err := a.cache.Authenticate(ctx, strings.TrimSpace(tok))
	if err != nil {
		if errors.Is(err, errdefs.ErrUnauthenticated) {
			a.log.Warn("token refused", "peer", peer.Addr, "procedure", spec.Procedure, "err", err)
			return iam.Authority{}, fmt.Errorf("the bearer token was refused (unknown, expired or revoked): %w", errdefs.ErrUnauthenticated)
		}
		return iam.Authority{}, fmt.Errorf("check the bearer token: %w", err) // the store is away: Unavailable
	}
	return au, nil
}

// peerOf is where a call came from for the audit trail: the connection's
// peer, or for a call an in-process adapter (E2B's API) makes for a
// client, that client's address as the adapter says it.
func peerOf(peer connect.Peer, h interface{ Get(string) string }) connect.Peer {
	if peer.Addr == (memconn.Addr{}).String() {
		if p := h.Get(memconn.PeerHeader); p != "" {
			peer.Addr = p
		}
	}
	return peer
}

// check authenticates and authorises a call; the context it returns
// carries the caller's authority.
func (a authInterceptor) check(ctx context.Context, spec connect.Spec, peer connect.Peer, h interface{ Get(string) string }) (context.Context, iam.Authority, error) {
	peer = peerOf(peer, h)
	au, err := a.authority(ctx, spec, peer, h)
	if err != nil {
		a.audit.add(iam.Authority{}, spec.Procedure, "", peer.Addr, err)
		return nil, au, err
	}
	// IAMService's handlers decide each call on the project it names, with
	// the store's rules (a runner token may revoke itself, an admin of a
	// sub-project manages it): authentication is all they need here.
	if strings.HasPrefix(spec.Procedure, "/dsec.v1.IAMService/") {
		return withOp(iam.WithAuthority(ctx, au), iam.Op(spec.Procedure)), au, nil
	}
	allow := iam.Allow(au, iam.Op(spec.Procedure), au.Project)
	if objectScoped[spec.Procedure] {
		// Decided by the handler on the object's project (objects.go).
		allow = allowSomewhere(au, iam.Op(spec.Procedure))
	}
	if err := allow; err != nil {
		a.log.Warn("call refused", "peer", peer.Addr, "procedure", spec.Procedure, "principal", au.Principal, "err", err)
		a.audit.add(au, spec.Procedure, "", peer.Addr, err)
		return nil, au, err
	}
	return withOp(iam.WithAuthority(ctx, au), iam.Op(spec.Procedure)), au, nil
}

func (a authInterceptor) WrapUnary(next connect.UnaryFunc) connect.UnaryFunc {
	return func(ctx context.Context, req connect.AnyRequest) (connect.AnyResponse, error) {
		ctx, au, err := a.check(ctx, req.Spec(), req.Peer(), req.Header())
		if err != nil {
			return nil, errdefs.ToConnect(err)
		}
		resp, err := next(ctx, req)
		if in, id, ok := hiddenFrom(au, err); ok {
			a.audit.add(in, req.Spec().Procedure, id, peerOf(req.Peer(), req.Header()).Addr, err)
		} else if audited(req.Spec().Procedure) {
			in := au
			in.Project = auditProject(au, req.Any(), a.projects)
			a.audit.add(in, req.Spec().Procedure, objectOf(req.Any(), resp, err), peerOf(req.Peer(), req.Header()).Addr, err)
		}
		return resp, err
	}
}

func (a authInterceptor) WrapStreamingClient(next connect.StreamingClientFunc) connect.StreamingClientFunc {
	return next
}

func (a authInterceptor) WrapStreamingHandler(next connect.StreamingHandlerFunc) connect.StreamingHandlerFunc {
	return func(ctx context.Context, conn connect.StreamingHandlerConn) error {
		ctx, au, err := a.check(ctx, conn.Spec(), conn.Peer(), conn.RequestHeader())
		if err != nil {
			return errdefs.ToConnect(err)
		}
		err = next(ctx, conn)
		if in, id, ok := hiddenFrom(au, err); ok {
			a.audit.add(in, conn.Spec().Procedure, id, peerOf(conn.Peer(), conn.RequestHeader()).Addr, err)
		} else if audited(conn.Spec().Procedure) {
			a.audit.add(au, conn.Spec().Procedure, "", peerOf(conn.Peer(), conn.RequestHeader()).Addr, err)
		}
		return err
	}
}

// AuthorizeFnCall decides a FnCall made through an adapter that is not a
// Connect service (SandboxFusion's API) by the caller's bearer token, as
// the interceptor decides FnCallService.RunCode, and returns the context
// to run it in, carrying the caller's authority. A call without a token
// runs as a runner of the project Config.TokenlessFnCall names, or is
// refused (Unauthenticated) when it names none; without Auth every call
// is the node administrator's.
func (s *Server) AuthorizeFnCall(ctx context.Context, token, peer string) (context.Context, error) {
	const op = "/dsec.v1.FnCallService/RunCode"
	if s.authn == nil {
		return iam.WithAuthority(ctx, iam.NodeAdmin()), nil
	}
	if token == "" {
		a, err := tokenless(s.cfg.TokenlessFnCall)
		if err != nil {
			s.log.Warn("token-less call refused", "peer", peer, "procedure", op)
			s.audit.add(iam.Authority{}, op, "", peer, err)
			return nil, err
		}
		return withOp(iam.WithAuthority(ctx, a), iam.Op(op)), nil
	}
	a := authInterceptor{cache: s.authn, log: s.log, audit: s.audit}
	h := http.Header{}
	h.Set("Authorization", "Bearer "+token)
	ctx, _, err := a.check(ctx, connect.Spec{Procedure: op}, connect.Peer{Addr: peer}, h)
	return ctx, err
}

// TokenlessPrincipal is the principal a call without a token runs as
// where an operator allows such calls (Config.TokenlessFnCall): it names
// no stored principal, only the calls in the audit trail.
const TokenlessPrincipal = "tokenless"

// tokenless is the authority of a SandboxFusion call without a token:
// runner on project, or a refusal saying how to call when project is "".
func tokenless(project string) (iam.Authority, error) {
	if project == "" {
		return iam.Authority{}, fmt.Errorf("SandboxFusion's API on this server needs a dsec token (Authorization: Bearer <token> of a runner); "+
			"calls without one are refused unless the server is started with --sandboxfusion-project naming the project they run in: %w", errdefs.ErrUnauthenticated)
	}
	path, err := iam.CleanPath(project)
	if err != nil {
		return iam.Authority{}, fmt.Errorf("the project of token-less SandboxFusion calls: %w", err)
	}
	return iam.Authority{Principal: TokenlessPrincipal, Project: path, Role: iam.Runner,
		Bindings: []iam.Binding{{Project: path, Role: iam.Runner}}}, nil
}

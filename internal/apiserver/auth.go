package apiserver

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"strings"
	"sync"

	"connectrpc.com/connect"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/reflect/protoreflect"
	"google.golang.org/protobuf/reflect/protoregistry"

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
		return nil, iam.Authority{}, err
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
		return nil, au, err
	}
	return withOp(iam.WithAuthority(ctx, au), iam.Op(spec.Procedure)), au, nil
}

func (a authInterceptor) WrapUnary(next connect.UnaryFunc) connect.UnaryFunc {
	return func(ctx context.Context, req connect.AnyRequest) (connect.AnyResponse, error) {
		peer := peerOf(req.Peer(), req.Header()).Addr
		ctx, au, err := a.check(ctx, req.Spec(), req.Peer(), req.Header())
		if err != nil {
			a.record(au, req.Spec().Procedure, req.Any(), nil, nil, peer, err)
			return nil, errdefs.ToConnect(err)
		}
		ctx, note := withAuditNote(ctx)
		resp, err := next(ctx, req)
		a.record(au, req.Spec().Procedure, req.Any(), resp, note, peer, err)
		return resp, err
	}
}

// record queues the audit record of a call by au that ended with err, if
// the trail keeps it: a call on a sandbox the token cannot see (under the
// sandbox's project), a management call (audited), and a refused call of
// any procedure. req is the call's request (a stream's first message; nil
// when none was read), which names the call's object and the project it
// is recorded under (auditProject, or what the handler noted).
func (a authInterceptor) record(au iam.Authority, procedure string, req any, resp connect.AnyResponse, note *auditNote, peer string, err error) {
	if a.audit == nil {
		return
	}
	if in, id, ok := hiddenFrom(au, err); ok {
		a.audit.add(in, procedure, id, peer, err)
		return
	}
	if !audited(procedure) && !refused(err) {
		return
	}
	req = requestPart(req)
	in := au
	if au.Node || au.Principal != "" {
		// A caller who was not authenticated names no project to be
		// recorded under: its records are the root's.
		in.Project = auditProject(au, req, a.projects)
		if p, ok := note.get(); ok && iam.Within(p, au.Project) {
			in.Project = p
		}
	}
	a.audit.add(in, procedure, objectOf(req, resp, err), peer, err)
}

// refused reports whether err refuses the caller: its token, or its role
// for what it asked.
func refused(err error) bool {
	switch connect.CodeOf(errdefs.ToConnect(err)) {
	case connect.CodeUnauthenticated, connect.CodePermissionDenied:
		return err != nil
	}
	return false
}

func (a authInterceptor) WrapStreamingClient(next connect.StreamingClientFunc) connect.StreamingClientFunc {
	return next
}

func (a authInterceptor) WrapStreamingHandler(next connect.StreamingHandlerFunc) connect.StreamingHandlerFunc {
	return func(ctx context.Context, conn connect.StreamingHandlerConn) error {
		peer := peerOf(conn.Peer(), conn.RequestHeader()).Addr
		ctx, au, err := a.check(ctx, conn.Spec(), conn.Peer(), conn.RequestHeader())
		if err != nil {
			a.record(au, conn.Spec().Procedure, refusedRequest(conn), nil, nil, peer, err)
			return errdefs.ToConnect(err)
		}
		ctx, note := withAuditNote(ctx)
		first := &firstReceived{StreamingHandlerConn: conn}
		err = next(ctx, first)
		a.record(au, conn.Spec().Procedure, first.get(), nil, note, peer, err)
		return err
	}
}

// firstReceived is a stream's connection that keeps a copy of the first
// message received, which names the call's object for the audit trail
// (the sandbox of an exec or a shell, the ref of an upload), as a unary
// call's request does.
type firstReceived struct {
	connect.StreamingHandlerConn
	mu    sync.Mutex
	first proto.Message
}

func (c *firstReceived) Receive(m any) error {
	err := c.StreamingHandlerConn.Receive(m)
	if pm, ok := m.(proto.Message); ok && err == nil {
		c.mu.Lock()
		if c.first == nil {
			c.first = proto.Clone(pm) // the handler may receive the next one into m
		}
		c.mu.Unlock()
	}
	return err
}

// get is the first message received, nil when none was.
func (c *firstReceived) get() any {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.first == nil {
		return nil
	}
	return c.first
}

// refusedRequest reads the request of a server stream refused before its
// handler ran, to name the call's object in the audit record, as a
// refused unary call's does; nil for a client or bidirectional stream,
// whose first message a client may hold back.
func refusedRequest(conn connect.StreamingHandlerConn) any {
	if conn.Spec().StreamType != connect.StreamTypeServer {
		return nil
	}
	md, ok := conn.Spec().Schema.(protoreflect.MethodDescriptor)
	if !ok {
		return nil
	}
	mt, err := protoregistry.GlobalTypes.FindMessageByName(md.Input().FullName())
	if err != nil {
		return nil
	}
	m := mt.New().Interface()
	if err := conn.Receive(m); err != nil {
		return nil
	}
	return m
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
	ctx, au, err := a.check(ctx, connect.Spec{Procedure: op}, connect.Peer{Addr: peer}, h)
	if err != nil {
		a.record(au, op, nil, nil, nil, peer, err)
	}
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

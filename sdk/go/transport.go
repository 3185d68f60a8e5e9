package dsec

import (
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptrace"
	"net/url"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"connectrpc.com/connect"

	dsecv1 "dsec.dev/dsec/api/gen/dsec/v1"
	"dsec.dev/dsec/api/gen/dsec/v1/dsecv1connect"
)

// endpoint is one apiserver address and the HTTP transport that reaches it.
type endpoint struct {
	addr   string // as given, for messages
	scheme string // "http" or "https"
	host   string // the URL's host ("dsecd" on a Unix socket)
	prefix string // path before the procedure, without a trailing slash
	rt     http.RoundTripper
	// up carries uploads: HTTP/2 where the SDK made the transports (see
	// uploadTransport), else rt.
	up http.RoundTripper
}

// splitAddrs splits a comma-separated address list.
func splitAddrs(list string) ([]string, error) {
	var out []string
	for _, a := range strings.Split(list, ",") {
		a = strings.TrimSpace(a)
		if a == "" {
			return nil, invalid("address list %q has an empty entry", list)
		}
		out = append(out, a)
	}
	return out, nil
}

// parseEndpoint reads unix:///path, http://host:port, https://host:port or
// host:port (http). socket is the Unix socket's path, else "".
func parseEndpoint(addr string) (ep *endpoint, socket string, err error) {
	ep = &endpoint{addr: addr, scheme: "http"}
	switch {
	case strings.HasPrefix(addr, "unix://"):
		socket = strings.TrimPrefix(addr, "unix://")
		if socket == "" {
			return nil, "", invalid("address %q names no socket", addr)
		}
		ep.host = "dsecd"
		return ep, socket, nil
	case strings.HasPrefix(addr, "http://"), strings.HasPrefix(addr, "https://"):
		u, err := url.Parse(addr)
		if err != nil || u.Host == "" || u.User != nil || u.RawQuery != "" || u.Fragment != "" {
			return nil, "", invalid("address %q is not a URL of the form scheme://host:port[/path]", addr)
		}
		ep.scheme, ep.host, ep.prefix = u.Scheme, u.Host, strings.TrimSuffix(u.Path, "/")
		return ep, "", nil
	case strings.Contains(addr, "://"):
		return nil, "", invalid("address %q: only unix://, http:// and https:// are supported", addr)
	}
	if _, _, err := net.SplitHostPort(addr); err != nil {
		return nil, "", invalid("address %q: %v", addr, err)
	}
	ep.host = addr
	return ep, "", nil
}

// newTransport is the HTTP/1.1 transport of one endpoint: kept-alive
// connections, over TCP, TLS or a Unix socket.
func newTransport(socket string, tlsConf *tls.Config) *http.Transport {
	dialer := &net.Dialer{Timeout: 10 * time.Second, KeepAlive: 15 * time.Second}
	tr := &http.Transport{Protocols: new(http.Protocols), MaxIdleConnsPerHost: 64, IdleConnTimeout: 90 * time.Second,
		TLSClientConfig: tlsConf, TLSHandshakeTimeout: 10 * time.Second, DialContext: dialer.DialContext}
	tr.Protocols.SetHTTP1(true)
	if socket != "" {
		tr.DialContext = func(ctx context.Context, _, _ string) (net.Conn, error) {
			return dialer.DialContext(ctx, "unix", socket)
		}
	}
	return tr
}

// uploadTransport is newTransport for layer uploads: HTTP/2 (negotiated
// over TLS, cleartext otherwise, which dsecd serves). A server may refuse
// an upload before its end (too big, a hostile entry); over HTTP/2 its
// answer comes back while the rest is unsent, where HTTP/1.1 can lose it to
// the connection the server closes under the body.
func uploadTransport(socket string, tlsConf *tls.Config, https bool) *http.Transport {
	tr := newTransport(socket, tlsConf)
	tr.Protocols = new(http.Protocols)
	if https {
		tr.Protocols.SetHTTP1(true)
		tr.Protocols.SetHTTP2(true)
	} else {
		tr.Protocols.SetUnencryptedHTTP2(true)
	}
	return tr
}

// pool sends each request to one of its endpoints: the current one, or
// the next when a request cannot reach it. It adds the bearer token to every
// request. It is the RoundTripper under every generated client.
type pool struct {
	eps  []*endpoint
	cur  atomic.Int32 // index of the current endpoint
	cred credential
	// basePath is the path of the base URL the generated clients are made
	// with, which each endpoint's prefix replaces.
	basePath string
	// addrFrom says where the addresses came from (see AddrFrom).
	addrFrom string
}

// advance moves the current endpoint past i, unless another call has moved it already.
func (p *pool) advance(i int) {
	p.cur.CompareAndSwap(int32(i), int32((i+1)%len(p.eps)))
}

// callTrace follows one call (all its attempts) across the pool: which
// endpoints it tried and which one the last attempt reached.
type callTrace struct {
	p       *pool
	mu      sync.Mutex
	tried   []bool
	reached int // endpoint the last attempt reached, -1: none
}

type traceKey struct{}

// trace returns ctx with a callTrace, the one it carries if any.
func (p *pool) trace(ctx context.Context) (context.Context, *callTrace) {
	if ct, ok := ctx.Value(traceKey{}).(*callTrace); ok && ct.p == p {
		return ctx, ct
	}
	ct := &callTrace{p: p, tried: make([]bool, len(p.eps)), reached: -1}
	return context.WithValue(ctx, traceKey{}, ct), ct
}

// lastReached is the endpoint the last attempt reached, or -1.
func (ct *callTrace) lastReached() int {
	if ct == nil {
		return -1
	}
	ct.mu.Lock()
	defer ct.mu.Unlock()
	return ct.reached
}

// untried reports whether some endpoint has not been tried by this call.
func (ct *callTrace) untried() bool {
	if ct == nil {
		return false
	}
	ct.mu.Lock()
	defer ct.mu.Unlock()
	for _, t := range ct.tried {
		if !t {
			return true
		}
	}
	return false
}

// order is the endpoints an attempt tries, in turn: from the current one
// on, those this call has not tried yet first.
func (p *pool) order(ct *callTrace) []int {
	n := len(p.eps)
	if n == 1 {
		return []int{0}
	}
	start := int(p.cur.Load())
	out := make([]int, 0, n)
	ct.mu.Lock()
	defer ct.mu.Unlock()
	for _, fresh := range []bool{true, false} {
		for k := range n {
			if i := (start + k) % n; ct.tried[i] != fresh {
				out = append(out, i)
			}
		}
	}
	return out
}

// RoundTrip sends req to the current endpoint, and to the next ones while
// an attempt fails before it has a connection to a server (refused, timed
// out, TLS handshake failed): such a request was never seen, so any call
// may go on to the next address at once. Once a connection carried it, the
// outcome is the caller's, whatever it is.
func (p *pool) RoundTrip(req *http.Request) (*http.Response, error) { return p.roundTrip(req, false) }

// uploads is the pool sending over each endpoint's upload transport.
type uploads struct{ p *pool }

func (u uploads) RoundTrip(req *http.Request) (*http.Response, error) {
	return u.p.roundTrip(req, true)
}

func (p *pool) roundTrip(req *http.Request, upload bool) (*http.Response, error) {
	ctx := req.Context()
	ctx, ct := p.trace(ctx)
	ct.mu.Lock()
	ct.reached = -1
	ct.mu.Unlock()
	body := holdBody(req)
	defer body.settle()
	var errs []error
	for n, i := range p.order(ct) {
		ep := p.eps[i]
		var connected atomic.Bool
		r := req.Clone(httptrace.WithClientTrace(ctx, &httptrace.ClientTrace{
			GotConn: func(httptrace.GotConnInfo) { connected.Store(true) },
		}))
		r.URL.Scheme, r.URL.Host, r.Host = ep.scheme, ep.host, ""
		r.URL.Path, r.URL.RawPath = ep.prefix+strings.TrimPrefix(req.URL.Path, p.basePath), ""
		if p.cred.token != "" && r.Header.Get("Authorization") == "" {
			r.Header.Set("Authorization", "Bearer "+p.cred.token)
		}
		var err error
		if r.Body, err = body.attempt(req, n); err != nil {
			return nil, err
		}
		ct.mu.Lock()
		ct.tried[i] = true
		ct.mu.Unlock()
		rt := ep.rt
		if upload {
			rt = ep.up
		}
		resp, err := rt.RoundTrip(r)
		if err == nil || connected.Load() {
			ct.mu.Lock()
			ct.reached = i
			ct.mu.Unlock()
			return resp, err
		}
		if ctx.Err() != nil || body.wasRead() {
			return nil, err
		}
		errs = append(errs, fmt.Errorf("%s: %w", ep.addr, err))
		p.advance(i)
	}
	return nil, &unreachableError{errs: errs, from: p.addrFrom}
}

// unreachableError: no endpoint could be reached.
type unreachableError struct {
	errs []error
	from string // where the addresses came from (AddrFrom)
}

func (e *unreachableError) Error() string {
	if len(e.errs) == 1 {
		return e.errs[0].Error()
	}
	msgs := make([]string, len(e.errs))
	for i, err := range e.errs {
		msgs[i] = err.Error()
	}
	return fmt.Sprintf("none of %d apiservers could be reached: %s", len(e.errs), strings.Join(msgs, "; "))
}

func (e *unreachableError) Unwrap() []error { return e.errs }

// Unreachable reports whether err says that no address could be reached:
// every dial refused or timed out, or every TLS handshake failed.
func Unreachable(err error) bool {
	var ue *unreachableError
	return errors.As(err, &ue)
}

// AddrFrom says where the addresses an unreachable err tried came from:
// the caller's (DialOptions.AddrName, "" when unnamed), "$DSEC_ADDR", or
// DefaultAddr for the default. "" when err is not Unreachable.
func AddrFrom(err error) string {
	var ue *unreachableError
	if !errors.As(err, &ue) {
		return ""
	}
	return ue.from
}

// heldBody lets a request body outlive an attempt that never reached a
// server, so that the next attempt sends it: a transport closes the body on
// every error, and a streamed body cannot be made again. A body that can be
// (GetBody: every unary and server-stream request) is made again instead.
type heldBody struct {
	rc          io.ReadCloser
	mu          sync.Mutex
	read        bool
	settled     bool
	closeWanted bool
}

func holdBody(req *http.Request) *heldBody {
	if req.Body == nil || req.Body == http.NoBody || req.GetBody != nil {
		return nil
	}
	return &heldBody{rc: req.Body}
}

// attempt is the body of the nth attempt.
func (b *heldBody) attempt(req *http.Request, n int) (io.ReadCloser, error) {
	if b == nil {
		if n == 0 || req.GetBody == nil {
			return req.Body, nil
		}
		return req.GetBody()
	}
	b.mu.Lock()
	b.closeWanted = false // a failed attempt's close is not the request's
	b.mu.Unlock()
	return b, nil
}

func (b *heldBody) Read(p []byte) (int, error) {
	b.mu.Lock()
	b.read = true
	b.mu.Unlock()
	return b.rc.Read(p)
}

func (b *heldBody) Close() error {
	b.mu.Lock()
	if !b.settled {
		b.closeWanted = true
		b.mu.Unlock()
		return nil
	}
	b.mu.Unlock()
	return b.rc.Close()
}

func (b *heldBody) wasRead() bool {
	if b == nil {
		return false
	}
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.read
}

// settle ends the holding: a close asked for by the attempt that stands
// happens now, later ones at once.
func (b *heldBody) settle() {
	if b == nil {
		return
	}
	b.mu.Lock()
	b.settled = true
	want := b.closeWanted
	b.mu.Unlock()
	if want {
		b.rc.Close()
	}
}

// interceptor moves the pool on when a server it reached answers
// Unavailable, and says where the token came from when one answers
// Unauthenticated. The Client retries above it, with backoff (see
// Client.retry); under a Conn (failover) it sends a call that may repeat
// (repeatable) to the next address itself, each address once, at once,
// and keeps errors *connect.Error.
type interceptor struct {
	p        *pool
	failover bool
}

func (ic interceptor) WrapUnary(next connect.UnaryFunc) connect.UnaryFunc {
	return func(ctx context.Context, req connect.AnyRequest) (connect.AnyResponse, error) {
		ctx, ct := ic.p.trace(ctx)
		for {
			resp, err := next(ctx, req)
			err = ic.after(ct, err)
			if err == nil || !ic.failover || !repeatable(req.Spec(), req.Any()) || !ic.again(ctx, ct, err) {
				return resp, err
			}
		}
	}
}

func (ic interceptor) WrapStreamingClient(next connect.StreamingClientFunc) connect.StreamingClientFunc {
	return func(ctx context.Context, spec connect.Spec) connect.StreamingClientConn {
		ctx, ct := ic.p.trace(ctx)
		w := &watchedConn{StreamingClientConn: next(ctx, spec), ic: ic, ct: ct}
		if ic.failover && spec.StreamType == connect.StreamTypeServer && repeatable(spec, nil) {
			return &replayConn{watchedConn: w, ctx: ctx, spec: spec, next: next}
		}
		return w
	}
}

func (interceptor) WrapStreamingHandler(next connect.StreamingHandlerFunc) connect.StreamingHandlerFunc {
	return next
}

func (ic interceptor) after(ct *callTrace, err error) error {
	switch connect.CodeOf(err) {
	case connect.CodeUnavailable:
		if i := ct.lastReached(); i >= 0 {
			ic.p.advance(i)
		}
	case connect.CodeUnauthenticated:
		if ic.failover {
			return ic.p.cred.annotateWire(err)
		}
		return ic.p.cred.annotate(err)
	}
	return err
}

// again reports whether a call that may repeat goes on to another address
// after err: a server had it and answered Unavailable (or broke the
// connection), and this call has addresses left that it has not tried.
func (ic interceptor) again(ctx context.Context, ct *callTrace, err error) bool {
	return connect.CodeOf(err) == connect.CodeUnavailable && ctx.Err() == nil && ct.lastReached() >= 0 && ct.untried()
}

// repeatable reports whether a call may be sent again once a server had
// it: the calls the API marks free of side effects or idempotent, a create
// with an idempotency key, the reads (WatchDir among them), and Remove and
// MakeDir. msg is the request, nil for a stream.
func repeatable(spec connect.Spec, msg any) bool {
	if spec.IdempotencyLevel != connect.IdempotencyUnknown {
		return true
	}
	switch spec.Procedure {
	case dsecv1connect.SandboxServiceReadFileProcedure, dsecv1connect.SandboxServiceListDirProcedure,
		dsecv1connect.SandboxServiceStatProcedure, dsecv1connect.SandboxServiceListProcessesProcedure,
		dsecv1connect.SandboxServiceAttachProcedure, dsecv1connect.SandboxServiceDownloadProcedure,
		dsecv1connect.SandboxServiceRemoveProcedure, dsecv1connect.SandboxServiceMakeDirProcedure,
		dsecv1connect.SandboxServiceWatchDirProcedure:
		return true
	case dsecv1connect.SandboxServiceCreateProcedure:
		r, ok := msg.(*dsecv1.CreateRequest)
		return ok && r.GetIdempotencyKey() != ""
	}
	return false
}

type watchedConn struct {
	connect.StreamingClientConn
	ic interceptor
	ct *callTrace
}

func (c *watchedConn) Receive(m any) error {
	err := c.StreamingClientConn.Receive(m)
	if err != nil && !errors.Is(err, io.EOF) {
		err = c.ic.after(c.ct, err)
	}
	return err
}

// replayConn is a server stream that may repeat: until its first message
// it is opened again on the next address, with the same request, when the
// server answers Unavailable. After that the caller has seen output, and
// the stream's error is the caller's.
type replayConn struct {
	*watchedConn
	ctx      context.Context
	spec     connect.Spec
	next     connect.StreamingClientFunc
	sent     []any
	closed   bool
	received bool
}

func (c *replayConn) Send(m any) error {
	c.sent = append(c.sent, m)
	return c.StreamingClientConn.Send(m)
}

func (c *replayConn) CloseRequest() error {
	c.closed = true
	return c.StreamingClientConn.CloseRequest()
}

func (c *replayConn) Receive(m any) error {
	for {
		err := c.watchedConn.Receive(m)
		if err == nil {
			c.received = true
		}
		if err == nil || errors.Is(err, io.EOF) || c.received || !c.ic.again(c.ctx, c.ct, err) {
			return err
		}
		c.StreamingClientConn.CloseResponse()
		c.StreamingClientConn = c.next(c.ctx, c.spec)
		for _, s := range c.sent {
			c.StreamingClientConn.Send(s) // an error shows at Receive
		}
		if c.closed {
			c.StreamingClientConn.CloseRequest()
		}
	}
}

// unauthenticated is an Unauthenticated error with where the client's
// token came from. The server's message is kept, the token taken out of it.
type unauthenticated struct {
	ce     *connect.Error
	source string // credential.describe
}

func (e *unauthenticated) Error() string { return e.ce.Error() + " (" + e.source + ")" }
func (e *unauthenticated) Unwrap() error { return e.ce }

func (c credential) annotate(err error) error {
	var ce *connect.Error
	if !errors.As(err, &ce) {
		return err
	}
	if msg := c.redact(ce.Message()); msg != ce.Message() {
		clean := connect.NewWireError(ce.Code(), errors.New(msg))
		for k, v := range ce.Meta() {
			clean.Meta()[k] = v
		}
		ce = clean
	}
	return &unauthenticated{ce: ce, source: c.describe()}
}

// annotateWire is annotate for a Conn, whose callers read a
// *connect.Error's message: where the token came from goes into it,
// before the kind's words the server may end it with.
func (c credential) annotateWire(err error) error {
	var ce *connect.Error
	if !errors.As(err, &ce) {
		return err
	}
	msg := c.redact(ce.Message())
	tail := ": " + strings.ReplaceAll(connect.CodeUnauthenticated.String(), "_", " ")
	cut := strings.TrimSuffix(msg, tail)
	msg = cut + " (" + c.describe() + ")"
	if cut != c.redact(ce.Message()) {
		msg += tail
	}
	out := connect.NewWireError(connect.CodeUnauthenticated, errors.New(msg))
	for k, v := range ce.Meta() {
		out.Meta()[k] = v
	}
	return out
}

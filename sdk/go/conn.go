package dsec

import (
	"context"
	"errors"
	"fmt"
	"net/http"

	"connectrpc.com/connect"

	dsecv1 "dsec.dev/dsec/api/gen/dsec/v1"
	"dsec.dev/dsec/api/gen/dsec/v1/dsecv1connect"
)

// DialOptions are how Dial finds and proves itself to the servers; the
// zero value reads the environment, as NewClient does.
type DialOptions struct {
	// Token is the bearer token; "" looks in the environment and the node's
	// token file (see the package doc).
	Token string
	// TokenName is what messages call Token (the CLI's "--token"); "" means
	// "DialOptions.Token".
	TokenName string
	// CAFile is a PEM bundle to verify https:// servers with; "" means
	// $DSEC_CA_FILE, else the system roots.
	CAFile string
	// AddrName is what messages call the address Dial was given (the
	// CLI's "--addr"); see AddrFrom.
	AddrName string
}

// Conn is the API's generated clients over the transport a Client uses:
// the same addresses, failover, token and TLS. It is for programs that
// need the API's messages as they are (the dsec CLI, benchmarks, tests);
// most programs want a Client.
//
// A Conn fails over as a Client does, with one difference: nothing waits.
// A call that reached a server and got Unavailable back goes on to the
// next address only if it may repeat (the calls the API marks free of side
// effects or idempotent, Create with an idempotency key, which the caller
// must set, the reads ReadFile, ListDir, Stat, ListProcesses, Attach,
// Download and WatchDir — a stream only until its first message — and
// Remove and MakeDir), each address once; with one address a failed call
// fails at once. Errors stay *connect.Error, an Unauthenticated one with
// where the token came from in its message.
type Conn struct {
	Sandboxes dsecv1connect.SandboxServiceClient
	Layers    dsecv1connect.LayerServiceClient
	FnCall    dsecv1connect.FnCallServiceClient
	IAM       dsecv1connect.IAMServiceClient
	// HTTP sends requests for BaseURL over HTTP/1.1 to the current address,
	// with the token, going on to the next one as the calls do when a
	// request cannot reach a server.
	HTTP    *http.Client
	BaseURL string // the first address's
	pool    *pool
}

// Dial makes a Conn for addr (one address or a comma-separated list; ""
// means $DSEC_ADDR, else DefaultAddr) with o. It reads the token and the
// CA bundle but does not connect yet. Calls go over HTTP/1.1 with
// kept-alive connections; the shell's bidirectional stream and layer
// uploads go over HTTP/2.
func Dial(addr string, o DialOptions) (*Conn, error) {
	name := o.TokenName
	if name == "" {
		name = "DialOptions.Token"
	}
	addrName := o.AddrName
	if addrName == "" {
		addrName = "Dial's address"
	}
	p, err := newPool(poolConfig{addr: addr, addrName: addrName, token: o.Token, tokenName: name,
		tokenHint: "give " + name, caFile: o.CAFile})
	if err != nil {
		return nil, dialError(err)
	}
	base := p.baseURL()
	hc := &http.Client{Transport: p}
	h2 := &http.Client{Transport: uploads{p}}
	ic := connect.WithInterceptors(interceptor{p: p, failover: true})
	return &Conn{
		Sandboxes: sandboxConn{
			SandboxServiceClient: dsecv1connect.NewSandboxServiceClient(hc, base, ic),
			bidi:                 dsecv1connect.NewSandboxServiceClient(h2, base, ic),
		},
		Layers: layerConn{
			LayerServiceClient: dsecv1connect.NewLayerServiceClient(hc, base, ic),
			h2:                 dsecv1connect.NewLayerServiceClient(h2, base, ic),
		},
		FnCall:  dsecv1connect.NewFnCallServiceClient(hc, base, ic),
		IAM:     dsecv1connect.NewIAMServiceClient(hc, base, ic),
		HTTP:    hc,
		BaseURL: base,
		pool:    p,
	}, nil
}

// Close drops the Conn's idle connections.
func (c *Conn) Close() error {
	c.pool.closeIdle()
	return nil
}

// dialError is a setup error of Dial in the form the CLI has always
// printed ("address "x": ...: invalid argument"); it still matches
// ErrInvalidArgument.
func dialError(err error) error {
	var e *Error
	if errors.As(err, &e) && e.Kind == ErrInvalidArgument {
		return fmt.Errorf("%s: %w", e.Message, ErrInvalidArgument)
	}
	return err
}

// sandboxConn sends every call over HTTP/1.1 but the shell's, which
// needs HTTP/2.
type sandboxConn struct {
	dsecv1connect.SandboxServiceClient
	bidi dsecv1connect.SandboxServiceClient
}

func (c sandboxConn) Shell(ctx context.Context) *connect.BidiStreamForClient[dsecv1.ShellInput, dsecv1.ShellOutput] {
	return c.bidi.Shell(ctx)
}

// layerConn sends every call over HTTP/1.1 but uploads (see
// uploadTransport).
type layerConn struct {
	dsecv1connect.LayerServiceClient
	h2 dsecv1connect.LayerServiceClient
}

func (c layerConn) UploadLayer(ctx context.Context) *connect.ClientStreamForClient[dsecv1.UploadLayerRequest, dsecv1.Layer] {
	return c.h2.UploadLayer(ctx)
}

// Client is a Client over the Conn's transport (and its token), with the
// default timeout and retries, for a program that uses both (the CLI's
// replay does).
func (c *Conn) Client() *Client {
	lc := c.Layers.(layerConn)
	return &Client{sb: c.Sandboxes, layers: c.Layers, fn: c.FnCall, iam: c.IAM, uploads: lc.h2,
		hc: c.HTTP, pool: c.pool, timeout: DefaultTimeout, maxRetries: 6}
}

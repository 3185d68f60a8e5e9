// Package apiclient connects Go code inside this repository (the CLI, the
// benchmarks, the end-to-end tests) to a dsecd or a cluster of apiservers.
// Users' programs use the Go SDK under sdk/go instead.
//
// An address is one address or a comma-separated list of them, each
// unix:///path, http://host:port, https://host:port or host:port (http).
// The clients keep a current address, the first to begin with, and move to
// the next when one fails:
//
//   - A call that cannot reach a server (the dial is refused or times out,
//     the TLS handshake fails) goes on to the next address at once, whatever
//     the call, Exec and Shell included: no server has seen it.
//   - A call that reached a server and got Unavailable back (or a proxy's
//     502, 503 or 504, or a connection broken before the answer) goes on to
//     the next address only if it may repeat: the calls the API marks free of
//     side effects or idempotent (Get, List, Delete, SetNetworkRules,
//     NetworkLog, SetWarmPool, ListWarmPools, ListLayers, ListEnvironments,
//     LayerStats), Create with an idempotency key (the same key is sent
//     again), the reads ReadFile, ListDir, Stat, ListProcesses, and Attach,
//     Download and WatchDir (a stream only until its first message), and
//     Remove and MakeDir. Exec, WriteStdin, WriteFile, Move, Signal, the
//     Session calls, Upload, Shell, ImportLayer, RemoveLayer and
//     ImportImage never are.
//
// A call tries each address at most once; nothing here waits and tries
// again, so with one address a failed call fails as it always did.
//
// Every request carries "Authorization: Bearer <token>", the token being
// Options.Token, else $DSEC_TOKEN, else the contents of the file named by
// $DSEC_TOKEN_FILE (which must be readable), else those of DefaultTokenFile
// when it exists and is readable, else none. It is read once, by Dial, and
// never appears in an error: the message of an Unauthenticated answer says
// where the token came from instead. https:// addresses are verified with
// the system roots, or with Options.CAFile, else $DSEC_CA_FILE, when set.
package apiclient

import (
	"context"
	"net/http"
	"os"

	"connectrpc.com/connect"

	dsecv1 "dsec.dev/dsec/api/gen/dsec/v1"
	"dsec.dev/dsec/api/gen/dsec/v1/dsecv1connect"
)

// DefaultAddr is the local daemon's Unix socket.
const DefaultAddr = "unix:///var/lib/dsec/dsecd.sock"

// Addr returns addr, else $DSEC_ADDR, else DefaultAddr.
func Addr(addr string) string {
	if addr != "" {
		return addr
	}
	if env := os.Getenv("DSEC_ADDR"); env != "" {
		return env
	}
	return DefaultAddr
}

// addrFrom says where Addr(addr) takes the address from: name (the
// caller's, when addr is set), "$DSEC_ADDR", or DefaultAddr.
func addrFrom(addr, name string) string {
	switch {
	case addr != "":
		if name == "" {
			name = "Dial's address"
		}
		return name
	case os.Getenv("DSEC_ADDR") != "":
		return "$DSEC_ADDR"
	}
	return DefaultAddr
}

// Options are how Dial finds and proves itself to the servers; the zero
// value reads the environment.
type Options struct {
	// Token is the bearer token; "" looks in the environment and the node's
	// token file.
	Token string
	// TokenName is what messages call Token (the CLI's "--token"); "" means
	// "Options.Token".
	TokenName string
	// CAFile is a PEM bundle to verify https:// servers with; "" means
	// $DSEC_CA_FILE, else the system roots.
	CAFile string
	// AddrName is what messages call the address Dial was given (the
	// CLI's "--addr"); see AddrFrom.
	AddrName string
}

// Clients are the services of a dsecd or of a cluster of apiservers.
type Clients struct {
	Sandboxes dsecv1connect.SandboxServiceClient
	Layers    dsecv1connect.LayerServiceClient
	FnCall    dsecv1connect.FnCallServiceClient
	// HTTP sends requests for BaseURL over HTTP/1.1 to the current address,
	// with the token, going on to the next one as the calls do when a
	// request cannot reach a server.
	HTTP    *http.Client
	BaseURL string // the first address's
}

// Dial makes clients for addr (see the package doc) with the token and CA
// bundle of the environment. It does not connect yet.
func Dial(addr string) (*Clients, error) { return DialWith(addr, Options{}) }

// DialWith makes clients for addr with o. Calls go over HTTP/1.1 with
// kept-alive connections, which answers sooner than HTTP/2 (about 0.2 ms an
// exec on these machines); the bidirectional shell stream needs HTTP/2 and
// gets transports of its own.
func DialWith(addr string, o Options) (*Clients, error) {
	addrs, err := splitAddrs(Addr(addr))
	if err != nil {
		return nil, err
	}
	name := o.TokenName
	if name == "" {
		name = "Options.Token"
	}
	cred, err := loadCredential(o.Token, name)
	if err != nil {
		return nil, err
	}
	tlsConf, err := tlsConfig(o.CAFile)
	if err != nil {
		return nil, err
	}
	p := &pool{cred: cred, addrFrom: addrFrom(addr, o.AddrName)}
	for _, a := range addrs {
		ep, socket, err := parseEndpoint(a)
		if err != nil {
			return nil, err
		}
		ep.h1, ep.h2 = newTransport(ep, socket, tlsConf, false), newTransport(ep, socket, tlsConf, true)
		p.eps = append(p.eps, ep)
	}
	first := p.eps[0]
	p.basePath = first.prefix
	base := first.scheme + "://" + first.host + first.prefix
	hc := &http.Client{Transport: via{p: p}}
	ic := connect.WithInterceptors(interceptor{p})
	return &Clients{
		Sandboxes: sandboxClient{
			SandboxServiceClient: dsecv1connect.NewSandboxServiceClient(hc, base, ic),
			bidi:                 dsecv1connect.NewSandboxServiceClient(&http.Client{Transport: via{p: p, h2: true}}, base, ic),
			p:                    p,
		},
		Layers: layerClient{
			LayerServiceClient: dsecv1connect.NewLayerServiceClient(hc, base, ic),
			h2:                 dsecv1connect.NewLayerServiceClient(&http.Client{Transport: via{p: p, h2: true}}, base, ic),
		},
		FnCall:  dsecv1connect.NewFnCallServiceClient(hc, base, ic),
		HTTP:    hc,
		BaseURL: base,
	}, nil
}

// sandboxClient sends every call over HTTP/1.1 but the shell's.
type sandboxClient struct {
	dsecv1connect.SandboxServiceClient
	bidi dsecv1connect.SandboxServiceClient
	p    *pool // the calls' addresses
}

// layerClient sends every call over HTTP/1.1 but uploads. An edge may
// refuse an upload before its end (it is too big, or holds a hostile
// entry): over HTTP/2 the answer comes back while the rest is unsent, where
// HTTP/1.1 can lose it to the connection the server closes under the body.
type layerClient struct {
	dsecv1connect.LayerServiceClient
	h2 dsecv1connect.LayerServiceClient
}

func (c layerClient) UploadLayer(ctx context.Context) *connect.ClientStreamForClient[dsecv1.UploadLayerRequest, dsecv1.Layer] {
	return c.h2.UploadLayer(ctx)
}

func (c sandboxClient) Shell(ctx context.Context) *connect.BidiStreamForClient[dsecv1.ShellInput, dsecv1.ShellOutput] {
	return c.bidi.Shell(ctx)
}

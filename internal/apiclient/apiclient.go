// Package apiclient connects Go code inside this repository (the CLI, the
// benchmarks, the end-to-end tests) to a dsecd. Users' programs use the Go
// SDK under sdk/go instead.
package apiclient

import (
	"context"
	"fmt"
	"net"
	"net/http"
	"os"
	"strings"

	"dsec.dev/dsec/api/gen/dsec/v1/dsecv1connect"
	"dsec.dev/dsec/internal/errdefs"
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

// Clients are the services of one dsecd.
type Clients struct {
	Sandboxes dsecv1connect.SandboxServiceClient
	Layers    dsecv1connect.LayerServiceClient
	HTTP      *http.Client
	BaseURL   string
}

// Dial makes clients for addr: unix:///path, http://host:port or host:port.
// Every call goes over cleartext HTTP/2, so bidirectional streams work.
func Dial(addr string) (*Clients, error) {
	addr = Addr(addr)
	tr := &http.Transport{Protocols: new(http.Protocols), MaxIdleConnsPerHost: 64}
	tr.Protocols.SetUnencryptedHTTP2(true)
	base := ""
	switch {
	case strings.HasPrefix(addr, "unix://"):
		path := strings.TrimPrefix(addr, "unix://")
		if path == "" {
			return nil, fmt.Errorf("address %q names no socket: %w", addr, errdefs.ErrInvalidArgument)
		}
		var d net.Dialer
		tr.DialContext = func(ctx context.Context, _, _ string) (net.Conn, error) {
			return d.DialContext(ctx, "unix", path)
		}
		base = "http://dsecd"
	case strings.HasPrefix(addr, "http://"):
		base = strings.TrimSuffix(addr, "/")
	case strings.Contains(addr, "://"):
		return nil, fmt.Errorf("address %q: only unix:// and http:// are supported: %w", addr, errdefs.ErrInvalidArgument)
	default:
		base = "http://" + addr
	}
	hc := &http.Client{Transport: tr}
	return &Clients{
		Sandboxes: dsecv1connect.NewSandboxServiceClient(hc, base),
		Layers:    dsecv1connect.NewLayerServiceClient(hc, base),
		HTTP:      hc,
		BaseURL:   base,
	}, nil
}

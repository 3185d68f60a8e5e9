// Package agentclient is the edge's side of the agent channel: a Connect
// client speaking cleartext HTTP/2 over the sandbox's Unix socket.
package agentclient

import (
	"context"
	"net"
	"net/http"

	"connectrpc.com/connect"

	"dsec.dev/dsec/api/gen/dsec/agent/v1/agentv1connect"
)

// Dial returns a client for the agent listening on socketPath. It connects
// lazily and keeps one HTTP/2 connection for all calls (reconnecting if the
// connection breaks, e.g. after an edge restart); it never fails itself.
func Dial(socketPath string) agentv1connect.AgentServiceClient {
	protocols := new(http.Protocols)
	protocols.SetUnencryptedHTTP2(true)
	tr := &http.Transport{
		Protocols: protocols,
		DialContext: func(ctx context.Context, _, _ string) (net.Conn, error) {
			var d net.Dialer
			return d.DialContext(ctx, "unix", socketPath)
		},
		MaxIdleConnsPerHost: 1,
	}
	// Not advertising gzip keeps the agent from compressing its answers:
	// on a Unix socket that costs CPU and latency and saves nothing.
	return agentv1connect.NewAgentServiceClient(&http.Client{Transport: tr}, "http://dsec-agent",
		connect.WithAcceptCompression("gzip", nil, nil))
}

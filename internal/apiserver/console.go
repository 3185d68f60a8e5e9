package apiserver

import (
	"context"
	"net/http"
	"sync"

	"connectrpc.com/connect"

	"dsec.dev/dsec/api/gen/dsec/v1/dsecv1connect"
	"dsec.dev/dsec/internal/console"
	"dsec.dev/dsec/internal/iam"
)

// webConsole is the server's web console (package console) at /console,
// made on its first request: its pages call this server's own services
// through the loopback connection, each call carrying the signed-in
// token, so the interceptor and handlers decide them as any client's.
type webConsole struct {
	once sync.Once
	h    http.Handler
	err  error
}

func (s *Server) serveConsole(w http.ResponseWriter, r *http.Request) {
	s.console.once.Do(func() {
		hc := s.loop.http(s)
		opt := connect.WithInterceptors(console.BearerToken{})
		cfg := console.Config{
			Sandboxes:    dsecv1connect.NewSandboxServiceClient(hc, "http://in-process", opt),
			Layers:       dsecv1connect.NewLayerServiceClient(hc, "http://in-process", opt),
			Authenticate: s.authenticate,
			Sessions:     s.cfg.ConsoleSessions,
			Log:          s.log.With("component", "console"),
		}
		if s.cfg.IAM != nil {
			cfg.IAM = dsecv1connect.NewIAMServiceClient(hc, "http://in-process", opt)
		}
		s.console.h, s.console.err = console.New(cfg)
	})
	if s.console.err != nil {
		http.Error(w, "the console is not available: "+s.console.err.Error(), http.StatusInternalServerError)
		return
	}
	s.console.h.ServeHTTP(w, r)
}

// authenticate checks a token as the interceptor does; without Config.Auth
// every caller is the node's administrator.
func (s *Server) authenticate(ctx context.Context, token string) (iam.Authority, error) {
	if s.authn == nil {
		return iam.NodeAdmin(), nil
	}
	return s.authn.Authenticate(ctx, token)
}

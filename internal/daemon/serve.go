package daemon

import (
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"os"
	"sync"
	"time"

	"dsec.dev/dsec/internal/apiserver"
	"dsec.dev/dsec/internal/iam"
	"dsec.dev/dsec/internal/sandboxfusion"
)

// tokenlessProject is the project SandboxFusion's calls without a token
// run in, from its flag: def when unset, "" (refused) for "none", else the
// path checked, with "/" for the root.
func tokenlessProject(flag, def string) (string, error) {
	switch flag {
	case "":
		return def, nil
	case "none":
		return "", nil
	}
	p, err := iam.CleanPath(flag)
	if err != nil {
		return "", fmt.Errorf("--sandboxfusion-project: %w", err)
	}
	return "/" + p, nil
}

// serveSandboxFusion serves SandboxFusion's HTTP API on addr, calls run by
// the apiserver, until ctx ends; wait waits for that, and served is the
// address it listens on. With optional, an address already in use is a
// warning (the all-in-one's default), not an error, and served is "".
func serveSandboxFusion(ctx context.Context, addr string, optional bool, api *apiserver.Server, log *slog.Logger) (served string, wait func(), err error) {
	ln, err := net.Listen("tcp", addr)
	if err != nil {
		if optional {
			log.Warn("SandboxFusion's API is not served: its default address is taken (set --sandboxfusion-listen)", "addr", addr, "err", err)
			return "", func() {}, nil
		}
		return "", nil, fmt.Errorf("listen for SandboxFusion's API on %s: %w", addr, err)
	}
	h := sandboxfusion.NewHandler(api, sandboxfusion.Config{Log: log.With("component", "sandboxfusion"),
		Authorize: api.AuthorizeFnCall})
	done := make(chan struct{})
	go func() {
		defer close(done)
		if err := serve(ctx, log, h, nil, ln); err != nil {
			log.Error("SandboxFusion's API stopped", "err", err)
		}
	}()
	log.Info("serving SandboxFusion's API", "addr", ln.Addr().String())
	return ln.Addr().String(), func() { <-done }, nil
}

// serve serves h on every listener until ctx ends or one fails, then shuts
// the server down (in-flight calls get 5 s). Without TLS it speaks HTTP/1.1
// and cleartext HTTP/2; with it, HTTP/2 over TLS (and HTTP/1.1).
func serve(ctx context.Context, log *slog.Logger, h http.Handler, tlsConfig *tls.Config, lns ...net.Listener) error {
	srv := &http.Server{
		Handler:           h,
		ReadHeaderTimeout: 10 * time.Second,
		Protocols:         new(http.Protocols),
		ErrorLog:          slog.NewLogLogger(log.Handler(), slog.LevelDebug),
		// Calls on a Unix socket are trusted by its file mode; the others
		// need a token where the apiserver checks them.
		ConnContext: apiserver.ConnContext,
	}
	srv.Protocols.SetHTTP1(true)
	if tlsConfig != nil {
		srv.TLSConfig = tlsConfig
		srv.Protocols.SetHTTP2(true)
	} else {
		srv.Protocols.SetUnencryptedHTTP2(true)
	}
	errc := make(chan error, len(lns))
	var wg sync.WaitGroup
	for _, ln := range lns {
		wg.Add(1)
		go func() {
			defer wg.Done()
			var err error
			if tlsConfig != nil {
				err = srv.ServeTLS(ln, "", "")
			} else {
				err = srv.Serve(ln)
			}
			if err != nil && !errors.Is(err, http.ErrServerClosed) {
				errc <- fmt.Errorf("serve %s: %w", ln.Addr(), err)
			}
		}()
	}
	var serveErr error
	select {
	case <-ctx.Done():
	case serveErr = <-errc:
	}
	sctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 5*time.Second)
	defer cancel()
	if err := srv.Shutdown(sctx); err != nil {
		srv.Close()
	}
	wg.Wait()
	return serveErr
}

// listenUnix listens on a Unix socket only its owner and group may use.
func listenUnix(path string) (net.Listener, error) {
	os.Remove(path)
	ln, err := net.Listen("unix", path)
	if err != nil {
		return nil, fmt.Errorf("listen on %s: %w", path, err)
	}
	if err := os.Chmod(path, 0o660); err != nil {
		ln.Close()
		return nil, fmt.Errorf("chmod %s: %w", path, err)
	}
	return ln, nil
}

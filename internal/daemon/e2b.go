package daemon

import (
	"context"
	"crypto/rand"
	"errors"
	"fmt"
	"io/fs"
	"log/slog"
	"net"
	"net/http"
	"os"
	"path/filepath"

	"connectrpc.com/connect"

	"dsec.dev/dsec/api/gen/dsec/v1/dsecv1connect"
	"dsec.dev/dsec/internal/apiserver"
	"dsec.dev/dsec/internal/e2b"
	"dsec.dev/dsec/internal/memconn"
)

// E2BSecretFile is where, under the all-in-one dsecd's root (or in dsecd
// init-cluster's directory), the secret that signs envd access tokens is
// kept. Every apiserver of a cluster must hold the same one.
const E2BSecretFile = "e2b.secret"

// e2bSecretBytes is the size of a new secret.
const e2bSecretBytes = 32

// loadE2BSecret reads the secret at path; with create, a missing file is
// made (mode 0600) with a fresh secret.
func loadE2BSecret(path string, create bool) ([]byte, error) {
	b, err := os.ReadFile(path)
	if err == nil {
		if len(b) < e2bSecretBytes {
			return nil, fmt.Errorf("the E2B secret in %s is shorter than %d bytes", path, e2bSecretBytes)
		}
		return b, nil
	}
	if !errors.Is(err, fs.ErrNotExist) || !create {
		return nil, fmt.Errorf("read the E2B secret: %w", err)
	}
	b = make([]byte, e2bSecretBytes)
	rand.Read(b)
	if err := writeFileAtomic(path, b, 0o600); err != nil {
		return nil, fmt.Errorf("write the E2B secret: %w", err)
	}
	return b, nil
}

// writeFileAtomic writes b to path through a temporary file and a rename.
func writeFileAtomic(path string, b []byte, mode os.FileMode) error {
	tmp, err := os.CreateTemp(filepath.Dir(path), "."+filepath.Base(path)+"-*")
	if err != nil {
		return err
	}
	defer os.Remove(tmp.Name())
	if err := tmp.Chmod(mode); err != nil {
		tmp.Close()
		return err
	}
	if _, err := tmp.Write(b); err != nil {
		tmp.Close()
		return err
	}
	if err := tmp.Close(); err != nil {
		return err
	}
	return os.Rename(tmp.Name(), path)
}

// EnsureE2BSecret makes the secret at path unless it exists: dsecd
// init-cluster's, for the apiservers' --e2b-secret-file.
func EnsureE2BSecret(path string) error {
	_, err := loadE2BSecret(path, true)
	return err
}

// serveE2B serves E2B's API (package e2b) on addr until ctx ends; wait
// waits for that; served is the address it listens on. Access tokens are signed with the secret in secretFile
// (made when missing, with create). The adapter reaches the apiserver
// through an in-process connection, which the apiserver trusts: the
// adapter checks its callers' API keys itself.
func serveE2B(ctx context.Context, addr, secretFile string, create bool, api *apiserver.Server, auth e2b.Authenticator, log *slog.Logger) (served string, wait func(), err error) {
	secret, err := loadE2BSecret(secretFile, create)
	if err != nil {
		return "", nil, err
	}
	ln, err := net.Listen("tcp", addr)
	if err != nil {
		return "", nil, fmt.Errorf("listen for E2B's API on %s: %w", addr, err)
	}
	mem := memconn.New()
	tr := &http.Transport{DialContext: mem.Dial, Protocols: new(http.Protocols), MaxIdleConnsPerHost: 64}
	tr.Protocols.SetUnencryptedHTTP2(true)
	client := dsecv1connect.NewSandboxServiceClient(&http.Client{Transport: tr}, "http://in-process", connect.WithInterceptors(e2b.ForwardToken{}))
	h, err := e2b.NewHandler(e2b.Config{API: client, Auth: auth, Signer: e2b.NewSigner(secret), Log: log.With("component", "e2b")})
	if err != nil {
		ln.Close()
		return "", nil, err
	}
	done := make(chan struct{}, 2)
	go func() {
		if err := serve(ctx, log, api.Handler(), nil, mem); err != nil {
			log.Error("the E2B adapter's way to the apiserver stopped", "err", err)
		}
		done <- struct{}{}
	}()
	go func() {
		if err := serve(ctx, log, h, nil, ln); err != nil {
			log.Error("E2B's API stopped", "err", err)
		}
		done <- struct{}{}
	}()
	log.Info("serving E2B's API", "addr", ln.Addr().String())
	return ln.Addr().String(), func() { <-done; <-done; tr.CloseIdleConnections() }, nil
}

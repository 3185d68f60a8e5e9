package daemon

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"time"

	"dsec.dev/dsec/internal/errdefs"
	"dsec.dev/dsec/internal/store"
)

// AdminTokenFile is where, under its root, the all-in-one dsecd keeps the
// token of its admin principal (mode 0600): callers on the node's loopback
// TCP port present it; the Unix socket needs none.
const AdminTokenFile = "admin.token"

// AdminPrincipal is the principal the all-in-one dsecd's token belongs to.
const AdminPrincipal = "admin"

// ensureAdminToken makes the admin principal and a token in the file, once:
// a token already in the file that the store still accepts is kept.
func ensureAdminToken(ctx context.Context, st store.Store, path string) error {
	if b, err := os.ReadFile(path); err == nil {
		if _, err := st.Authenticate(ctx, strings.TrimSpace(string(b))); err == nil {
			return nil
		}
	}
	if _, err := st.CreatePrincipal(ctx, AdminPrincipal); err != nil && !errors.Is(err, errdefs.ErrAlreadyExists) {
		return fmt.Errorf("make the admin principal: %w", err)
	}
	tok, _, err := st.IssueToken(ctx, AdminPrincipal, 0)
	if err != nil {
		return fmt.Errorf("issue the admin token: %w", err)
	}
	tmp, err := os.CreateTemp(filepath.Dir(path), ".admin-token-*")
	if err != nil {
		return fmt.Errorf("write %s: %w", path, err)
	}
	defer os.Remove(tmp.Name())
	if err := tmp.Chmod(0o600); err != nil {
		tmp.Close()
		return fmt.Errorf("write %s: %w", path, err)
	}
	if _, err := tmp.WriteString(tok + "\n"); err != nil {
		tmp.Close()
		return fmt.Errorf("write %s: %w", path, err)
	}
	if err := tmp.Close(); err != nil {
		return fmt.Errorf("write %s: %w", path, err)
	}
	if err := os.Rename(tmp.Name(), path); err != nil {
		return fmt.Errorf("write %s: %w", path, err)
	}
	return nil
}

// IssueToken mints a token for principal (made if new) in the metadata
// store at dsn: `dsecd token`.
func IssueToken(ctx context.Context, dsn, principal string, ttl time.Duration) (string, error) {
	st, err := store.Open(ctx, dsn)
	if err != nil {
		return "", err
	}
	defer st.Close()
	if _, err := st.CreatePrincipal(ctx, principal); err != nil && !errors.Is(err, errdefs.ErrAlreadyExists) {
		return "", err
	}
	tok, _, err := st.IssueToken(ctx, principal, ttl)
	return tok, err
}

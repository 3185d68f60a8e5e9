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
	"dsec.dev/dsec/internal/iam"
	"dsec.dev/dsec/internal/store"
)

// AdminTokenFile is where, under its root, the all-in-one dsecd keeps the
// token of its admin principal (mode 0600): callers on the node's loopback
// TCP port present it; the Unix socket needs none.
const AdminTokenFile = "admin.token"

// AdminPrincipal is the principal the all-in-one dsecd's token belongs to:
// the root project's admin.
const AdminPrincipal = "admin"

// ensureAdminToken makes the admin principal, its admin binding on the root
// project and a token in the file, once: a token already in the file that
// the store still accepts is kept.
func ensureAdminToken(ctx context.Context, st store.Store, path string) error {
	if b, err := os.ReadFile(path); err == nil {
		if _, err := st.Authenticate(ctx, strings.TrimSpace(string(b))); err == nil {
			return nil
		}
	}
	tok, err := mint(ctx, st, AdminPrincipal, "", iam.Admin, 0)
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

// IssueToken mints a token for principal with role on project (a path)
// in the metadata store at dsn, as the node's administrator: `dsecd token`.
// A new principal is made in the root project; a principal whose bindings
// give it less than role on project is granted role there.
func IssueToken(ctx context.Context, dsn, principal, project string, role iam.Role, ttl time.Duration) (string, error) {
	st, err := store.Open(ctx, dsn)
	if err != nil {
		return "", err
	}
	defer st.Close()
	return mint(ctx, st, principal, project, role, ttl)
}

// mint makes principal if new, grants it role on project if its bindings
// give it less there, and mints a token, all as the node's administrator.
func mint(ctx context.Context, st store.Store, principal, project string, role iam.Role, ttl time.Duration) (string, error) {
	node := iam.NodeAdmin()
	_, err := st.CreatePrincipal(ctx, node, store.PrincipalSpec{Name: principal, Kind: store.KindUser})
	if err != nil && !errors.Is(err, errdefs.ErrAlreadyExists) {
		return "", fmt.Errorf("make principal %s: %w", principal, err)
	}
	bindings, err := st.Bindings(ctx, principal)
	if err != nil {
		return "", err
	}
	path, err := iam.CleanPath(project)
	if err != nil {
		return "", err
	}
	if iam.Effective(bindings, path) < role {
		if err := st.Grant(ctx, node, principal, path, role); err != nil {
			return "", err
		}
	}
	tok, _, err := st.MintToken(ctx, node, store.TokenSpec{Principal: principal, Project: path, Role: role, TTL: ttl})
	return tok, err
}

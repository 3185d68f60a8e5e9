//go:build !linux

package agent

import (
	"context"
	"fmt"
	"net"

	"dsec.dev/dsec/internal/errdefs"
)

// Serve is only implemented on Linux.
func Serve(ctx context.Context, cfg Config) error {
	return fmt.Errorf("serve agent: %w", errdefs.ErrNotSupported)
}

// StateDumpMain is only implemented on Linux.
func StateDumpMain() int { return 1 }

// ServeListener is only implemented on Linux.
func ServeListener(ctx context.Context, cfg Config, ln net.Listener) error {
	ln.Close()
	return fmt.Errorf("serve agent: %w", errdefs.ErrNotSupported)
}

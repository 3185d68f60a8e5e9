//go:build !linux

package vmnet

import (
	"context"
	"fmt"

	"dsec.dev/dsec/internal/errdefs"
)

// Attach is only implemented on Linux.
func Attach(ctx context.Context, nsPath string) (*Link, error) {
	return nil, fmt.Errorf("attach vm network: %w", errdefs.ErrNotSupported)
}

// Detach is only implemented on Linux.
func Detach(ctx context.Context, nsPath string) error {
	return fmt.Errorf("detach vm network: %w", errdefs.ErrNotSupported)
}

// ReadSentry is only implemented on Linux.
func ReadSentry(nsPath string) (Sentry, error) {
	return Sentry{}, fmt.Errorf("read sentry network: %w", errdefs.ErrNotSupported)
}

// AttachSentry is only implemented on Linux.
func AttachSentry(ctx context.Context, nsPath string, s Sentry) error {
	return fmt.Errorf("attach sentry network: %w", errdefs.ErrNotSupported)
}

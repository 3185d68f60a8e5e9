//go:build !linux

package agent

import (
	"context"
	"fmt"

	"dsec.dev/dsec/internal/errdefs"
)

// Serve is only implemented on Linux.
func Serve(ctx context.Context, cfg Config) error {
	return fmt.Errorf("serve agent: %w", errdefs.ErrNotSupported)
}

// StateDumpMain is only implemented on Linux.
func StateDumpMain() int { return 1 }

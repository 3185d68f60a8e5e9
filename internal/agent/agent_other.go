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

// ChildMain is only implemented on Linux.
func ChildMain() int { return 127 }

// StateDumpMain is only implemented on Linux.
func StateDumpMain() int { return 1 }

//go:build !linux

package bench

import (
	"context"
	"fmt"
	"log/slog"

	"dsec.dev/dsec/internal/errdefs"
)

// OCIBuildOptions name the trees of one bench image.
type OCIBuildOptions struct {
	Base, BaseCache, Layer, Out, Name string
}

// RunStorage needs Linux (dsecd, mounts, block device counters).
func RunStorage(ctx context.Context, log *slog.Logger, o StorageOptions) (*StorageReport, error) {
	return nil, fmt.Errorf("run storage bench: %w", errdefs.ErrNotSupported)
}

// BuildOCI needs Linux (overlayfs whiteouts, xattrs).
func BuildOCI(ctx context.Context, o OCIBuildOptions) error {
	return fmt.Errorf("build oci: %w", errdefs.ErrNotSupported)
}

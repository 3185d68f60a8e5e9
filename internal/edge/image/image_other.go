//go:build !linux

package image

import (
	"context"
	"fmt"
	"io"

	"dsec.dev/dsec/internal/errdefs"
)

// Import needs Linux (openat2, mknod, xattrs, mkfs.erofs).
func (s *Store) Import(ctx context.Context, ref string, kind Kind, src string, opts ImportOptions) (Layer, error) {
	return Layer{}, fmt.Errorf("import layer: %w", errdefs.ErrNotSupported)
}

// Mount needs Linux (file-backed EROFS).
func (s *Store) Mount(ctx context.Context, digest string) (string, error) {
	return "", fmt.Errorf("mount layer %s: %w", digest, errdefs.ErrNotSupported)
}

// UnmountAll has nothing to do off Linux: nothing can be mounted.
func (s *Store) UnmountAll(ctx context.Context) error { return nil }

func (s *Store) unmountLayer(ctx context.Context, hex string) error { return nil }

func (s *Store) cleanTmp() {}

// BuildBusyboxRootfs needs Linux.
func BuildBusyboxRootfs(dir string) error {
	return fmt.Errorf("build busybox rootfs: %w", errdefs.ErrNotSupported)
}

// ImportLayers needs Linux, like Import.
func (s *Store) ImportLayers(ctx context.Context, ref string, kind Kind, srcs []LayerSource, opts ImportOptions) (Layer, error) {
	return Layer{}, fmt.Errorf("import layers: %w", errdefs.ErrNotSupported)
}

// PruneWhiteouts needs Linux.
func PruneWhiteouts(ctx context.Context, dir string, lower []string) (Pruned, error) {
	return Pruned{}, fmt.Errorf("prune whiteouts in %s: %w", dir, errdefs.ErrNotSupported)
}

// BuildLayerFile needs Linux (mkfs.erofs).
func BuildLayerFile(ctx context.Context, dir, out string) (string, int64, error) {
	return "", 0, fmt.Errorf("build layer from %s: %w", dir, errdefs.ErrNotSupported)
}

// ImportArchive needs Linux, like Import.
func (s *Store) ImportArchive(ctx context.Context, ref string, kind Kind, r io.Reader, name string, opts ImportOptions) (Layer, error) {
	return Layer{}, fmt.Errorf("import layer: %w", errdefs.ErrNotSupported)
}

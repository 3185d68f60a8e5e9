//go:build !linux

package snapshot

import (
	"context"
	"fmt"

	"dsec.dev/dsec/internal/errdefs"
)

// Capture needs Linux (overlayfs uppers, btrfs, FICLONE).
func Capture(ctx context.Context, upper, dst string) (*Tree, error) {
	return nil, fmt.Errorf("capture upper %s: %w", upper, errdefs.ErrNotSupported)
}

// Pack needs Linux (mkfs.erofs, overlay whiteouts).
func Pack(ctx context.Context, t *Tree, out string, opts PackOptions) (Packed, error) {
	return Packed{}, fmt.Errorf("pack %s: %w", t.Dir, errdefs.ErrNotSupported)
}

// RemoveCapture needs Linux: nothing can have been captured elsewhere.
func RemoveCapture(dst string) error {
	return fmt.Errorf("remove capture %s: %w", dst, errdefs.ErrNotSupported)
}

// Lay needs Linux (the *at calls that follow no symlink).
func Lay(ctx context.Context, t *Tree, root string, opts PackOptions) (Laid, error) {
	return Laid{}, fmt.Errorf("lay %s: %w", t.Dir, errdefs.ErrNotSupported)
}

// WriteFiles needs Linux (openat2's RESOLVE_IN_ROOT).
func WriteFiles(root string, files []File) error {
	return fmt.Errorf("write files into %s: %w", root, errdefs.ErrNotSupported)
}

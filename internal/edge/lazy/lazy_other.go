//go:build !linux

package lazy

import (
	"context"
	"fmt"

	"dsec.dev/dsec/internal/errdefs"
)

type mountState struct{}

func (m *mountState) addFile(f *FS, l *layer) error {
	return fmt.Errorf("add layer file: %w", errdefs.ErrNotSupported)
}

func (m *mountState) removeFile(hex string) {}

func (f *FS) pushRest(l *layer, i int, data []byte, within, n int64) {}

// Mount needs Linux (FUSE and file-backed EROFS).
func Mount(ctx context.Context, cfg Config) (*FS, error) {
	return nil, fmt.Errorf("mount lazy fs: %w", errdefs.ErrNotSupported)
}

// Close does nothing where Mount cannot succeed.
func (f *FS) Close(ctx context.Context) error {
	return fmt.Errorf("close lazy fs: %w", errdefs.ErrNotSupported)
}

// MetaChunks needs Linux (file-backed EROFS mounts).
func MetaChunks(ctx context.Context, f *FS, hex string, tmpDir string) ([]int, error) {
	return nil, fmt.Errorf("find metadata chunks: %w", errdefs.ErrNotSupported)
}

//go:build !linux

package fuse2fs

import (
	"context"
	"path/filepath"
	"time"

	"dsec.dev/dsec/internal/errdefs"
)

// Nobody is the uid and gid fuse2fs runs as by default.
const Nobody = 65534

// Options configure Mount (see the Linux build).
type Options struct {
	Binary, Helper          string
	UID, GID                int
	ReadOnly                bool
	Timeout, Deadline       time.Duration
	CPUSeconds, MemoryBytes int64
}

// Mounted is an image mounted by fuse2fs.
type Mounted struct{}

// Mount is Linux's.
func Mount(ctx context.Context, image, dir string, o Options) (*Mounted, error) {
	return nil, errdefs.ErrNotSupported
}

// Aborted is Linux's.
func (m *Mounted) Aborted() error { return nil }

// Unmount is Linux's.
func (m *Mounted) Unmount() error { return errdefs.ErrNotSupported }

// Detach is Linux's.
func Detach(dir string) error { return errdefs.ErrNotSupported }

// Fusermount is Linux's.
func Fusermount(args []string) int { return 1 }

// IsFusermount reports whether argv0 names this program as fusermount.
func IsFusermount(argv0 string) bool { return filepath.Base(argv0) == "fusermount" }

//go:build !linux

package provenance

import (
	"fmt"
	"log/slog"

	dsecv1 "dsec.dev/dsec/api/gen/dsec/v1"
	"dsec.dev/dsec/internal/errdefs"
)

// Watcher needs fanotify (Linux).
type Watcher struct{}

// NewWatcher: fanotify exists on Linux only.
func NewWatcher(*slog.Logger) (*Watcher, error) {
	return nil, fmt.Errorf("watch protected paths: %w", errdefs.ErrNotSupported)
}

func (*Watcher) Close() error { return nil }
func (*Watcher) Watch(id, root string, agent int, paths []string) ([]string, error) {
	return nil, fmt.Errorf("watch protected paths: %w", errdefs.ErrNotSupported)
}
func (*Watcher) Reads(string) []*dsecv1.ProvenanceRead { return nil }
func (*Watcher) Forget(string)                         {}

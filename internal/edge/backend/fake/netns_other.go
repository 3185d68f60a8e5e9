//go:build !linux

package fake

import (
	"fmt"

	"dsec.dev/dsec/internal/errdefs"
)

// checkNetns: network namespaces are Linux's.
func checkNetns(path string) error {
	return fmt.Errorf("join netns %s: %w", path, errdefs.ErrNotSupported)
}

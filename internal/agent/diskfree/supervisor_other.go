//go:build !linux || !(amd64 || arm64)

package diskfree

import (
	"fmt"
	"log/slog"

	"dsec.dev/dsec/internal/errdefs"
)

// Config says which mount the supervisor describes; see the Linux version.
type Config struct {
	Root   string
	Qgroup string
	Log    *slog.Logger
}

// Start returns errdefs.ErrNotSupported: the supervisor needs Linux on
// amd64 or arm64.
func Start(cfg Config) error {
	return fmt.Errorf("start statfs supervisor: %w", errdefs.ErrNotSupported)
}

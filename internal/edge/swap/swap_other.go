//go:build !linux

package swap

import (
	"context"
	"log/slog"

	"dsec.dev/dsec/internal/errdefs"
)

// Swap is Linux-only.
type Swap struct{}

// Provision is Linux-only; with Kind None it does nothing.
func Provision(ctx context.Context, dir string, cfg Config, log *slog.Logger) (*Swap, error) {
	if cfg.Kind == None {
		return nil, nil
	}
	return nil, errdefs.ErrNotSupported
}

func (s *Swap) Path() string { return "" }

// Remove is Linux-only.
func Remove(dir string) error { return nil }

// Describe is Linux-only.
func Describe(dir string) (Node, error) { return Node{}, errdefs.ErrNotSupported }

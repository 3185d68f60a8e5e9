//go:build !linux

package microvm

import (
	"context"
	"fmt"

	"dsec.dev/dsec/internal/edge/backend"
	"dsec.dev/dsec/internal/errdefs"
)

// Runtime runs microVM sandboxes; Linux only.
type Runtime struct{}

// New returns errdefs.ErrNotSupported off Linux.
func New(cfg Config) (*Runtime, error) {
	return nil, fmt.Errorf("make microvm runtime: %w", errdefs.ErrNotSupported)
}

func (r *Runtime) Features() backend.Features                { return backend.Features{} }
func (r *Runtime) Init(ctx context.Context) error            { return errdefs.ErrNotSupported }
func (r *Runtime) Teardown(ctx context.Context) error        { return errdefs.ErrNotSupported }
func (r *Runtime) Channel(id string) (backend.Dialer, error) { return nil, errdefs.ErrNotSupported }
func (r *Runtime) Start(ctx context.Context, s backend.Spec) (backend.Dialer, error) {
	return nil, errdefs.ErrNotSupported
}
func (r *Runtime) Status(ctx context.Context, id string) (backend.Status, error) {
	return backend.Status{}, errdefs.ErrNotSupported
}
func (r *Runtime) Delete(ctx context.Context, id string) error { return errdefs.ErrNotSupported }
func (r *Runtime) List(ctx context.Context) ([]string, error)  { return nil, errdefs.ErrNotSupported }
func (r *Runtime) Usage(ctx context.Context, id string) (backend.Usage, error) {
	return backend.Usage{}, errdefs.ErrNotSupported
}

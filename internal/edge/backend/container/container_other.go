//go:build !linux

package container

import (
	"context"
	"fmt"

	"github.com/opencontainers/runtime-spec/specs-go"

	"dsec.dev/dsec/internal/edge/backend"
	"dsec.dev/dsec/internal/edge/snapshot"
	"dsec.dev/dsec/internal/errdefs"
)

// Container runs container sandboxes; Linux only.
type Container struct{}

// New returns errdefs.ErrNotSupported off Linux.
func New(cfg Config) (*Container, error) {
	return nil, fmt.Errorf("make container runtime: %w", errdefs.ErrNotSupported)
}

// NewFnCall returns errdefs.ErrNotSupported off Linux.
func NewFnCall(cfg Config) (*Container, error) {
	return nil, fmt.Errorf("make fncall runtime: %w", errdefs.ErrNotSupported)
}

func (r *Container) Features() backend.Features                { return backend.Features{} }
func (r *Container) Init(ctx context.Context) error            { return errdefs.ErrNotSupported }
func (r *Container) Teardown(ctx context.Context) error        { return errdefs.ErrNotSupported }
func (r *Container) Channel(id string) (backend.Dialer, error) { return nil, errdefs.ErrNotSupported }
func (r *Container) Start(ctx context.Context, s backend.Spec) (backend.Dialer, error) {
	return nil, errdefs.ErrNotSupported
}
func (r *Container) Status(ctx context.Context, id string) (backend.Status, error) {
	return backend.Status{}, errdefs.ErrNotSupported
}
func (r *Container) Delete(ctx context.Context, id string) error { return errdefs.ErrNotSupported }
func (r *Container) List(ctx context.Context) ([]string, error)  { return nil, errdefs.ErrNotSupported }

// BareSpec returns errdefs.ErrNotSupported off Linux.
func BareSpec(s backend.Spec, rootfs string, args []string) (*specs.Spec, error) {
	return nil, errdefs.ErrNotSupported
}

func (r *Container) Freeze(ctx context.Context, id string) error { return errdefs.ErrNotSupported }
func (r *Container) Thaw(ctx context.Context, id string) error   { return errdefs.ErrNotSupported }
func (r *Container) Frozen(ctx context.Context, id string) (bool, error) {
	return false, errdefs.ErrNotSupported
}
func (r *Container) Pause(ctx context.Context, id string, reclaim bool) (backend.PauseStats, error) {
	return backend.PauseStats{}, errdefs.ErrNotSupported
}
func (r *Container) Resume(ctx context.Context, id string, prefetch bool) (backend.ResumeStats, error) {
	return backend.ResumeStats{}, errdefs.ErrNotSupported
}

func (r *Container) Capture(ctx context.Context, id, name string) (*snapshot.Tree, error) {
	return nil, errdefs.ErrNotSupported
}

func (r *Container) Usage(ctx context.Context, id string) (backend.Usage, error) {
	return backend.Usage{}, errdefs.ErrNotSupported
}
func (r *Container) Upper(id string) (string, error) { return "", errdefs.ErrNotSupported }
func (r *Container) Root(ctx context.Context, id string) (string, int, error) {
	return "", 0, errdefs.ErrNotSupported
}
func (r *Container) Processes(ctx context.Context, id string) ([]backend.Process, error) {
	return nil, errdefs.ErrNotSupported
}
func (r *Container) AuditSession(ctx context.Context, id string) (uint32, error) {
	return 0, errdefs.ErrNotSupported
}

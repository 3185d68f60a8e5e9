//go:build !linux

package runtime

import (
	"context"
	"fmt"

	"github.com/opencontainers/runtime-spec/specs-go"

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

func (r *Container) Features() Features                 { return Features{} }
func (r *Container) Init(ctx context.Context) error     { return errdefs.ErrNotSupported }
func (r *Container) Teardown(ctx context.Context) error { return errdefs.ErrNotSupported }
func (r *Container) Channel(id string) (Dialer, error)  { return nil, errdefs.ErrNotSupported }
func (r *Container) Start(ctx context.Context, s Spec) (Dialer, error) {
	return nil, errdefs.ErrNotSupported
}
func (r *Container) Status(ctx context.Context, id string) (Status, error) {
	return Status{}, errdefs.ErrNotSupported
}
func (r *Container) Delete(ctx context.Context, id string) error { return errdefs.ErrNotSupported }
func (r *Container) List(ctx context.Context) ([]string, error)  { return nil, errdefs.ErrNotSupported }

// BareSpec returns errdefs.ErrNotSupported off Linux.
func BareSpec(s Spec, rootfs string, args []string) (*specs.Spec, error) {
	return nil, errdefs.ErrNotSupported
}

func (r *Container) Freeze(ctx context.Context, id string) error { return errdefs.ErrNotSupported }
func (r *Container) Thaw(ctx context.Context, id string) error   { return errdefs.ErrNotSupported }
func (r *Container) Frozen(ctx context.Context, id string) (bool, error) {
	return false, errdefs.ErrNotSupported
}
func (r *Container) Pause(ctx context.Context, id string, reclaim bool) (PauseStats, error) {
	return PauseStats{}, errdefs.ErrNotSupported
}
func (r *Container) Resume(ctx context.Context, id string, prefetch bool) (ResumeStats, error) {
	return ResumeStats{}, errdefs.ErrNotSupported
}

func (r *Container) Upper(id string) (string, error) { return "", errdefs.ErrNotSupported }
func (r *Container) CaptureDir() string              { return "" }

func (r *Container) Usage(ctx context.Context, id string) (Usage, error) {
	return Usage{}, errdefs.ErrNotSupported
}

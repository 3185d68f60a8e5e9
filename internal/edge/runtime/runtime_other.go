//go:build !linux

package runtime

import (
	"context"
	"fmt"

	"github.com/opencontainers/runtime-spec/specs-go"

	"dsec.dev/dsec/internal/errdefs"
)

// Runtime starts and removes container sandboxes; Linux only.
type Runtime struct{}

// New returns errdefs.ErrNotSupported off Linux.
func New(cfg Config) (*Runtime, error) {
	return nil, fmt.Errorf("make container runtime: %w", errdefs.ErrNotSupported)
}

func (r *Runtime) Init(ctx context.Context) error          { return errdefs.ErrNotSupported }
func (r *Runtime) Teardown(ctx context.Context) error      { return errdefs.ErrNotSupported }
func (r *Runtime) Start(ctx context.Context, s Spec) error { return errdefs.ErrNotSupported }
func (r *Runtime) Status(ctx context.Context, id string) (Status, error) {
	return Status{}, errdefs.ErrNotSupported
}
func (r *Runtime) Delete(ctx context.Context, id string) error { return errdefs.ErrNotSupported }
func (r *Runtime) List(ctx context.Context) ([]string, error)  { return nil, errdefs.ErrNotSupported }

// BareSpec returns errdefs.ErrNotSupported off Linux.
func BareSpec(s Spec, rootfs string, args []string) (*specs.Spec, error) {
	return nil, errdefs.ErrNotSupported
}

func (r *Runtime) Freeze(ctx context.Context, id string) error { return errdefs.ErrNotSupported }
func (r *Runtime) Thaw(ctx context.Context, id string) error   { return errdefs.ErrNotSupported }
func (r *Runtime) Frozen(ctx context.Context, id string) (bool, error) {
	return false, errdefs.ErrNotSupported
}
func (r *Runtime) Pause(ctx context.Context, id string, reclaim bool) (PauseStats, error) {
	return PauseStats{}, errdefs.ErrNotSupported
}
func (r *Runtime) Resume(ctx context.Context, id string, prefetch bool) (ResumeStats, error) {
	return ResumeStats{}, errdefs.ErrNotSupported
}

func (r *Runtime) Upper(id string) (string, error) { return "", errdefs.ErrNotSupported }
func (r *Runtime) CaptureDir() string              { return "" }

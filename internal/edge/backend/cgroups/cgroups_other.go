//go:build !linux

package cgroups

import (
	"context"
	"fmt"

	"dsec.dev/dsec/internal/errdefs"
)

// Layout is the host's cgroup layout.
type Layout struct{}

// Detect reads the host's cgroup layout.
func Detect() (*Layout, error) {
	return nil, fmt.Errorf("detect cgroups: %w", errdefs.ErrNotSupported)
}

func (l *Layout) V2() bool                                     { return false }
func (l *Layout) EnsureParent(parent string) error             { return errdefs.ErrNotSupported }
func (l *Layout) RemoveParent(parent string) error             { return errdefs.ErrNotSupported }
func (l *Layout) Create(rel string) (string, string, error)    { return "", "", errdefs.ErrNotSupported }
func (l *Layout) CreateCPU(rel string) (string, error)         { return "", errdefs.ErrNotSupported }
func (l *Layout) Exists(rel string) bool                       { return false }
func (l *Layout) Kill(ctx context.Context, rel string) error   { return errdefs.ErrNotSupported }
func (l *Layout) Remove(ctx context.Context, rel string) error { return errdefs.ErrNotSupported }
func (l *Layout) Stats(rel string) (Stats, error)              { return Stats{}, errdefs.ErrNotSupported }
func (l *Layout) Usage(rel string) (Usage, error)              { return Usage{}, errdefs.ErrNotSupported }
func (l *Layout) Dir(ctrl, rel string) string                  { return "" }

// Limits bound a process cgroup.
type Limits struct {
	MemoryBytes, Pids, CPUQuotaUsec, CPUPeriodUsec int64
}

func (l *Layout) Place(rel string, pid int, lim Limits) error { return errdefs.ErrNotSupported }

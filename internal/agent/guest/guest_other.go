//go:build !linux

// Package guest is dsec-agent's guest mode, pid 1 of a microVM; it runs on
// Linux only.
package guest

import (
	"context"
	"fmt"
	"time"

	"dsec.dev/dsec/internal/agent"
	"dsec.dev/dsec/internal/errdefs"
)

// Config is guest mode's configuration.
type Config struct {
	Agent     agent.Config
	KernelDir string
	Port      string
	PortWait  time.Duration
	Layers    []string
	Upper     string
	Network   *Network
}

// Run is only implemented on Linux.
func Run(ctx context.Context, cfg Config) error {
	return fmt.Errorf("run guest: %w", errdefs.ErrNotSupported)
}

// PowerOff is only implemented on Linux.
func PowerOff() error { return fmt.Errorf("power off: %w", errdefs.ErrNotSupported) }

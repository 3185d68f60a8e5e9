//go:build !linux

package qemu

import (
	"fmt"

	"dsec.dev/dsec/internal/errdefs"
)

// DetectAccel returns TCG: KVM is only looked for on Linux.
func DetectAccel() (Accel, string) { return TCG, "KVM is Linux's" }

// HostTSCkHz is only implemented on Linux.
func HostTSCkHz() (int64, error) {
	return 0, fmt.Errorf("find the host's TSC frequency: %w", errdefs.ErrNotSupported)
}

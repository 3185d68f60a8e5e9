//go:build !linux

package provenance

import (
	"fmt"
	"log/slog"

	"dsec.dev/dsec/internal/errdefs"
)

// DefaultSyscallRate is the records a second a SyscallLog reads at most.
const DefaultSyscallRate = 5000

// SyscallLog needs the audit netlink socket (Linux).
type SyscallLog struct{}

// NewSyscallLog: the audit socket exists on Linux only.
func NewSyscallLog(*slog.Logger, int) (*SyscallLog, error) {
	return nil, fmt.Errorf("record refused syscalls: %w", errdefs.ErrNotSupported)
}

// ReadSession: audit sessions exist on Linux only.
func ReadSession(int) (uint32, error) {
	return 0, fmt.Errorf("read audit session: %w", errdefs.ErrNotSupported)
}

func (*SyscallLog) Close() error { return nil }
func (*SyscallLog) Track(string, uint32) error {
	return fmt.Errorf("track refused syscalls: %w", errdefs.ErrNotSupported)
}
func (*SyscallLog) Denials(string) (Denials, bool) { return Denials{}, false }
func (*SyscallLog) Forget(string)                  {}

//go:build !linux

package quota

import (
	"fmt"

	"dsec.dev/dsec/internal/errdefs"
)

// Manager makes limited directories under a root; Linux only.
type Manager struct{}

// Open returns errdefs.ErrNotSupported off Linux.
func Open(root string) (*Manager, error) {
	return nil, fmt.Errorf("open quotas on %s: %w", root, errdefs.ErrNotSupported)
}

// EnableBtrfs returns errdefs.ErrNotSupported off Linux.
func EnableBtrfs(root string) error { return errdefs.ErrNotSupported }

func (m *Manager) Kind() string                                { return "" }
func (m *Manager) Create(name string, l Limit) (string, error) { return "", errdefs.ErrNotSupported }
func (m *Manager) Remove(name string) error                    { return errdefs.ErrNotSupported }
func (m *Manager) Usage(name string) (Limit, Usage, error) {
	return Limit{}, Usage{}, errdefs.ErrNotSupported
}
func (m *Manager) Qgroup(name string) (string, error) { return "", errdefs.ErrNotSupported }

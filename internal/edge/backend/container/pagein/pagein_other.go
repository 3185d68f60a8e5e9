//go:build !linux

package pagein

import "dsec.dev/dsec/internal/errdefs"

// WillNeed is Linux-only.
func WillNeed(pid int) (int64, error) { return 0, errdefs.ErrNotSupported }

// PageOut is Linux-only.
func PageOut(pid int) (int64, error) { return 0, errdefs.ErrNotSupported }

// WillNeedTmpfs is Linux-only.
func WillNeedTmpfs(pid int) (int64, error) { return 0, errdefs.ErrNotSupported }

//go:build !linux

package vmstate

import (
	"fmt"

	"dsec.dev/dsec/internal/errdefs"
)

var errNotLinux = fmt.Errorf("vm state files: %w", errdefs.ErrNotSupported)

func processRSS(int) int64                   { return 0 }
func residentRanges(string) ([]span, error)  { return nil, errNotLinux }
func cachedBytes(string) (int64, error)      { return 0, errNotLinux }
func writeRanges(string, []span) error       { return errNotLinux }
func prefetch(string, []span) (int64, error) { return 0, errNotLinux }
func dropCache(string) error                 { return errNotLinux }
func fileSize(string) int64                  { return 0 }
func allocatedBytes(string) int64            { return 0 }

// Clone copies the file src to dst; Linux only.
func Clone(src, dst string) error { return errNotLinux }

//go:build !linux

package provenance

import "io/fs"

// isWhiteout: overlayfs's whiteouts exist on Linux only.
func isWhiteout(fs.FileInfo) bool { return false }

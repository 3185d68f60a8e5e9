package provenance

import (
	"io/fs"
	"syscall"
)

// isWhiteout reports whether info is an overlayfs whiteout: a character
// device numbered 0/0.
func isWhiteout(info fs.FileInfo) bool {
	if info.Mode()&fs.ModeCharDevice == 0 {
		return false
	}
	st, ok := info.Sys().(*syscall.Stat_t)
	return ok && st.Rdev == 0
}

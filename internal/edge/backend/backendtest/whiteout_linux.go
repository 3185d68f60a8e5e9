package backendtest

import (
	"fmt"

	"golang.org/x/sys/unix"
)

// whiteout reports whether path is an overlayfs whiteout: a character
// device numbered 0/0.
func whiteout(path string) (bool, string) {
	var st unix.Stat_t
	if err := unix.Lstat(path, &st); err != nil {
		return false, err.Error()
	}
	if st.Mode&unix.S_IFMT != unix.S_IFCHR || st.Rdev != 0 {
		return false, fmt.Sprintf("mode %o, device %d", st.Mode, st.Rdev)
	}
	return true, ""
}

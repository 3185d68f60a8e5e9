package provenance

import (
	"io/fs"
	"syscall"
)

// inodeOf is info's inode number and inode change time (ns), which no
// process in the sandbox can set back.
func inodeOf(info fs.FileInfo) (ino uint64, ctimeNs int64) {
	st, ok := info.Sys().(*syscall.Stat_t)
	if !ok {
		return 0, 0
	}
	return st.Ino, st.Ctim.Nano()
}

//go:build !linux

package provenance

import "io/fs"

// inodeOf: the inode and its change time are read on Linux only; a stamp
// elsewhere is the mode, size and modification time.
func inodeOf(fs.FileInfo) (ino uint64, ctimeNs int64) { return 0, 0 }

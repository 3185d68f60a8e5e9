//go:build !linux

package image

import "io/fs"

// lockFile is a no-op off Linux: the store is only shared between processes
// on Linux nodes.
func lockFile(path string) (func(), error) { return func() {}, nil }

func inode(fi fs.FileInfo) uint64 { return 0 }

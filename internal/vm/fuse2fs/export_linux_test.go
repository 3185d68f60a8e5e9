package fuse2fs

import "golang.org/x/sys/unix"

// Stop stops m's fuse2fs (SIGSTOP): a FUSE server that blocks without
// spinning, as a hostile image might leave it.
func Stop(m *Mounted) error { return m.cmd.Process.Signal(unix.SIGSTOP) }

package microvm

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"

	"dsec.dev/dsec/internal/vm/guestcfg"
)

// makeDisk makes the VM's writable disk at path: a sparse file of size
// bytes holding ext4, with the agent's configuration at its root. The
// inode tables and the journal are left unwritten (they read as zeros from
// the sparse file, and the guest mounts with noinit_itable), so the disk
// costs the host only what the guest writes; no blocks are reserved for
// root, so the sandbox gets all of its limit. inodes 0 keeps mkfs's ratio
// (one per 16 KiB).
func makeDisk(ctx context.Context, path string, size, inodes int64, a guestcfg.Agent) error {
	seed, err := os.MkdirTemp(filepath.Dir(path), ".seed-")
	if err != nil {
		return fmt.Errorf("make writable disk: %w", err)
	}
	defer os.RemoveAll(seed)
	if err := guestcfg.Write(filepath.Join(seed, guestcfg.FileName), a); err != nil {
		return fmt.Errorf("make writable disk: %w", err)
	}
	f, err := os.OpenFile(path, os.O_WRONLY|os.O_CREATE|os.O_EXCL, 0o600)
	if err != nil {
		return fmt.Errorf("make writable disk: %w", err)
	}
	err = f.Truncate(size)
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	if err != nil {
		return fmt.Errorf("make writable disk: %w", err)
	}
	args := []string{"-q", "-F", "-m", "0", "-E", "lazy_itable_init=1,lazy_journal_init=1,nodiscard,root_owner=0:0", "-d", seed}
	if inodes > 0 {
		args = append(args, "-N", strconv.FormatInt(inodes, 10))
	}
	args = append(args, path)
	out, err := exec.CommandContext(ctx, "mkfs.ext4", args...).CombinedOutput()
	if err != nil {
		return fmt.Errorf("make writable disk: mkfs.ext4 (Debian's e2fsprogs): %v: %s", err, out)
	}
	return nil
}

package vmstate

import (
	"fmt"
	"os"
	"path/filepath"

	"dsec.dev/dsec/internal/vm/qemu"
)

// Fork prepares a child of the VM saved with config parent: a copy of its
// RAM file and of each writable drive in dir (reflinks where the file
// system can, else copies that keep the holes), and returns the child's
// config, to Resume from the parent's state file (which children share:
// Resume only reads it). The child's run directory is dir/run. Read-only
// drives are shared. What Fork made is removed again when it fails.
//
// A child starts as a copy of the parent's memory: its host name,
// machine-id and the kernel's random state are the parent's until the
// caller gives it its own through the agent (Reidentify).
func Fork(parent qemu.Config, dir string) (child qemu.Config, err error) {
	if parent.MemoryFile == "" {
		return child, fmt.Errorf("fork vm: the parent's RAM is not a file (qemu.Config.MemoryFile)")
	}
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return child, fmt.Errorf("fork vm: %w", err)
	}
	var made []string
	defer func() {
		if err != nil {
			for _, f := range made {
				os.Remove(f)
			}
		}
	}()
	clone := func(src, name string) (string, error) {
		dst := filepath.Join(dir, name)
		if err := Clone(src, dst); err != nil {
			return "", fmt.Errorf("fork vm: %w", err)
		}
		made = append(made, dst)
		return dst, nil
	}
	child = parent
	child.Dir = filepath.Join(dir, "run")
	if child.MemoryFile, err = clone(parent.MemoryFile, "memory"); err != nil {
		return child, err
	}
	child.Drives = append([]qemu.Drive(nil), parent.Drives...)
	for i, d := range child.Drives {
		if d.ReadOnly {
			continue
		}
		if child.Drives[i].Path, err = clone(d.Path, fmt.Sprintf("disk%d-%s", i, filepath.Base(d.Path))); err != nil {
			return child, err
		}
	}
	return child, nil
}

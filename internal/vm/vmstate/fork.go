package vmstate

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"time"

	"dsec.dev/dsec/internal/vm/qemu"
	"dsec.dev/dsec/internal/vm/qmp"
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

// Snapshot saves the running VM q monitors for forks and runs it on: its
// vCPUs stop, its devices' state is written into stateFile (by migration,
// the RAM left out, as Pause writes it), copy runs while it stands still
// (the place to Clone its RAM file and writable drives: the state file
// and those copies are then one consistent saved VM, which Resume runs as
// Fork's children are), and the vCPUs run again (cont also takes its
// disks back from the finished migration). QEMU stops and flushes its
// block layer to the drives' files at the stop, so a copy holds what the
// guest wrote; the guest's own cache is in its RAM. It returns how long
// the VM stood still. A failure runs the VM again all the same.
func Snapshot(ctx context.Context, q *qmp.Client, stateFile string, copy func() error) (time.Duration, error) {
	var m meta
	var err error
	if m.ChannelConnected, err = channelConnected(ctx, q); err != nil {
		return 0, fmt.Errorf("snapshot vm: %w", err)
	}
	t0 := time.Now()
	if err := q.Stop(ctx); err != nil {
		return 0, fmt.Errorf("snapshot vm: %w", err)
	}
	err = save(ctx, q, stateFile)
	if err == nil {
		err = copy()
	}
	if err == nil {
		err = writeMeta(stateFile, m)
	}
	if cerr := q.Cont(context.WithoutCancel(ctx)); cerr != nil {
		return time.Since(t0), fmt.Errorf("snapshot vm: run it again: %w", errors.Join(cerr, err))
	}
	if err != nil {
		return time.Since(t0), fmt.Errorf("snapshot vm: %w", err)
	}
	return time.Since(t0), nil
}

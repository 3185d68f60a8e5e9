package microvm

import (
	"context"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"time"

	dsecv1 "dsec.dev/dsec/api/gen/dsec/v1"
	"dsec.dev/dsec/internal/agent/agentclient"
	"dsec.dev/dsec/internal/edge/backend"
	"dsec.dev/dsec/internal/edge/snapshot"
	"dsec.dev/dsec/internal/errdefs"
	"dsec.dev/dsec/internal/vm/fuse2fs"
	"dsec.dev/dsec/internal/vm/qemu"
	"dsec.dev/dsec/internal/vm/vmstate"
)

var _ backend.Snapshotter = (*Runtime)(nil)

// The files of a capture's dir, <StateDir>/captures/<id>.<name>.
const (
	captureDisk  = "upper.ext4" // the clone of the VM's writable disk
	captureMount = "mnt"        // where the clone is mounted
)

// syncTimeout bounds the guest's sync before a freeze.
const syncTimeout = time.Minute

// Capture captures VM id's writable layer, frozen by Freeze (or saved by
// Pause): its writable disk is cloned (vmstate.Clone: a reflink where the
// state dir's file system shares extents, else a copy of its data ranges)
// to <StateDir>/captures/<id>.<name>/upper.ext4 and the clone mounted on
// the host at mnt/ beside it by fuse2fs (package fuse2fs: e2fsprogs'
// user-space ext4 over FUSE, run as nobody with no capabilities in its own
// namespaces; nosuid, nodev, noexec), so that no host kernel file-system
// driver parses what the guest wrote: a guest that crafted its ext4 on
// purpose reaches an unprivileged user-space parser, whose failure fails
// the capture or its reads, not the node. The Tree is the overlay's upper
// dir in it, whiteouts as the guest's overlayfs wrote them (0/0 character
// devices, trusted.overlay.* extended attributes). The clone is mounted
// read-write: package snapshot edits a tree in place, and fuse2fs replays
// the ext4 journal into the clone first, so what the guest committed (its
// sync, see Freeze) is there though not yet written to its final place;
// the VM's own disk is never touched. Remove unmounts the clone, ends its
// fuse2fs and deletes it; Init removes what an earlier instance left.
func (r *Runtime) Capture(ctx context.Context, id, name string) (*snapshot.Tree, error) {
	if !backend.ValidID(id) || !backend.ValidID(name) {
		return nil, fmt.Errorf("capture sandbox %q as %q: %w", id, name, errdefs.ErrInvalidArgument)
	}
	dir, err := r.existing(id, "capture")
	if err != nil {
		return nil, err
	}
	start := time.Now()
	if err := os.MkdirAll(r.capturesDir(), 0o700); err != nil {
		return nil, fmt.Errorf("capture sandbox %s: %w", id, err)
	}
	cdir := filepath.Join(r.capturesDir(), id+"."+name)
	if err := os.Mkdir(cdir, 0o700); err != nil {
		if errors.Is(err, fs.ErrExist) {
			return nil, fmt.Errorf("capture sandbox %s as %s: %w", id, name, errdefs.ErrAlreadyExists)
		}
		return nil, fmt.Errorf("capture sandbox %s: %w", id, err)
	}
	tree, err := mountClone(ctx, filepath.Join(dir, upperDisk), cdir)
	if err != nil {
		if rerr := removeCapture(cdir); rerr != nil {
			r.log.Warn("remove a failed capture", "path", cdir, "err", rerr)
		}
		return nil, fmt.Errorf("capture sandbox %s: %w", id, err)
	}
	tree.Took = time.Since(start)
	return tree, nil
}

// mountClone clones disk into cdir and mounts the clone there.
func mountClone(ctx context.Context, disk, cdir string) (*snapshot.Tree, error) {
	clone := filepath.Join(cdir, captureDisk)
	if err := vmstate.Clone(disk, clone); err != nil {
		return nil, fmt.Errorf("clone the writable disk: %w", err)
	}
	mnt := filepath.Join(cdir, captureMount)
	if err := os.Mkdir(mnt, 0o700); err != nil {
		return nil, fmt.Errorf("clone the writable disk: %w", err)
	}
	m, err := fuse2fs.Mount(ctx, clone, mnt, fuse2fs.Options{})
	if err != nil {
		return nil, fmt.Errorf("mount the clone of the writable disk: %w", err)
	}
	remove := func() error {
		uerr := m.Unmount()
		return errors.Join(uerr, removeCapture(cdir))
	}
	upper := filepath.Join(mnt, "upper")
	fi, err := os.Lstat(upper)
	switch {
	case errors.Is(err, fs.ErrNotExist):
		// A guest that never mounted its overlay has no upper dir yet:
		// an empty one is its writable layer.
		err = os.Mkdir(upper, 0o755)
	case err == nil && !fi.IsDir():
		// A guest's symlink there would point Pack at the host's own
		// tree.
		err = fmt.Errorf("the clone's upper is a %s, not a directory: %w", fi.Mode().Type(), errdefs.ErrFailedPrecondition)
	}
	if err != nil {
		return nil, errors.Join(fmt.Errorf("the upper dir of the clone of the writable disk: %w", err), m.Unmount())
	}
	tree := snapshot.NewTree(upper, snapshot.MethodDiskClone, 0, remove)
	// A fuse2fs that blocks is cut off at its mount's deadline (its FUSE
	// connection aborted): the pack then fails saying so.
	tree.Broken = m.Aborted
	return tree, nil
}

// removeCapture detaches a capture's clone, when mounted (one an earlier
// instance left: its fuse2fs then ends), and deletes its dir. A clone that
// stays mounted is not deleted (the error says so).
func removeCapture(cdir string) error {
	if err := fuse2fs.Detach(filepath.Join(cdir, captureMount)); err != nil {
		return fmt.Errorf("remove capture %s: %w", cdir, err)
	}
	if err := os.RemoveAll(cdir); err != nil {
		return fmt.Errorf("remove capture %s: %w", cdir, err)
	}
	return nil
}

func (r *Runtime) capturesDir() string { return filepath.Join(r.cfg.StateDir, "captures") }

// clearCaptures removes the captures an earlier instance left: a snapshot
// cut short by a restart.
func (r *Runtime) clearCaptures() error {
	return r.clearLeft(r.capturesDir(), "removing a capture left by an interrupted snapshot", removeCapture)
}

// clearLeft removes with remove each entry an earlier instance left in dir,
// logging msg for each.
func (r *Runtime) clearLeft(dir, msg string, remove func(string) error) error {
	des, err := os.ReadDir(dir)
	if errors.Is(err, fs.ErrNotExist) {
		return nil
	}
	if err != nil {
		return fmt.Errorf("read %s: %w", dir, err)
	}
	var errs []error
	for _, de := range des {
		p := filepath.Join(dir, de.Name())
		r.log.Info(msg, "path", p)
		errs = append(errs, remove(p))
	}
	return errors.Join(errs...)
}

// syncGuest has VM id's guest write its dirty data to its disks (sync(2)
// run by the agent, as the sandbox's user: sync needs no privilege), so
// that a capture of the writable disk after the freeze holds what the
// sandbox wrote. QMP stop itself drains and flushes QEMU's block layer,
// but what the guest kernel still caches never reached it. A guest whose
// agent does not answer is frozen anyway: its capture holds what reached
// the disk (the journal replayed: consistent, possibly older).
func (r *Runtime) syncGuest(ctx context.Context, id, dir string) {
	ctx, cancel := context.WithTimeout(ctx, syncTimeout)
	defer cancel()
	c := agentclient.New(r.channels.get(filepath.Join(dir, qemu.ChannelSocket)).Dial)
	defer c.Close()
	if err := runSync(ctx, c); err != nil {
		r.log.Warn("sync the guest before a freeze: a capture holds only what reached its disk", "id", id, "err", err)
	}
}

func runSync(ctx context.Context, c agentclient.Client) error {
	s, err := c.ExecEvents(ctx, &dsecv1.ExecRequest{Argv: []string{guestShell, "-c", "sync"}})
	if err != nil {
		return err
	}
	defer s.Close()
	var exited *dsecv1.ExecExited
	for s.Receive() {
		if e := s.Msg().GetExited(); e != nil {
			exited = e
		}
	}
	if err := s.Err(); err != nil {
		return err
	}
	if exited == nil || exited.GetExitCode() != 0 {
		return fmt.Errorf("sync ended without success: %v", exited)
	}
	return nil
}

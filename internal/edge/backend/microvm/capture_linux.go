package microvm

import (
	"context"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"os/exec"
	"path/filepath"
	"time"

	"golang.org/x/sys/unix"

	dsecv1 "dsec.dev/dsec/api/gen/dsec/v1"
	"dsec.dev/dsec/internal/agent/agentclient"
	"dsec.dev/dsec/internal/edge/backend"
	"dsec.dev/dsec/internal/edge/snapshot"
	"dsec.dev/dsec/internal/errdefs"
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
// the host (ext4 on a loop device, nosuid, nodev, noexec) at mnt/ beside
// it; the Tree is the overlay's upper dir in it, whiteouts as the guest's
// overlayfs wrote them (0/0 character devices, trusted.overlay.*
// extended attributes). The clone is mounted read-write: package snapshot
// edits a tree in place, and mounting replays the ext4 journal into the
// clone, so what the guest committed (its sync, see Freeze) is there
// though not yet written to its final place; the VM's own disk is never
// touched. Remove unmounts the clone and deletes it; Init removes what an
// earlier instance left.
//
// The clone's file system is the guest's, mounted by the host's kernel:
// a guest that corrupted it on purpose reaches the host's ext4 driver.
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
	// mount(8) sets the loop device up and has it freed at the unmount
	// (autoclear).
	out, err := exec.CommandContext(ctx, "mount", "-t", "ext4", "-o", "loop,nosuid,nodev,noexec", clone, mnt).CombinedOutput()
	if err != nil {
		return nil, fmt.Errorf("mount the clone of the writable disk: %v: %s", err, out)
	}
	upper := filepath.Join(mnt, "upper")
	if fi, err := os.Lstat(upper); err != nil || !fi.IsDir() {
		// A guest that never mounted its overlay has no upper dir yet:
		// an empty one is its writable layer.
		if err := os.Mkdir(upper, 0o755); err != nil && !errors.Is(err, fs.ErrExist) {
			return nil, fmt.Errorf("the clone of the writable disk has no upper dir: %w", err)
		}
	}
	return snapshot.NewTree(upper, snapshot.MethodDiskClone, 0, func() error { return removeCapture(cdir) }), nil
}

// removeCapture unmounts a capture's clone, when mounted, and deletes its
// dir. A clone that stays mounted is not deleted (the error says so).
func removeCapture(cdir string) error {
	mnt := filepath.Join(cdir, captureMount)
	if err := unix.Unmount(mnt, 0); err != nil && !errors.Is(err, unix.EINVAL) && !errors.Is(err, unix.ENOENT) {
		return fmt.Errorf("remove capture %s: unmount: %w", cdir, err)
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
	des, err := os.ReadDir(r.capturesDir())
	if errors.Is(err, fs.ErrNotExist) {
		return nil
	}
	if err != nil {
		return fmt.Errorf("read %s: %w", r.capturesDir(), err)
	}
	var errs []error
	for _, de := range des {
		p := filepath.Join(r.capturesDir(), de.Name())
		r.log.Info("removing a capture left by an interrupted snapshot", "path", p)
		errs = append(errs, removeCapture(p))
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

package container

import (
	"context"
	"errors"
	"fmt"
	"io/fs"
	"log/slog"
	"os"
	"path/filepath"
	"runtime"

	"golang.org/x/sys/unix"

	"dsec.dev/dsec/internal/edge/backend/container/mountinfo"
)

// mkfsBtrfs formats image, new and not mounted, as the upper file system's
// btrfs.
//
// mkfs.btrfs first stats the source of every mount it can see, to be sure
// the image is not in use, and refuses to go on when one cannot be reached.
// A file-backed EROFS layer whose file lives on the FUSE mount of a lazyfs
// that died (another root's dsecd and its lazyfs killed, say) fails that
// stat with ENOTCONN, and on such a host no other root could start. So when
// mkfs.btrfs refuses and such mounts exist, it runs again in a mount
// namespace of its own in which they are detached; the host's mounts are
// left as they are, for their own root to clean up.
func mkfsBtrfs(ctx context.Context, log *slog.Logger, image string) error {
	args := []string{"-q", "-f", "-L", "dsec-upper", "-m", "single", "-d", "single", image}
	err := run(ctx, "mkfs.btrfs", args...)
	if err == nil {
		return nil
	}
	ms, rerr := mountinfo.Read()
	if rerr != nil {
		return err
	}
	dead := unreachableMounts(ms)
	if len(dead) == 0 {
		return err
	}
	log.Warn("mounts of this host cannot be reached (their FUSE server is gone): formatting the upper file system without them in view",
		"mounts", dead, "first_try", err)
	return runWithoutMounts(ctx, dead, "mkfs.btrfs", args...)
}

// unreachableMounts returns the mount points of the mounts whose source is
// a path that cannot be looked up for a reason other than its absence: a
// file on a dead FUSE mount (ENOTCONN), say.
func unreachableMounts(ms []mountinfo.Mount) []string {
	var out []string
	for _, m := range ms {
		if !filepath.IsAbs(m.Source) {
			continue
		}
		if _, err := os.Stat(m.Source); err != nil && !errors.Is(err, fs.ErrNotExist) {
			out = append(out, m.Point)
		}
	}
	return out
}

// runWithoutMounts runs a command in a new mount namespace, private to it,
// from which the given mount points are detached. The namespace is made on
// a thread of its own, locked to the goroutine and never unlocked, so the
// Go runtime ends the thread, and the namespace with it, when the command
// is done. Never the main thread: Go does not end that one but keeps it
// idle, and /proc/self/mountinfo, which package mountinfo reads, is the
// main thread's view, so the process would see the private namespace from
// then on (its own later mounts missing, the detached ones gone).
func runWithoutMounts(ctx context.Context, points []string, name string, args ...string) error {
	errc := make(chan error, 1)
	go func() {
		runtime.LockOSThread()
		if unix.Gettid() == unix.Getpid() {
			// Hold the main thread while another goroutine, which cannot
			// get it now, does the work.
			defer runtime.UnlockOSThread()
			errc <- runWithoutMounts(ctx, points, name, args...)
			return
		}
		if err := unix.Unshare(unix.CLONE_NEWNS); err != nil {
			errc <- fmt.Errorf("new mount namespace for %s: %w", name, err)
			return
		}
		if err := unix.Mount("", "/", "", unix.MS_REC|unix.MS_PRIVATE, ""); err != nil {
			errc <- fmt.Errorf("make the mount namespace for %s private: %w", name, err)
			return
		}
		for _, p := range points {
			if err := unix.Unmount(p, unix.MNT_DETACH); err != nil && !errors.Is(err, unix.EINVAL) && !errors.Is(err, unix.ENOENT) {
				errc <- fmt.Errorf("detach %s in %s's mount namespace: %w", p, name, err)
				return
			}
		}
		errc <- run(ctx, name, args...)
	}()
	return <-errc
}

package snapshot

import (
	"errors"
	"fmt"
	"os"
	"path"
	"strings"

	"golang.org/x/sys/unix"

	"dsec.dev/dsec/internal/errdefs"
)

// WriteFiles writes files into the running file system seen at root (a
// host path such as /proc/PID/root of a sandbox's init) as root, uid and
// gid 0, with each file's mode exactly (no umask). Each path resolves
// inside root as the sandbox's processes see it: symlinks of its layers
// on the way are followed, and can never lead out of root (openat2's
// RESOLVE_IN_ROOT: root is "/" to them). Directories on the way that root
// lacks are made, 0755; whatever root holds at a path itself, a file or a
// symlink, is replaced (a symlink is never written through); a directory
// there is an error. It is what a write of each file by the sandbox's
// agent as root with its parents made does, in one call of the host's.
func WriteFiles(root string, files []File) error {
	rfd, err := unix.Open(root, unix.O_PATH|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
	if err != nil {
		return fmt.Errorf("write files into %s: %w", root, err)
	}
	defer unix.Close(rfd)
	for _, f := range files {
		if err := writeFile(rfd, f); err != nil {
			return fmt.Errorf("write %s: %w", f.Path, err)
		}
	}
	return nil
}

func writeFile(rfd int, f File) error {
	if !path.IsAbs(f.Path) || path.Clean(f.Path) != f.Path || f.Path == "/" {
		return fmt.Errorf("not an absolute, clean path of a file: %w", errdefs.ErrInvalidArgument)
	}
	mode := uint32(f.Mode.Perm())
	if mode == 0 {
		mode = 0o644
	}
	dir, name := path.Split(strings.TrimPrefix(f.Path, "/"))
	pfd, err := makeDirIn(rfd, strings.TrimSuffix(dir, "/"))
	if err != nil {
		return err
	}
	defer unix.Close(pfd)
	var st unix.Stat_t
	switch err := unix.Fstatat(pfd, name, &st, unix.AT_SYMLINK_NOFOLLOW); {
	case errors.Is(err, unix.ENOENT):
	case err != nil:
		return err
	case st.Mode&unix.S_IFMT == unix.S_IFDIR:
		return fmt.Errorf("a directory is there: %w", errdefs.ErrFailedPrecondition)
	default:
		if err := unix.Unlinkat(pfd, name, 0); err != nil && !errors.Is(err, unix.ENOENT) {
			return fmt.Errorf("replace what is there: %w", err)
		}
	}
	fd, err := unix.Openat(pfd, name, unix.O_WRONLY|unix.O_CREAT|unix.O_EXCL|unix.O_NOFOLLOW|unix.O_CLOEXEC, mode)
	if err != nil {
		return err
	}
	file := os.NewFile(uintptr(fd), f.Path)
	defer file.Close()
	if _, err := file.Write(f.Data); err != nil {
		return err
	}
	if err := unix.Fchown(fd, 0, 0); err != nil {
		return err
	}
	if err := unix.Fchmod(fd, mode); err != nil {
		return err
	}
	return file.Close()
}

// makeDirIn opens directory rel (relative, clean; "" is root) of the tree
// at rfd, resolved in it, making each directory of the way it lacks.
func makeDirIn(rfd int, rel string) (int, error) {
	how := &unix.OpenHow{
		Flags:   unix.O_PATH | unix.O_DIRECTORY | unix.O_CLOEXEC,
		Resolve: unix.RESOLVE_IN_ROOT | unix.RESOLVE_NO_MAGICLINKS,
	}
	open := func(p string) (int, error) {
		if p == "" {
			p = "."
		}
		for {
			fd, err := unix.Openat2(rfd, p, how)
			if !errors.Is(err, unix.EAGAIN) && !errors.Is(err, unix.EINTR) {
				return fd, err
			}
		}
	}
	fd, err := open(rel)
	if err == nil || !errors.Is(err, unix.ENOENT) {
		if err != nil {
			err = fmt.Errorf("open /%s: %w", rel, err)
		}
		return fd, err
	}
	parent, name := path.Split(rel)
	pfd, err := makeDirIn(rfd, strings.TrimSuffix(parent, "/"))
	if err != nil {
		return -1, err
	}
	err = unix.Mkdirat(pfd, name, 0o755)
	unix.Close(pfd)
	if err != nil && !errors.Is(err, unix.EEXIST) {
		return -1, fmt.Errorf("make /%s: %w", rel, err)
	}
	fd, err = open(rel)
	if err != nil {
		return -1, fmt.Errorf("open /%s: %w", rel, err)
	}
	return fd, nil
}

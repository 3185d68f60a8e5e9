package pagein

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"

	"golang.org/x/sys/unix"

	"dsec.dev/dsec/internal/edge/backend/container/mountinfo"
)

// maxTmpfsEntries bounds the directory entries WillNeedTmpfs visits in one
// mount namespace, so that a tree of millions of small files cannot hold a
// resume up: what it leaves out is faulted back in when read.
const maxTmpfsEntries = 1 << 16

// WillNeedTmpfs asks the kernel to read the swapped-out pages of every
// file in the tmpfs mounts of pid's mount namespace (/dev/shm, a tmpfs
// /tmp) back into RAM, and returns the bytes of the files it was asked
// about. A file in tmpfs that no process maps is in no process's mappings,
// so WillNeed does not reach it. pid's processes should be frozen, so that
// nothing there moves meanwhile. Each mount is opened inside pid's root
// with no symlink followed, and the walk below it follows none either and
// stays on the mount's own file system.
func WillNeedTmpfs(pid int) (int64, error) {
	f, err := os.Open("/proc/" + strconv.Itoa(pid) + "/mountinfo")
	if errors.Is(err, os.ErrNotExist) {
		return 0, nil // exited
	}
	if err != nil {
		return 0, fmt.Errorf("read mounts of %d: %w", pid, err)
	}
	mounts, err := mountinfo.Parse(f)
	f.Close()
	if err != nil {
		return 0, fmt.Errorf("read mounts of %d: %w", pid, err)
	}
	root, err := unix.Open("/proc/"+strconv.Itoa(pid)+"/root", unix.O_PATH|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
	if err != nil {
		return 0, fmt.Errorf("open the root of %d: %w", pid, err)
	}
	defer unix.Close(root)
	w := tmpfsWalk{left: maxTmpfsEntries}
	var errs []error
	for _, m := range mounts {
		if m.FSType != "tmpfs" {
			continue
		}
		if err := w.mount(root, m); err != nil {
			errs = append(errs, fmt.Errorf("prefetch tmpfs %s of %d: %w", m.Point, pid, err))
		}
	}
	return w.bytes, errors.Join(errs...)
}

// tmpfsWalk is one WillNeedTmpfs: the bytes asked about so far and the
// entries it may still visit.
type tmpfsWalk struct {
	bytes int64
	left  int
}

// mount walks the tmpfs mounted at m.Point under root.
func (w *tmpfsWalk) mount(root int, m mountinfo.Mount) error {
	fd, err := unix.Openat2(root, strings.TrimPrefix(m.Point, "/"), &unix.OpenHow{
		Flags:   unix.O_RDONLY | unix.O_DIRECTORY | unix.O_CLOEXEC,
		Resolve: unix.RESOLVE_IN_ROOT | unix.RESOLVE_NO_SYMLINKS | unix.RESOLVE_NO_MAGICLINKS,
	})
	if errors.Is(err, unix.ENOENT) || errors.Is(err, unix.ENOTDIR) || errors.Is(err, unix.ELOOP) {
		return nil // over-mounted, or not a directory (a tmpfs file mount)
	}
	if err != nil {
		return err
	}
	dir := os.NewFile(uintptr(fd), m.Point)
	defer dir.Close()
	var st unix.Stat_t
	if err := unix.Fstat(fd, &st); err != nil {
		return err
	}
	if unix.Major(st.Dev) != uint32(m.Major) || unix.Minor(st.Dev) != uint32(m.Minor) {
		return nil // another mount hides it
	}
	w.dir(dir, st.Dev)
	return nil
}

// dir advises every regular file below dir that lives on device dev; what
// cannot be opened or read is left out.
func (w *tmpfsWalk) dir(dir *os.File, dev uint64) {
	for w.left > 0 {
		des, err := dir.ReadDir(256)
		for _, de := range des {
			if w.left--; w.left < 0 {
				return
			}
			switch {
			case de.IsDir():
				w.subdir(dir, de.Name(), dev)
			case de.Type().IsRegular():
				w.file(dir, de.Name(), dev)
			}
		}
		if err != nil {
			return // io.EOF at the end
		}
	}
}

// subdir walks directory name of dir, if it is on dev (another mount is
// walked as such when it is tmpfs).
func (w *tmpfsWalk) subdir(dir *os.File, name string, dev uint64) {
	fd, err := unix.Openat(int(dir.Fd()), name, unix.O_RDONLY|unix.O_DIRECTORY|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0)
	if err != nil {
		return
	}
	sub := os.NewFile(uintptr(fd), filepath.Join(dir.Name(), name))
	defer sub.Close()
	var st unix.Stat_t
	if unix.Fstat(fd, &st) == nil && st.Dev == dev {
		w.dir(sub, dev)
	}
}

// file asks the kernel to read regular file name of dir back into RAM, if
// it is on dev: mapped, a tmpfs file's swapped pages come back with
// MADV_WILLNEED, while fadvise does nothing on tmpfs.
func (w *tmpfsWalk) file(dir *os.File, name string, dev uint64) {
	fd, err := unix.Openat(int(dir.Fd()), name, unix.O_RDONLY|unix.O_NOFOLLOW|unix.O_NONBLOCK|unix.O_NOCTTY|unix.O_NOATIME|unix.O_CLOEXEC, 0)
	if err != nil {
		return
	}
	defer unix.Close(fd)
	var st unix.Stat_t
	if err := unix.Fstat(fd, &st); err != nil || st.Mode&unix.S_IFMT != unix.S_IFREG || st.Dev != dev || st.Size <= 0 {
		return
	}
	mem, err := unix.Mmap(fd, 0, int(st.Size), unix.PROT_READ, unix.MAP_SHARED)
	if err != nil {
		return
	}
	defer unix.Munmap(mem)
	if unix.Madvise(mem, unix.MADV_WILLNEED) == nil {
		w.bytes += st.Size
	}
}

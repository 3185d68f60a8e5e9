package snapshot

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"path"
	"path/filepath"
	"strconv"
	"time"

	"golang.org/x/sys/unix"

	"dsec.dev/dsec/internal/edge/btrfs"
	"dsec.dev/dsec/internal/errdefs"
)

// Capture copies the overlay upper dir upper to dst, as fast as the file
// systems allow, and returns the copy. The caller keeps the sandbox frozen
// while it runs (nothing may write upper meanwhile) and thaws it after.
//
// dst must not exist and its parent must; it should be on upper's file
// system, where the fast methods work. In order of preference:
//
//   - a btrfs snapshot, when upper or its parent is a btrfs subvolume
//     (other than the top level) and dst is on the same btrfs;
//   - a walk that clones each file's extents (FICLONE), where the file
//     system shares extents (btrfs, XFS with reflink);
//   - a walk that copies contents (copy_file_range; holes stay holes).
//
// A walk keeps every object the upper holds: names as they are (any byte),
// file types (sockets and device nodes included: Pack decides what a layer
// keeps), owners, modes with setuid, setgid and sticky bits, atimes and
// mtimes, extended attributes of every namespace (trusted.* and security.*
// included), symlink targets, and hard links as links (the 0:0 whiteouts
// overlayfs links to one inode among them). Change and birth times and
// inode flags (chattr) are not kept. It holds one open directory per level
// of depth and remembers only the objects with more than one link.
//
// On any error, cancellation included, nothing is left at dst. A full
// destination fails with an error wrapping errdefs.ErrResourceExhausted.
func Capture(ctx context.Context, upper, dst string) (*Tree, error) {
	start := time.Now()
	t, err := capture(ctx, upper, dst)
	if err != nil {
		if errors.Is(err, unix.ENOSPC) || errors.Is(err, unix.EDQUOT) {
			err = fmt.Errorf("%w: %w", err, errdefs.ErrResourceExhausted)
		}
		return nil, fmt.Errorf("capture upper %s into %s: %w", upper, dst, err)
	}
	t.Took = time.Since(start)
	return t, nil
}

func capture(ctx context.Context, upper, dst string) (*Tree, error) {
	if err := ctx.Err(); err != nil {
		return nil, err
	}
	var st unix.Stat_t
	if err := unix.Lstat(upper, &st); err != nil {
		return nil, err
	}
	if st.Mode&unix.S_IFMT != unix.S_IFDIR {
		return nil, fmt.Errorf("not a directory: %w", errdefs.ErrInvalidArgument)
	}
	if _, err := os.Lstat(dst); err == nil {
		return nil, fmt.Errorf("%s exists: %w", dst, errdefs.ErrAlreadyExists)
	}
	subvol, rel, ok, err := subvolumeOf(upper)
	if err != nil {
		return nil, err
	}
	if ok {
		err := btrfs.Snapshot(subvol, dst)
		if err == nil {
			return &Tree{Dir: filepath.Join(dst, rel), Method: MethodBtrfs, root: dst}, nil
		}
		// dst on another btrfs (EXDEV) or another kind of file system,
		// which knows no btrfs ioctl: walk.
		if !errors.Is(err, unix.EXDEV) && !errors.Is(err, unix.ENOTTY) && !errors.Is(err, unix.EOPNOTSUPP) {
			return nil, err
		}
	}
	return walkCopy(ctx, upper, dst, &st)
}

// subvolumeOf returns the root of the btrfs subvolume holding upper and
// upper's path inside it, when that subvolume is upper itself or its parent
// (as the runtime makes each sandbox's <UpperRoot>/<id>) and not the file
// system's top level; ok is false otherwise, as a snapshot would then hold
// more than the sandbox's layer.
func subvolumeOf(upper string) (root, rel string, ok bool, err error) {
	root, rel = upper, "."
	sub, err := btrfs.IsSubvolume(upper)
	if err == nil && !sub {
		root, rel = filepath.Dir(upper), filepath.Base(upper)
		sub, err = btrfs.IsSubvolume(root)
	}
	if err != nil || !sub {
		return "", "", false, err
	}
	id, err := btrfs.SubvolumeID(root)
	if err != nil {
		return "", "", false, err
	}
	return root, rel, id != btrfs.TopLevel, nil
}

// RemoveCapture deletes what Capture left at dst: the btrfs snapshot, or
// the copied tree. A missing dst is fine. It is what Tree.Remove does, for
// a caller that finds a capture again by its path (after a restart).
func RemoveCapture(dst string) error {
	sub, err := btrfs.IsSubvolume(dst)
	if errors.Is(err, os.ErrNotExist) {
		return nil
	}
	if err != nil {
		return fmt.Errorf("remove capture %s: %w", dst, err)
	}
	if sub {
		return btrfs.DeleteSubvolume(dst)
	}
	if err := os.RemoveAll(dst); err != nil {
		return fmt.Errorf("remove capture %s: %w", dst, err)
	}
	return nil
}

// walkCopy copies the tree at upper (whose stat is st) to a new dst.
func walkCopy(ctx context.Context, upper, dst string, st *unix.Stat_t) (_ *Tree, err error) {
	src, err := openDir(unix.AT_FDCWD, upper)
	if err != nil {
		return nil, err
	}
	defer src.Close()
	if err := os.Mkdir(dst, 0o700); err != nil {
		if errors.Is(err, os.ErrExist) {
			return nil, fmt.Errorf("%s exists: %w", dst, errdefs.ErrAlreadyExists)
		}
		return nil, err
	}
	defer func() {
		if err != nil {
			if rerr := os.RemoveAll(dst); rerr != nil {
				err = fmt.Errorf("%w (and remove the partial copy: %v)", err, rerr)
			}
		}
	}()
	root, err := openDir(unix.AT_FDCWD, dst)
	if err != nil {
		return nil, err
	}
	defer root.Close()
	c := &copier{ctx: ctx, root: root, reflink: true, rangeCopy: true, links: map[inode]string{}}
	if err := c.dir(src, root, "/"); err != nil {
		return nil, err
	}
	if err := c.metaFd(src, root, "/", st); err != nil {
		return nil, err
	}
	method := MethodCopy
	if c.reflink && c.copied == 0 {
		method = MethodReflink
	}
	return &Tree{Dir: dst, Method: method, Entries: c.entries, Bytes: c.bytes, root: dst}, nil
}

type inode struct{ dev, ino uint64 }

// copier copies one tree.
type copier struct {
	ctx  context.Context
	root *os.File // the destination's root
	// reflink is cleared when the destination cannot clone extents,
	// rangeCopy when copy_file_range does not work between the two.
	reflink, rangeCopy bool
	// links maps each object with more than one link to its first copy's
	// path from the root.
	links          map[inode]string
	entries, bytes int64
	copied         int64 // regular files copied rather than cloned
	buf            []byte
}

// dir copies the contents of the directory src (rel from the root, for
// messages) into the empty directory dst.
func (c *copier) dir(src, dst *os.File, rel string) error {
	for {
		names, err := src.Readdirnames(1024)
		for _, name := range names {
			if err := c.entry(src, dst, name, path.Join(rel, name)); err != nil {
				return err
			}
		}
		if errors.Is(err, io.EOF) {
			return nil
		}
		if err != nil {
			return fmt.Errorf("list %q: %w", rel, err)
		}
	}
}

// entry copies the object name of the directory src into dst.
func (c *copier) entry(src, dst *os.File, name, full string) error {
	if c.entries++; c.entries%1024 == 0 {
		if err := c.ctx.Err(); err != nil {
			return err
		}
	}
	sfd, dfd := int(src.Fd()), int(dst.Fd())
	var st unix.Stat_t
	if err := unix.Fstatat(sfd, name, &st, unix.AT_SYMLINK_NOFOLLOW); err != nil {
		return fmt.Errorf("stat %q: %w", full, err)
	}
	typ := st.Mode & unix.S_IFMT
	id := inode{uint64(st.Dev), st.Ino}
	if typ != unix.S_IFDIR && st.Nlink > 1 {
		if first, ok := c.links[id]; ok {
			if err := unix.Linkat(int(c.root.Fd()), first[1:], dfd, name, 0); err != nil {
				return fmt.Errorf("link %q to %q: %w", full, first, err)
			}
			return nil
		}
	}
	switch typ {
	case unix.S_IFDIR:
		if err := unix.Mkdirat(dfd, name, 0o700); err != nil {
			return fmt.Errorf("make directory %q: %w", full, err)
		}
		s, err := openDir(sfd, name)
		if err != nil {
			return fmt.Errorf("open %q: %w", full, err)
		}
		defer s.Close()
		d, err := openDir(dfd, name)
		if err != nil {
			return fmt.Errorf("open copy of %q: %w", full, err)
		}
		defer d.Close()
		if err := c.dir(s, d, full); err != nil {
			return err
		}
		return c.metaFd(s, d, full, &st)
	case unix.S_IFREG:
		if err := c.file(sfd, dfd, name, full, &st); err != nil {
			return err
		}
	case unix.S_IFLNK:
		target, err := readlinkat(sfd, name)
		if err != nil {
			return fmt.Errorf("read symlink %q: %w", full, err)
		}
		if err := unix.Symlinkat(target, dfd, name); err != nil {
			return fmt.Errorf("make symlink %q: %w", full, err)
		}
		if err := c.metaAt(sfd, dfd, name, full, &st); err != nil {
			return err
		}
	default: // character and block devices (whiteouts among them), FIFOs, sockets
		if err := unix.Mknodat(dfd, name, st.Mode, int(st.Rdev)); err != nil {
			return fmt.Errorf("make %q: %w", full, err)
		}
		if err := c.metaAt(sfd, dfd, name, full, &st); err != nil {
			return err
		}
	}
	if st.Nlink > 1 {
		c.links[id] = full
	}
	return nil
}

// file copies the regular file name of src into dst, with its metadata.
func (c *copier) file(sfd, dfd int, name, full string, st *unix.Stat_t) error {
	s, err := unix.Openat(sfd, name, unix.O_RDONLY|unix.O_NOFOLLOW|unix.O_NOATIME|unix.O_CLOEXEC, 0)
	if err != nil {
		return fmt.Errorf("open %q: %w", full, err)
	}
	sf := os.NewFile(uintptr(s), full)
	defer sf.Close()
	d, err := unix.Openat(dfd, name, unix.O_WRONLY|unix.O_CREAT|unix.O_EXCL|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0o600)
	if err != nil {
		return fmt.Errorf("create %q: %w", full, err)
	}
	df := os.NewFile(uintptr(d), full)
	defer df.Close()
	if err := c.content(s, d, st.Size); err != nil {
		return fmt.Errorf("copy %q: %w", full, err)
	}
	c.bytes += st.Size
	return c.metaFd(sf, df, full, st)
}

// content copies size bytes of s to the empty file d: a clone when the
// file system can, else the data ranges only, so holes stay holes.
func (c *copier) content(s, d int, size int64) error {
	if size == 0 {
		return nil
	}
	if c.reflink {
		err := unix.IoctlFileClone(d, s)
		if err == nil {
			return nil
		}
		switch {
		case errors.Is(err, unix.EOPNOTSUPP), errors.Is(err, unix.EXDEV), errors.Is(err, unix.ENOTTY):
			c.reflink = false // the file system cannot; stop asking
		case errors.Is(err, unix.EINVAL):
			// This pair cannot (e.g. nodatacow against datacow): copy it.
		default:
			return fmt.Errorf("clone: %w", err)
		}
	}
	c.copied++
	for off := int64(0); off < size; {
		data, err := unix.Seek(s, off, unix.SEEK_DATA)
		if errors.Is(err, unix.ENXIO) {
			break // a hole to the end
		}
		if err != nil {
			return fmt.Errorf("find data: %w", err)
		}
		hole, err := unix.Seek(s, data, unix.SEEK_HOLE)
		if err != nil {
			return fmt.Errorf("find hole: %w", err)
		}
		if hole > size {
			hole = size
		}
		if err := c.copyRange(s, d, data, hole-data); err != nil {
			return err
		}
		off = hole
	}
	return unix.Ftruncate(d, size)
}

// copyRange copies n bytes at off of s to the same offset of d.
func (c *copier) copyRange(s, d int, off, n int64) error {
	for n > 0 && c.rangeCopy {
		roff, woff := off, off
		k, err := unix.CopyFileRange(s, &roff, d, &woff, int(min(n, 1<<30)), 0)
		switch {
		case errors.Is(err, unix.EXDEV), errors.Is(err, unix.EOPNOTSUPP), errors.Is(err, unix.EINVAL), errors.Is(err, unix.ENOSYS):
			c.rangeCopy = false
			continue
		case err != nil:
			return err
		case k == 0:
			return fmt.Errorf("file ended %d bytes early: %w", n, io.ErrUnexpectedEOF)
		}
		off, n = off+int64(k), n-int64(k)
	}
	if c.buf == nil && n > 0 {
		c.buf = make([]byte, 1<<20)
	}
	for n > 0 {
		k, err := unix.Pread(s, c.buf[:min(n, int64(len(c.buf)))], off)
		if err != nil {
			return err
		}
		if k == 0 {
			return fmt.Errorf("file ended %d bytes early: %w", n, io.ErrUnexpectedEOF)
		}
		if _, err := unix.Pwrite(d, c.buf[:k], off); err != nil {
			return err
		}
		off, n = off+int64(k), n-int64(k)
	}
	return nil
}

// metaFd gives the open copy d the owner, mode, xattrs and times of s.
// The owner goes first (chown clears setuid bits and file capabilities),
// times last.
func (c *copier) metaFd(s, d *os.File, full string, st *unix.Stat_t) error {
	dfd := int(d.Fd())
	if err := unix.Fchown(dfd, int(st.Uid), int(st.Gid)); err != nil {
		return fmt.Errorf("chown %q: %w", full, err)
	}
	if err := unix.Fchmod(dfd, st.Mode&^unix.S_IFMT); err != nil {
		return fmt.Errorf("chmod %q: %w", full, err)
	}
	if err := copyXattrs(atFd(int(s.Fd())), atFd(dfd)); err != nil {
		return fmt.Errorf("copy xattrs of %q: %w", full, err)
	}
	ts := []unix.Timespec{st.Atim, st.Mtim}
	if err := unix.UtimesNanoAt(unix.AT_FDCWD, fdPath(dfd, ""), ts, 0); err != nil {
		return fmt.Errorf("set times of %q: %w", full, err)
	}
	return nil
}

// metaAt is metaFd for the object name of the directories sfd and dfd,
// which is not followed if a symlink.
func (c *copier) metaAt(sfd, dfd int, name, full string, st *unix.Stat_t) error {
	if err := unix.Fchownat(dfd, name, int(st.Uid), int(st.Gid), unix.AT_SYMLINK_NOFOLLOW); err != nil {
		return fmt.Errorf("chown %q: %w", full, err)
	}
	if st.Mode&unix.S_IFMT != unix.S_IFLNK {
		// mknod applied the umask.
		if err := unix.Fchmodat(dfd, name, st.Mode&^unix.S_IFMT, 0); err != nil {
			return fmt.Errorf("chmod %q: %w", full, err)
		}
	}
	if err := copyXattrs(atName(sfd, name), atName(dfd, name)); err != nil {
		return fmt.Errorf("copy xattrs of %q: %w", full, err)
	}
	ts := []unix.Timespec{st.Atim, st.Mtim}
	if err := unix.UtimesNanoAt(dfd, name, ts, unix.AT_SYMLINK_NOFOLLOW); err != nil {
		return fmt.Errorf("set times of %q: %w", full, err)
	}
	return nil
}

// fdPath names the entry name of the directory fd through /proc, for the
// calls that take no directory fd. fd is a verified directory and name one
// component, so the path resolves to exactly that object (the l* calls do
// not follow name if it is a symlink). With name "" it names fd itself,
// for calls that follow the (magic) link.
func fdPath(fd int, name string) string {
	p := "/proc/self/fd/" + strconv.Itoa(fd)
	if name != "" {
		p += "/" + name
	}
	return p
}

// object is something extended attributes are read from or written to:
// an open file, or a path that is not followed if a symlink.
type object struct {
	fd   int
	path string // set: use the path
}

func atFd(fd int) object                { return object{fd: fd} }
func atName(dirfd int, n string) object { return object{fd: -1, path: fdPath(dirfd, n)} }

func (o object) list(buf []byte) (int, error) {
	if o.path != "" {
		return unix.Llistxattr(o.path, buf)
	}
	return unix.Flistxattr(o.fd, buf)
}

func (o object) get(name string, buf []byte) (int, error) {
	if o.path != "" {
		return unix.Lgetxattr(o.path, name, buf)
	}
	return unix.Fgetxattr(o.fd, name, buf)
}

func (o object) set(name string, v []byte) error {
	if o.path != "" {
		return unix.Lsetxattr(o.path, name, v, 0)
	}
	return unix.Fsetxattr(o.fd, name, v, 0)
}

func (o object) remove(name string) error {
	if o.path != "" {
		return unix.Lremovexattr(o.path, name)
	}
	return unix.Fremovexattr(o.fd, name)
}

// copyXattrs copies every extended attribute of src to dst.
func copyXattrs(src, dst object) error {
	names, err := listXattrs(src)
	if err != nil {
		return err
	}
	for _, n := range names {
		v, err := getXattr(src, n)
		if err != nil {
			return err
		}
		if err := dst.set(n, v); err != nil {
			return fmt.Errorf("set %s: %w", n, err)
		}
	}
	return nil
}

// listXattrs lists the extended attributes of o.
func listXattrs(o object) ([]string, error) {
	buf, err := readSized(o.list)
	if errors.Is(err, unix.EOPNOTSUPP) {
		return nil, nil
	}
	if err != nil {
		return nil, fmt.Errorf("list xattrs: %w", err)
	}
	var names []string
	for _, b := range bytes.Split(buf, []byte{0}) {
		if len(b) > 0 {
			names = append(names, string(b))
		}
	}
	return names, nil
}

// getXattr reads the extended attribute name of o.
func getXattr(o object, name string) ([]byte, error) {
	v, err := readSized(func(buf []byte) (int, error) { return o.get(name, buf) })
	if err != nil {
		return nil, fmt.Errorf("get %s: %w", name, err)
	}
	return v, nil
}

// readSized calls read with no buffer for the size, then with a buffer that
// size, again while the value grows in between.
func readSized(read func([]byte) (int, error)) ([]byte, error) {
	for {
		size, err := read(nil)
		if err != nil || size == 0 {
			return nil, err
		}
		buf := make([]byte, size)
		n, err := read(buf)
		if errors.Is(err, unix.ERANGE) {
			continue
		}
		if err != nil {
			return nil, err
		}
		return buf[:n], nil
	}
}

// readlinkat reads the target of the symlink name in dirfd.
func readlinkat(dirfd int, name string) (string, error) {
	for size := 256; ; size *= 2 {
		buf := make([]byte, size)
		n, err := unix.Readlinkat(dirfd, name, buf)
		if err != nil {
			return "", err
		}
		if n < size {
			return string(buf[:n]), nil
		}
	}
}

// openDir opens the directory name in dirfd without following a symlink.
// The file's name is its /proc/self/fd path, so that os.File's ReadDir can
// stat entries whose type the file system does not report.
func openDir(dirfd int, name string) (*os.File, error) {
	fd, err := unix.Openat(dirfd, name, unix.O_RDONLY|unix.O_DIRECTORY|unix.O_NOFOLLOW|unix.O_NOATIME|unix.O_CLOEXEC, 0)
	if err != nil {
		return nil, err
	}
	return os.NewFile(uintptr(fd), fdPath(fd, "")), nil
}

package fs

import (
	"archive/tar"
	"bytes"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path"
	"path/filepath"
	"sort"
	"strings"
	"syscall"
	"time"

	"golang.org/x/sys/unix"

	dsecv1 "dsec.dev/dsec/api/gen/dsec/v1"
	"dsec.dev/dsec/internal/agent/account"
	"dsec.dev/dsec/internal/errdefs"
)

const (
	// DefaultReadLimit caps ReadFile when the request sets no limit.
	DefaultReadLimit = 64 << 20
	// DownloadChunkSize is the size of Download's chunks.
	DownloadChunkSize = 256 << 10
)

// FS does file operations; a relative path starts at the request's user's
// working directory (WorkDir), where that user's commands start too.
type FS struct {
	Dir string // the sandbox's working directory; "" = each user's home, else /
}

// WorkDir is the directory a's commands start in and a's relative paths
// resolve against: the sandbox's working directory when it has one, else
// a's home when that is a directory, else /. Commands and file calls both
// ask it, so `pwd` and a file written as "rel.txt" agree.
func (f *FS) WorkDir(a account.Account) string {
	if f.Dir != "" {
		return f.Dir
	}
	if a.Home != "" {
		if st, err := os.Stat(a.Home); err == nil && st.IsDir() {
			return a.Home
		}
	}
	return "/"
}

// abs makes p absolute against a's working directory.
func (f *FS) abs(a account.Account, p string) (string, error) {
	if p == "" {
		return "", fmt.Errorf("resolve path: empty path: %w", errdefs.ErrInvalidArgument)
	}
	if strings.ContainsRune(p, 0) {
		return "", fmt.Errorf("resolve path %q: NUL byte: %w", p, errdefs.ErrInvalidArgument)
	}
	if filepath.IsAbs(p) {
		return filepath.Clean(p), nil
	}
	return filepath.Join(f.WorkDir(a), p), nil
}

// wrap turns an OS error into a kind-carrying error: "verb path: cause: kind".
func wrap(verb, p string, err error) error {
	if err == nil {
		return nil
	}
	var errno syscall.Errno
	if !errors.As(err, &errno) {
		if errors.Is(err, errdefs.ErrInvalidArgument) || errors.Is(err, errdefs.ErrPermissionDenied) ||
			errors.Is(err, errdefs.ErrNotFound) || errors.Is(err, errdefs.ErrFailedPrecondition) {
			return fmt.Errorf("%s %s: %w", verb, p, err)
		}
		return fmt.Errorf("%s %s: %v: %w", verb, p, err, errdefs.ErrInternal)
	}
	kind := errdefs.ErrInternal
	switch errno {
	case unix.ENOENT:
		kind = errdefs.ErrNotFound
	case unix.EACCES, unix.EPERM, unix.EROFS:
		kind = errdefs.ErrPermissionDenied
	case unix.EEXIST:
		kind = errdefs.ErrAlreadyExists
	case unix.ENOTDIR, unix.EISDIR, unix.EINVAL, unix.ELOOP, unix.ENAMETOOLONG:
		kind = errdefs.ErrInvalidArgument
	case unix.ENOTEMPTY, unix.EBUSY:
		kind = errdefs.ErrFailedPrecondition
	case unix.ENOSPC, unix.EDQUOT, unix.EMFILE, unix.ENFILE:
		kind = errdefs.ErrResourceExhausted
	}
	return fmt.Errorf("%s %s: %s: %w", verb, p, errno.Error(), kind)
}

// ReadFile reads up to limit bytes (0 = DefaultReadLimit) from offset.
func (f *FS) ReadFile(a account.Account, p string, offset, limit int64) (data []byte, size int64, truncated bool, err error) {
	p, err = f.abs(a, p)
	if err != nil {
		return nil, 0, false, err
	}
	if offset < 0 || limit < 0 {
		return nil, 0, false, fmt.Errorf("read file %s: negative offset or limit: %w", p, errdefs.ErrInvalidArgument)
	}
	if limit == 0 || limit > DefaultReadLimit {
		limit = DefaultReadLimit
	}
	err = asUser(a, func() error {
		fd, err := os.Open(p)
		if err != nil {
			return wrap("read file", p, err)
		}
		defer fd.Close()
		st, err := fd.Stat()
		if err != nil {
			return wrap("read file", p, err)
		}
		if st.IsDir() {
			return fmt.Errorf("read file %s: is a directory: %w", p, errdefs.ErrInvalidArgument)
		}
		size = st.Size()
		want := limit
		if st.Mode().IsRegular() && size-offset < want {
			want = max(size-offset, 0)
		}
		buf := make([]byte, 0, min(want, 1<<20))
		r := io.NewSectionReader(fd, offset, limit+1)
		var chunk [64 << 10]byte
		for int64(len(buf)) <= limit {
			n, err := r.Read(chunk[:])
			buf = append(buf, chunk[:n]...)
			if err == io.EOF {
				break
			}
			if err != nil {
				return wrap("read file", p, err)
			}
		}
		if int64(len(buf)) > limit {
			buf = buf[:limit]
			truncated = true
		}
		if !st.Mode().IsRegular() {
			size = offset + int64(len(buf))
		}
		data = buf
		return nil
	})
	return data, size, truncated, err
}

// WriteFile writes data to p (mode 0 = 0644 for a new file).
func (f *FS) WriteFile(a account.Account, p string, data []byte, mode uint32, appendTo, makeParents bool) (int64, error) {
	p, err := f.abs(a, p)
	if err != nil {
		return 0, err
	}
	var written int64
	err = asUser(a, func() error {
		if makeParents {
			if err := os.MkdirAll(filepath.Dir(p), 0o755); err != nil {
				return wrap("make parents of", p, err)
			}
		}
		flags := os.O_WRONLY
		if appendTo {
			flags |= os.O_APPEND
		} else {
			flags |= os.O_TRUNC
		}
		perm := os.FileMode(0o644)
		if mode != 0 {
			perm = os.FileMode(mode & 0o7777)
		}
		fd, err := os.OpenFile(p, flags|os.O_CREATE|os.O_EXCL, perm)
		created := err == nil
		if errors.Is(err, fs.ErrExist) {
			fd, err = os.OpenFile(p, flags, 0)
		}
		if err != nil {
			return wrap("write file", p, err)
		}
		defer fd.Close()
		if created || mode != 0 {
			if err := fd.Chmod(perm); err != nil && created {
				return wrap("write file", p, err)
			}
		}
		n, err := fd.Write(data)
		written = int64(n)
		if err != nil {
			return wrap("write file", p, err)
		}
		return wrap("write file", p, fd.Close())
	})
	return written, err
}

func fileInfo(p string, st os.FileInfo) *dsecv1.FileInfo {
	fi := &dsecv1.FileInfo{
		Name:        st.Name(),
		Path:        p,
		Size:        st.Size(),
		Mode:        uint32(st.Mode().Perm()),
		MtimeUnixMs: st.ModTime().UnixMilli(),
	}
	if st.Mode()&os.ModeSetuid != 0 {
		fi.Mode |= 0o4000
	}
	if st.Mode()&os.ModeSetgid != 0 {
		fi.Mode |= 0o2000
	}
	if st.Mode()&os.ModeSticky != 0 {
		fi.Mode |= 0o1000
	}
	switch {
	case st.Mode().IsRegular():
		fi.Type = "file"
	case st.IsDir():
		fi.Type = "dir"
	case st.Mode()&os.ModeSymlink != 0:
		fi.Type = "symlink"
		fi.LinkTarget, _ = os.Readlink(p)
	default:
		fi.Type = "other"
	}
	if s, ok := st.Sys().(*syscall.Stat_t); ok {
		fi.Uid, fi.Gid = s.Uid, s.Gid
	}
	return fi
}

// Stat describes p without following a final symlink.
func (f *FS) Stat(a account.Account, p string) (*dsecv1.FileInfo, error) {
	p, err := f.abs(a, p)
	if err != nil {
		return nil, err
	}
	var fi *dsecv1.FileInfo
	err = asUser(a, func() error {
		st, err := os.Lstat(p)
		if err != nil {
			return wrap("stat", p, err)
		}
		fi = fileInfo(p, st)
		return nil
	})
	return fi, err
}

// ListDir lists a directory, sorted by name.
func (f *FS) ListDir(a account.Account, p string) ([]*dsecv1.FileInfo, error) {
	p, err := f.abs(a, p)
	if err != nil {
		return nil, err
	}
	var out []*dsecv1.FileInfo
	err = asUser(a, func() error {
		ents, err := os.ReadDir(p)
		if err != nil {
			return wrap("list directory", p, err)
		}
		for _, e := range ents {
			full := filepath.Join(p, e.Name())
			st, err := os.Lstat(full)
			if err != nil {
				continue // removed meanwhile
			}
			out = append(out, fileInfo(full, st))
		}
		return nil
	})
	sort.Slice(out, func(i, j int) bool { return out[i].Name < out[j].Name })
	return out, err
}

// Remove deletes p, and everything under it when recursive.
func (f *FS) Remove(a account.Account, p string, recursive bool) error {
	p, err := f.abs(a, p)
	if err != nil {
		return err
	}
	if p == "/" {
		return fmt.Errorf("remove /: refusing to remove the root: %w", errdefs.ErrInvalidArgument)
	}
	return asUser(a, func() error {
		if _, err := os.Lstat(p); err != nil {
			return wrap("remove", p, err)
		}
		if recursive {
			return wrap("remove", p, os.RemoveAll(p))
		}
		return wrap("remove", p, os.Remove(p))
	})
}

// MakeDir makes a directory (mode 0 = 0755), with its parents when asked.
func (f *FS) MakeDir(a account.Account, p string, parents bool, mode uint32) error {
	p, err := f.abs(a, p)
	if err != nil {
		return err
	}
	perm := os.FileMode(0o755)
	if mode != 0 {
		perm = os.FileMode(mode & 0o777)
	}
	return asUser(a, func() error {
		if parents {
			if err := os.MkdirAll(p, perm); err != nil {
				return wrap("make directory", p, err)
			}
		} else if err := os.Mkdir(p, perm); err != nil {
			return wrap("make directory", p, err)
		}
		return wrap("make directory", p, os.Chmod(p, perm))
	})
}

// Move renames src to dst (rename(2), so a file at dst is replaced and a
// directory at dst must be empty), making dst's parents first when asked,
// and describes the entry at dst.
func (f *FS) Move(a account.Account, src, dst string, makeParents bool) (*dsecv1.FileInfo, error) {
	src, err := f.abs(a, src)
	if err != nil {
		return nil, err
	}
	dst, err = f.abs(a, dst)
	if err != nil {
		return nil, err
	}
	if src == "/" || dst == "/" {
		return nil, fmt.Errorf("move %s to %s: the root cannot be moved or replaced: %w", src, dst, errdefs.ErrInvalidArgument)
	}
	var fi *dsecv1.FileInfo
	err = asUser(a, func() error {
		if _, err := os.Lstat(src); err != nil {
			return wrap("move", src, err)
		}
		if makeParents {
			if err := os.MkdirAll(filepath.Dir(dst), 0o755); err != nil {
				return wrap("make parents of", dst, err)
			}
		}
		if err := os.Rename(src, dst); err != nil {
			if errors.Is(err, unix.EXDEV) {
				return fmt.Errorf("move %s to %s: they are on different file systems: %w", src, dst, errdefs.ErrFailedPrecondition)
			}
			return wrap("move "+src+" to", dst, err)
		}
		st, err := os.Lstat(dst)
		if err != nil {
			return wrap("stat", dst, err)
		}
		fi = fileInfo(dst, st)
		return nil
	})
	return fi, err
}

// Download writes p (a file, symlink or directory tree) as a tar stream to
// send in chunks of DownloadChunkSize. Entry names start with p's base name.
func (f *FS) Download(a account.Account, p string, send func([]byte) error) error {
	p, err := f.abs(a, p)
	if err != nil {
		return err
	}
	return asUser(a, func() error {
		root, err := os.Lstat(p)
		if err != nil {
			return wrap("download", p, err)
		}
		cw := &chunkWriter{send: send, buf: make([]byte, 0, DownloadChunkSize)}
		tw := tar.NewWriter(cw)
		base := filepath.Base(p)
		if p == "/" {
			base = "."
		}
		add := func(full, name string, st os.FileInfo) error {
			link := ""
			if st.Mode()&os.ModeSymlink != 0 {
				link, _ = os.Readlink(full)
			}
			hdr, err := tar.FileInfoHeader(st, link)
			if err != nil {
				return nil // sockets and the like: skip
			}
			hdr.Name = name
			if st.IsDir() {
				hdr.Name += "/"
			}
			hdr.Uname, hdr.Gname = "", ""
			if st.Mode().IsRegular() {
				fd, err := os.Open(full)
				if err != nil {
					return wrap("download", full, err)
				}
				defer fd.Close()
				if err := tw.WriteHeader(hdr); err != nil {
					return err
				}
				if _, err := io.CopyN(tw, fd, hdr.Size); err != nil {
					return wrap("download", full, err)
				}
				return nil
			}
			return tw.WriteHeader(hdr)
		}
		if !root.IsDir() {
			if err := add(p, base, root); err != nil {
				return err
			}
		} else {
			err = filepath.WalkDir(p, func(full string, d fs.DirEntry, err error) error {
				if err != nil {
					return wrap("download", full, err)
				}
				st, err := d.Info()
				if err != nil {
					return nil
				}
				rel, _ := filepath.Rel(p, full)
				return add(full, path.Join(base, filepath.ToSlash(rel)), st)
			})
			if err != nil {
				return err
			}
		}
		if err := tw.Close(); err != nil {
			return err
		}
		return cw.flush()
	})
}

type chunkWriter struct {
	send func([]byte) error
	buf  []byte
}

func (c *chunkWriter) Write(b []byte) (int, error) {
	n := len(b)
	for len(b) > 0 {
		k := min(cap(c.buf)-len(c.buf), len(b))
		c.buf = append(c.buf, b[:k]...)
		b = b[k:]
		if len(c.buf) == cap(c.buf) {
			if err := c.flush(); err != nil {
				return 0, err
			}
		}
	}
	return n, nil
}

func (c *chunkWriter) flush() error {
	if len(c.buf) == 0 {
		return nil
	}
	out := append([]byte(nil), c.buf...)
	c.buf = c.buf[:0]
	return c.send(out)
}

// Upload extracts the tar archive data into dir (made if missing). It first
// checks every entry and refuses the archive, writing nothing, when a name is
// absolute or contains "..", or an entry is a device node or other special
// file. While extracting it never follows a symlink below dir.
func (f *FS) Upload(a account.Account, dir string, data []byte) (files, written int64, err error) {
	dir, err = f.abs(a, dir)
	if err != nil {
		return 0, 0, err
	}
	if err := checkArchive(data); err != nil {
		return 0, 0, err
	}
	err = asUser(a, func() error {
		if err := os.MkdirAll(dir, 0o755); err != nil {
			return wrap("upload to", dir, err)
		}
		rootfd, err := unix.Open(dir, unix.O_DIRECTORY|unix.O_RDONLY|unix.O_CLOEXEC, 0)
		if err != nil {
			return wrap("upload to", dir, err)
		}
		defer unix.Close(rootfd)
		tr := tar.NewReader(bytes.NewReader(data))
		for {
			hdr, err := tr.Next()
			if err == io.EOF {
				return nil
			}
			if err != nil {
				return fmt.Errorf("upload to %s: read archive: %v: %w", dir, err, errdefs.ErrInvalidArgument)
			}
			comps := splitName(hdr.Name)
			if len(comps) == 0 {
				continue
			}
			n, err := extract(rootfd, comps, hdr, tr)
			if err != nil {
				return fmt.Errorf("upload to %s: entry %q: %w", dir, hdr.Name, err)
			}
			if hdr.Typeflag == tar.TypeReg || hdr.Typeflag == tar.TypeRegA {
				files++
				written += n
			}
		}
	})
	return files, written, err
}

// splitName returns the path components of a tar entry name ("" and "."
// dropped). Callers run checkArchive first, so ".." never appears.
func splitName(name string) []string {
	var out []string
	for _, c := range strings.Split(name, "/") {
		if c != "" && c != "." {
			out = append(out, c)
		}
	}
	return out
}

func checkName(name string) error {
	if strings.HasPrefix(name, "/") {
		return fmt.Errorf("absolute name %q: %w", name, errdefs.ErrInvalidArgument)
	}
	if strings.ContainsRune(name, 0) {
		return fmt.Errorf("name %q has a NUL byte: %w", name, errdefs.ErrInvalidArgument)
	}
	for _, c := range strings.Split(name, "/") {
		if c == ".." {
			return fmt.Errorf("name %q leaves the target directory: %w", name, errdefs.ErrInvalidArgument)
		}
	}
	return nil
}

func checkArchive(data []byte) error {
	tr := tar.NewReader(bytes.NewReader(data))
	for {
		hdr, err := tr.Next()
		if err == io.EOF {
			return nil
		}
		if err != nil {
			return fmt.Errorf("upload: read archive: %v: %w", err, errdefs.ErrInvalidArgument)
		}
		if err := checkName(hdr.Name); err != nil {
			return fmt.Errorf("upload: refuse archive: %w", err)
		}
		switch hdr.Typeflag {
		case tar.TypeReg, tar.TypeRegA, tar.TypeDir, tar.TypeSymlink:
		case tar.TypeLink:
			if err := checkName(hdr.Linkname); err != nil {
				return fmt.Errorf("upload: refuse archive: hard link %q: %w", hdr.Name, err)
			}
			if len(splitName(hdr.Linkname)) == 0 {
				return fmt.Errorf("upload: refuse archive: hard link %q to the root: %w", hdr.Name, errdefs.ErrInvalidArgument)
			}
		case tar.TypeChar, tar.TypeBlock:
			return fmt.Errorf("upload: refuse archive: %q is a device node: %w", hdr.Name, errdefs.ErrInvalidArgument)
		default:
			return fmt.Errorf("upload: refuse archive: %q has unsupported type %q: %w", hdr.Name, string(hdr.Typeflag), errdefs.ErrInvalidArgument)
		}
	}
}

// openDir walks comps below rootfd without following symlinks, making
// missing directories when create is set. The caller closes the result.
func openDir(rootfd int, comps []string, create bool) (int, error) {
	fd, err := unix.Dup(rootfd)
	if err != nil {
		return -1, err
	}
	unix.CloseOnExec(fd)
	for _, c := range comps {
		if create {
			if err := unix.Mkdirat(fd, c, 0o755); err != nil && !errors.Is(err, unix.EEXIST) {
				unix.Close(fd)
				return -1, wrap("make directory", c, err)
			}
		}
		next, err := unix.Openat(fd, c, unix.O_DIRECTORY|unix.O_NOFOLLOW|unix.O_RDONLY|unix.O_CLOEXEC, 0)
		unix.Close(fd)
		if errors.Is(err, unix.ELOOP) || errors.Is(err, unix.ENOTDIR) {
			return -1, fmt.Errorf("%q is a symlink or not a directory; refusing to write through it: %w", c, errdefs.ErrInvalidArgument)
		}
		if err != nil {
			return -1, wrap("open directory", c, err)
		}
		fd = next
	}
	return fd, nil
}

func extract(rootfd int, comps []string, hdr *tar.Header, r io.Reader) (int64, error) {
	mode := uint32(hdr.Mode) & 0o777
	if hdr.Typeflag == tar.TypeDir {
		fd, err := openDir(rootfd, comps, true)
		if err != nil {
			return 0, err
		}
		defer unix.Close(fd)
		if mode == 0 {
			mode = 0o755
		}
		unix.Fchmod(fd, mode|uint32(hdr.Mode)&0o1000)
		return 0, nil
	}
	parent, err := openDir(rootfd, comps[:len(comps)-1], true)
	if err != nil {
		return 0, err
	}
	defer unix.Close(parent)
	base := comps[len(comps)-1]
	mtime := []unix.Timespec{unix.NsecToTimespec(time.Now().UnixNano()), unix.NsecToTimespec(hdr.ModTime.UnixNano())}
	switch hdr.Typeflag {
	case tar.TypeSymlink:
		unix.Unlinkat(parent, base, 0)
		if err := unix.Symlinkat(hdr.Linkname, parent, base); err != nil {
			return 0, wrap("make symlink", base, err)
		}
		unix.UtimesNanoAt(parent, base, mtime, unix.AT_SYMLINK_NOFOLLOW)
		return 0, nil
	case tar.TypeLink:
		old := splitName(hdr.Linkname)
		oldParent, err := openDir(rootfd, old[:len(old)-1], false)
		if err != nil {
			return 0, err
		}
		defer unix.Close(oldParent)
		unix.Unlinkat(parent, base, 0)
		if err := unix.Linkat(oldParent, old[len(old)-1], parent, base, 0); err != nil {
			return 0, wrap("make hard link", base, err)
		}
		return 0, nil
	}
	// A regular file: replace a symlink in the way instead of following it.
	flags := unix.O_WRONLY | unix.O_CREAT | unix.O_TRUNC | unix.O_NOFOLLOW | unix.O_NONBLOCK | unix.O_CLOEXEC
	fd, err := unix.Openat(parent, base, flags, 0o600)
	if errors.Is(err, unix.ELOOP) {
		unix.Unlinkat(parent, base, 0)
		fd, err = unix.Openat(parent, base, flags|unix.O_EXCL, 0o600)
	}
	if err != nil {
		return 0, wrap("create file", base, err)
	}
	file := os.NewFile(uintptr(fd), base)
	defer file.Close()
	var st unix.Stat_t
	if err := unix.Fstat(fd, &st); err != nil || st.Mode&unix.S_IFMT != unix.S_IFREG {
		return 0, fmt.Errorf("%q is not a regular file: %w", base, errdefs.ErrInvalidArgument)
	}
	n, err := io.Copy(file, r)
	if err != nil {
		return n, wrap("write file", base, err)
	}
	if mode == 0 {
		mode = 0o644
	}
	unix.Fchmod(fd, mode)
	unix.UtimesNanoAt(parent, base, mtime, unix.AT_SYMLINK_NOFOLLOW)
	return n, wrap("write file", base, file.Close())
}

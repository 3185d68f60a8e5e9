package image

import (
	"archive/tar"
	"bufio"
	"compress/gzip"
	"context"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"time"

	"golang.org/x/sys/unix"

	"dsec.dev/dsec/internal/errdefs"
)

// extractSource feeds src (a directory, or a plain or gzip'd tar archive) into x.
func extractSource(ctx context.Context, x *extractor, src string) error {
	fi, err := os.Stat(src)
	if errors.Is(err, fs.ErrNotExist) {
		return fmt.Errorf("open import source %s: %w", src, errdefs.ErrNotFound)
	}
	if err != nil {
		return fmt.Errorf("open import source %s: %w", src, err)
	}
	switch {
	case fi.IsDir():
		return extractDir(ctx, x, src)
	case fi.Mode().IsRegular():
		return extractArchive(ctx, x, src)
	default:
		return fmt.Errorf("open import source %s: neither a directory nor a tar archive: %w", src, errdefs.ErrInvalidArgument)
	}
}

// extractArchive reads a tar archive, gunzipping it first when it starts
// with the gzip magic.
func extractArchive(ctx context.Context, x *extractor, src string) error {
	f, err := os.Open(src)
	if err != nil {
		return fmt.Errorf("open import source %s: %w", src, err)
	}
	defer f.Close()
	return extractArchiveFrom(ctx, x, f, src)
}

// extractArchiveFrom reads a tar archive (plain or gzip) from r, named src
// in messages, and then r to its end: the bytes a stream carries after the
// archive (padding of a tape record) are read but not used.
func extractArchiveFrom(ctx context.Context, x *extractor, r io.Reader, src string) error {
	br := bufio.NewReaderSize(r, 1<<16)
	var tr io.Reader = br
	if magic, _ := br.Peek(2); len(magic) == 2 && magic[0] == 0x1f && magic[1] == 0x8b {
		zr, err := gzip.NewReader(br)
		if err != nil {
			return fmt.Errorf("read archive %s: %v: %w", src, err, errdefs.ErrInvalidArgument)
		}
		defer zr.Close()
		tr = zr
	}
	if err := extractTar(ctx, x, tr, src, false); err != nil {
		return err
	}
	if _, err := io.Copy(io.Discard, br); err != nil {
		return fmt.Errorf("read archive %s: %w", src, err)
	}
	return nil
}

// extractTar feeds the entries of the tar stream r (named src in messages)
// into x. An archive without entries is refused unless allowEmpty.
func extractTar(ctx context.Context, x *extractor, r io.Reader, src string, allowEmpty bool) error {
	tr := tar.NewReader(r)
	for n := 0; ; n++ {
		if err := ctx.Err(); err != nil {
			return err
		}
		hdr, err := tr.Next()
		if err == io.EOF {
			if n == 0 && !allowEmpty {
				return fmt.Errorf("read archive %s: no entries: %w", src, errdefs.ErrInvalidArgument)
			}
			return nil
		}
		if err != nil {
			return fmt.Errorf("read archive %s: %v: %w", src, err, errdefs.ErrInvalidArgument)
		}
		if hdr.Typeflag == tar.TypeXGlobalHeader {
			continue // archive-wide metadata, not a file
		}
		e := &entry{
			raw:      hdr.Name,
			typ:      hdr.Typeflag,
			mode:     hdr.Mode &^ 0o170000, // some writers add the file type bits
			uid:      hdr.Uid,
			gid:      hdr.Gid,
			size:     hdr.Size,
			linkname: hdr.Linkname,
			mtime:    hdr.ModTime,
			devmajor: hdr.Devmajor,
			devminor: hdr.Devminor,
			body:     tr,
		}
		if e.typ == tar.TypeRegA {
			e.typ = tar.TypeReg
		}
		for k, v := range hdr.PAXRecords {
			if name, ok := strings.CutPrefix(k, "SCHILY.xattr."); ok {
				if e.xattrs == nil {
					e.xattrs = map[string]string{}
				}
				e.xattrs[name] = v
			}
		}
		if err := x.add(e); err != nil {
			return err
		}
	}
}

// extractDir walks a directory without following symlinks and feeds every
// object in it, the root included, through the same checks as a tar entry.
// Files with several links become hard links to the first path seen.
func extractDir(ctx context.Context, x *extractor, src string) error {
	type inodeKey struct{ dev, ino uint64 }
	seen := map[inodeKey]string{}
	return filepath.WalkDir(src, func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			return fmt.Errorf("walk import source: %w", err)
		}
		if err := ctx.Err(); err != nil {
			return err
		}
		rel, err := filepath.Rel(src, p)
		if err != nil {
			return fmt.Errorf("walk import source: %w", err)
		}
		rel = filepath.ToSlash(rel)
		var st unix.Stat_t
		if err := unix.Lstat(p, &st); err != nil {
			return fmt.Errorf("walk import source %s: %w", p, err)
		}
		e := &entry{
			raw:   rel,
			mode:  int64(st.Mode & 0o7777),
			uid:   int(st.Uid),
			gid:   int(st.Gid),
			mtime: time.Unix(st.Mtim.Unix()),
		}
		if e.xattrs, err = readXattrs(p); err != nil {
			return fmt.Errorf("walk import source %s: %w", p, err)
		}
		switch st.Mode & unix.S_IFMT {
		case unix.S_IFDIR:
			e.typ = tar.TypeDir
		case unix.S_IFLNK:
			e.typ = tar.TypeSymlink
			if e.linkname, err = os.Readlink(p); err != nil {
				return fmt.Errorf("walk import source %s: %w", p, err)
			}
		case unix.S_IFREG:
			key := inodeKey{uint64(st.Dev), st.Ino}
			if first, ok := seen[key]; ok && st.Nlink > 1 {
				e.typ, e.linkname = tar.TypeLink, first
				return x.add(e)
			}
			seen[key] = rel
			e.typ, e.size = tar.TypeReg, st.Size
			f, err := os.OpenFile(p, os.O_RDONLY|syscall.O_NOFOLLOW, 0)
			if err != nil {
				return fmt.Errorf("walk import source %s: %w", p, err)
			}
			defer f.Close()
			e.body = f
		case unix.S_IFCHR:
			e.typ = tar.TypeChar
			e.devmajor, e.devminor = int64(unix.Major(uint64(st.Rdev))), int64(unix.Minor(uint64(st.Rdev)))
		case unix.S_IFBLK:
			e.typ = tar.TypeBlock
			e.devmajor, e.devminor = int64(unix.Major(uint64(st.Rdev))), int64(unix.Minor(uint64(st.Rdev)))
		case unix.S_IFIFO:
			e.typ = tar.TypeFifo
		default:
			e.typ = 's' // a socket: refused by the checks with its name
		}
		return x.add(e)
	})
}

// readXattrs returns the extended attributes of p itself (not a symlink's target).
func readXattrs(p string) (map[string]string, error) {
	buf := make([]byte, 4096)
	n, err := unix.Llistxattr(p, buf)
	if errors.Is(err, unix.ERANGE) {
		if n, err = unix.Llistxattr(p, nil); err == nil {
			buf = make([]byte, n)
			n, err = unix.Llistxattr(p, buf)
		}
	}
	if errors.Is(err, unix.ENOTSUP) {
		return nil, nil
	}
	if err != nil {
		return nil, fmt.Errorf("list xattrs: %w", err)
	}
	var out map[string]string
	for _, name := range strings.Split(string(buf[:n]), "\x00") {
		if name == "" {
			continue
		}
		sz, err := unix.Lgetxattr(p, name, nil)
		if err != nil {
			return nil, fmt.Errorf("get xattr %s: %w", name, err)
		}
		val := make([]byte, sz)
		if sz > 0 {
			if sz, err = unix.Lgetxattr(p, name, val); err != nil {
				return nil, fmt.Errorf("get xattr %s: %w", name, err)
			}
		}
		if out == nil {
			out = map[string]string{}
		}
		out[name] = string(val[:sz])
	}
	return out, nil
}

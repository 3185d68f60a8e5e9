package lazy

import (
	"context"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"slices"

	"golang.org/x/sys/unix"
)

// MetaChunks returns the chunk numbers of a registered layer that hold EROFS
// metadata (superblock, inodes, directories, symlink targets): it resets the
// layer's trace, drops the kernel's cached pages of the layer file, mounts
// the image from the file on a temp dir under tmpDir, walks the whole tree
// (lstat every entry, read every directory, read every symlink; no file
// contents), unmounts, and returns the chunks read, ascending; then it
// resets the trace again. The importer stores them in Index.Meta. Other
// readers of the same layer during the walk would add their chunks, so run
// it on a layer nothing else uses.
func MetaChunks(ctx context.Context, f *FS, hex string, tmpDir string) ([]int, error) {
	l, err := f.layer(hex)
	if err != nil {
		return nil, err
	}
	l.resetTrace()
	if err := f.mnt.dropPages(l); err != nil {
		return nil, fmt.Errorf("find metadata chunks of %s: %w", hex, err)
	}
	dir, err := os.MkdirTemp(tmpDir, "erofs-meta-")
	if err != nil {
		return nil, fmt.Errorf("find metadata chunks of %s: %w", hex, err)
	}
	defer os.Remove(dir)
	src := filepath.Join(f.cfg.MountPoint, hex)
	if err := unix.Mount(src, dir, "erofs", unix.MS_RDONLY, ""); err != nil {
		return nil, fmt.Errorf("mount erofs %s: %w", hex, err)
	}
	walkErr := walkMeta(ctx, dir)
	if err := unix.Unmount(dir, 0); err != nil {
		f.log.Warn("unmount erofs busy, detaching", "dir", dir, "err", err)
		if err := unix.Unmount(dir, unix.MNT_DETACH); err != nil {
			return nil, fmt.Errorf("unmount erofs %s: %w", hex, err)
		}
	}
	if walkErr != nil {
		return nil, fmt.Errorf("walk erofs %s: %w", hex, walkErr)
	}
	chunks := l.traced()
	slices.Sort(chunks)
	// The walk is not a sandbox's reads: the trace starts afresh, and the
	// pages the walk brought in are dropped so that sandboxes' reads of
	// them reach the file system and its trace.
	l.resetTrace()
	if err := f.mnt.dropPages(l); err != nil {
		return nil, fmt.Errorf("find metadata chunks of %s: %w", hex, err)
	}
	return chunks, nil
}

// walkMeta touches every piece of metadata under dir and no file contents.
func walkMeta(ctx context.Context, dir string) error {
	return filepath.WalkDir(dir, func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		if err := ctx.Err(); err != nil {
			return err
		}
		info, err := os.Lstat(p)
		if err != nil {
			return err
		}
		if info.Mode()&fs.ModeSymlink != 0 {
			if _, err := os.Readlink(p); err != nil {
				return err
			}
		}
		// Extended attributes are metadata too (overlay whiteouts and
		// opaque markers live there).
		if err := listXattrs(p); err != nil {
			return err
		}
		return nil
	})
}

func listXattrs(p string) error {
	buf := make([]byte, 64<<10)
	n, err := unix.Llistxattr(p, buf)
	if errors.Is(err, unix.ENOTSUP) || errors.Is(err, unix.ENODATA) {
		return nil
	}
	if err != nil {
		return fmt.Errorf("list xattrs of %s: %w", p, err)
	}
	for _, name := range splitNul(buf[:n]) {
		if _, err := unix.Lgetxattr(p, name, nil); err != nil && !errors.Is(err, unix.ENODATA) {
			return fmt.Errorf("read xattr %s of %s: %w", name, p, err)
		}
	}
	return nil
}

func splitNul(b []byte) []string {
	var out []string
	start := 0
	for i, c := range b {
		if c == 0 {
			if i > start {
				out = append(out, string(b[start:i]))
			}
			start = i + 1
		}
	}
	return out
}

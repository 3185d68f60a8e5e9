package image

import (
	"context"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path"
	"strconv"

	"golang.org/x/sys/unix"
)

// PruneWhiteouts removes from the tree at dir the overlay whiteouts (0:0
// character devices) that hide nothing in lower, the root directories of
// the layers the tree will be stacked on (bottom first; none for a
// bottom-most layer), and the opaque marks (trusted.overlay.opaque) of
// directories that no lower layer holds.
//
// A name is looked up below as overlayfs does: layer by layer from the top,
// only where every directory on its path is a directory in that layer, and
// stopping at a layer whose entry is not a directory, is a whiteout, or is
// an opaque directory; below a directory the tree marks opaque nothing is
// looked up. Symlinks are never followed. Directories the pruning changes
// keep their mtimes. Nothing may write the tree meanwhile; lower is only
// read. The tree is walked one directory at a time, holding one open
// directory per level of depth (and per lower layer that has it).
func PruneWhiteouts(ctx context.Context, dir string, lower []string) (Pruned, error) {
	root, err := openTreeDir(unix.AT_FDCWD, dir)
	if err != nil {
		return Pruned{}, fmt.Errorf("prune whiteouts in %s: %w", dir, err)
	}
	defer root.Close()
	below := make([]*os.File, 0, len(lower))
	defer func() {
		for _, f := range below {
			f.Close()
		}
	}()
	for i := len(lower) - 1; i >= 0; i-- { // top first, as overlayfs looks
		f, err := openTreeDir(unix.AT_FDCWD, lower[i])
		if err != nil {
			return Pruned{}, fmt.Errorf("prune whiteouts in %s: lower layer: %w", dir, err)
		}
		below = append(below, f)
	}
	p := &pruner{ctx: ctx}
	if err := p.prune(root, "/", below); err != nil {
		return p.n, fmt.Errorf("prune whiteouts in %s: %w", dir, err)
	}
	return p.n, nil
}

type pruner struct {
	ctx     context.Context
	n       Pruned
	entries int
}

// prune walks the directory d (rel from the tree's root, for messages),
// which overlayfs merges with the directories below (top first).
func (p *pruner) prune(d *os.File, rel string, below []*os.File) error {
	var st unix.Stat_t
	if err := unix.Fstat(int(d.Fd()), &st); err != nil {
		return fmt.Errorf("stat %q: %w", rel, err)
	}
	changed := false
	for {
		ents, err := d.ReadDir(1024)
		for _, e := range ents {
			if p.entries++; p.entries%4096 == 0 {
				if err := p.ctx.Err(); err != nil {
					return err
				}
			}
			name, full := e.Name(), path.Join(rel, e.Name())
			switch e.Type() {
			case fs.ModeDevice | fs.ModeCharDevice:
				removed, err := p.whiteout(d, name, full, below)
				if err != nil {
					return err
				}
				changed = changed || removed
			case fs.ModeDir:
				if err := p.child(d, name, full, below); err != nil {
					return err
				}
			}
		}
		if errors.Is(err, io.EOF) {
			break
		}
		if err != nil {
			return fmt.Errorf("list %q: %w", rel, err)
		}
	}
	if changed {
		// An unlink sets the directory's mtime; the layer keeps the one the
		// tree had.
		ts := []unix.Timespec{st.Atim, st.Mtim}
		if err := unix.UtimesNanoAt(unix.AT_FDCWD, d.Name(), ts, 0); err != nil {
			return fmt.Errorf("restore mtime of %q: %w", rel, err)
		}
	}
	return nil
}

// whiteout removes the entry name of d when it is a whiteout that hides
// nothing below.
func (p *pruner) whiteout(d *os.File, name, full string, below []*os.File) (bool, error) {
	var st unix.Stat_t
	if err := unix.Fstatat(int(d.Fd()), name, &st, unix.AT_SYMLINK_NOFOLLOW); err != nil {
		return false, fmt.Errorf("stat %q: %w", full, err)
	}
	if !isWhiteout(&st) {
		return false, nil
	}
	i, bst, err := firstBelow(below, name)
	if err != nil {
		return false, fmt.Errorf("look up %q below: %w", full, err)
	}
	if i >= 0 && !isWhiteout(&bst) {
		return false, nil // hides what the first layer below holds
	}
	// Nothing below, or a lower whiteout hides the name already.
	if err := unix.Unlinkat(int(d.Fd()), name, 0); err != nil {
		return false, fmt.Errorf("remove whiteout %q: %w", full, err)
	}
	p.n.Whiteouts++
	return true, nil
}

// child prunes the subdirectory name of d.
func (p *pruner) child(d *os.File, name, full string, below []*os.File) error {
	c, err := openTreeDir(int(d.Fd()), name)
	if err != nil {
		return fmt.Errorf("open %q: %w", full, err)
	}
	defer c.Close()
	opaque, err := hasOpaqueMark(c)
	if err != nil {
		return fmt.Errorf("read xattrs of %q: %w", full, err)
	}
	var next []*os.File
	defer func() {
		for _, f := range next {
			f.Close()
		}
	}()
	for rest := below; ; {
		i, bst, err := firstBelow(rest, name)
		if err != nil {
			return fmt.Errorf("look up %q below: %w", full, err)
		}
		if i < 0 || bst.Mode&unix.S_IFMT != unix.S_IFDIR {
			break // a file or whiteout ends the lookup
		}
		bc, err := openTreeDir(int(rest[i].Fd()), name)
		if err != nil {
			return fmt.Errorf("open %q below: %w", full, err)
		}
		next = append(next, bc)
		if o, err := hasOpaqueMark(bc); err != nil {
			return fmt.Errorf("read xattrs of %q below: %w", full, err)
		} else if o {
			break
		}
		rest = rest[i+1:]
	}
	if opaque {
		if len(next) == 0 {
			if err := unix.Fremovexattr(int(c.Fd()), opaqueXattr); err != nil {
				return fmt.Errorf("remove opaque mark of %q: %w", full, err)
			}
			p.n.OpaqueMarks++
		}
		return p.prune(c, full, nil)
	}
	return p.prune(c, full, next)
}

// firstBelow finds name in the directories below (top first) and returns
// the index of the first that holds it, with its stat, or -1.
func firstBelow(below []*os.File, name string) (int, unix.Stat_t, error) {
	var st unix.Stat_t
	for i, b := range below {
		err := unix.Fstatat(int(b.Fd()), name, &st, unix.AT_SYMLINK_NOFOLLOW)
		if errors.Is(err, unix.ENOENT) {
			continue
		}
		return i, st, err
	}
	return -1, st, nil
}

// openTreeDir opens the directory name in dirfd without following a
// symlink. The file's name is its /proc/self/fd path, so that os.File's
// ReadDir can stat entries whose type the file system does not report.
func openTreeDir(dirfd int, name string) (*os.File, error) {
	fd, err := unix.Openat(dirfd, name, unix.O_RDONLY|unix.O_DIRECTORY|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0)
	if err != nil {
		return nil, err
	}
	return os.NewFile(uintptr(fd), "/proc/self/fd/"+strconv.Itoa(fd)), nil
}

// isWhiteout reports whether st is an overlay whiteout, a 0:0 character device.
func isWhiteout(st *unix.Stat_t) bool {
	return st.Mode&unix.S_IFMT == unix.S_IFCHR && st.Rdev == 0
}

// hasOpaqueMark reports whether the directory d is marked opaque for
// overlayfs.
func hasOpaqueMark(d *os.File) (bool, error) {
	var buf [8]byte
	n, err := unix.Fgetxattr(int(d.Fd()), opaqueXattr, buf[:])
	switch {
	case errors.Is(err, unix.ENODATA), errors.Is(err, unix.EOPNOTSUPP):
		return false, nil
	case errors.Is(err, unix.ERANGE):
		return false, nil // not a value overlayfs writes
	case err != nil:
		return false, err
	}
	return string(buf[:n]) == "y", nil
}

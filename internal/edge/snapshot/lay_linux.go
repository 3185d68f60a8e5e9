package snapshot

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"hash"
	"io"
	"os"
	"path"
	"slices"
	"strings"
	"time"

	"golang.org/x/sys/unix"

	"dsec.dev/dsec/internal/errdefs"
)

// Lay lays the selected paths of the captured upper t into a running file
// system, seen at root as its processes see it (a host path such as
// /proc/PID/root of a sandbox's init), so that what it then shows at those
// paths is what a layer packed from t with opts would show stacked over
// it: a grade's capture laid into a clean room started ahead (a grade
// pool's) instead of packed into a layer and started on. root must show
// the layers the capture was taken above, unchanged (a room that nothing
// ran in yet).
//
// opts.Include names the paths laid (it is required), opts.Trusted and
// opts.Exclude the paths left out, as Pack takes them; t is read, never
// edited. Under each include path, each object of t replaces what root
// holds at its path, as an upper layer's does: a directory merges with a
// directory below (an opaque one empties it first) and replaces anything
// else; a file, symlink or FIFO replaces whatever is there; a whiteout
// removes it. Directories on the way to an include path are made where
// root lacks them (or holds something else there) and keep root's own
// metadata otherwise; a symlink, file or whiteout of t on the way means t
// holds no such path, and nothing is laid for it. Owners, modes, times and
// user.* extended attributes are kept; sockets and device nodes are left
// out (Laid.Warnings), hard links laid as separate files.
//
// No symlink is followed in t or in root below it: every object is reached
// from its parent's file descriptor (O_NOFOLLOW), so a link the capture
// holds, or one root's layers hold, is laid or replaced, never written
// through. Laid.Digest covers what was laid (each object's path, kind,
// owner, mode and content or target, in path order): the node's word for
// the workspace a grade ran on.
func Lay(ctx context.Context, t *Tree, root string, opts PackOptions) (Laid, error) {
	start := time.Now()
	includes, err := cleanExcludes(opts.Include)
	if err != nil || len(includes) == 0 {
		if err == nil {
			err = fmt.Errorf("no include path: %w", errdefs.ErrInvalidArgument)
		}
		return Laid{}, fmt.Errorf("lay %s: include: %w", t.Dir, err)
	}
	trusted, err := cleanExcludes(opts.Trusted)
	if err != nil {
		return Laid{}, fmt.Errorf("lay %s: trusted: %w", t.Dir, err)
	}
	excludes, err := cleanExcludes(opts.Exclude)
	if err != nil {
		return Laid{}, fmt.Errorf("lay %s: %w", t.Dir, err)
	}
	src, err := openDir(unix.AT_FDCWD, t.Dir)
	if err != nil {
		return Laid{}, fmt.Errorf("lay %s: %w", t.Dir, err)
	}
	defer src.Close()
	// root itself is followed (a /proc/PID/root magic link); nothing below.
	dfd, err := unix.Open(root, unix.O_RDONLY|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
	if err != nil {
		return Laid{}, fmt.Errorf("lay into %s: %w", root, err)
	}
	dst := os.NewFile(uintptr(dfd), root)
	defer dst.Close()
	l := &layer{ctx: ctx, h: sha256.New(), trusted: trusted, excludes: excludes}
	slices.Sort(includes)
	var res Laid
	for _, rel := range includes {
		found, err := l.include(src, dst, rel)
		if err != nil {
			if t.Broken != nil {
				if b := t.Broken(); b != nil {
					err = fmt.Errorf("%w: %w", b, err)
				}
			}
			return Laid{}, fmt.Errorf("lay /%s into %s: %w", rel, root, err)
		}
		if found {
			res.Included = append(res.Included, "/"+rel)
		}
	}
	res.Digest = "sha256:" + hex.EncodeToString(l.h.Sum(nil))
	res.Entries, res.Bytes, res.Warnings = l.entries, l.bytes, l.warnings
	for _, p := range trusted {
		if l.cleared["/"+p] {
			res.Cleared = append(res.Cleared, "/"+p)
		}
	}
	res.Took = time.Since(start)
	return res, nil
}

type layer struct {
	ctx               context.Context
	h                 hash.Hash
	trusted, excludes []string
	cleared           map[string]bool
	entries, bytes    int64
	warnings          []string
	buf               []byte
}

// include lays include path rel (clean, relative): it walks t down to it
// through directories only, making the same directories in dst, and lays
// what t holds there. It reports whether t holds rel.
func (l *layer) include(src, dst *os.File, rel string) (bool, error) {
	for _, tp := range l.trusted {
		if under(rel, tp) {
			return false, nil // the trusted tree replaces it whole
		}
	}
	comps := strings.Split(rel, "/")
	sdir, ddir := src, dst
	var opened []*os.File
	defer func() {
		for _, f := range opened {
			f.Close()
		}
	}()
	for i, c := range comps[:len(comps)-1] {
		var st unix.Stat_t
		err := unix.Fstatat(int(sdir.Fd()), c, &st, unix.AT_SYMLINK_NOFOLLOW)
		if errors.Is(err, unix.ENOENT) {
			return false, nil
		}
		if err != nil {
			return false, err
		}
		if st.Mode&unix.S_IFMT != unix.S_IFDIR {
			return false, nil // a symlink, file or whiteout on the way: left out
		}
		sub, err := openDir(int(sdir.Fd()), c)
		if err != nil {
			return false, err
		}
		opened = append(opened, sub)
		d, err := l.wayDir(ddir, c, strings.Join(comps[:i+1], "/"))
		if err != nil {
			return false, err
		}
		opened = append(opened, d)
		sdir, ddir = sub, d
	}
	name := comps[len(comps)-1]
	var st unix.Stat_t
	err := unix.Fstatat(int(sdir.Fd()), name, &st, unix.AT_SYMLINK_NOFOLLOW)
	if errors.Is(err, unix.ENOENT) {
		return false, nil
	}
	if err != nil {
		return false, err
	}
	return true, l.entry(sdir, ddir, name, rel, &st)
}

// wayDir returns directory name of dst, made (0755, root's) where dst
// holds nothing or something other than a directory there.
func (l *layer) wayDir(dst *os.File, name, rel string) (*os.File, error) {
	dfd := int(dst.Fd())
	var st unix.Stat_t
	err := unix.Fstatat(dfd, name, &st, unix.AT_SYMLINK_NOFOLLOW)
	switch {
	case err == nil && st.Mode&unix.S_IFMT == unix.S_IFDIR:
	case err == nil || errors.Is(err, unix.ENOENT):
		if err == nil {
			if err := removeAt(dfd, name, &st); err != nil {
				return nil, fmt.Errorf("replace /%s: %w", rel, err)
			}
		}
		if err := unix.Mkdirat(dfd, name, 0o755); err != nil {
			return nil, fmt.Errorf("make /%s: %w", rel, err)
		}
	default:
		return nil, fmt.Errorf("stat /%s: %w", rel, err)
	}
	d, err := openDir(dfd, name)
	if err != nil {
		return nil, fmt.Errorf("open /%s: %w", rel, err)
	}
	return d, nil
}

func (l *layer) clear(trusted string) {
	if l.cleared == nil {
		l.cleared = map[string]bool{}
	}
	l.cleared["/"+trusted] = true
}

// skip reports whether rel is left out: a trusted or excluded path, or an
// ancestor of a trusted path that t holds as other than a directory.
func (l *layer) skip(rel string, st *unix.Stat_t) bool {
	for _, tp := range l.trusted {
		if rel == tp || (st.Mode&unix.S_IFMT != unix.S_IFDIR && under(tp, rel)) {
			l.clear(tp)
			return true
		}
	}
	for _, ex := range l.excludes {
		if rel == ex {
			return true
		}
	}
	return false
}

// under reports whether p is dir or inside it (both clean, relative).
func under(p, dir string) bool { return p == dir || strings.HasPrefix(p, dir+"/") }

// entry lays name of directory src (whose stat is st) as name of dst.
func (l *layer) entry(src, dst *os.File, name, rel string, st *unix.Stat_t) error {
	if err := l.ctx.Err(); err != nil {
		return err
	}
	if l.skip(rel, st) {
		return nil
	}
	sfd, dfd := int(src.Fd()), int(dst.Fd())
	kind := st.Mode & unix.S_IFMT
	if kind == unix.S_IFCHR && st.Rdev == 0 { // a whiteout
		fmt.Fprintf(l.h, "w %q\n", rel)
		l.entries++
		return l.remove(dfd, name, rel)
	}
	switch kind {
	case unix.S_IFDIR, unix.S_IFREG, unix.S_IFLNK, unix.S_IFIFO:
	default:
		l.warnings = append(l.warnings, fmt.Sprintf("/%s: a socket or device node, left out", rel))
		return nil
	}
	fmt.Fprintf(l.h, "%o %d:%d %q", st.Mode, st.Uid, st.Gid, rel)
	l.entries++
	switch kind {
	case unix.S_IFDIR:
		return l.dir(sfd, dfd, name, rel, st)
	case unix.S_IFREG:
		return l.file(sfd, dfd, name, rel, st)
	case unix.S_IFLNK:
		target, err := readlinkat(sfd, name)
		if err != nil {
			return fmt.Errorf("read link /%s: %w", rel, err)
		}
		fmt.Fprintf(l.h, " -> %q\n", target)
		if err := l.remove(dfd, name, rel); err != nil {
			return err
		}
		if err := unix.Symlinkat(target, dfd, name); err != nil {
			return fmt.Errorf("link /%s: %w", rel, err)
		}
	default: // a FIFO
		fmt.Fprintln(l.h)
		if err := l.remove(dfd, name, rel); err != nil {
			return err
		}
		if err := unix.Mknodat(dfd, name, unix.S_IFIFO|0o600, 0); err != nil {
			return fmt.Errorf("make FIFO /%s: %w", rel, err)
		}
	}
	return l.meta(sfd, dfd, name, rel, st)
}

// dir lays directory name: merged with a directory dst holds there (after
// emptying it when the capture's is opaque), else made.
func (l *layer) dir(sfd, dfd int, name, rel string, st *unix.Stat_t) error {
	fmt.Fprintln(l.h)
	sub, err := openDir(sfd, name)
	if err != nil {
		return fmt.Errorf("open /%s: %w", rel, err)
	}
	defer sub.Close()
	var dt unix.Stat_t
	err = unix.Fstatat(dfd, name, &dt, unix.AT_SYMLINK_NOFOLLOW)
	merge := err == nil && dt.Mode&unix.S_IFMT == unix.S_IFDIR
	if err != nil && !errors.Is(err, unix.ENOENT) {
		return fmt.Errorf("stat /%s in the room: %w", rel, err)
	}
	if err == nil && !merge {
		if err := removeAt(dfd, name, &dt); err != nil {
			return fmt.Errorf("replace /%s: %w", rel, err)
		}
	}
	if !merge {
		if err := unix.Mkdirat(dfd, name, 0o700); err != nil {
			return fmt.Errorf("make /%s: %w", rel, err)
		}
	}
	d, err := openDir(dfd, name)
	if err != nil {
		return fmt.Errorf("open /%s in the room: %w", rel, err)
	}
	defer d.Close()
	if merge && opaque(int(sub.Fd())) {
		fmt.Fprintf(l.h, "opaque %q\n", rel)
		names, err := d.Readdirnames(-1)
		if err != nil {
			return fmt.Errorf("list /%s in the room: %w", rel, err)
		}
		for _, n := range names {
			if err := l.remove(int(d.Fd()), n, path.Join(rel, n)); err != nil {
				return err
			}
		}
	}
	names, err := sub.Readdirnames(-1)
	if err != nil {
		return fmt.Errorf("list /%s: %w", rel, err)
	}
	slices.Sort(names)
	for _, n := range names {
		var cst unix.Stat_t
		if err := unix.Fstatat(int(sub.Fd()), n, &cst, unix.AT_SYMLINK_NOFOLLOW); err != nil {
			return fmt.Errorf("stat /%s: %w", path.Join(rel, n), err)
		}
		if err := l.entry(sub, d, n, path.Join(rel, n), &cst); err != nil {
			return err
		}
	}
	return l.meta(sfd, dfd, name, rel, st)
}

// opaque reports whether directory fd of the capture carries overlayfs's
// opaque mark.
func opaque(fd int) bool {
	v := make([]byte, 4)
	n, err := unix.Fgetxattr(fd, overlayPrefix+"opaque", v)
	return err == nil && n == 1 && v[0] == 'y'
}

// file lays regular file name, its content copied and hashed.
func (l *layer) file(sfd, dfd int, name, rel string, st *unix.Stat_t) error {
	if err := l.remove(dfd, name, rel); err != nil {
		return err
	}
	in, err := unix.Openat(sfd, name, unix.O_RDONLY|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0)
	if err != nil {
		return fmt.Errorf("open /%s: %w", rel, err)
	}
	inf := os.NewFile(uintptr(in), rel)
	defer inf.Close()
	out, err := unix.Openat(dfd, name, unix.O_WRONLY|unix.O_CREAT|unix.O_EXCL|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0o600)
	if err != nil {
		return fmt.Errorf("create /%s: %w", rel, err)
	}
	outf := os.NewFile(uintptr(out), rel)
	defer outf.Close()
	if l.buf == nil {
		l.buf = make([]byte, 256<<10)
	}
	ch := sha256.New()
	n, err := io.CopyBuffer(io.MultiWriter(outf, ch), struct{ io.Reader }{inf}, l.buf)
	if err != nil {
		return fmt.Errorf("copy /%s: %w", rel, err)
	}
	l.bytes += n
	fmt.Fprintf(l.h, " %d %x\n", n, ch.Sum(nil))
	return l.meta(sfd, dfd, name, rel, st)
}

// remove removes name of dst with everything under it, if it is there.
func (l *layer) remove(dfd int, name, rel string) error {
	var st unix.Stat_t
	err := unix.Fstatat(dfd, name, &st, unix.AT_SYMLINK_NOFOLLOW)
	if errors.Is(err, unix.ENOENT) {
		return nil
	}
	if err == nil {
		err = removeAt(dfd, name, &st)
	}
	if err != nil {
		return fmt.Errorf("remove /%s in the room: %w", rel, err)
	}
	return nil
}

// meta gives name of dst the owner, mode, user.* extended attributes and
// times name of the capture has.
func (l *layer) meta(sfd, dfd int, name, rel string, st *unix.Stat_t) error {
	if err := unix.Fchownat(dfd, name, int(st.Uid), int(st.Gid), unix.AT_SYMLINK_NOFOLLOW); err != nil {
		return fmt.Errorf("chown /%s: %w", rel, err)
	}
	if st.Mode&unix.S_IFMT != unix.S_IFLNK {
		if err := unix.Fchmodat(dfd, name, st.Mode&^unix.S_IFMT, 0); err != nil {
			return fmt.Errorf("chmod /%s: %w", rel, err)
		}
		names, err := listXattrs(atName(sfd, name))
		if err != nil {
			return fmt.Errorf("list xattrs of /%s: %w", rel, err)
		}
		for _, x := range names {
			if !strings.HasPrefix(x, "user.") {
				continue
			}
			v, err := getXattr(atName(sfd, name), x)
			if err != nil {
				return fmt.Errorf("read xattr %s of /%s: %w", x, rel, err)
			}
			if err := atName(dfd, name).set(x, v); err != nil {
				return fmt.Errorf("set xattr %s of /%s: %w", x, rel, err)
			}
		}
	}
	ts := []unix.Timespec{st.Atim, st.Mtim}
	if err := unix.UtimesNanoAt(dfd, name, ts, unix.AT_SYMLINK_NOFOLLOW); err != nil {
		return fmt.Errorf("set times of /%s: %w", rel, err)
	}
	return nil
}

package image

import (
	"errors"
	"fmt"
	"os"
	"path"
	"strconv"
	"strings"
	"time"

	"golang.org/x/sys/unix"
)

// OCI layers delete a lower layer's NAME with an entry DIR/.wh.NAME and hide
// everything lower layers hold in DIR with DIR/.wh..wh..opq. The extractor,
// in whiteout mode, turns them into what overlayfs understands: a 0:0
// character device NAME, and the xattr trusted.overlay.opaque=y on DIR.
// mkfs.erofs keeps both (devices and trusted.* xattrs are copied by default)
// and overlayfs honours them on an EROFS lower layer.
//
// Several OCI layers may be applied into one staging tree (a collapsed
// layer): then a whiteout also removes what earlier layers of the same
// import put there, and still leaves the overlay whiteout to hide the layers
// stacked below the built one. Whiteouts apply to earlier layers only, never
// to entries of their own layer stream.
const (
	whiteoutPrefix = ".wh."
	opaqueMarker   = ".wh..wh..opq"
	opaqueXattr    = "trusted.overlay.opaque"
)

// nextLayer starts a new layer stream: whiteouts from now on apply to what
// was extracted so far.
func (x *extractor) nextLayer() {
	x.layerNames = map[string]bool{}
}

// markLayer records that the current layer stream made name, and so has
// content in each of its parent directories.
func (x *extractor) markLayer(name string) {
	for name != "" && name != "." && !x.layerNames[name] {
		x.layerNames[name] = true
		name = path.Dir(name)
	}
}

// whiteout handles the whiteout entry e, DIR/BASE with BASE starting ".wh.".
func (x *extractor) whiteout(e *entry, dir, base string) error {
	if base == opaqueMarker {
		return x.opaque(e, dir)
	}
	if strings.HasPrefix(base, whiteoutPrefix+whiteoutPrefix) {
		return refuse(e, "unsupported AUFS metadata entry")
	}
	target := strings.TrimPrefix(base, whiteoutPrefix)
	if target == "" || target == "." || target == ".." {
		return refuse(e, "whiteout names no file")
	}
	full := path.Join(dir, target)
	if x.layerNames[full] {
		return nil // made by this layer: the whiteout is for the layers below
	}
	pfd, err := x.openDir(e, dir, true)
	if err != nil {
		return err
	}
	defer unix.Close(pfd)
	if err := x.removeTree(e, pfd, target, full); err != nil {
		return err
	}
	if err := unix.Mknodat(pfd, target, unix.S_IFCHR, 0); err != nil {
		return fmt.Errorf("import entry %q: mknod whiteout: %w", e.raw, err)
	}
	if err := unix.Fchownat(pfd, target, 0, 0, unix.AT_SYMLINK_NOFOLLOW); err != nil {
		return fmt.Errorf("import entry %q: chown whiteout: %w", e.raw, err)
	}
	ts := []unix.Timespec{unix.NsecToTimespec(e.mtime.UnixNano()), unix.NsecToTimespec(e.mtime.UnixNano())}
	if err := unix.UtimesNanoAt(pfd, target, ts, unix.AT_SYMLINK_NOFOLLOW); err != nil {
		return fmt.Errorf("import entry %q: set mtime: %w", e.raw, err)
	}
	return nil
}

// opaque handles DIR/.wh..wh..opq: what earlier layers put in DIR goes, and
// DIR is marked opaque so the layers below stay hidden too.
func (x *extractor) opaque(e *entry, dir string) error {
	fd, err := x.openDir(e, dir, true)
	if err != nil {
		return err
	}
	defer unix.Close(fd)
	if err := x.pruneEarlier(e, fd, dir); err != nil {
		return err
	}
	if err := setOpaque(e, fd, ""); err != nil {
		return err
	}
	x.markLayer(dir)
	return nil
}

// pruneEarlier removes from the directory fd (rel from the staging root)
// whatever the current layer stream did not create, descending into the
// directories it did create, which merged with earlier ones.
func (x *extractor) pruneEarlier(e *entry, fd int, rel string) error {
	dfd, err := unix.Openat(fd, ".", unix.O_RDONLY|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
	if err != nil {
		return fmt.Errorf("import entry %q: open %s: %w", e.raw, rel, err)
	}
	d := os.NewFile(uintptr(dfd), rel)
	names, err := d.Readdirnames(-1)
	d.Close()
	if err != nil {
		return fmt.Errorf("import entry %q: list %s: %w", e.raw, rel, err)
	}
	for _, n := range names {
		full := path.Join(rel, n)
		if !x.layerNames[full] {
			if err := x.removeTree(e, fd, n, full); err != nil {
				return err
			}
			continue
		}
		if _, ok := x.dirs[full]; !ok {
			continue // not a directory
		}
		cfd, err := x.openDir(e, full, false)
		if err != nil {
			return err
		}
		err = x.pruneEarlier(e, cfd, full)
		unix.Close(cfd)
		if err != nil {
			return err
		}
	}
	return nil
}

// removeTree removes base (full from the staging root) in the directory pfd,
// with everything under it, and forgets what the extractor knew about it.
func (x *extractor) removeTree(e *entry, pfd int, base, full string) error {
	var st unix.Stat_t
	err := unix.Fstatat(pfd, base, &st, unix.AT_SYMLINK_NOFOLLOW)
	if errors.Is(err, unix.ENOENT) {
		return nil
	}
	if err != nil {
		return fmt.Errorf("import entry %q: stat %s: %w", e.raw, full, err)
	}
	if st.Mode&unix.S_IFMT != unix.S_IFDIR {
		delete(x.regular, full)
		if err := unix.Unlinkat(pfd, base, 0); err != nil {
			return fmt.Errorf("import entry %q: remove %s: %w", e.raw, full, err)
		}
		return nil
	}
	// pfd is a verified directory inside the stage and base one component;
	// RemoveAll opens nothing below it through a symlink.
	if err := os.RemoveAll("/proc/self/fd/" + strconv.Itoa(pfd) + "/" + base); err != nil {
		return fmt.Errorf("import entry %q: remove %s: %w", e.raw, full, err)
	}
	prefix := full + "/"
	for _, m := range []map[string]bool{x.regular, x.layerNames} {
		delete(m, full)
		for k := range m {
			if strings.HasPrefix(k, prefix) {
				delete(m, k)
			}
		}
	}
	delete(x.dirs, full)
	for k := range x.dirs {
		if strings.HasPrefix(k, prefix) {
			delete(x.dirs, k)
		}
	}
	return nil
}

// replaceWhiteoutWithDir turns the whiteout c (done from the staging root) in
// the directory fd into an opaque directory, so a later layer can fill it.
// It reports false when c is not a whiteout.
func (x *extractor) replaceWhiteoutWithDir(e *entry, fd int, c, done string) (bool, error) {
	var st unix.Stat_t
	if err := unix.Fstatat(fd, c, &st, unix.AT_SYMLINK_NOFOLLOW); err != nil {
		return false, fmt.Errorf("import entry %q: stat %s: %w", e.raw, done, err)
	}
	if st.Mode&unix.S_IFMT != unix.S_IFCHR || st.Rdev != 0 {
		return false, nil
	}
	if err := unix.Unlinkat(fd, c, 0); err != nil {
		return false, fmt.Errorf("import entry %q: replace whiteout %s: %w", e.raw, done, err)
	}
	if err := unix.Mkdirat(fd, c, 0o755); err != nil {
		return false, fmt.Errorf("import entry %q: create parent %s: %w", e.raw, done, err)
	}
	if err := setOpaque(e, fd, c); err != nil {
		return false, err
	}
	x.dirs[done] = dirMeta{mode: 0o755, mtime: time.Unix(0, 0)}
	return true, nil
}

// setOpaque marks the directory base in pfd (pfd itself when base is "")
// opaque for overlayfs.
func setOpaque(e *entry, pfd int, base string) error {
	if base == "" {
		base = "." // the directory itself, not the /proc magic link
	}
	p := "/proc/self/fd/" + strconv.Itoa(pfd) + "/" + base
	if err := unix.Lsetxattr(p, opaqueXattr, []byte("y"), 0); err != nil {
		return fmt.Errorf("import entry %q: set %s: %w", e.raw, opaqueXattr, err)
	}
	return nil
}

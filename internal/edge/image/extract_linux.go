package image

import (
	"archive/tar"
	"errors"
	"fmt"
	"io"
	"os"
	"path"
	"sort"
	"strconv"
	"strings"
	"time"

	"golang.org/x/sys/unix"

	"dsec.dev/dsec/internal/errdefs"
)

// entry is one file system object to create in a staging tree. Tar archives
// and source directories are both turned into entries, so they pass the same
// checks.
type entry struct {
	raw      string // the name as the source spelled it, for messages
	name     string // cleaned, relative, "" for the root
	typ      byte   // a tar.Type* constant
	mode     int64  // permission bits incl. setuid, setgid and sticky
	uid, gid int
	size     int64
	linkname string // symlink target, or the hard link's earlier file
	mtime    time.Time
	devmajor int64
	devminor int64
	xattrs   map[string]string
	body     io.Reader // content of a regular file
}

// dirMeta is applied to directories after extraction, so creating their
// children does not change their mtime and a read-only mode does not block them.
type dirMeta struct {
	mode  uint32
	mtime time.Time
}

// extractor writes entries into a staging directory without ever following a
// symlink: every parent is opened with openat2(RESOLVE_IN_ROOT|RESOLVE_NO_SYMLINKS)
// relative to the staging root, and every object is created by name in it.
type extractor struct {
	stage   string
	root    int // O_PATH fd of stage
	opts    ImportOptions
	bytes   int64
	entries int64
	regular map[string]bool // regular files extracted so far: valid hard link targets
	dirs    map[string]dirMeta

	// whiteouts turns OCI whiteout entries (.wh.NAME, .wh..wh..opq) into
	// overlayfs ones; set for OCI layer streams, see whiteout_linux.go.
	whiteouts bool
	// layerNames holds what entries of the current layer stream created:
	// OCI whiteouts apply only to earlier layers.
	layerNames map[string]bool

	// skipped counts the special files under /dev left out (see skipDev);
	// skippedNames holds the first few.
	skipped      int
	skippedNames []string
}

func newExtractor(stage string, opts ImportOptions) (*extractor, error) {
	fd, err := unix.Open(stage, unix.O_PATH|unix.O_DIRECTORY|unix.O_CLOEXEC|unix.O_NOFOLLOW, 0)
	if err != nil {
		return nil, fmt.Errorf("open staging dir: %w", err)
	}
	if opts.MaxBytes <= 0 {
		opts.MaxBytes = defaultMaxBytes
	}
	if opts.MaxEntries <= 0 {
		opts.MaxEntries = defaultMaxEntries
	}
	return &extractor{
		stage:   stage,
		root:    fd,
		opts:    opts,
		regular: map[string]bool{},
		// The root and implicit parents get fixed metadata, so the same
		// content always gives the same image.
		dirs: map[string]dirMeta{"": {mode: 0o755, mtime: time.Unix(0, 0)}},
	}, nil
}

func (x *extractor) close() { unix.Close(x.root) }

// limit names the option that bounds an import, as its caller sets it.
func (x *extractor) limit(option string) string {
	if x.opts.LimitName != "" {
		return x.opts.LimitName
	}
	return option
}

// allowSetuidHint names every way to pass ImportOptions.AllowSetuid.
const allowSetuidHint = "import with --allow-setuid (dsec layer import, dsec image import) or allow_setuid / AllowSetuid (API and SDKs)"

// refuse builds the error for a rejected entry.
func refuse(e *entry, format string, args ...any) error {
	return fmt.Errorf("import entry %q: %s: %w", e.raw, fmt.Sprintf(format, args...), errdefs.ErrInvalidArgument)
}

// cleanName turns an entry name into a clean relative path ("" is the root),
// refusing absolute names and ".." components.
func cleanName(raw string) (string, error) {
	if raw == "" {
		return "", errors.New("empty name")
	}
	if strings.ContainsRune(raw, 0) {
		return "", errors.New("name contains a NUL byte")
	}
	if strings.HasPrefix(raw, "/") {
		return "", errors.New("absolute path")
	}
	var parts []string
	for _, p := range strings.Split(raw, "/") {
		switch p {
		case "", ".":
		case "..":
			return "", errors.New("path contains a .. component")
		default:
			parts = append(parts, p)
		}
	}
	return strings.Join(parts, "/"), nil
}

// add checks e and creates it in the staging tree.
func (x *extractor) add(e *entry) error {
	x.entries++
	if x.entries > x.opts.MaxEntries {
		return refuse(e, "more than %d entries (limit %s)", x.opts.MaxEntries, x.limit("MaxEntries"))
	}
	name, err := cleanName(e.raw)
	if err != nil {
		return refuse(e, "%v", err)
	}
	e.name = name
	if x.whiteouts {
		if dir, base := path.Split(name); strings.HasPrefix(base, whiteoutPrefix) {
			return x.whiteout(e, strings.TrimSuffix(dir, "/"), base)
		}
	}
	if x.skipDev(e) {
		x.skipped++
		if len(x.skippedNames) < maxSkippedNames {
			x.skippedNames = append(x.skippedNames, "/"+e.name)
		}
		return nil
	}
	if err := x.check(e); err != nil {
		return err
	}
	if e.name == "" {
		if e.typ != tar.TypeDir {
			return refuse(e, "the layer root must be a directory")
		}
		if err := x.setXattrsAndOwner(e, x.root, "."); err != nil {
			return err
		}
		x.dirs[""] = dirMeta{mode: uint32(e.mode), mtime: e.mtime}
		return nil
	}
	dir, base := path.Split(e.name)
	dir = strings.TrimSuffix(dir, "/")
	pfd, err := x.openDir(e, dir, true)
	if err != nil {
		return err
	}
	defer unix.Close(pfd)
	replacedWhiteout, err := x.clear(e, pfd, base)
	if err != nil {
		return err
	}
	if err := x.create(e, pfd, base); err != nil {
		return err
	}
	if x.whiteouts {
		x.markLayer(e.name)
	}
	if e.typ == tar.TypeLink {
		return nil // shares the earlier file's inode and metadata
	}
	if err := x.setXattrsAndOwner(e, pfd, base); err != nil {
		return err
	}
	switch e.typ {
	case tar.TypeDir:
		if replacedWhiteout {
			// A directory deleted by an earlier layer and made again:
			// nothing of the lower layers' directory may show through.
			if err := setOpaque(e, pfd, base); err != nil {
				return err
			}
		}
		x.dirs[e.name] = dirMeta{mode: uint32(e.mode), mtime: e.mtime}
		return nil
	case tar.TypeSymlink:
	default:
		if err := unix.Fchmodat(pfd, base, uint32(e.mode), 0); err != nil {
			return fmt.Errorf("import entry %q: chmod: %w", e.raw, err)
		}
	}
	ts := []unix.Timespec{unix.NsecToTimespec(e.mtime.UnixNano()), unix.NsecToTimespec(e.mtime.UnixNano())}
	if err := unix.UtimesNanoAt(pfd, base, ts, unix.AT_SYMLINK_NOFOLLOW); err != nil {
		return fmt.Errorf("import entry %q: set mtime: %w", e.raw, err)
	}
	return nil
}

// devNote says why device nodes under /dev are skipped, not refused.
const devNote = "those under /dev are skipped, as every sandbox gets its own /dev"

// skipDev reports whether e is a special file (device node, named pipe or
// socket) under /dev, which the importer leaves out: the runtime mounts a
// fresh /dev over the layer's, so nothing of it would be seen, and a root
// file system made by debootstrap or copied from a machine has them
// (/dev/console, /dev/null…). Overlay whiteouts (0:0) are not devices and
// are kept.
func (x *extractor) skipDev(e *entry) bool {
	if !strings.HasPrefix(e.name, "dev/") {
		return false
	}
	switch e.typ {
	case tar.TypeBlock, tar.TypeFifo, 's':
		return true
	case tar.TypeChar:
		return x.whiteouts || e.devmajor != 0 || e.devminor != 0
	}
	return false
}

// maxSkippedNames is how many skipped files a warning names.
const maxSkippedNames = 8

// warnings says what the extraction left out; none when it left out nothing.
func (x *extractor) warnings() []string {
	if x.skipped == 0 {
		return nil
	}
	list := strings.Join(x.skippedNames, ", ")
	if more := x.skipped - len(x.skippedNames); more > 0 {
		list += fmt.Sprintf(" and %d more", more)
	}
	return []string{fmt.Sprintf("left out %d device nodes or other special files under /dev (%s): every sandbox gets its own /dev", x.skipped, list)}
}

// check applies the content rules that do not depend on the tree so far.
func (x *extractor) check(e *entry) error {
	if e.mode < 0 || e.mode > 0o7777 {
		return refuse(e, "mode %o out of range", e.mode)
	}
	if e.uid < 0 || e.gid < 0 || e.uid > 1<<31 || e.gid > 1<<31 {
		return refuse(e, "owner %d:%d out of range", e.uid, e.gid)
	}
	switch e.typ {
	case tar.TypeReg, tar.TypeDir, tar.TypeSymlink, tar.TypeLink:
	case tar.TypeChar:
		if x.whiteouts {
			// OCI layers mark deletions with .wh. entries; the importer makes
			// the overlay whiteouts itself and takes none from the archive.
			return refuse(e, "character device %d:%d outside /dev (a layer holds no device nodes; %s)", e.devmajor, e.devminor, devNote)
		}
		if e.devmajor != 0 || e.devminor != 0 {
			return refuse(e, "character device %d:%d outside /dev (a layer holds no device nodes but overlay whiteouts, 0:0; %s)", e.devmajor, e.devminor, devNote)
		}
	case tar.TypeBlock:
		return refuse(e, "block device %d:%d outside /dev (a layer holds no device nodes; %s)", e.devmajor, e.devminor, devNote)
	case tar.TypeFifo:
		return refuse(e, "named pipe outside /dev (%s)", devNote)
	case 's':
		return refuse(e, "socket outside /dev (%s)", devNote)
	default:
		return refuse(e, "unsupported entry type %q", string(e.typ))
	}
	if e.typ == tar.TypeReg && e.mode&0o6000 != 0 && !x.opts.AllowSetuid {
		return refuse(e, "setuid/setgid file (mode %04o); %s to accept it", e.mode, allowSetuidHint)
	}
	if e.typ == tar.TypeReg {
		if e.size < 0 {
			return refuse(e, "negative size")
		}
		if e.size > x.opts.MaxBytes-x.bytes {
			return refuse(e, "content exceeds %d bytes (limit %s)", x.opts.MaxBytes, x.limit("MaxBytes"))
		}
	}
	if e.typ == tar.TypeSymlink {
		if e.linkname == "" || strings.ContainsRune(e.linkname, 0) {
			return refuse(e, "empty or invalid symlink target")
		}
		// Absolute targets resolve inside the container's root; relative
		// ones must not climb above the layer root.
		if !strings.HasPrefix(e.linkname, "/") {
			if t := path.Clean(path.Join(path.Dir(e.name), e.linkname)); t == ".." || strings.HasPrefix(t, "../") {
				return refuse(e, "symlink target %q climbs above the layer root", e.linkname)
			}
		}
	}
	for _, k := range sortedKeys(e.xattrs) {
		switch {
		case k == "trusted.overlay.opaque" && x.whiteouts:
			return refuse(e, "extended attribute %q (OCI layers mark opaque directories with %s)", k, opaqueMarker)
		case k == "trusted.overlay.opaque", strings.HasPrefix(k, "user."),
			k == "system.posix_acl_access", k == "system.posix_acl_default":
		case k == "security.capability":
			if !x.opts.AllowSetuid {
				return refuse(e, "file capabilities (security.capability); %s to accept them", allowSetuidHint)
			}
		default:
			return refuse(e, "unsupported extended attribute %q", k)
		}
	}
	return nil
}

// openDir opens the directory rel (relative to the staging root) without
// following symlinks, creating missing components when create is set.
func (x *extractor) openDir(e *entry, rel string, create bool) (int, error) {
	how := &unix.OpenHow{
		Flags:   unix.O_PATH | unix.O_DIRECTORY | unix.O_CLOEXEC,
		Resolve: unix.RESOLVE_IN_ROOT | unix.RESOLVE_NO_SYMLINKS | unix.RESOLVE_NO_MAGICLINKS | unix.RESOLVE_NO_XDEV,
	}
	if rel == "" {
		rel = "."
	}
	fd, err := unix.Openat2(x.root, rel, how)
	if err == nil {
		return fd, nil
	}
	switch {
	case errors.Is(err, unix.ELOOP):
		return -1, refuse(e, "path goes through a symlink")
	case errors.Is(err, unix.ENOTDIR) && !(create && x.whiteouts):
		return -1, refuse(e, "a parent is not a directory")
	case (errors.Is(err, unix.ENOENT) || errors.Is(err, unix.ENOTDIR)) && create:
	default:
		return -1, fmt.Errorf("import entry %q: open parent: %w", e.raw, err)
	}
	// Create the missing parents one component at a time.
	fd, err = unix.Openat2(x.root, ".", how)
	if err != nil {
		return -1, fmt.Errorf("import entry %q: open staging root: %w", e.raw, err)
	}
	done := ""
	for _, c := range strings.Split(rel, "/") {
		done = path.Join(done, c)
		next, err := unix.Openat2(fd, c, how)
		if errors.Is(err, unix.ENOENT) {
			if err := unix.Mkdirat(fd, c, 0o755); err != nil && !errors.Is(err, unix.EEXIST) {
				unix.Close(fd)
				return -1, fmt.Errorf("import entry %q: create parent %s: %w", e.raw, done, err)
			}
			if _, ok := x.dirs[done]; !ok {
				x.dirs[done] = dirMeta{mode: 0o755, mtime: time.Unix(0, 0)}
			}
			next, err = unix.Openat2(fd, c, how)
		}
		if errors.Is(err, unix.ENOTDIR) && x.whiteouts {
			// A directory an earlier layer deleted: replace its whiteout
			// with an opaque directory.
			var ok bool
			if ok, err = x.replaceWhiteoutWithDir(e, fd, c, done); ok {
				next, err = unix.Openat2(fd, c, how)
			} else if err == nil {
				err = unix.ENOTDIR
			}
		}
		unix.Close(fd)
		switch {
		case errors.Is(err, unix.ELOOP):
			return -1, refuse(e, "path goes through a symlink")
		case errors.Is(err, unix.ENOTDIR):
			return -1, refuse(e, "a parent is not a directory")
		case err != nil:
			return -1, fmt.Errorf("import entry %q: open parent %s: %w", e.raw, done, err)
		}
		fd = next
	}
	return fd, nil
}

// clear makes room for e at base: a later entry replaces an earlier one,
// except that only a directory may take a directory's place (and then merges).
// With whiteouts on, a later layer may replace an earlier layer's directory.
// It reports whether it removed an overlay whiteout.
func (x *extractor) clear(e *entry, pfd int, base string) (bool, error) {
	var st unix.Stat_t
	err := unix.Fstatat(pfd, base, &st, unix.AT_SYMLINK_NOFOLLOW)
	if errors.Is(err, unix.ENOENT) {
		return false, nil
	}
	if err != nil {
		return false, fmt.Errorf("import entry %q: stat: %w", e.raw, err)
	}
	if st.Mode&unix.S_IFMT == unix.S_IFDIR {
		if e.typ == tar.TypeDir {
			return false, nil
		}
		if !x.whiteouts || x.layerNames[e.name] {
			return false, refuse(e, "replaces a directory")
		}
		return false, x.removeTree(e, pfd, base, e.name)
	}
	whiteout := x.whiteouts && st.Mode&unix.S_IFMT == unix.S_IFCHR && st.Rdev == 0
	delete(x.regular, e.name)
	if err := unix.Unlinkat(pfd, base, 0); err != nil {
		return false, fmt.Errorf("import entry %q: replace: %w", e.raw, err)
	}
	return whiteout, nil
}

func (x *extractor) create(e *entry, pfd int, base string) error {
	switch e.typ {
	case tar.TypeDir:
		if err := unix.Mkdirat(pfd, base, 0o700); err != nil && !errors.Is(err, unix.EEXIST) {
			return fmt.Errorf("import entry %q: mkdir: %w", e.raw, err)
		}
	case tar.TypeReg:
		fd, err := unix.Openat(pfd, base, unix.O_WRONLY|unix.O_CREAT|unix.O_EXCL|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0o600)
		if err != nil {
			return fmt.Errorf("import entry %q: create: %w", e.raw, err)
		}
		f := os.NewFile(uintptr(fd), e.name)
		n, err := io.Copy(f, io.LimitReader(e.body, e.size))
		if cerr := f.Close(); err == nil {
			err = cerr
		}
		if err != nil {
			return fmt.Errorf("import entry %q: write: %w", e.raw, err)
		}
		if n != e.size {
			return refuse(e, "content truncated: %d of %d bytes", n, e.size)
		}
		x.bytes += n
		x.regular[e.name] = true
	case tar.TypeSymlink:
		if err := unix.Symlinkat(e.linkname, pfd, base); err != nil {
			return fmt.Errorf("import entry %q: symlink: %w", e.raw, err)
		}
	case tar.TypeLink:
		target, err := cleanName(e.linkname)
		if err != nil || target == "" {
			return refuse(e, "hard link target %q is outside the layer", e.linkname)
		}
		if !x.regular[target] {
			return refuse(e, "hard link target %q is not an earlier regular file", e.linkname)
		}
		tdir, tbase := path.Split(target)
		tfd, err := x.openDir(e, strings.TrimSuffix(tdir, "/"), false)
		if err != nil {
			return err
		}
		defer unix.Close(tfd)
		var st unix.Stat_t
		if err := unix.Fstatat(tfd, tbase, &st, unix.AT_SYMLINK_NOFOLLOW); err != nil || st.Mode&unix.S_IFMT != unix.S_IFREG {
			return refuse(e, "hard link target %q is not an earlier regular file", e.linkname)
		}
		if err := unix.Linkat(tfd, tbase, pfd, base, 0); err != nil {
			return fmt.Errorf("import entry %q: link: %w", e.raw, err)
		}
		x.regular[e.name] = true
	case tar.TypeChar: // an overlay whiteout (0:0), checked above
		if err := unix.Mknodat(pfd, base, unix.S_IFCHR, 0); err != nil {
			return fmt.Errorf("import entry %q: mknod whiteout: %w", e.raw, err)
		}
	}
	return nil
}

// setXattrsAndOwner sets ownership, then extended attributes (chown would
// clear file capabilities set before it).
func (x *extractor) setXattrsAndOwner(e *entry, pfd int, base string) error {
	if err := unix.Fchownat(pfd, base, e.uid, e.gid, unix.AT_SYMLINK_NOFOLLOW); err != nil {
		return fmt.Errorf("import entry %q: chown %d:%d: %w", e.raw, e.uid, e.gid, err)
	}
	// The parent fd is a verified directory inside the stage and base one
	// component, so the /proc path resolves to exactly that object.
	p := "/proc/self/fd/" + strconv.Itoa(pfd) + "/" + base
	for _, k := range sortedKeys(e.xattrs) {
		if err := unix.Lsetxattr(p, k, []byte(e.xattrs[k]), 0); err != nil {
			return fmt.Errorf("import entry %q: set xattr %s: %w", e.raw, k, err)
		}
	}
	return nil
}

// finish applies directory modes and mtimes, deepest first.
func (x *extractor) finish() error {
	names := sortedKeys(x.dirs)
	sort.SliceStable(names, func(i, j int) bool { return strings.Count(names[i], "/") > strings.Count(names[j], "/") })
	for _, name := range names {
		m := x.dirs[name]
		e := &entry{raw: name}
		if name == "" {
			e.raw = "."
		}
		fd, err := x.openDir(e, name, false)
		if err != nil {
			return err
		}
		p := "/proc/self/fd/" + strconv.Itoa(fd)
		err = unix.Chmod(p, m.mode)
		if err == nil {
			ts := []unix.Timespec{unix.NsecToTimespec(m.mtime.UnixNano()), unix.NsecToTimespec(m.mtime.UnixNano())}
			err = unix.UtimesNanoAt(unix.AT_FDCWD, p, ts, 0)
		}
		unix.Close(fd)
		if err != nil {
			return fmt.Errorf("import entry %q: set directory metadata: %w", e.raw, err)
		}
	}
	return nil
}

func sortedKeys[V any](m map[string]V) []string {
	keys := make([]string, 0, len(m))
	for k := range m {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	return keys
}

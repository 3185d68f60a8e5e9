package snapshot

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"path"
	"path/filepath"
	"strings"
	"sync"
	"time"

	"golang.org/x/sys/unix"

	"dsec.dev/dsec/internal/edge/image"
	"dsec.dev/dsec/internal/errdefs"
)

// Pack turns the captured upper t into an EROFS layer file at out (which
// must not exist), to be stacked right above opts.Lower, the layers the
// sandbox ran on: overlayfs then shows what the sandbox showed. It edits
// t in place, in this order, and then builds the file with the layer
// store's own mkfs.erofs settings (image.BuildLayerFile):
//
//   - each path of opts.Exclude is removed with everything under it (see
//     the package doc for what a sandbox made from the layer then sees);
//   - sockets and device nodes (other than the 0:0 whiteouts) are removed,
//     and Packed.Warnings names them;
//   - overlayfs's private extended attributes (trusted.overlay.origin,
//     impure, nlink, upper, uuid, protattr, ...) are removed, except
//     trusted.overlay.opaque=y and the trusted.overlay.overlay.* a sandbox
//     set itself (overlayfs escapes those); a trusted.overlay.redirect or
//     metacopy, which overlayfs writes only when mounted with redirect_dir
//     or metacopy on, is refused with errdefs.ErrFailedPrecondition;
//   - whiteouts and opaque marks that hide nothing in opts.Lower are
//     removed (image.PruneWhiteouts).
//
// While the walk goes on, and then beside mkfs.erofs, a prefetcher asks the
// kernel to read each regular file ahead (POSIX_FADV_WILLNEED, up to
// prefetchBytes of content), so that many reads are queued at once instead
// of one after another as mkfs.erofs reaches each file: a capture is a new
// btrfs snapshot, none of whose pages are cached, and on a loop-mounted
// upper each read waits its turn (20,000 small files: mkfs.erofs 3.1 s
// alone, 1.0 s behind the prefetcher).
//
// Every edit is the same when repeated, so after a failure Pack may run
// again on t. Directories keep their mtimes. More objects than
// opts.MaxEntries, a content total over opts.MaxBytes, or over the free
// space at out, is refused with
// errdefs.ErrResourceExhausted before mkfs.erofs runs; so is a full disk
// meanwhile. An exclude path that is not absolute or has a ".." component
// is refused with errdefs.ErrInvalidArgument before anything is touched.
// On any error, out does not exist.
func Pack(ctx context.Context, t *Tree, out string, opts PackOptions) (Packed, error) {
	start := time.Now()
	excludes, err := cleanExcludes(opts.Exclude)
	if err != nil {
		return Packed{}, fmt.Errorf("pack %s: %w", t.Dir, err)
	}
	if _, err := cleanExcludes(opts.Include); err != nil {
		return Packed{}, fmt.Errorf("pack %s: include: %w", t.Dir, err)
	}
	if _, err := cleanExcludes(opts.Trusted); err != nil {
		return Packed{}, fmt.Errorf("pack %s: trusted: %w", t.Dir, err)
	}
	if _, err := os.Lstat(out); err == nil {
		return Packed{}, fmt.Errorf("pack %s: %s exists: %w", t.Dir, out, errdefs.ErrAlreadyExists)
	}
	p, err := pack(ctx, t, out, excludes, opts)
	if err != nil {
		os.Remove(out)
		if errors.Is(err, unix.ENOSPC) || errors.Is(err, unix.EDQUOT) {
			err = fmt.Errorf("%w: %w", err, errdefs.ErrResourceExhausted)
		}
		if t.Broken != nil {
			if b := t.Broken(); b != nil {
				err = fmt.Errorf("%w: %w", b, err)
			}
		}
		return Packed{}, fmt.Errorf("pack %s: %w", t.Dir, err)
	}
	p.Took = time.Since(start)
	return p, nil
}

func pack(ctx context.Context, t *Tree, out string, excludes []string, opts PackOptions) (Packed, error) {
	root, err := openDir(unix.AT_FDCWD, t.Dir)
	if err != nil {
		return Packed{}, err
	}
	defer root.Close()
	var res Packed
	if len(opts.Include) > 0 {
		includes, _ := cleanExcludes(opts.Include)
		if res.Included, err = keepOnly(root, includes); err != nil {
			return Packed{}, fmt.Errorf("include: %w", err)
		}
	}
	trusted, _ := cleanExcludes(opts.Trusted)
	for _, rel := range trusted {
		found, err := clearWay(root, rel)
		if err != nil {
			return Packed{}, fmt.Errorf("trusted /%s: %w", rel, err)
		}
		if found {
			res.Cleared = append(res.Cleared, "/"+rel)
		}
	}
	for _, rel := range excludes {
		found, err := exclude(root, rel)
		if err != nil {
			return Packed{}, fmt.Errorf("exclude /%s: %w", rel, err)
		}
		if found {
			res.Excluded = append(res.Excluded, "/"+rel)
		}
	}
	pf := startPrefetch(int(root.Fd()))
	defer pf.stop()
	c := &cleaner{ctx: ctx, links: map[inode]bool{}, prefetch: pf}
	if err := c.xattrs(atFd(int(root.Fd())), "/"); err != nil {
		return Packed{}, err
	}
	if err := c.dir(root, "/"); err != nil {
		return Packed{}, err
	}
	pf.close()
	if res.Pruned, err = image.PruneWhiteouts(ctx, t.Dir, opts.Lower); err != nil {
		return Packed{}, err
	}
	res.Entries, res.ContentBytes = c.entries-res.Pruned.Whiteouts, c.bytes
	res.StrippedXattrs, res.Warnings = c.stripped, c.warnings()

	maxBytes, maxEntries := opts.MaxBytes, opts.MaxEntries
	if maxBytes <= 0 {
		maxBytes = defaultMaxBytes
	}
	if maxEntries <= 0 {
		maxEntries = defaultMaxEntries
	}
	if res.Entries > maxEntries {
		return Packed{}, fmt.Errorf("the upper holds %d objects, over the limit of %d: %w", res.Entries, maxEntries, errdefs.ErrResourceExhausted)
	}
	if c.bytes > maxBytes {
		return Packed{}, fmt.Errorf("the upper holds %d bytes of file content (sparse files at their full size, which a layer stores), over the limit of %d: %w", c.bytes, maxBytes, errdefs.ErrResourceExhausted)
	}
	var sfs unix.Statfs_t
	if err := unix.Statfs(filepath.Dir(out), &sfs); err != nil {
		return Packed{}, fmt.Errorf("statfs %s: %w", filepath.Dir(out), err)
	}
	if free := int64(sfs.Bavail) * sfs.Bsize; c.bytes > free {
		return Packed{}, fmt.Errorf("the layer needs at least %d bytes (file content, sparse files at their full size) and %s has %d free: %w", c.bytes, filepath.Dir(out), free, errdefs.ErrResourceExhausted)
	}

	buildStart := time.Now()
	res.Digest, res.Size, err = image.BuildLayerFile(ctx, t.Dir, out)
	if err != nil {
		return Packed{}, err
	}
	res.File, res.Build = out, time.Since(buildStart)
	return res, nil
}

// exclude removes rel (clean, relative to the tree's root) with everything
// under it, and reports whether the tree held it. The path is taken
// literally: a symlink, file or whiteout on the way means the tree holds
// no such path.
func exclude(root *os.File, rel string) (bool, error) {
	dir, base := path.Split(rel)
	parent := root
	if dir != "" {
		fd, err := unix.Openat2(int(root.Fd()), strings.TrimSuffix(dir, "/"), &unix.OpenHow{
			Flags:   unix.O_RDONLY | unix.O_DIRECTORY | unix.O_CLOEXEC,
			Resolve: unix.RESOLVE_BENEATH | unix.RESOLVE_NO_SYMLINKS | unix.RESOLVE_NO_MAGICLINKS | unix.RESOLVE_NO_XDEV,
		})
		if errors.Is(err, unix.ENOENT) || errors.Is(err, unix.ENOTDIR) || errors.Is(err, unix.ELOOP) {
			return false, nil
		}
		if err != nil {
			return false, err
		}
		parent = os.NewFile(uintptr(fd), fdPath(fd, ""))
		defer parent.Close()
	}
	pfd := int(parent.Fd())
	var pst, st unix.Stat_t
	if err := unix.Fstat(pfd, &pst); err != nil {
		return false, err
	}
	err := unix.Fstatat(pfd, base, &st, unix.AT_SYMLINK_NOFOLLOW)
	if errors.Is(err, unix.ENOENT) {
		return false, nil
	}
	if err != nil {
		return false, err
	}
	if st.Mode&unix.S_IFMT == unix.S_IFDIR {
		// pfd is a directory inside the tree and base one component:
		// RemoveAll opens nothing below it through a symlink.
		err = os.RemoveAll(fdPath(pfd, base))
	} else {
		err = unix.Unlinkat(pfd, base, 0)
	}
	if err != nil {
		return false, err
	}
	return true, restoreTimes(pfd, &pst)
}

// restoreTimes sets the directory fd's atime and mtime back to st's.
func restoreTimes(fd int, st *unix.Stat_t) error {
	ts := []unix.Timespec{st.Atim, st.Mtim}
	if err := unix.UtimesNanoAt(unix.AT_FDCWD, fdPath(fd, ""), ts, 0); err != nil {
		return fmt.Errorf("restore directory mtime: %w", err)
	}
	return nil
}

// prefetchBytes bounds the file content Pack's walk asks the kernel to
// read ahead: past it, mkfs.erofs reads the rest as it goes.
const prefetchBytes = 1 << 30

// cleaner walks a captured tree, removing what a layer does not hold and
// counting what it does.
type cleaner struct {
	ctx                      context.Context
	entries, bytes, stripped int64
	prefetch                 *prefetcher    // reads the tree's files ahead
	prefetched               int64          // bytes queued for it
	links                    map[inode]bool // regular files with more links, counted once
	sockets, devices         []string       // the first few removed
	nSockets, nDevices       int
}

// maxNameLen is the longest name mkfs.erofs 1.5 builds into a layer: it
// cuts names to 254 bytes and then fails to find the file (the kernel, and
// EROFS itself, allow 255).
const maxNameLen = 254

// maxNamed is how many removed objects of a kind a warning names.
const maxNamed = 8

func (c *cleaner) dir(d *os.File, rel string) error {
	dfd := int(d.Fd())
	var dst unix.Stat_t
	if err := unix.Fstat(dfd, &dst); err != nil {
		return fmt.Errorf("stat %q: %w", rel, err)
	}
	changed := false
	for {
		names, err := d.Readdirnames(1024)
		for _, name := range names {
			removed, err := c.entry(d, name, path.Join(rel, name))
			if err != nil {
				return err
			}
			changed = changed || removed
		}
		if errors.Is(err, io.EOF) {
			break
		}
		if err != nil {
			return fmt.Errorf("list %q: %w", rel, err)
		}
	}
	if changed {
		return restoreTimes(dfd, &dst)
	}
	return nil
}

// entry cleans the object name of d and reports whether it removed it.
func (c *cleaner) entry(d *os.File, name, full string) (bool, error) {
	if c.entries%1024 == 0 {
		if err := c.ctx.Err(); err != nil {
			return false, err
		}
	}
	if len(name) > maxNameLen {
		return false, fmt.Errorf("%q: a name of %d bytes; mkfs.erofs stores at most %d (rename it in the sandbox): %w", full, len(name), maxNameLen, errdefs.ErrFailedPrecondition)
	}
	dfd := int(d.Fd())
	var st unix.Stat_t
	if err := unix.Fstatat(dfd, name, &st, unix.AT_SYMLINK_NOFOLLOW); err != nil {
		return false, fmt.Errorf("stat %q: %w", full, err)
	}
	switch typ := st.Mode & unix.S_IFMT; {
	case typ == unix.S_IFSOCK:
		c.nSockets++
		if len(c.sockets) < maxNamed {
			c.sockets = append(c.sockets, full)
		}
		return true, c.remove(dfd, name, full)
	case typ == unix.S_IFBLK, typ == unix.S_IFCHR && st.Rdev != 0:
		c.nDevices++
		if len(c.devices) < maxNamed {
			c.devices = append(c.devices, full)
		}
		return true, c.remove(dfd, name, full)
	}
	c.entries++
	if err := c.xattrs(atName(dfd, name), full); err != nil {
		return false, err
	}
	switch st.Mode & unix.S_IFMT {
	case unix.S_IFREG:
		id := inode{uint64(st.Dev), st.Ino}
		if st.Nlink > 1 {
			if c.links[id] {
				return false, nil
			}
			c.links[id] = true
		}
		c.bytes += st.Size
		c.readAhead(full, st.Size)
	case unix.S_IFDIR:
		sub, err := openDir(dfd, name)
		if err != nil {
			return false, fmt.Errorf("open %q: %w", full, err)
		}
		defer sub.Close()
		return false, c.dir(sub, full)
	}
	return false, nil
}

// readAhead queues the regular file rel of the tree for the prefetcher,
// while the budget lasts.
func (c *cleaner) readAhead(rel string, size int64) {
	if size == 0 || c.prefetched+size > prefetchBytes {
		return
	}
	c.prefetched += size
	c.prefetch.add(rel, size)
}

// prefetcher reads files of a tree ahead with a few workers, each opening
// a file beneath the tree's root (no symlinks followed) and asking for its
// pages with POSIX_FADV_WILLNEED. Its reads are hints: a file that does
// not open, or was removed meanwhile, is left to mkfs.erofs.
type prefetcher struct {
	root  int
	files chan prefetchFile
	done  sync.WaitGroup
	once  sync.Once
	quit  chan struct{}
}

type prefetchFile struct {
	rel  string // from the root, with a leading slash
	size int64
}

// prefetchWorkers is how many files are opened and hinted at once: the
// hint itself queues the reads, so a few keep the queue full.
const prefetchWorkers = 2

func startPrefetch(root int) *prefetcher {
	p := &prefetcher{root: root, files: make(chan prefetchFile, 4096), quit: make(chan struct{})}
	for range prefetchWorkers {
		p.done.Add(1)
		go func() {
			defer p.done.Done()
			for f := range p.files {
				select {
				case <-p.quit:
					continue // drain: the walk may still be adding
				default:
				}
				p.readAhead(f)
			}
		}()
	}
	return p
}

func (p *prefetcher) readAhead(f prefetchFile) {
	fd, err := unix.Openat2(p.root, strings.TrimPrefix(f.rel, "/"), &unix.OpenHow{
		Flags:   unix.O_RDONLY | unix.O_NOFOLLOW | unix.O_NONBLOCK | unix.O_CLOEXEC,
		Resolve: unix.RESOLVE_BENEATH | unix.RESOLVE_NO_SYMLINKS | unix.RESOLVE_NO_MAGICLINKS,
	})
	if err != nil {
		return
	}
	unix.Fadvise(fd, 0, f.size, unix.FADV_WILLNEED)
	unix.Close(fd)
}

// add queues a file; it blocks while the workers are behind.
func (p *prefetcher) add(rel string, size int64) { p.files <- prefetchFile{rel, size} }

// close ends the queue: the workers finish what it holds.
func (p *prefetcher) close() { p.once.Do(func() { close(p.files) }) }

// stop drops what is still queued and waits for the workers, which must
// be done before the tree's root is closed.
func (p *prefetcher) stop() {
	close(p.quit)
	p.close()
	p.done.Wait()
}

func (c *cleaner) remove(dfd int, name, full string) error {
	if err := unix.Unlinkat(dfd, name, 0); err != nil {
		return fmt.Errorf("remove %q: %w", full, err)
	}
	return nil
}

// xattrs removes overlayfs's private extended attributes from o.
func (c *cleaner) xattrs(o object, full string) error {
	names, err := listXattrs(o)
	if err != nil {
		return fmt.Errorf("%q: %w", full, err)
	}
	for _, n := range names {
		keep, err := keepXattr(o, n)
		if err != nil {
			return fmt.Errorf("%q: %w", full, err)
		}
		if keep {
			continue
		}
		if err := o.remove(n); err != nil {
			return fmt.Errorf("%q: remove %s: %w", full, n, err)
		}
		c.stripped++
	}
	return nil
}

const overlayPrefix = "trusted.overlay."

// keepXattr says whether a layer keeps the extended attribute name of o.
func keepXattr(o object, name string) (bool, error) {
	rest, ok := strings.CutPrefix(name, overlayPrefix)
	switch {
	case !ok:
		return true, nil
	case strings.HasPrefix(rest, "overlay."):
		return true, nil // set by the sandbox; overlayfs escaped it
	case rest == "opaque":
		v, err := getXattr(o, name)
		return string(v) == "y", err
	case rest == "redirect", rest == "metacopy":
		return false, fmt.Errorf("has %s, which overlayfs writes only with redirect_dir or metacopy on; packing resolves neither: %w", name, errdefs.ErrFailedPrecondition)
	}
	return false, nil
}

// warnings says what the cleaning removed besides private attributes.
func (c *cleaner) warnings() []string {
	var out []string
	if c.nSockets > 0 {
		out = append(out, fmt.Sprintf("left out %d sockets (%s): a socket is the address of a process, which a snapshot does not carry",
			c.nSockets, namedList(c.sockets, c.nSockets)))
	}
	if c.nDevices > 0 {
		out = append(out, fmt.Sprintf("left out %d device nodes (%s): a layer holds none, and every sandbox gets its own /dev",
			c.nDevices, namedList(c.devices, c.nDevices)))
	}
	return out
}

func namedList(names []string, n int) string {
	var q []string
	for _, s := range names {
		q = append(q, fmt.Sprintf("%q", s))
	}
	list := strings.Join(q, ", ")
	if more := n - len(names); more > 0 {
		list += fmt.Sprintf(" and %d more", more)
	}
	return list
}

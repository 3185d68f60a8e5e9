package snapshot

import (
	"context"
	"encoding/binary"
	"errors"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"
	"golang.org/x/sys/unix"

	"dsec.dev/dsec/internal/errdefs"
	"dsec.dev/dsec/internal/testutil"
)

// oddNames are names with bytes a layer must keep as they are.
var oddNames = []string{"\x01ctl", "new\nline", "inv\xffutf8", "sp ace", "-dash", "ütf8", "back\\slash", strings.Repeat("n", maxNameLen)}

// lowerTree writes the tree the sandbox's lower layer is built from.
func lowerTree(t testing.TB) string {
	t.Helper()
	dir := t.TempDir()
	w := func(name, body string, mode os.FileMode) {
		p := filepath.Join(dir, name)
		if err := os.MkdirAll(filepath.Dir(p), 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(p, []byte(body), mode); err != nil {
			t.Fatal(err)
		}
		if err := unix.Chmod(p, uint32(mode)); err != nil { // past the umask, setuid included
			t.Fatal(err)
		}
	}
	w("etc/passwd", "root:x:0:0::/root:/bin/sh\n", 0o644)
	w("etc/hosts.allow", "ALL: LOCAL\n", 0o644)
	w("etc/shadow", "root:*:1::::::\n", 0o640)
	w("etc/gone", "deleted by the sandbox\n", 0o644)
	w("usr/bin/tool", "#!/bin/sh\n", 0o755)
	w("usr/bin/suid", "setuid in the lower layer\n", 0o4755)
	w("usr/lib/libx.so", "library\n", 0o644)
	w("var/cache/big/a", "a", 0o644)
	w("var/cache/big/sub/b", "b", 0o644)
	w("opt/old/x", "old x", 0o644)
	w("opt/old/y/z", "old z", 0o644)
	w("srv/movefile", "moved\n", 0o644)
	w("srv/movedir/p", "p\n", 0o644)
	w("srv/movedir/q/r", "r\n", 0o600)
	w("data/hard1", "linked in the lower layer\n", 0o644)
	w("data/xattrs", "xattrs\n", 0o644)
	w("keep/unchanged", "unchanged\n", 0o644)
	w("excl/keep-below", "the lower layer's\n", 0o644)
	mustDo(t, os.Link(filepath.Join(dir, "data/hard1"), filepath.Join(dir, "data/hard2")))
	mustDo(t, os.Symlink("libx.so", filepath.Join(dir, "usr/lib/link")))
	mustDo(t, os.Chown(filepath.Join(dir, "etc/shadow"), 0, 42))
	mustDo(t, os.MkdirAll(filepath.Join(dir, "home/user"), 0o755))
	mustDo(t, os.Chown(filepath.Join(dir, "home/user"), 1000, 1000))
	mustDo(t, unix.Setxattr(filepath.Join(dir, "data/xattrs"), "user.lower", []byte("1"), 0))
	mustDo(t, unix.Setxattr(filepath.Join(dir, "data/xattrs"), "trusted.lower", []byte("2"), 0))
	old := time.Unix(1600000000, 123456789)
	mustDo(t, filepath.Walk(dir, func(p string, fi os.FileInfo, err error) error {
		if err != nil || fi.Mode()&os.ModeSymlink != 0 {
			return err
		}
		return os.Chtimes(p, old, old)
	}))
	return dir
}

func mustDo(t testing.TB, err error) {
	t.Helper()
	if err != nil {
		t.Fatal(err)
	}
}

// change makes, through the merged directory m of a sandbox's overlay,
// every kind of change a sandbox makes.
func change(t testing.TB, m string) {
	t.Helper()
	p := func(name string) string { return filepath.Join(m, name) }
	w := func(name, body string, mode os.FileMode) {
		if err := os.MkdirAll(filepath.Dir(p(name)), 0o755); err != nil {
			t.Fatal(err)
		}
		mustDo(t, os.WriteFile(p(name), []byte(body), mode))
		mustDo(t, unix.Chmod(p(name), uint32(mode))) // past the umask, setuid included
	}
	// New, modified and empty files.
	w("new.txt", "new\n", 0o644)
	w("empty", "", 0o600)
	f, err := os.OpenFile(p("etc/passwd"), os.O_APPEND|os.O_WRONLY, 0)
	mustDo(t, err)
	_, err = f.WriteString("user:x:1000:1000::/home/user:/bin/sh\n")
	mustDo(t, err)
	mustDo(t, f.Close())
	// Deletions (whiteouts), a directory replaced (opaque), renames.
	mustDo(t, os.Remove(p("etc/gone")))
	mustDo(t, os.RemoveAll(p("var/cache/big")))
	mustDo(t, os.RemoveAll(p("opt/old")))
	w("opt/old/fresh", "fresh\n", 0o644)
	mustDo(t, os.Rename(p("srv/movefile"), p("srv/moved")))
	// A lower directory cannot be renamed with redirect_dir off (EXDEV):
	// mv copies it and deletes the original.
	if err := os.Rename(p("srv/movedir"), p("srv/moveddir")); !errors.Is(err, unix.EXDEV) {
		t.Fatalf("rename of a lower directory: %v; want EXDEV (redirect_dir off)", err)
	}
	w("srv/moveddir/p", "p\n", 0o644)
	w("srv/moveddir/q/r", "r\n", 0o600)
	mustDo(t, os.RemoveAll(p("srv/movedir")))
	// Hard links (new ones, and one to a lower file), symlinks.
	w("links/a", "linked\n", 0o644)
	mustDo(t, os.Link(p("links/a"), p("links/b")))
	mustDo(t, os.Link(p("links/a"), p("links/c")))
	mustDo(t, os.Link(p("data/hard1"), p("data/hard3")))
	mustDo(t, os.Symlink("/etc/passwd", p("links/abs")))
	mustDo(t, os.Symlink("../new.txt", p("links/rel")))
	mustDo(t, os.Symlink("/nonexistent", p("links/dangling")))
	// Extended attributes of every namespace, one through overlayfs's
	// escape, and on a lower file (copied up).
	mustDo(t, unix.Setxattr(p("new.txt"), "user.new", []byte("1"), 0))
	mustDo(t, unix.Setxattr(p("new.txt"), "trusted.sandbox", []byte("yes"), 0))
	mustDo(t, unix.Setxattr(p("new.txt"), "security.dsectest", []byte("s"), 0))
	mustDo(t, unix.Setxattr(p("new.txt"), "trusted.overlay.mine", []byte("escaped"), 0))
	mustDo(t, unix.Setxattr(p("data/xattrs"), "user.lower", []byte("changed"), 0))
	mustDo(t, unix.Lsetxattr(p("links/abs"), "trusted.onlink", []byte("l"), 0))
	mustDo(t, unix.Setxattr(p("new.txt"), "system.posix_acl_access", aclUserReads(1000), 0))
	// Owners and modes: setuid, setgid, sticky; a lower file's owner.
	w("usr/local/bin/suidnew", "setuid\n", 0o4755)
	mustDo(t, os.Mkdir(p("shared"), 0o755))
	mustDo(t, unix.Chmod(p("shared"), 0o2775))
	mustDo(t, os.Mkdir(p("scratch"), 0o755))
	mustDo(t, unix.Chmod(p("scratch"), 0o1777))
	w("home/user/notes", "mine\n", 0o600)
	mustDo(t, os.Chown(p("home/user/notes"), 1000, 1000))
	mustDo(t, os.Chown(p("etc/hosts.allow"), 5, 5))
	// Odd names, a big sparse file, special files.
	for _, n := range oddNames {
		w("odd/"+n, n, 0o644)
	}
	sparse, err := os.Create(p("sparse"))
	mustDo(t, err)
	mustDo(t, sparse.Truncate(32<<20))
	_, err = sparse.WriteAt([]byte("tail"), 20<<20)
	mustDo(t, err)
	mustDo(t, sparse.Close())
	mustDo(t, os.MkdirAll(p("run"), 0o755))
	mustDo(t, unix.Mkfifo(p("run/fifo"), 0o600))
	mustDo(t, unix.Mknod(p("run/sock"), unix.S_IFSOCK|0o755, 0))
	mustDo(t, unix.Mknod(p("run/null"), unix.S_IFCHR|0o666, int(unix.Mkdev(1, 3))))
	// Build residue to exclude: a new file, and changes to a lower one.
	w("excl/residue/answers", "42\n", 0o644)
	w("excl/keep-below", "changed by the sandbox\n", 0o644)
	old := time.Unix(1500000000, 5)
	mustDo(t, os.Chtimes(p("new.txt"), old, old))
}

// aclUserReads is a POSIX access ACL (the kernel's xattr form) that lets
// uid read besides the owner, group and others of mode 0644.
func aclUserReads(uid uint32) []byte {
	b := binary.LittleEndian.AppendUint32(nil, 2) // version
	for _, e := range []struct {
		tag, perm uint16
		id        uint32
	}{{0x01, 6, ^uint32(0)}, {0x02, 4, uid}, {0x04, 4, ^uint32(0)}, {0x10, 4, ^uint32(0)}, {0x20, 4, ^uint32(0)}} {
		b = binary.LittleEndian.AppendUint16(b, e.tag)
		b = binary.LittleEndian.AppendUint16(b, e.perm)
		b = binary.LittleEndian.AppendUint32(b, e.id)
	}
	return b
}

// sandbox is a lower layer and an overlay upper on it, changed as a
// sandbox would.
type sandbox struct {
	lower, upper string
	want         map[string]obj // the merged view, less what a layer drops
	groups       [][]string     // its hard-link groups
}

// newSandbox builds the lower layer, mounts an overlay with its upper and
// work dirs under dir, makes the changes, records the merged view and
// unmounts it.
func newSandbox(t testing.TB, dir string) *sandbox {
	t.Helper()
	sb := &sandbox{lower: layerOf(t, lowerTree(t)), upper: filepath.Join(dir, "upper")}
	work := filepath.Join(dir, "work")
	mustDo(t, os.MkdirAll(sb.upper, 0o755))
	mustDo(t, os.MkdirAll(work, 0o755))
	merged, unmount := overlay(t, []string{sb.lower}, sb.upper, work)
	change(t, merged)
	sb.want = describe(t, merged)
	for _, gone := range []string{"run/sock", "run/null", "excl/residue", "excl/residue/answers"} {
		delete(sb.want, gone)
	}
	sb.want["excl/keep-below"] = obj{}
	sb.groups = linkGroups(t, merged)
	unmount()
	// Whiteouts that hide nothing below (as a stale upper could hold): in
	// a directory only the upper has, and at the root.
	for _, p := range []string{"links/ghost", "ghost"} {
		whiteoutKeepingMtime(t, filepath.Join(sb.upper, p))
	}
	return sb
}

// whiteoutKeepingMtime makes the whiteout p, leaving its directory's times.
func whiteoutKeepingMtime(t testing.TB, p string) {
	t.Helper()
	var st unix.Stat_t
	mustDo(t, unix.Stat(filepath.Dir(p), &st))
	mustDo(t, unix.Mknod(p, unix.S_IFCHR, 0))
	mustDo(t, unix.UtimesNano(filepath.Dir(p), []unix.Timespec{st.Atim, st.Mtim}))
}

// TestCaptureAndPack captures a changed upper with each method, packs it
// and stacks the layer on the sandbox's lower layer: the view is the
// sandbox's, object by object.
func TestCaptureAndPack(t *testing.T) {
	needRoot(t)
	for _, tc := range []struct {
		method Method
		fs     func(t *testing.T) (upperParent, captureDir string)
	}{
		{MethodCopy, func(t *testing.T) (string, string) { return t.TempDir(), t.TempDir() }},
		{MethodReflink, func(t *testing.T) (string, string) {
			mnt := btrfsFS(t, 512<<20)
			return filepath.Join(mnt, "plain"), mnt
		}},
		{MethodBtrfs, func(t *testing.T) (string, string) {
			mnt := btrfsFS(t, 512<<20)
			return subvolume(t, filepath.Join(mnt, "sb-1")), mnt
		}},
	} {
		t.Run(string(tc.method), func(t *testing.T) {
			upperParent, captures := tc.fs(t)
			sb := newSandbox(t, upperParent)
			rawUpper := describe(t, sb.upper)
			upperGroups := linkGroups(t, sb.upper)

			tree, err := Capture(context.Background(), sb.upper, filepath.Join(captures, "capture"))
			if err != nil {
				t.Fatal(err)
			}
			defer func() {
				if err := tree.Remove(); err != nil {
					t.Errorf("Remove: %v", err)
				}
				if _, err := os.Lstat(filepath.Join(captures, "capture")); !errors.Is(err, os.ErrNotExist) {
					t.Errorf("capture after Remove: %v", err)
				}
			}()
			if tree.Method != tc.method {
				t.Errorf("captured by %s; want %s", tree.Method, tc.method)
			}
			t.Logf("captured %d entries, %d bytes by %s in %v", tree.Entries, tree.Bytes, tree.Method, tree.Took)
			// The capture holds the upper as it was: every object, special
			// files and overlayfs's xattrs included, and the links.
			if diff := cmp.Diff(rawUpper, describe(t, tree.Dir)); diff != "" {
				t.Errorf("capture differs from the upper (-upper +capture):\n%s", diff)
			}
			if diff := cmp.Diff(upperGroups, linkGroups(t, tree.Dir)); diff != "" {
				t.Errorf("hard links of the capture (-upper +capture):\n%s", diff)
			}
			whiteoutLinks := false
			for _, g := range upperGroups {
				whiteoutLinks = whiteoutLinks || rawUpper[g[0]].Type == "char" && rawUpper[g[0]].Rdev == 0
			}
			if !whiteoutLinks {
				t.Error("the upper holds no whiteouts sharing an inode: overlayfs makes them so, and the capture must keep them linked")
			}

			out := filepath.Join(t.TempDir(), "snap.erofs")
			packed, err := Pack(context.Background(), tree, out, PackOptions{
				Lower:   []string{sb.lower},
				Exclude: []string{"/excl/residue", "/excl/keep-below", "/not/there", "/links/abs/through-a-symlink"},
			})
			if err != nil {
				t.Fatal(err)
			}
			t.Logf("packed %d entries, %d content bytes into %d bytes in %v (mkfs %v); pruned %+v, stripped %d xattrs",
				packed.Entries, packed.ContentBytes, packed.Size, packed.Took, packed.Build, packed.Pruned, packed.StrippedXattrs)
			if packed.Pruned.Whiteouts != 2 {
				t.Errorf("pruned %d whiteouts; want the 2 that hide nothing", packed.Pruned.Whiteouts)
			}
			if strings.Join(packed.Excluded, " ") != "/excl/residue /excl/keep-below" {
				t.Errorf("excluded %q; want the two paths the upper held", packed.Excluded)
			}
			if w := strings.Join(packed.Warnings, "\n"); !strings.Contains(w, `1 sockets ("/run/sock")`) || !strings.Contains(w, `1 device nodes ("/run/null")`) {
				t.Errorf("warnings %q; want the socket and the device node named", packed.Warnings)
			}
			for p, o := range describe(t, tree.Dir) {
				for k := range o.Xattrs {
					if strings.HasPrefix(k, overlayPrefix) && k != "trusted.overlay.opaque" && !strings.HasPrefix(k, overlayPrefix+"overlay.") {
						t.Errorf("%q keeps %s", p, k)
					}
				}
			}

			merged, _ := overlay(t, []string{sb.lower, mountLayer(t, out)}, "", "")
			testutil.CheckListable(t, merged)
			got := describe(t, merged)
			if o, ok := got["excl/keep-below"]; !ok || o.Sum != sumOf(t, filepath.Join(sb.lower, "excl/keep-below")) {
				t.Errorf("excluded excl/keep-below = %+v, %v; want the lower layer's", o, ok)
			}
			got["excl/keep-below"] = obj{}
			if diff := cmp.Diff(sb.want, got); diff != "" {
				t.Errorf("restored view differs from the sandbox's (-sandbox +restored):\n%s", diff)
			}
			if diff := cmp.Diff(sb.groups, linkGroups(t, merged)); diff != "" {
				t.Errorf("hard links of the restored view (-sandbox +restored):\n%s", diff)
			}
		})
	}
}

// TestCaptureElsewhere captures a btrfs subvolume's upper onto other file
// systems: the walk copies it.
func TestCaptureElsewhere(t *testing.T) {
	needRoot(t)
	upper := smallTree(t, filepath.Join(subvolume(t, filepath.Join(btrfsFS(t, 256<<20), "sb-1")), "upper"), 1<<10)
	for name, dir := range map[string]string{"ext4": t.TempDir(), "tmpfs": tmpfs(t, 1<<20), "another btrfs": btrfsFS(t, 256<<20)} {
		tree, err := Capture(context.Background(), upper, filepath.Join(dir, "capture"))
		if err != nil {
			t.Errorf("capture onto %s: %v", name, err)
			continue
		}
		if tree.Method != MethodCopy {
			t.Errorf("capture onto %s by %s; want %s", name, tree.Method, MethodCopy)
		}
		if diff := cmp.Diff(describe(t, upper), describe(t, tree.Dir)); diff != "" {
			t.Errorf("capture onto %s differs (-upper +capture):\n%s", name, diff)
		}
		mustDo(t, tree.Remove())
	}
}

// smallTree writes a few files, size bytes in all, under dir.
func smallTree(t testing.TB, dir string, size int) string {
	t.Helper()
	mustDo(t, os.MkdirAll(filepath.Join(dir, "sub"), 0o755))
	mustDo(t, os.WriteFile(filepath.Join(dir, "sub/big"), make([]byte, size), 0o644))
	mustDo(t, os.WriteFile(filepath.Join(dir, "small"), []byte("small\n"), 0o644))
	return dir
}

func TestCaptureFailureLeavesNothing(t *testing.T) {
	needRoot(t)
	upper := smallTree(t, t.TempDir(), 4<<20)
	full := tmpfs(t, 1<<20)
	for _, tc := range []struct {
		name string
		ctx  func() context.Context
		dst  string
		kind error
	}{
		{"destination full", context.Background, filepath.Join(full, "capture"), errdefs.ErrResourceExhausted},
		{"cancelled", func() context.Context {
			ctx, cancel := context.WithCancel(context.Background())
			cancel()
			return ctx
		}, filepath.Join(t.TempDir(), "capture"), context.Canceled},
		{"destination exists", context.Background, t.TempDir(), errdefs.ErrAlreadyExists},
		{"no parent", context.Background, filepath.Join(t.TempDir(), "missing", "capture"), os.ErrNotExist},
	} {
		t.Run(tc.name, func(t *testing.T) {
			before, _ := os.ReadDir(filepath.Dir(tc.dst))
			tree, err := Capture(tc.ctx(), upper, tc.dst)
			if !errors.Is(err, tc.kind) {
				t.Fatalf("Capture: %v, %v; want %v", tree, err, tc.kind)
			}
			if after, _ := os.ReadDir(filepath.Dir(tc.dst)); len(after) != len(before) {
				t.Errorf("Capture left %d entries in %s (had %d)", len(after), filepath.Dir(tc.dst), len(before))
			}
		})
	}
	// A cancellation noticed midway removes what was copied so far.
	many := t.TempDir()
	for i := range 3000 {
		mustDo(t, os.WriteFile(filepath.Join(many, "f"+strconv.Itoa(i)), []byte("x"), 0o644))
	}
	dst := filepath.Join(t.TempDir(), "capture")
	ctx := &cancelAfter{Context: context.Background(), checks: 2}
	if _, err := Capture(ctx, many, dst); !errors.Is(err, context.Canceled) {
		t.Errorf("Capture cancelled midway: %v; want context canceled", err)
	}
	if ctx.checks > 0 {
		t.Errorf("Capture looked at its context %d times fewer than the test needs", ctx.checks)
	}
	if _, err := os.Lstat(dst); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("a cancelled capture left %s: %v", dst, err)
	}
}

// cancelAfter is a context that is cancelled once Err has said it was not
// checks times.
type cancelAfter struct {
	context.Context
	checks int
}

func (c *cancelAfter) Err() error {
	if c.checks--; c.checks < 0 {
		return context.Canceled
	}
	return nil
}

// TestSnapshotOfFullDisk captures and packs an upper whose file system a
// sandbox filled.
func TestSnapshotOfFullDisk(t *testing.T) {
	needRoot(t)
	lower := layerOf(t, smallTree(t, t.TempDir(), 1<<10))
	fs := tmpfs(t, 8<<20)
	upper, work := filepath.Join(fs, "upper"), filepath.Join(fs, "work")
	mustDo(t, os.Mkdir(upper, 0o755))
	mustDo(t, os.Mkdir(work, 0o755))
	merged, unmount := overlay(t, []string{lower}, upper, work)
	f, err := os.Create(filepath.Join(merged, "fill"))
	mustDo(t, err)
	chunk := make([]byte, 64<<10)
	for i := range chunk {
		chunk[i] = byte(i)
	}
	for err == nil {
		_, err = f.Write(chunk)
	}
	if !errors.Is(err, unix.ENOSPC) {
		t.Fatalf("filling the upper: %v; want ENOSPC", err)
	}
	f.Close()
	mustDo(t, os.Remove(filepath.Join(merged, "small"))) // a whiteout, with no space left
	want := describe(t, merged)
	unmount()

	tree, err := Capture(context.Background(), upper, filepath.Join(t.TempDir(), "capture"))
	if err != nil {
		t.Fatal(err)
	}
	defer tree.Remove()
	out := filepath.Join(t.TempDir(), "snap.erofs")
	if _, err := Pack(context.Background(), tree, out, PackOptions{Lower: []string{lower}}); err != nil {
		t.Fatal(err)
	}
	restored, _ := overlay(t, []string{lower, mountLayer(t, out)}, "", "")
	if diff := cmp.Diff(want, describe(t, restored)); diff != "" {
		t.Errorf("restored view differs (-sandbox +restored):\n%s", diff)
	}
}

func TestPackRefuses(t *testing.T) {
	needRoot(t)
	capture := func(t *testing.T, upper string) *Tree {
		tree, err := Capture(context.Background(), upper, filepath.Join(t.TempDir(), "capture"))
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { tree.Remove() })
		return tree
	}
	t.Run("exclude paths outside the sandbox", func(t *testing.T) {
		tree := capture(t, smallTree(t, t.TempDir(), 10))
		before := describe(t, tree.Dir)
		for _, p := range []string{"../x", "small", "", "/", "/sub/../../x", "/a/../b", "/x\x00y", "./small"} {
			out := filepath.Join(t.TempDir(), "snap.erofs")
			if _, err := Pack(context.Background(), tree, out, PackOptions{Exclude: []string{"/small", p}}); !errors.Is(err, errdefs.ErrInvalidArgument) {
				t.Errorf("exclude %q: %v; want invalid argument", p, err)
			}
			if _, err := os.Lstat(out); !errors.Is(err, os.ErrNotExist) {
				t.Errorf("exclude %q: %s left: %v", p, out, err)
			}
		}
		if diff := cmp.Diff(before, describe(t, tree.Dir)); diff != "" {
			t.Errorf("a refused Pack changed the tree:\n%s", diff)
		}
	})
	t.Run("redirect", func(t *testing.T) {
		upper := smallTree(t, t.TempDir(), 10)
		mustDo(t, unix.Setxattr(filepath.Join(upper, "sub"), "trusted.overlay.redirect", []byte("/elsewhere"), 0))
		out := filepath.Join(t.TempDir(), "snap.erofs")
		_, err := Pack(context.Background(), capture(t, upper), out, PackOptions{})
		if !errors.Is(err, errdefs.ErrFailedPrecondition) || !strings.Contains(err.Error(), "redirect_dir") {
			t.Errorf("Pack of an upper with a redirect: %v; want failed precondition naming redirect_dir", err)
		}
		if _, err := os.Lstat(out); !errors.Is(err, os.ErrNotExist) {
			t.Errorf("%s left: %v", out, err)
		}
	})
	t.Run("a name mkfs.erofs cannot store", func(t *testing.T) {
		upper := smallTree(t, t.TempDir(), 10)
		long := strings.Repeat("l", 255)
		mustDo(t, os.WriteFile(filepath.Join(upper, "sub", long), nil, 0o644))
		_, err := Pack(context.Background(), capture(t, upper), filepath.Join(t.TempDir(), "snap.erofs"), PackOptions{})
		if !errors.Is(err, errdefs.ErrFailedPrecondition) || !strings.Contains(err.Error(), "/sub/"+long) {
			t.Errorf("Pack of a 255-byte name: %v; want failed precondition naming it", err)
		}
	})
	t.Run("too big, then again", func(t *testing.T) {
		tree := capture(t, smallTree(t, t.TempDir(), 2<<20))
		out := filepath.Join(t.TempDir(), "snap.erofs")
		if _, err := Pack(context.Background(), tree, out, PackOptions{MaxBytes: 1 << 20}); !errors.Is(err, errdefs.ErrResourceExhausted) {
			t.Errorf("Pack over MaxBytes: %v; want resource exhausted", err)
		}
		if _, err := Pack(context.Background(), tree, out, PackOptions{MaxEntries: 2}); !errors.Is(err, errdefs.ErrResourceExhausted) {
			t.Errorf("Pack over MaxEntries: %v; want resource exhausted", err)
		}
		if _, err := Pack(context.Background(), tree, filepath.Join(tmpfs(t, 1<<20), "snap.erofs"), PackOptions{}); !errors.Is(err, errdefs.ErrResourceExhausted) {
			t.Errorf("Pack onto a small file system: %v; want resource exhausted", err)
		}
		if _, err := Pack(context.Background(), tree, out, PackOptions{}); err != nil {
			t.Fatalf("Pack again: %v", err)
		}
		if _, err := Pack(context.Background(), tree, out, PackOptions{}); !errors.Is(err, errdefs.ErrAlreadyExists) {
			t.Errorf("Pack onto an existing file: %v; want already exists", err)
		}
	})
}

package fuse2fs_test

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"dsec.dev/dsec/internal/edge/snapshot"
	"dsec.dev/dsec/internal/errdefs"
	"dsec.dev/dsec/internal/testutil"
	"dsec.dev/dsec/internal/vm/fuse2fs"
)

// TestMain runs as libfuse's fusermount when fuse2fs runs this binary so
// (package doc).
func TestMain(m *testing.M) {
	if fuse2fs.IsFusermount(os.Args[0]) {
		os.Exit(fuse2fs.Fusermount(os.Args))
	}
	os.Exit(m.Run())
}

func requireFuse2fs(t testing.TB) {
	t.Helper()
	testutil.RequireRoot(t)
	for _, c := range []string{"fuse2fs", "mkfs.ext4", "debugfs", "unshare", "setpriv", "prlimit"} {
		testutil.RequireCommand(t, c)
	}
}

// makeUpper writes an overlay upper dir as a guest's overlayfs leaves it
// in dir/upper: files owned by others, a hard link, a symlink, a symlink
// loop, a whiteout (a 0/0 character device), an opaque dir
// (trusted.overlay.opaque), a user xattr and a huge sparse file.
func makeUpper(t *testing.T, dir string) {
	t.Helper()
	up := filepath.Join(dir, "upper")
	must := func(err error) {
		t.Helper()
		if err != nil {
			t.Fatal(err)
		}
	}
	must(os.MkdirAll(filepath.Join(up, "opaque"), 0o755))
	must(os.WriteFile(filepath.Join(up, "file"), []byte("hello"), 0o640))
	must(os.Lchown(filepath.Join(up, "file"), 1234, 5678))
	must(os.Link(filepath.Join(up, "file"), filepath.Join(up, "link")))
	must(os.Symlink("file", filepath.Join(up, "sym")))
	must(os.Symlink("loop", filepath.Join(up, "loop")))
	must(unix.Mknod(filepath.Join(up, "gone"), unix.S_IFCHR|0o000, 0))
	must(unix.Setxattr(filepath.Join(up, "opaque"), "trusted.overlay.opaque", []byte("y"), 0))
	must(unix.Setxattr(filepath.Join(up, "file"), "user.note", []byte("kept"), 0))
	must(os.WriteFile(filepath.Join(up, "opaque", "inside"), bytes.Repeat([]byte("x"), 100000), 0o600))
	f, err := os.Create(filepath.Join(up, "sparse"))
	must(err)
	must(f.Truncate(1 << 40))
	must(f.Close())
}

func makeImage(t *testing.T, features string) string {
	t.Helper()
	src := t.TempDir()
	makeUpper(t, src)
	img := filepath.Join(t.TempDir(), "disk.ext4")
	args := []string{"-q", "-F", "-m", "0", "-b", "4096", "-d", src}
	if features != "" {
		args = append(args, "-O", features)
	}
	args = append(args, img, "64M")
	if out, err := exec.Command("mkfs.ext4", args...).CombinedOutput(); err != nil {
		t.Fatalf("mkfs.ext4: %v: %s", err, out)
	}
	return img
}

func mount(t *testing.T, img string) (*fuse2fs.Mounted, string, error) {
	t.Helper()
	dir := t.TempDir()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	m, err := fuse2fs.Mount(ctx, img, dir, fuse2fs.Options{Timeout: 30 * time.Second, CPUSeconds: 20})
	if err == nil {
		t.Cleanup(func() { m.Unmount() })
	}
	return m, dir, err
}

// TestMount: the tree fuse2fs serves is the image's as the host's ext4
// would show it (owners, modes, hard links, symlinks, whiteouts, xattrs
// in trusted.* and user.*), its journal replayed; it can be edited as package snapshot does;
// Unmount leaves nothing mounted or running.
func TestMount(t *testing.T) {
	requireFuse2fs(t)
	img := makeImage(t, "")
	// As a guest's disk frozen mid-use: its journal needs replaying
	// (fuse2fs 1.47.0's own replay crashed on such a disk).
	if out, err := exec.Command("debugfs", "-w", "-R", "feature needs_recovery", img).CombinedOutput(); err != nil {
		t.Fatalf("debugfs: %v: %s", err, out)
	}
	m, dir, err := mount(t, img)
	if err != nil {
		t.Fatal(err)
	}
	up := filepath.Join(dir, "upper")
	var st, lst unix.Stat_t
	if err := unix.Lstat(filepath.Join(up, "file"), &st); err != nil || st.Uid != 1234 || st.Gid != 5678 || st.Mode != unix.S_IFREG|0o640 || st.Nlink != 2 {
		t.Errorf("file: %+v, %v", st, err)
	}
	if err := unix.Lstat(filepath.Join(up, "link"), &lst); err != nil || lst.Ino != st.Ino {
		t.Errorf("a hard link's inode %d, the file's %d: %v", lst.Ino, st.Ino, err)
	}
	if b, err := os.ReadFile(filepath.Join(up, "link")); err != nil || string(b) != "hello" {
		t.Errorf("link: %q, %v", b, err)
	}
	if l, err := os.Readlink(filepath.Join(up, "sym")); err != nil || l != "file" {
		t.Errorf("sym: %q, %v", l, err)
	}
	if err := unix.Lstat(filepath.Join(up, "gone"), &st); err != nil || st.Mode&unix.S_IFMT != unix.S_IFCHR || st.Rdev != 0 {
		t.Errorf("whiteout: %+v, %v", st, err)
	}
	for _, x := range []struct{ path, name, want string }{
		{"opaque", "trusted.overlay.opaque", "y"}, {"file", "user.note", "kept"},
	} {
		buf := make([]byte, 64)
		n, err := unix.Lgetxattr(filepath.Join(up, x.path), x.name, buf)
		if err != nil || string(buf[:n]) != x.want {
			t.Errorf("%s's %s: %q, %v", x.path, x.name, buf[:max(n, 0)], err)
		}
	}
	if fi, err := os.Lstat(filepath.Join(up, "sparse")); err != nil || fi.Size() != 1<<40 {
		t.Errorf("sparse: %v, %v", fi, err)
	}
	// package snapshot's edits: an xattr removed, a file unlinked, times set.
	if err := unix.Lremovexattr(filepath.Join(up, "opaque"), "trusted.overlay.opaque"); err != nil {
		t.Errorf("removexattr: %v", err)
	}
	if err := os.Remove(filepath.Join(up, "gone")); err != nil {
		t.Errorf("unlink: %v", err)
	}
	if err := os.Chtimes(up, time.Unix(1, 0), time.Unix(2, 0)); err != nil {
		t.Errorf("utimes: %v", err)
	}
	if err := m.Unmount(); err != nil {
		t.Fatal(err)
	}
	assertGone(t, dir)
}

// assertGone: nothing is mounted on dir and no fuse2fs serves it.
func assertGone(t *testing.T, dir string) {
	t.Helper()
	b, err := os.ReadFile("/proc/self/mountinfo")
	if err != nil {
		t.Fatal(err)
	}
	if strings.Contains(string(b), " "+dir+" ") {
		t.Errorf("%s is still mounted", dir)
	}
	if out, _ := exec.Command("pgrep", "-f", "fuse2fs /proc/self/fd").Output(); len(out) > 0 {
		t.Errorf("fuse2fs still runs: %s", out)
	}
}

// TestHostileImages: images corrupted where a parser looks (the
// superblock, the inode of the upper dir, its directory block, the inode
// table past it), with and without metadata checksums (a guest can compute
// them), are refused with fuse2fs's words or served as a tree whose walk
// ends (errors allowed): a symlink loop and a 1 TiB sparse file among it.
// Every case leaves nothing mounted or running.
func TestHostileImages(t *testing.T) {
	requireFuse2fs(t)
	for _, features := range []string{"", "^metadata_csum"} {
		img := makeImage(t, features)
		targets := locate(t, img)
		for _, tg := range targets {
			for seed := range 3 {
				name := fmt.Sprintf("%s/%s/%d", strings.TrimPrefix(cmpName(features), "^"), tg.name, seed)
				t.Run(name, func(t *testing.T) {
					bad := filepath.Join(t.TempDir(), "bad.ext4")
					copyFile(t, img, bad)
					corrupt(t, bad, tg.off+int64(seed*tg.span/3), 8, byte(0x55*(seed+1)))
					m, dir, err := mount(t, bad)
					if err != nil {
						t.Logf("refused: %v", err)
						assertGone(t, dir)
						return
					}
					n, werr := walk(dir)
					t.Logf("served: %d entries walked, first error %v", n, werr)
					if err := m.Unmount(); err != nil {
						t.Error(err)
					}
					assertGone(t, dir)
				})
			}
		}
	}
}

func cmpName(features string) string {
	if features == "" {
		return "csum"
	}
	return "nocsum"
}

type target struct {
	name string
	off  int64
	span int // bytes the seeds spread over
}

// locate finds, with debugfs, where the image keeps its superblock, the
// upper dir's inode, its directory block and the inode table after it.
func locate(t *testing.T, img string) []target {
	t.Helper()
	debugfs := func(req string) string {
		out, err := exec.Command("debugfs", "-R", req, img).CombinedOutput()
		if err != nil {
			t.Fatalf("debugfs %s: %v: %s", req, err, out)
		}
		return string(out)
	}
	const block = 4096
	imap := regexp.MustCompile(`located at block (\d+), offset 0x([0-9a-f]+)`).FindStringSubmatch(debugfs("imap /upper"))
	blocks := regexp.MustCompile(`\(0\):(\d+)`).FindStringSubmatch(debugfs("stat /upper"))
	if imap == nil || blocks == nil {
		t.Fatalf("debugfs: no inode or block of /upper")
	}
	ib, _ := strconv.ParseInt(imap[1], 10, 64)
	io, _ := strconv.ParseInt(imap[2], 16, 64)
	db, _ := strconv.ParseInt(blocks[1], 10, 64)
	return []target{
		{"superblock", 1024, 256},
		{"upper-inode", ib*block + io, 160},
		{"upper-dirblock", db * block, 256},
		{"inode-table", ib*block + io + 256, 2048},
	}
}

func copyFile(t *testing.T, src, dst string) {
	t.Helper()
	b, err := os.ReadFile(src)
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(dst, b, 0o600); err != nil {
		t.Fatal(err)
	}
}

func corrupt(t *testing.T, path string, off int64, n int, x byte) {
	t.Helper()
	f, err := os.OpenFile(path, os.O_RDWR, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	b := make([]byte, n)
	if _, err := f.ReadAt(b, off); err != nil {
		t.Fatal(err)
	}
	for i := range b {
		b[i] ^= x
	}
	if _, err := f.WriteAt(b, off); err != nil {
		t.Fatal(err)
	}
}

// walk visits the tree as Pack does (no symlink followed), reading at most
// 1 MiB of each file and every xattr; it returns what it saw and the first
// error.
func walk(root string) (int, error) {
	var n int
	var first error
	note := func(err error) {
		if first == nil && err != nil {
			first = err
		}
	}
	err := filepath.WalkDir(root, func(p string, d fs.DirEntry, err error) error {
		n++
		if err != nil {
			note(err)
			return nil
		}
		buf := make([]byte, 4096)
		if _, err := unix.Llistxattr(p, buf); err != nil && !errors.Is(err, unix.ENOTSUP) {
			note(err)
		}
		if d.Type().IsRegular() {
			f, err := os.Open(p)
			if err != nil {
				note(err)
				return nil
			}
			_, err = io.Copy(io.Discard, io.LimitReader(f, 1<<20))
			note(err)
			f.Close()
		}
		return nil
	})
	note(err)
	return n, first
}

// TestDeadline: a fuse2fs that blocks without spinning (stopped: no
// rlimit of CPU time catches it) does not hang its reader past the
// mount's deadline: the FUSE connection is aborted through fusectl, a
// pack waiting on the mount fails with an error that says why, and
// Unmount leaves nothing running.
func TestDeadline(t *testing.T) {
	requireFuse2fs(t)
	img := makeImage(t, "")
	dir := t.TempDir()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	const deadline = 3 * time.Second
	m, err := fuse2fs.Mount(ctx, img, dir, fuse2fs.Options{Timeout: 30 * time.Second, CPUSeconds: 20, Deadline: deadline})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { m.Unmount() })
	if err := fuse2fs.Stop(m); err != nil {
		t.Fatalf("stop fuse2fs: %v", err)
	}
	tree := snapshot.NewTree(filepath.Join(dir, "upper"), snapshot.MethodDiskClone, 0, func() error { return nil })
	tree.Broken = m.Aborted
	packed := make(chan error, 1)
	go func() {
		_, err := snapshot.Pack(context.Background(), tree, filepath.Join(t.TempDir(), "layer.erofs"), snapshot.PackOptions{})
		packed <- err
	}()
	select {
	case err = <-packed:
	case <-time.After(2 * time.Minute):
		t.Fatalf("a pack of a mount whose fuse2fs blocks still waits 2 min on, past its deadline of %s", deadline)
	}
	if !errors.Is(err, errdefs.ErrDeadlineExceeded) || !strings.Contains(err.Error(), "FUSE connection was aborted") {
		t.Errorf("a pack of a mount whose fuse2fs blocks: %v; want the deadline's abort named", err)
	}
	if a := m.Aborted(); a == nil || strings.Contains(a.Error(), "killed instead") {
		t.Errorf("Aborted: %v; want the connection aborted through fusectl", a)
	}
	if err := m.Unmount(); err != nil {
		t.Errorf("Unmount: %v", err)
	}
	var st unix.Statfs_t
	if err := unix.Statfs(dir, &st); err != nil || st.Type == unix.FUSE_SUPER_MAGIC {
		t.Errorf("after Unmount, %s is still a FUSE mount (statfs: %v)", dir, err)
	}
}

package snapshot

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"io"
	"io/fs"
	"os"
	"os/exec"
	"path/filepath"
	"sort"
	"strconv"
	"strings"
	"testing"

	"golang.org/x/sys/unix"

	"dsec.dev/dsec/internal/edge/image"
	"dsec.dev/dsec/internal/testutil"
)

// needRoot gates tests that mount, mknod and set trusted.* xattrs.
func needRoot(t testing.TB) {
	t.Helper()
	testutil.RequireRoot(t)
	testutil.RequireCommand(t, "mkfs.erofs")
}

// mountAt mounts and unmounts at cleanup (before the directories go).
func mountAt(t testing.TB, source, target, fstype string, flags uintptr, data string) {
	t.Helper()
	if err := os.MkdirAll(target, 0o755); err != nil {
		t.Fatal(err)
	}
	if err := unix.Mount(source, target, fstype, flags, data); err != nil {
		t.Fatalf("mount %s %s on %s (%s): %v", fstype, source, target, data, err)
	}
	t.Cleanup(func() {
		if err := unix.Unmount(target, 0); err != nil {
			t.Errorf("unmount %s: %v", target, err)
		}
	})
}

// layerOf builds an EROFS layer of the tree at dir, as the layer store
// does, and returns where it is mounted.
func layerOf(t testing.TB, dir string) string {
	t.Helper()
	file := filepath.Join(t.TempDir(), "layer.erofs")
	if _, _, err := image.BuildLayerFile(context.Background(), dir, file); err != nil {
		t.Fatal(err)
	}
	return mountLayer(t, file)
}

// mountLayer mounts an EROFS layer file read-only and returns where.
func mountLayer(t testing.TB, file string) string {
	t.Helper()
	mnt := filepath.Join(t.TempDir(), "mnt")
	mountAt(t, file, mnt, "erofs", unix.MS_RDONLY|unix.MS_NODEV, "")
	return mnt
}

// overlay mounts lower (bottom first) under upper and work, or read-only
// without upper, and returns the merged directory. unmount unmounts it
// early; cleanup does so otherwise.
func overlay(t testing.TB, lower []string, upper, work string) (merged string, unmount func()) {
	t.Helper()
	top := make([]string, len(lower))
	for i, l := range lower {
		top[len(lower)-1-i] = l
	}
	if upper == "" && len(top) == 1 {
		// Without an upper dir overlayfs wants two lower ones.
		top = append(top, t.TempDir())
	}
	merged = filepath.Join(t.TempDir(), "merged")
	if err := os.Mkdir(merged, 0o755); err != nil {
		t.Fatal(err)
	}
	opts, flags := "lowerdir="+strings.Join(top, ":"), uintptr(unix.MS_RDONLY)
	if upper != "" {
		opts += ",upperdir=" + upper + ",workdir=" + work
		flags = 0
	}
	if err := unix.Mount("overlay", merged, "overlay", flags, opts); err != nil {
		t.Fatalf("mount overlay %s: %v", opts, err)
	}
	mounted := true
	unmount = func() {
		if mounted {
			mounted = false
			if err := unix.Unmount(merged, 0); err != nil {
				t.Errorf("unmount overlay %s: %v", merged, err)
			}
		}
	}
	t.Cleanup(unmount)
	return merged, unmount
}

// btrfsFS makes a btrfs file system of size bytes on a loop device and
// returns where it is mounted; it is gone at cleanup.
func btrfsFS(t testing.TB, size int64) string {
	t.Helper()
	testutil.RequireCommand(t, "mkfs.btrfs")
	dir := t.TempDir()
	img := filepath.Join(dir, "btrfs.img")
	f, err := os.Create(img)
	if err != nil {
		t.Fatal(err)
	}
	if err := f.Truncate(size); err != nil {
		t.Fatal(err)
	}
	f.Close()
	if out, err := exec.Command("mkfs.btrfs", "-q", "-f", img).CombinedOutput(); err != nil {
		t.Fatalf("mkfs.btrfs: %v: %s", err, out)
	}
	mnt := filepath.Join(dir, "mnt")
	if err := os.Mkdir(mnt, 0o755); err != nil {
		t.Fatal(err)
	}
	// mount(8) sets up the loop device and frees it at unmount.
	if out, err := exec.Command("mount", "-t", "btrfs", "-o", "loop", img, mnt).CombinedOutput(); err != nil {
		t.Fatalf("mount btrfs: %v: %s", err, out)
	}
	t.Cleanup(func() {
		if err := unix.Unmount(mnt, 0); err != nil {
			t.Errorf("unmount btrfs: %v", err)
		}
	})
	return mnt
}

// subvolume makes the btrfs subvolume dir.
func subvolume(t testing.TB, dir string) string {
	t.Helper()
	testutil.RequireCommand(t, "btrfs")
	if out, err := exec.Command("btrfs", "-q", "subvolume", "create", dir).CombinedOutput(); err != nil {
		t.Fatalf("btrfs subvolume create %s: %v: %s", dir, err, out)
	}
	return dir
}

// tmpfs mounts a tmpfs of size bytes and returns where.
func tmpfs(t testing.TB, size int64) string {
	t.Helper()
	mnt := filepath.Join(t.TempDir(), "tmpfs")
	mountAt(t, "tmpfs", mnt, "tmpfs", 0, "size="+strconv.FormatInt(size, 10))
	return mnt
}

// obj is what a test compares of one object in a tree.
type obj struct {
	Type   string
	Perm   uint32 // permission, setuid, setgid and sticky bits
	UID    uint32
	GID    uint32
	Size   int64
	Sum    string // sha256 of a regular file's content
	Target string // a symlink's
	Rdev   uint64
	Mtime  int64
	Xattrs map[string]string
}

// describe records every object under dir (not dir itself), keyed by path
// from dir. Through overlayfs the private xattrs are hidden already; on a
// raw tree they are kept.
func describe(t testing.TB, dir string) map[string]obj {
	t.Helper()
	out := map[string]obj{}
	err := filepath.WalkDir(dir, func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		rel, _ := filepath.Rel(dir, p)
		var st unix.Stat_t
		if err := unix.Lstat(p, &st); err != nil {
			return err
		}
		o := obj{Perm: st.Mode &^ unix.S_IFMT, UID: st.Uid, GID: st.Gid, Mtime: st.Mtim.Nano(), Xattrs: xattrsOf(t, p)}
		switch st.Mode & unix.S_IFMT {
		case unix.S_IFDIR:
			o.Type = "dir"
		case unix.S_IFREG:
			o.Type, o.Size, o.Sum = "file", st.Size, sumOf(t, p)
		case unix.S_IFLNK:
			o.Type = "symlink"
			if o.Target, err = os.Readlink(p); err != nil {
				return err
			}
			o.Perm = 0 // not kept by every file system
		case unix.S_IFCHR:
			o.Type, o.Rdev = "char", st.Rdev
		case unix.S_IFBLK:
			o.Type, o.Rdev = "block", st.Rdev
		case unix.S_IFIFO:
			o.Type = "fifo"
		case unix.S_IFSOCK:
			o.Type = "socket"
		}
		if rel != "." {
			out[rel] = o
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	return out
}

func sumOf(t testing.TB, p string) string {
	t.Helper()
	f, err := os.Open(p)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	h := sha256.New()
	if _, err := io.Copy(h, f); err != nil {
		t.Fatal(err)
	}
	return hex.EncodeToString(h.Sum(nil))
}

func xattrsOf(t testing.TB, p string) map[string]string {
	t.Helper()
	names, err := listXattrs(object{path: p})
	if err != nil {
		t.Fatalf("%s: %v", p, err)
	}
	if len(names) == 0 {
		return nil
	}
	m := map[string]string{}
	for _, n := range names {
		v, err := getXattr(object{path: p}, n)
		if err != nil {
			t.Fatalf("%s: %v", p, err)
		}
		m[n] = string(v)
	}
	return m
}

// linkGroups lists the non-directory objects under dir that share an inode,
// each group sorted, the groups sorted.
func linkGroups(t testing.TB, dir string) [][]string {
	t.Helper()
	byInode := map[[2]uint64][]string{}
	err := filepath.WalkDir(dir, func(p string, d fs.DirEntry, err error) error {
		if err != nil || d.IsDir() {
			return err
		}
		var st unix.Stat_t
		if err := unix.Lstat(p, &st); err != nil {
			return err
		}
		rel, _ := filepath.Rel(dir, p)
		id := [2]uint64{uint64(st.Dev), st.Ino}
		byInode[id] = append(byInode[id], rel)
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	var out [][]string
	for _, g := range byInode {
		if len(g) > 1 {
			sort.Strings(g)
			out = append(out, g)
		}
	}
	sort.Slice(out, func(i, j int) bool { return out[i][0] < out[j][0] })
	return out
}

package container

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"testing"

	"github.com/hanwen/go-fuse/v2/fs"
	"github.com/hanwen/go-fuse/v2/fuse"
	"golang.org/x/sys/unix"

	"dsec.dev/dsec/internal/edge/backend/container/mountinfo"
	"dsec.dev/dsec/internal/testutil"
)

// TestMkfsBesideDeadFUSE makes what a root whose dsecd and lazyfs were
// killed leaves on a host: a file-backed EROFS layer whose file is on a
// FUSE mount with no server. mkfs.btrfs refuses to format anything on such
// a host (it cannot stat that layer's source); the upper file system of
// another root must be made all the same, and the host's mounts left as
// they were.
func TestMkfsBesideDeadFUSE(t *testing.T) {
	testutil.RequireRoot(t)
	testutil.RequireCommand(t, "mkfs.btrfs")
	testutil.RequireCommand(t, "mkfs.erofs")
	dir := t.TempDir()
	back, fuseDir, layerDir, src := filepath.Join(dir, "back"), filepath.Join(dir, "fuse"), filepath.Join(dir, "layer"), filepath.Join(dir, "src")
	for _, d := range []string{back, fuseDir, layerDir, src} {
		if err := os.Mkdir(d, 0o700); err != nil {
			t.Fatal(err)
		}
	}
	if err := os.WriteFile(filepath.Join(src, "hello"), []byte("hello\n"), 0o644); err != nil {
		t.Fatal(err)
	}

	// The layer's file served by a FUSE mount, as lazyfs serves them.
	root, err := fs.NewLoopbackRoot(back)
	if err != nil {
		t.Fatal(err)
	}
	_, err = fs.Mount(fuseDir, root, &fs.Options{MountOptions: fuse.MountOptions{
		FsName: "dsec-test-fuse", Name: "dsec-test-fuse", DirectMountStrict: true,
		// EROFS refuses a file-backed mount on a stacked file system.
		DisabledCapabilities: fuse.CAP_PASSTHROUGH,
	}})
	if err != nil {
		t.Fatalf("mount FUSE: %v", err)
	}
	t.Cleanup(func() {
		if err := unix.Unmount(fuseDir, 0); err != nil {
			_ = unix.Unmount(fuseDir, unix.MNT_DETACH)
		}
	})
	layer := filepath.Join(fuseDir, "layer.erofs")
	if out, err := exec.Command("mkfs.erofs", "--quiet", layer, src).CombinedOutput(); err != nil {
		t.Fatalf("mkfs.erofs: %v: %s", err, out)
	}
	if err := unix.Mount(layer, layerDir, "erofs", unix.MS_RDONLY, ""); err != nil {
		t.Fatalf("mount the layer: %v", err)
	}
	t.Cleanup(func() { _ = unix.Unmount(layerDir, unix.MNT_DETACH) })

	// The server dies: its connection is aborted, and every lookup on the
	// mount fails with ENOTCONN from then on.
	abortFUSE(t, fuseDir)
	if _, err := os.Stat(layer); !errors.Is(err, unix.ENOTCONN) {
		t.Fatalf("stat the layer's file after the abort: %v, want ENOTCONN", err)
	}

	ctx := context.Background()
	plain := filepath.Join(dir, "plain.img")
	img := filepath.Join(dir, "upper.img")
	for _, f := range []string{plain, img} {
		if err := os.WriteFile(f, nil, 0o600); err != nil {
			t.Fatal(err)
		}
		if err := os.Truncate(f, minUpperFSBytes); err != nil {
			t.Fatal(err)
		}
	}
	if err := run(ctx, "mkfs.btrfs", "-q", "-f", plain); err != nil {
		t.Logf("mkfs.btrfs alone on this host, as expected: %v", err)
	} else {
		t.Logf("this mkfs.btrfs formats beside an unreachable mount by itself")
	}

	if err := mkfsBtrfs(ctx, slog.New(slog.NewTextHandler(io.Discard, nil)), img); err != nil {
		t.Fatalf("mkfsBtrfs beside a dead FUSE mount: %v", err)
	}
	magic := make([]byte, 8)
	f, err := os.Open(img)
	if err != nil {
		t.Fatal(err)
	}
	_, err = f.ReadAt(magic, 0x10040)
	f.Close()
	if err != nil || string(magic) != "_BHRfS_M" {
		t.Fatalf("upper image after mkfsBtrfs: magic %q, %v; want a btrfs", magic, err)
	}

	// The namespace mkfs.btrfs ran in was its own: the host still has the
	// layer mounted.
	ms, err := mountinfo.Read()
	if err != nil {
		t.Fatal(err)
	}
	if !slices.ContainsFunc(ms, func(m mountinfo.Mount) bool { return m.Point == layerDir }) {
		t.Errorf("the layer at %s is no longer mounted on the host", layerDir)
	}
	if got := unreachableMounts(ms); !slices.Contains(got, layerDir) {
		t.Errorf("unreachableMounts = %q, want %s among them", got, layerDir)
	}
}

// abortFUSE aborts the FUSE connection of the mount at dir through the
// fusectl file system, mounted for the while if the host has not.
func abortFUSE(t *testing.T, dir string) {
	t.Helper()
	var st unix.Stat_t
	if err := unix.Stat(dir, &st); err != nil {
		t.Fatal(err)
	}
	const ctl = "/sys/fs/fuse/connections"
	abort := fmt.Sprintf("%s/%d/abort", ctl, unix.Minor(st.Dev))
	if _, err := os.Stat(abort); errors.Is(err, os.ErrNotExist) {
		if err := unix.Mount("fusectl", ctl, "fusectl", 0, ""); err != nil {
			t.Fatalf("mount fusectl: %v", err)
		}
		defer unix.Unmount(ctl, 0)
	}
	if err := os.WriteFile(abort, []byte("1"), 0); err != nil {
		t.Fatalf("abort the FUSE connection: %v", err)
	}
}

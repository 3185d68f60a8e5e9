//go:build linux

package image

import (
	"archive/tar"
	"bufio"
	"context"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"dsec.dev/dsec/internal/testutil"
)

// mountsUnder counts this namespace's mounts at or below dir.
func mountsUnder(t *testing.T, dir string) int {
	t.Helper()
	f, err := os.Open("/proc/self/mountinfo")
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	n := 0
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		fields := strings.Fields(sc.Text())
		if len(fields) > 4 && (unescapeMountPath(fields[4]) == dir || strings.HasPrefix(unescapeMountPath(fields[4]), dir+"/")) {
			n++
		}
	}
	return n
}

func TestMountIdempotentAndUnmountAll(t *testing.T) {
	needImport(t)
	base := t.TempDir()
	root := filepath.Join(base, "store")
	s := newStore(t, root)
	ctx := context.Background()
	src := writeTar(t, base, "l.tar", false, []tarEntry{file("hello", "through erofs\n")})
	l, err := s.Import(ctx, "m:1", KindBase, src, ImportOptions{})
	if err != nil {
		t.Fatal(err)
	}

	var wg sync.WaitGroup
	dirs := make([]string, 6)
	errs := make([]error, 6)
	for i := range dirs {
		wg.Add(1)
		go func() {
			defer wg.Done()
			dirs[i], errs[i] = s.Mount(ctx, l.Digest)
		}()
	}
	wg.Wait()
	for i := range dirs {
		if errs[i] != nil || dirs[i] != dirs[0] {
			t.Fatalf("Mount #%d = %q, %v; want %q", i, dirs[i], errs[i], dirs[0])
		}
	}
	dir := dirs[0]
	if want := filepath.Join(root, "mnt", strings.TrimPrefix(l.Digest, "sha256:")); dir != want {
		t.Errorf("mounted at %s, want %s", dir, want)
	}
	b, err := os.ReadFile(filepath.Join(dir, "hello"))
	if err != nil || string(b) != "through erofs\n" {
		t.Errorf("read through mount: %q, %v", b, err)
	}
	if err := os.WriteFile(filepath.Join(dir, "new"), nil, 0o644); err == nil {
		t.Error("wrote into a read-only layer")
	}
	var sfs unix.Statfs_t
	if err := unix.Statfs(dir, &sfs); err != nil || uint32(sfs.Type) != erofsSuperMagic {
		t.Errorf("statfs type %x, %v; want EROFS", sfs.Type, err)
	}
	if n := mountsUnder(t, dir); n != 1 {
		t.Errorf("%d mounts at %s, want 1", n, dir)
	}
	// No loop device: the mount source is the image file itself.
	if mi, _ := os.ReadFile("/proc/self/mountinfo"); !strings.Contains(string(mi), s.blobPath(strings.TrimPrefix(l.Digest, "sha256:"))) {
		t.Errorf("mount source is not the layer file")
	}

	// A restarted daemon (a new Store on the same root) adopts the mount.
	s2 := newStore(t, root)
	dir2, err := s2.Mount(ctx, l.Digest)
	if err != nil || dir2 != dir {
		t.Fatalf("Mount after restart = %q, %v", dir2, err)
	}
	if n := mountsUnder(t, dir); n != 1 {
		t.Errorf("%d mounts after re-mount from a new store, want 1", n)
	}

	if _, err := s.Mount(ctx, "sha256:"+strings.Repeat("1", 64)); err == nil {
		t.Error("mounted an unknown layer")
	}

	if err := s.UnmountAll(ctx); err != nil {
		t.Fatal(err)
	}
	if n := mountsUnder(t, root); n != 0 {
		t.Errorf("%d mounts left under %s after UnmountAll", n, root)
	}
	// Mounting again after teardown works.
	if _, err := s.Mount(ctx, l.Digest); err != nil {
		t.Fatal(err)
	}
	if err := s.UnmountAll(ctx); err != nil {
		t.Fatal(err)
	}
	if n := mountsUnder(t, root); n != 0 {
		t.Errorf("%d mounts left under %s", n, root)
	}
}

// TestWhiteoutHidesBaseFile stacks a base and a toolkit with a real overlay
// mount: the toolkit's whiteout and opaque directory hide the base's files.
func TestWhiteoutHidesBaseFile(t *testing.T) {
	needImport(t)
	base := t.TempDir()
	s := newStore(t, filepath.Join(base, "store"))
	ctx := context.Background()
	opaque := dirEnt("opaque")
	opaque.hdr.PAXRecords = map[string]string{"SCHILY.xattr.trusted.overlay.opaque": "y"}
	lower, err := s.Import(ctx, "os:1", KindBase, writeTar(t, base, "base.tar", false, []tarEntry{
		file("etc/secret", "base\n"), file("etc/keep", "keep\n"), file("opaque/old", "old\n"),
	}), ImportOptions{})
	if err != nil {
		t.Fatal(err)
	}
	upper, err := s.Import(ctx, "tk:1", KindToolkit, writeTar(t, base, "tk.tar", true, []tarEntry{
		device("etc/secret", tar.TypeChar, 0, 0), file("etc/added", "added\n"), opaque, file("opaque/new", "new\n"),
	}), ImportOptions{})
	if err != nil {
		t.Fatal(err)
	}
	layers, err := s.ResolveEnvironment("tk:1+os:1")
	if err != nil {
		t.Fatal(err)
	}
	if layers[0].Digest != lower.Digest || layers[1].Digest != upper.Digest {
		t.Fatalf("resolved %v", layers)
	}
	merged := overlay(t, s, base, layers)
	if _, err := os.Lstat(filepath.Join(merged, "etc/secret")); !os.IsNotExist(err) {
		t.Errorf("etc/secret through overlay: %v; want hidden by the whiteout", err)
	}
	for name, want := range map[string]string{"etc/keep": "keep\n", "etc/added": "added\n", "opaque/new": "new\n"} {
		if b, err := os.ReadFile(filepath.Join(merged, name)); err != nil || string(b) != want {
			t.Errorf("%s = %q, %v; want %q", name, b, err, want)
		}
	}
	if _, err := os.Lstat(filepath.Join(merged, "opaque/old")); !os.IsNotExist(err) {
		t.Errorf("opaque/old through overlay: %v; want hidden by the opaque directory", err)
	}
}

func TestBusyboxRootfs(t *testing.T) {
	needImport(t)
	_, err := os.Stat(busyboxPath)
	testutil.Require(t, err == nil, busyboxPath+" is missing (install busybox-static)")
	base := t.TempDir()
	s := newStore(t, filepath.Join(base, "store"))
	ctx := context.Background()
	var digests []string
	for _, name := range []string{"a", "b"} {
		dir := filepath.Join(base, name)
		if err := BuildBusyboxRootfs(dir); err != nil {
			t.Fatal(err)
		}
		l, err := s.Import(ctx, "busybox:"+name, KindBase, dir, ImportOptions{})
		if err != nil {
			t.Fatal(err)
		}
		digests = append(digests, l.Digest)
	}
	if digests[0] != digests[1] {
		t.Errorf("two busybox builds give digests %s and %s", digests[0], digests[1])
	}
	// scripts/build-busybox-base.sh builds the same tree.
	script := filepath.Join("..", "..", "..", "scripts", "build-busybox-base.sh")
	if out, err := exec.Command("sh", script, filepath.Join(base, "script")).CombinedOutput(); err != nil {
		t.Fatalf("%s: %v: %s", script, err, out)
	}
	l, err := s.Import(ctx, "busybox:script", KindBase, filepath.Join(base, "script"), ImportOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if l.Digest != digests[0] {
		t.Errorf("build-busybox-base.sh gives %s, BuildBusyboxRootfs %s", l.Digest, digests[0])
	}
	dir, err := s.Mount(ctx, digests[0])
	if err != nil {
		t.Fatal(err)
	}
	if target, err := os.Readlink(filepath.Join(dir, "bin/sh")); err != nil || target != "busybox" {
		t.Errorf("bin/sh -> %q, %v", target, err)
	}
	if b, err := os.ReadFile(filepath.Join(dir, "etc/passwd")); err != nil || !strings.Contains(string(b), "nobody:x:65534:65534:") {
		t.Errorf("etc/passwd = %q, %v", b, err)
	}
	var st unix.Stat_t
	if err := unix.Stat(filepath.Join(dir, "tmp"), &st); err != nil || st.Mode&0o7777 != 0o1777 {
		t.Errorf("tmp mode %o, %v", st.Mode&0o7777, err)
	}
	for _, d := range []string{"proc", "sys", "dev", "root", "home", "usr/bin"} {
		if fi, err := os.Stat(filepath.Join(dir, d)); err != nil || !fi.IsDir() {
			t.Errorf("%s: %v", d, err)
		}
	}
	// The layer runs: a shell out of it, in a chroot.
	out, err := exec.Command("chroot", dir, "/bin/sh", "-c", "echo $(cat /etc/group | wc -l) groups").CombinedOutput()
	if err != nil || strings.TrimSpace(string(out)) != "2 groups" {
		t.Errorf("chroot shell: %q, %v", out, err)
	}
}

// TestImportDebianTree imports a tree built by scripts/build-debian-base.sh
// when DSEC_TEST_DEBIAN_ROOT names one (it takes minutes to build, so the
// suite does not build it itself) and runs python3 out of the layer.
func TestImportDebianTree(t *testing.T) {
	src := os.Getenv("DSEC_TEST_DEBIAN_ROOT")
	if src == "" {
		t.Skip("set DSEC_TEST_DEBIAN_ROOT to a tree built by scripts/build-debian-base.sh")
	}
	needImport(t)
	s := newStore(t, filepath.Join(t.TempDir(), "store"))
	ctx := context.Background()
	start := time.Now()
	l, err := s.Import(ctx, "debian:test", KindBase, src, ImportOptions{AllowSetuid: true})
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("imported %s in %v: %d MiB image", l.Digest, time.Since(start).Round(time.Millisecond), l.Size>>20)
	dir, err := s.Mount(ctx, l.Digest)
	if err != nil {
		t.Fatal(err)
	}
	out, err := exec.Command("chroot", dir, "/usr/bin/python3", "-c", "import ssl, sys; print(sys.version_info[0])").CombinedOutput()
	if err != nil || strings.TrimSpace(string(out)) != "3" {
		t.Errorf("python3 in the layer: %q, %v", out, err)
	}
	var st unix.Stat_t
	if err := unix.Stat(filepath.Join(dir, "usr/bin/su"), &st); err != nil || st.Mode&unix.S_ISUID == 0 {
		t.Errorf("usr/bin/su: mode %o, %v; want setuid kept", st.Mode, err)
	}
}

//go:build linux

package image

import (
	"archive/tar"
	"bytes"
	"compress/gzip"
	"context"
	"encoding/binary"
	"errors"
	"io"
	"io/fs"
	"log/slog"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"dsec.dev/dsec/internal/errdefs"
	"dsec.dev/dsec/internal/testutil"
)

// needImport gates tests that import layers: they chown, mknod and run mkfs.erofs.
func needImport(t *testing.T) {
	t.Helper()
	testutil.RequireRoot(t)
	testutil.RequireCommand(t, "mkfs.erofs")
}

func newStore(t *testing.T, root string) *Store {
	t.Helper()
	s, err := Open(root, slog.New(slog.NewTextHandler(io.Discard, nil)))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if err := s.UnmountAll(context.Background()); err != nil {
			t.Errorf("UnmountAll: %v", err)
		}
	})
	return s
}

type tarEntry struct {
	hdr  tar.Header
	body string
}

func file(name, body string) tarEntry {
	return tarEntry{hdr: tar.Header{Typeflag: tar.TypeReg, Name: name, Mode: 0o644, Size: int64(len(body)), ModTime: time.Unix(1600000000, 0)}, body: body}
}

func dirEnt(name string) tarEntry {
	return tarEntry{hdr: tar.Header{Typeflag: tar.TypeDir, Name: name, Mode: 0o755, ModTime: time.Unix(1600000000, 0)}}
}

func symlink(name, target string) tarEntry {
	return tarEntry{hdr: tar.Header{Typeflag: tar.TypeSymlink, Name: name, Linkname: target, Mode: 0o777, ModTime: time.Unix(1600000000, 0)}}
}

func hardlink(name, target string) tarEntry {
	return tarEntry{hdr: tar.Header{Typeflag: tar.TypeLink, Name: name, Linkname: target, ModTime: time.Unix(1600000000, 0)}}
}

func device(name string, typ byte, major, minor int64) tarEntry {
	return tarEntry{hdr: tar.Header{Typeflag: typ, Name: name, Mode: 0o600, Devmajor: major, Devminor: minor, ModTime: time.Unix(1600000000, 0)}}
}

// writeTar writes entries as a tar archive (gzip'd when gz) and returns its path.
func writeTar(t *testing.T, dir, name string, gz bool, entries []tarEntry) string {
	t.Helper()
	data := tarBytes(t, entries)
	if gz {
		var buf bytes.Buffer
		zw := gzip.NewWriter(&buf)
		if _, err := zw.Write(data); err != nil {
			t.Fatal(err)
		}
		if err := zw.Close(); err != nil {
			t.Fatal(err)
		}
		data = buf.Bytes()
	}
	p := filepath.Join(dir, name)
	if err := os.WriteFile(p, data, 0o644); err != nil {
		t.Fatal(err)
	}
	return p
}

// sampleEntries is a small tree with every kind of object a layer keeps.
func sampleEntries() []tarEntry {
	owned := file("etc/owned", "owned by 1000\n")
	owned.hdr.Uid, owned.hdr.Gid, owned.hdr.Mode = 1000, 1001, 0o640
	opaque := dirEnt("opaque")
	opaque.hdr.PAXRecords = map[string]string{"SCHILY.xattr.trusted.overlay.opaque": "y"}
	sticky := dirEnt("tmp")
	sticky.hdr.Mode = 0o1777
	return []tarEntry{
		dirEnt("etc/"),
		file("etc/hello", "hello world\n"),
		owned,
		symlink("etc/link", "hello"),
		symlink("abs", "/etc/hello"),
		hardlink("etc/hard", "etc/hello"),
		opaque,
		sticky,
		device("gone", tar.TypeChar, 0, 0),
		file("implicit/parents/file", "x"), // no directory entries for its parents
	}
}

func TestImportTarGzipAndDirectory(t *testing.T) {
	needImport(t)
	base := t.TempDir()
	s := newStore(t, filepath.Join(base, "store"))
	ctx := context.Background()

	plain := writeTar(t, base, "layer.tar", false, sampleEntries())
	gz := writeTar(t, base, "layer.tar.gz", true, sampleEntries())
	l1, err := s.Import(ctx, "sample:tar", KindBase, plain, ImportOptions{})
	if err != nil {
		t.Fatalf("Import tar: %v", err)
	}
	l2, err := s.Import(ctx, "sample:gz", KindBase, gz, ImportOptions{})
	if err != nil {
		t.Fatalf("Import tar.gz: %v", err)
	}
	if l1.Digest != l2.Digest {
		t.Errorf("tar and tar.gz of the same tree: digests %s and %s differ", l1.Digest, l2.Digest)
	}
	// An upload: the archive as a stream, never a file of the store's.
	for _, src := range []string{plain, gz} {
		f, err := os.Open(src)
		if err != nil {
			t.Fatal(err)
		}
		l, err := s.ImportArchive(ctx, "", KindBase, io.MultiReader(f, bytes.NewReader(make([]byte, 10240))), "upload", ImportOptions{})
		f.Close()
		if err != nil || l.Digest != l1.Digest {
			t.Errorf("ImportArchive of %s (and a tape record's padding) = %+v, %v; want digest %s", filepath.Base(src), l, err, l1.Digest)
		}
	}
	if !strings.HasPrefix(l1.Digest, "sha256:") || l1.Kind != KindBase || l1.Size <= 0 || l1.Source != plain {
		t.Errorf("layer = %+v", l1)
	}
	got, err := s.Get("sample:gz")
	if err != nil {
		t.Fatal(err)
	}
	if want := []string{"sample:gz", "sample:tar"}; strings.Join(got.Refs, ",") != strings.Join(want, ",") {
		t.Errorf("refs = %v, want %v", got.Refs, want)
	}
	fi, err := os.Stat(filepath.Join(s.root, "blobs", strings.TrimPrefix(l1.Digest, "sha256:")))
	if err != nil || fi.Size() != l1.Size {
		t.Errorf("blob: %v, size %v want %d", err, fi, l1.Size)
	}

	dir, err := s.Mount(ctx, l1.Digest)
	if err != nil {
		t.Fatalf("Mount: %v", err)
	}
	checkSample(t, dir)

	// The mounted tree, imported as a directory, gives a layer with the same content.
	l3, err := s.Import(ctx, "sample:dir", KindBase, dir, ImportOptions{})
	if err != nil {
		t.Fatalf("Import directory: %v", err)
	}
	dir3, err := s.Mount(ctx, l3.Digest)
	if err != nil {
		t.Fatal(err)
	}
	checkSample(t, dir3)
	assertTmpEmpty(t, s)
}

// checkSample checks what sampleEntries put in a layer, read through its mount.
func checkSample(t *testing.T, dir string) {
	t.Helper()
	b, err := os.ReadFile(filepath.Join(dir, "etc/hello"))
	if err != nil || string(b) != "hello world\n" {
		t.Errorf("etc/hello = %q, %v", b, err)
	}
	var st unix.Stat_t
	if err := unix.Lstat(filepath.Join(dir, "etc/owned"), &st); err != nil {
		t.Fatal(err)
	}
	if st.Uid != 1000 || st.Gid != 1001 || st.Mode&0o7777 != 0o640 || st.Mtim.Sec != 1600000000 {
		t.Errorf("etc/owned: uid %d gid %d mode %o mtime %d, want 1000 1001 640 1600000000", st.Uid, st.Gid, st.Mode&0o7777, st.Mtim.Sec)
	}
	if target, err := os.Readlink(filepath.Join(dir, "etc/link")); err != nil || target != "hello" {
		t.Errorf("etc/link -> %q, %v", target, err)
	}
	if target, err := os.Readlink(filepath.Join(dir, "abs")); err != nil || target != "/etc/hello" {
		t.Errorf("abs -> %q, %v", target, err)
	}
	if err := unix.Lstat(filepath.Join(dir, "etc/hard"), &st); err != nil || st.Nlink != 2 {
		t.Errorf("etc/hard: nlink %d, %v; want a hard link", st.Nlink, err)
	}
	if err := unix.Lstat(filepath.Join(dir, "gone"), &st); err != nil || st.Mode&unix.S_IFMT != unix.S_IFCHR || st.Rdev != 0 {
		t.Errorf("gone: mode %o rdev %d, %v; want a 0/0 whiteout", st.Mode, st.Rdev, err)
	}
	if err := unix.Lstat(filepath.Join(dir, "tmp"), &st); err != nil || st.Mode&0o7777 != 0o1777 {
		t.Errorf("tmp: mode %o, %v; want 1777", st.Mode&0o7777, err)
	}
	val := make([]byte, 8)
	if n, err := unix.Lgetxattr(filepath.Join(dir, "opaque"), "trusted.overlay.opaque", val); err != nil || string(val[:n]) != "y" {
		t.Errorf("opaque: trusted.overlay.opaque = %q, %v", val[:max(n, 0)], err)
	}
	if b, err := os.ReadFile(filepath.Join(dir, "implicit/parents/file")); err != nil || string(b) != "x" {
		t.Errorf("implicit/parents/file = %q, %v", b, err)
	}
}

func assertTmpEmpty(t *testing.T, s *Store) {
	t.Helper()
	ents, err := os.ReadDir(s.tmpDir())
	if err != nil {
		t.Fatal(err)
	}
	if len(ents) != 0 {
		var names []string
		for _, e := range ents {
			names = append(names, e.Name())
		}
		t.Errorf("%s not empty: %v", s.tmpDir(), names)
	}
}

func TestReproducibleDigest(t *testing.T) {
	needImport(t)
	base := t.TempDir()
	s := newStore(t, filepath.Join(base, "store"))
	ctx := context.Background()
	src := filepath.Join(base, "src")
	if err := os.MkdirAll(filepath.Join(src, "a/b"), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(src, "a/b/f"), []byte("content"), 0o644); err != nil {
		t.Fatal(err)
	}
	l1, err := s.Import(ctx, "repro:1", KindWorkspace, src, ImportOptions{})
	if err != nil {
		t.Fatal(err)
	}
	time.Sleep(1100 * time.Millisecond) // a different build time must not change the digest
	l2, err := s.Import(ctx, "repro:2", KindWorkspace, src, ImportOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if l1.Digest != l2.Digest {
		t.Fatalf("same tree imported twice: %s != %s", l1.Digest, l2.Digest)
	}
	all, err := s.List()
	if err != nil {
		t.Fatal(err)
	}
	if len(all) != 1 || strings.Join(all[0].Refs, ",") != "repro:1,repro:2" {
		t.Errorf("List = %+v, want one layer with both refs", all)
	}
	// The image still mounts: the rewritten superblock checksum is right.
	dir, err := s.Mount(ctx, l1.Digest)
	if err != nil {
		t.Fatalf("Mount: %v", err)
	}
	if b, err := os.ReadFile(filepath.Join(dir, "a/b/f")); err != nil || string(b) != "content" {
		t.Errorf("a/b/f = %q, %v", b, err)
	}
}

func TestRefsListGetRemove(t *testing.T) {
	needImport(t)
	base := t.TempDir()
	s := newStore(t, filepath.Join(base, "store"))
	ctx := context.Background()
	a := writeTar(t, base, "a.tar", false, []tarEntry{file("a", "a")})
	b := writeTar(t, base, "b.tar", false, []tarEntry{file("b", "b")})

	la, err := s.Import(ctx, "tools", KindToolkit, a, ImportOptions{}) // tag defaults to latest
	if err != nil {
		t.Fatal(err)
	}
	if _, err := s.Import(ctx, "tools:v1", KindToolkit, a, ImportOptions{}); err != nil {
		t.Fatal(err)
	}
	lb, err := s.Import(ctx, "other:v1", KindToolkit, b, ImportOptions{})
	if err != nil {
		t.Fatal(err)
	}
	for _, name := range []string{"tools", "tools:latest", "tools:v1", la.Digest} {
		if l, err := s.Get(name); err != nil || l.Digest != la.Digest {
			t.Errorf("Get(%q) = %v, %v; want %s", name, l.Digest, err, la.Digest)
		}
	}
	for _, name := range []string{"nope", "tools:v2", "sha256:" + strings.Repeat("0", 64)} {
		if _, err := s.Get(name); !errors.Is(err, errdefs.ErrNotFound) {
			t.Errorf("Get(%q) err = %v, want ErrNotFound", name, err)
		}
	}
	for _, name := range []string{"Bad Name", "sha256:xyz", "a:b:c:"} {
		if _, err := s.Get(name); !errors.Is(err, errdefs.ErrInvalidArgument) {
			t.Errorf("Get(%q) err = %v, want ErrInvalidArgument", name, err)
		}
	}
	if _, err := s.Import(ctx, "wrong:kind", KindBase, a, ImportOptions{}); !errors.Is(err, errdefs.ErrAlreadyExists) {
		t.Errorf("import as another kind: err = %v, want ErrAlreadyExists", err)
	}

	// Moving a ref to other content.
	if _, err := s.Import(ctx, "tools:v1", KindToolkit, b, ImportOptions{}); err != nil {
		t.Fatal(err)
	}
	if l, _ := s.Get("tools:v1"); l.Digest != lb.Digest {
		t.Errorf("tools:v1 -> %s, want %s", l.Digest, lb.Digest)
	}

	// Removing a ref keeps a layer other refs hold; the last ref takes the file.
	if _, err := s.Mount(ctx, lb.Digest); err != nil {
		t.Fatal(err)
	}
	if err := s.Remove("other:v1"); err != nil {
		t.Fatal(err)
	}
	if _, err := s.Get(lb.Digest); err != nil {
		t.Errorf("layer held by tools:v1 gone: %v", err)
	}
	if err := s.Remove("tools:v1"); err != nil {
		t.Fatal(err)
	}
	hexB := strings.TrimPrefix(lb.Digest, "sha256:")
	if _, err := s.Get(lb.Digest); !errors.Is(err, errdefs.ErrNotFound) {
		t.Errorf("Get after last ref removed: %v, want ErrNotFound", err)
	}
	if _, err := os.Stat(s.blobPath(hexB)); !os.IsNotExist(err) {
		t.Errorf("blob of removed layer: %v, want gone", err)
	}
	if _, err := os.Stat(s.mountPath(hexB)); !os.IsNotExist(err) {
		t.Errorf("mount dir of removed layer: %v, want gone", err)
	}
	// Removing by digest drops every ref.
	if err := s.Remove(la.Digest); err != nil {
		t.Fatal(err)
	}
	if _, err := s.Get("tools"); !errors.Is(err, errdefs.ErrNotFound) {
		t.Errorf("Get(tools) after digest removal: %v", err)
	}
	if err := s.Remove("tools"); !errors.Is(err, errdefs.ErrNotFound) {
		t.Errorf("Remove of a missing ref: %v, want ErrNotFound", err)
	}
	all, err := s.List()
	if err != nil || len(all) != 0 {
		t.Errorf("List = %v, %v; want empty", all, err)
	}
	ents, _ := os.ReadDir(filepath.Join(s.root, "blobs"))
	if len(ents) != 0 {
		t.Errorf("blobs left: %d", len(ents))
	}
}

func TestResolveEnvironment(t *testing.T) {
	needImport(t)
	base := t.TempDir()
	s := newStore(t, filepath.Join(base, "store"))
	ctx := context.Background()
	digests := map[string]string{}
	for _, l := range []struct {
		ref  string
		kind Kind
	}{
		{"debian:12", KindBase}, {"alpine:3", KindBase},
		{"repo:a", KindWorkspace}, {"repo:b", KindWorkspace}, {"harness:1", KindToolkit},
	} {
		src := writeTar(t, base, strings.ReplaceAll(l.ref, ":", "_")+".tar", false, []tarEntry{file(l.ref, l.ref)})
		got, err := s.Import(ctx, l.ref, l.kind, src, ImportOptions{})
		if err != nil {
			t.Fatal(err)
		}
		digests[l.ref] = got.Digest
	}

	layers, err := s.ResolveEnvironment("harness:1+debian:12+repo:b+" + digests["repo:a"])
	if err != nil {
		t.Fatal(err)
	}
	var got []string
	for _, l := range layers {
		got = append(got, l.Digest)
	}
	want := []string{digests["debian:12"], digests["repo:b"], digests["repo:a"], digests["harness:1"]}
	if strings.Join(got, " ") != strings.Join(want, " ") {
		t.Errorf("resolved %v, want %v (base, workspaces in order, toolkits)", got, want)
	}
	if l, err := s.ResolveEnvironment("debian:12"); err != nil || len(l) != 1 {
		t.Errorf("base alone: %v, %v", l, err)
	}

	for _, tc := range []struct {
		env  string
		kind error
		msg  string
	}{
		{"debian:12+alpine:3", errdefs.ErrInvalidArgument, "two base layers"},
		{"repo:a+harness:1", errdefs.ErrInvalidArgument, "no base layer"},
		{"debian:12+nope:1", errdefs.ErrNotFound, "nope:1"},
		{"debian:12+", errdefs.ErrInvalidArgument, "empty layer name"},
		{"", errdefs.ErrInvalidArgument, "empty name"},
		{"debian:12+repo:a+repo:a", errdefs.ErrInvalidArgument, "same layer"},
		{"debian:12+sha256:abc", errdefs.ErrInvalidArgument, "sha256:abc"},
		// A typo: said once, with the nearest names and where to list them.
		{"debain:12", errdefs.ErrNotFound, "no layer or image is named debain:12; did you mean debian:12? (dsec layer ls"},
		{"debian:12+rep:b", errdefs.ErrNotFound, `environment "debian:12+rep:b": no layer or image is named rep:b; did you mean repo:b or repo:a?`},
		{"zzzzzz:9", errdefs.ErrNotFound, "no layer or image is named zzzzzz:9 (dsec layer ls"},
	} {
		_, err := s.ResolveEnvironment(tc.env)
		if !errors.Is(err, tc.kind) || !strings.Contains(err.Error(), tc.msg) {
			t.Errorf("ResolveEnvironment(%q) = %v; want %v mentioning %q", tc.env, err, tc.kind, tc.msg)
		}
		if err != nil && tc.env != "" && strings.Count(err.Error(), tc.env) > 1 {
			t.Errorf("ResolveEnvironment(%q) = %v: names the environment more than once", tc.env, err)
		}
	}

	env := "debian:12+repo:a"
	for range 3 {
		if err := s.RecordEnvironment(env, want[:2]); err != nil {
			t.Fatal(err)
		}
	}
	envs, err := s.Environments()
	if err != nil {
		t.Fatal(err)
	}
	if len(envs) != 1 || envs[0].Name != env || envs[0].Sandboxes != 3 || len(envs[0].Digests) != 2 || envs[0].LastUsed.IsZero() {
		t.Errorf("Environments = %+v", envs)
	}
}

func TestImportRefusesHostileArchives(t *testing.T) {
	needImport(t)
	base := t.TempDir()
	outside := filepath.Join(base, "outside")
	if err := os.MkdirAll(outside, 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(outside, "passwd"), []byte("sentinel"), 0o644); err != nil {
		t.Fatal(err)
	}
	before := testutil.TreeSnapshot(t, outside)
	s := newStore(t, filepath.Join(base, "store"))
	ctx := context.Background()

	setuid := file("bin/su", "#!")
	setuid.hdr.Mode = 0o4755
	setgid := file("bin/wall", "#!")
	setgid.hdr.Mode = 0o2755
	caps := file("bin/ping", "#!")
	caps.hdr.PAXRecords = map[string]string{"SCHILY.xattr.security.capability": capNetRaw()}
	trusted := file("f", "x")
	trusted.hdr.PAXRecords = map[string]string{"SCHILY.xattr.trusted.evil": "1"}
	big := file("big", strings.Repeat("x", 2048))
	var many []tarEntry
	for i := range 10 {
		many = append(many, file("f"+string(rune('a'+i)), "x"))
	}
	cases := []struct {
		name    string
		entries []tarEntry
		opts    ImportOptions
		msg     string // the error names the entry and says why
	}{
		{"absolute path", []tarEntry{file("/etc/evil", "x")}, ImportOptions{}, `"/etc/evil": absolute path`},
		{"dotdot", []tarEntry{file("../x", "x")}, ImportOptions{}, `"../x": path contains a .. component`},
		{"dotdot inside", []tarEntry{file("a/../../x", "x")}, ImportOptions{}, ".. component"},
		{"write through absolute symlink", []tarEntry{symlink("a", outside), file("a/passwd", "pwned")}, ImportOptions{}, `"a/passwd": path goes through a symlink`},
		{"write through symlink to /etc", []tarEntry{symlink("a", "/etc"), file("a/passwd", "pwned")}, ImportOptions{}, `"a/passwd": path goes through a symlink`},
		{"write through relative symlink", []tarEntry{dirEnt("d"), symlink("a", "d"), file("a/f", "x")}, ImportOptions{}, "path goes through a symlink"},
		{"symlink climbing out", []tarEntry{symlink("a", "../../x")}, ImportOptions{}, `"a": symlink target "../../x" climbs above the layer root`},
		{"nested symlink climbing out", []tarEntry{symlink("d/e/a", "../../../outside")}, ImportOptions{}, "climbs above"},
		{"hardlink outside", []tarEntry{hardlink("l", "../outside/passwd")}, ImportOptions{}, `"l": hard link target "../outside/passwd" is outside the layer`},
		{"hardlink absolute", []tarEntry{hardlink("l", filepath.Join(outside, "passwd"))}, ImportOptions{}, "is outside the layer"},
		{"hardlink to nothing", []tarEntry{hardlink("l", "missing")}, ImportOptions{}, "not an earlier regular file"},
		{"hardlink to directory", []tarEntry{dirEnt("d"), hardlink("l", "d")}, ImportOptions{}, "not an earlier regular file"},
		{"hardlink to symlink", []tarEntry{symlink("s", "/etc/passwd"), hardlink("l", "s")}, ImportOptions{}, "not an earlier regular file"},
		{"char device", []tarEntry{device("etc/x", tar.TypeChar, 1, 3)}, ImportOptions{}, `"etc/x": character device 1:3 outside /dev`},
		{"char device beside /dev", []tarEntry{device("devices/mem", tar.TypeChar, 1, 1)}, ImportOptions{}, `"devices/mem": character device 1:1 outside /dev`},
		{"char device as /dev", []tarEntry{device("dev", tar.TypeChar, 1, 1)}, ImportOptions{}, `"dev": character device 1:1 outside /dev`},
		{"block device", []tarEntry{device("var/sda", tar.TypeBlock, 8, 0)}, ImportOptions{}, "block device 8:0 outside /dev"},
		{"fifo", []tarEntry{device("p", tar.TypeFifo, 0, 0)}, ImportOptions{}, `"p": named pipe outside /dev`},
		{"setuid", []tarEntry{setuid}, ImportOptions{}, `"bin/su": setuid/setgid file (mode 4755); import with --allow-setuid (dsec layer import, dsec image import) or allow_setuid`},
		{"setgid", []tarEntry{setgid}, ImportOptions{}, "setuid/setgid file (mode 2755)"},
		{"file capabilities", []tarEntry{caps}, ImportOptions{}, "security.capability); import with --allow-setuid"},
		{"trusted xattr", []tarEntry{trusted}, ImportOptions{}, `unsupported extended attribute "trusted.evil"`},
		{"tar bomb one file", []tarEntry{big}, ImportOptions{MaxBytes: 1024}, `"big": content exceeds 1024 bytes`},
		{"tar bomb many files", []tarEntry{file("a", strings.Repeat("x", 600)), file("b", strings.Repeat("x", 600))}, ImportOptions{MaxBytes: 1024}, `"b": content exceeds`},
		{"tar bomb, the limit named", []tarEntry{big}, ImportOptions{MaxBytes: 1024, LimitName: "dsecd --max-upload-bytes"}, `content exceeds 1024 bytes (limit dsecd --max-upload-bytes)`},
		{"too many entries", many, ImportOptions{MaxEntries: 3}, `"fd": more than 3 entries`},
		{"file as parent", []tarEntry{file("f", "x"), file("f/g", "y")}, ImportOptions{}, "a parent is not a directory"},
		{"file replacing directory", []tarEntry{dirEnt("d"), file("d", "x")}, ImportOptions{}, "replaces a directory"},
	}
	sentinelOK := true
	for i, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			if tc.name == "write through symlink to /etc" && !sentinelOK {
				t.Skip("the same attack on a sentinel directory got through; not trying it on /etc")
			}
			for _, gz := range []bool{false, true} {
				src := writeTar(t, base, "hostile"+string(rune('a'+i))+".tar", gz, tc.entries)
				_, err := s.Import(ctx, "hostile:1", KindBase, src, tc.opts)
				if !errors.Is(err, errdefs.ErrInvalidArgument) || !strings.Contains(err.Error(), tc.msg) {
					t.Errorf("Import(gzip=%v) = %v; want ErrInvalidArgument containing %q", gz, err, tc.msg)
				}
				// The same archive uploaded, as a stream, meets the same checks.
				f, err := os.Open(src)
				if err != nil {
					t.Fatal(err)
				}
				_, err = s.ImportArchive(ctx, "hostile:1", KindBase, f, "upload", tc.opts)
				f.Close()
				if !errors.Is(err, errdefs.ErrInvalidArgument) || !strings.Contains(err.Error(), tc.msg) {
					t.Errorf("ImportArchive(gzip=%v) = %v; want ErrInvalidArgument containing %q", gz, err, tc.msg)
				}
			}
			if after := testutil.TreeSnapshot(t, outside); after != before {
				sentinelOK = false
				t.Errorf("outside changed:\n%s\nwant\n%s", after, before)
			}
			assertTmpEmpty(t, s)
			if all, _ := s.List(); len(all) != 0 {
				t.Errorf("a layer was stored: %+v", all)
			}
		})
	}
	if b, err := os.ReadFile("/etc/passwd"); err != nil || bytes.Contains(b, []byte("pwned")) {
		t.Errorf("/etc/passwd touched: %v", err)
	}

	// What the options allow.
	for _, tc := range []struct {
		name    string
		entries []tarEntry
		opts    ImportOptions
	}{
		{"setuid allowed", []tarEntry{setuid, setgid, caps}, ImportOptions{AllowSetuid: true}},
		{"setgid directory", []tarEntry{{hdr: tar.Header{Typeflag: tar.TypeDir, Name: "var/mail", Mode: 0o2775}}}, ImportOptions{}},
		{"exactly at the limits", []tarEntry{file("a", strings.Repeat("x", 512)), file("b", strings.Repeat("x", 512))}, ImportOptions{MaxBytes: 1024, MaxEntries: 2}},
	} {
		src := writeTar(t, base, "ok.tar", false, tc.entries)
		l, err := s.Import(ctx, "ok:1", KindBase, src, tc.opts)
		if err != nil {
			t.Errorf("%s: %v", tc.name, err)
			continue
		}
		if err := s.Remove(l.Digest); err != nil {
			t.Fatal(err)
		}
	}
}

func TestImportDirectoryChecks(t *testing.T) {
	needImport(t)
	base := t.TempDir()
	s := newStore(t, filepath.Join(base, "store"))
	ctx := context.Background()
	mk := func(t *testing.T, setup func(dir string) error) string {
		dir, err := os.MkdirTemp(base, "src-")
		if err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(filepath.Join(dir, "ok"), []byte("ok"), 0o644); err != nil {
			t.Fatal(err)
		}
		if err := setup(dir); err != nil {
			t.Fatal(err)
		}
		return dir
	}
	for _, tc := range []struct {
		name  string
		setup func(dir string) error
		opts  ImportOptions
		msg   string // empty: accepted
	}{
		{"device node", func(d string) error {
			return unix.Mknod(filepath.Join(d, "null"), unix.S_IFCHR|0o666, int(unix.Mkdev(1, 3)))
		}, ImportOptions{}, `"null": character device 1:3 outside /dev`},
		{"device node in /etc", func(d string) error {
			if err := os.Mkdir(filepath.Join(d, "etc"), 0o755); err != nil {
				return err
			}
			return unix.Mknod(filepath.Join(d, "etc", "x"), unix.S_IFCHR|0o600, int(unix.Mkdev(5, 1)))
		}, ImportOptions{}, `"etc/x": character device 5:1 outside /dev`},
		{"fifo", func(d string) error { return unix.Mkfifo(filepath.Join(d, "p"), 0o644) }, ImportOptions{}, `"p": named pipe outside /dev`},
		{"setuid", func(d string) error {
			if err := os.WriteFile(filepath.Join(d, "su"), []byte("x"), 0o755); err != nil {
				return err
			}
			return unix.Chmod(filepath.Join(d, "su"), 0o4755)
		}, ImportOptions{}, `"su": setuid/setgid`},
		{"symlink out", func(d string) error { return os.Symlink("../../../etc", filepath.Join(d, "up")) }, ImportOptions{}, `"up": symlink target`},
		{"whiteout", func(d string) error { return unix.Mknod(filepath.Join(d, "wh"), unix.S_IFCHR, 0) }, ImportOptions{}, ""},
		{"setuid allowed", func(d string) error {
			if err := os.WriteFile(filepath.Join(d, "su"), []byte("x"), 0o755); err != nil {
				return err
			}
			return unix.Chmod(filepath.Join(d, "su"), 0o4755)
		}, ImportOptions{AllowSetuid: true}, ""},
		{"hard links", func(d string) error { return os.Link(filepath.Join(d, "ok"), filepath.Join(d, "ok2")) }, ImportOptions{}, ""},
	} {
		t.Run(tc.name, func(t *testing.T) {
			src := mk(t, tc.setup)
			l, err := s.Import(ctx, "dir:1", KindBase, src, tc.opts)
			if tc.msg == "" {
				if err != nil {
					t.Fatalf("Import: %v", err)
				}
				if err := s.Remove(l.Digest); err != nil {
					t.Fatal(err)
				}
			} else if !errors.Is(err, errdefs.ErrInvalidArgument) || !strings.Contains(err.Error(), tc.msg) {
				t.Errorf("Import = %v; want ErrInvalidArgument containing %q", err, tc.msg)
			}
			assertTmpEmpty(t, s)
		})
	}
	if _, err := s.Import(ctx, "x:1", KindBase, filepath.Join(base, "missing"), ImportOptions{}); !errors.Is(err, errdefs.ErrNotFound) {
		t.Errorf("missing source: %v, want ErrNotFound", err)
	}
	if _, err := s.Import(ctx, "x:1", "layer", base, ImportOptions{}); !errors.Is(err, errdefs.ErrInvalidArgument) {
		t.Errorf("bad kind: %v, want ErrInvalidArgument", err)
	}
	notTar := filepath.Join(base, "not.tar")
	if err := os.WriteFile(notTar, bytes.Repeat([]byte("garbage!"), 200), 0o644); err != nil {
		t.Fatal(err)
	}
	if _, err := s.Import(ctx, "x:1", KindBase, notTar, ImportOptions{}); !errors.Is(err, errdefs.ErrInvalidArgument) {
		t.Errorf("not a tar: %v, want ErrInvalidArgument", err)
	}
	assertTmpEmpty(t, s)
}

// Device nodes and other special files under /dev are left out with a
// warning, from a tar archive as from a directory (a debootstrap tree has
// /dev/console): every sandbox gets its own /dev.
func TestImportSkipsSpecialFilesUnderDev(t *testing.T) {
	needImport(t)
	base := t.TempDir()
	s := newStore(t, filepath.Join(base, "store"))
	ctx := context.Background()
	tree := filepath.Join(base, "tree")
	for _, d := range []string{"etc", "dev/pts"} {
		if err := os.MkdirAll(filepath.Join(tree, d), 0o755); err != nil {
			t.Fatal(err)
		}
	}
	if err := os.WriteFile(filepath.Join(tree, "etc/hello"), []byte("hello\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(tree, "dev/README"), []byte("kept\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	for _, n := range []struct {
		name string
		mode uint32
		dev  int
	}{
		{"dev/console", unix.S_IFCHR | 0o600, int(unix.Mkdev(5, 1))},
		{"dev/null", unix.S_IFCHR | 0o666, int(unix.Mkdev(1, 3))},
		{"dev/loop0", unix.S_IFBLK | 0o660, int(unix.Mkdev(7, 0))},
		{"dev/pts/ptmx", unix.S_IFCHR | 0o666, int(unix.Mkdev(5, 2))},
		{"dev/initctl", unix.S_IFIFO | 0o600, 0},
	} {
		if err := unix.Mknod(filepath.Join(tree, n.name), n.mode, n.dev); err != nil {
			t.Fatal(err)
		}
	}
	entries := []tarEntry{
		dirEnt("etc/"), file("etc/hello", "hello\n"),
		dirEnt("dev/"), file("dev/README", "kept\n"), dirEnt("dev/pts/"),
		device("dev/console", tar.TypeChar, 5, 1), device("dev/null", tar.TypeChar, 1, 3),
		device("dev/loop0", tar.TypeBlock, 7, 0), device("dev/pts/ptmx", tar.TypeChar, 5, 2),
		device("dev/initctl", tar.TypeFifo, 0, 0),
	}
	for _, tc := range []struct {
		name, src string
	}{
		{"tar", writeTar(t, base, "rootfs.tar", false, entries)},
		{"tar.gz", writeTar(t, base, "rootfs.tar.gz", true, entries)},
		{"directory", tree},
	} {
		t.Run(tc.name, func(t *testing.T) {
			l, err := s.Import(ctx, "rootfs:"+strings.ReplaceAll(tc.name, ".", "-"), KindBase, tc.src, ImportOptions{})
			if err != nil {
				t.Fatalf("Import: %v", err)
			}
			if len(l.Warnings) != 1 || !strings.HasPrefix(l.Warnings[0], "left out 5 device nodes or other special files under /dev (") ||
				!strings.Contains(l.Warnings[0], "/dev/console") || !strings.Contains(l.Warnings[0], "/dev/pts/ptmx") ||
				!strings.Contains(l.Warnings[0], "every sandbox gets its own /dev") {
				t.Errorf("Warnings = %q; want one naming the 5 files left out", l.Warnings)
			}
			dir, err := s.Mount(ctx, l.Digest)
			if err != nil {
				t.Fatal(err)
			}
			for name, want := range map[string]string{"etc/hello": "hello\n", "dev/README": "kept\n"} {
				if b, err := os.ReadFile(filepath.Join(dir, name)); err != nil || string(b) != want {
					t.Errorf("%s = %q, %v; want %q", name, b, err, want)
				}
			}
			for _, name := range []string{"dev/console", "dev/null", "dev/loop0", "dev/pts/ptmx", "dev/initctl"} {
				if _, err := os.Lstat(filepath.Join(dir, name)); !errors.Is(err, fs.ErrNotExist) {
					t.Errorf("%s in the layer: %v; want it left out", name, err)
				}
			}
			if got, err := s.Get(l.Digest); err != nil || got.Warnings != nil {
				t.Errorf("Get = %+v, %v; want the layer without warnings (they are not stored)", got, err)
			}
			assertTmpEmpty(t, s)
		})
	}
	// Nothing left out, no warning.
	l, err := s.Import(ctx, "plain:1", KindBase, writeTar(t, base, "plain.tar", false, []tarEntry{file("f", "x")}), ImportOptions{})
	if err != nil || l.Warnings != nil {
		t.Errorf("Import of a tree without special files: %+v, %v; want no warnings", l, err)
	}
}

func TestOpenCleansDeadImports(t *testing.T) {
	root := filepath.Join(t.TempDir(), "store")
	s := newStore(t, root)
	// pid 2^22+1 is above pid_max's ceiling, so no such process runs.
	dead := filepath.Join(s.tmpDir(), "4194305-stage-x")
	live := filepath.Join(s.tmpDir(), "1-stage-x") // init is always alive
	for _, d := range []string{dead, live} {
		if err := os.MkdirAll(filepath.Join(d, "sub"), 0o755); err != nil {
			t.Fatal(err)
		}
	}
	newStore(t, root)
	if _, err := os.Stat(dead); !os.IsNotExist(err) {
		t.Errorf("leftover of a dead import kept: %v", err)
	}
	if _, err := os.Stat(live); err != nil {
		t.Errorf("staging dir of a live process removed: %v", err)
	}
	os.RemoveAll(live)
}

func TestConcurrentStoresShareIndex(t *testing.T) {
	needImport(t)
	base := t.TempDir()
	root := filepath.Join(base, "store")
	s1, s2 := newStore(t, root), newStore(t, root)
	ctx := context.Background()
	var wg sync.WaitGroup
	errs := make(chan error, 8)
	for i := range 8 {
		s := s1
		if i%2 == 1 {
			s = s2
		}
		src := writeTar(t, base, "c"+string(rune('a'+i))+".tar", false, []tarEntry{file("f", string(rune('a'+i)))})
		wg.Add(1)
		go func() {
			defer wg.Done()
			_, err := s.Import(ctx, "conc:"+string(rune('a'+i)), KindToolkit, src, ImportOptions{})
			errs <- err
		}()
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		if err != nil {
			t.Fatal(err)
		}
	}
	for _, s := range []*Store{s1, s2} {
		all, err := s.List()
		if err != nil || len(all) != 8 {
			t.Errorf("List = %d layers, %v; want 8", len(all), err)
		}
	}
}

// capNetRaw is a vfs_cap_data (revision 2, effective) granting CAP_NET_RAW.
func capNetRaw() string {
	b := make([]byte, 20)
	binary.LittleEndian.PutUint32(b[0:], 0x02000001)
	binary.LittleEndian.PutUint32(b[4:], 1<<unix.CAP_NET_RAW)
	return string(b)
}

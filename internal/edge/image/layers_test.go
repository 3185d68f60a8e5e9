//go:build linux

package image

import (
	"archive/tar"
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"io"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"golang.org/x/sys/unix"

	"dsec.dev/dsec/internal/errdefs"
	"dsec.dev/dsec/internal/testutil"
)

// tarBytes returns entries as an uncompressed tar stream.
func tarBytes(t *testing.T, entries []tarEntry) []byte {
	t.Helper()
	var buf bytes.Buffer
	tw := tar.NewWriter(&buf)
	for _, e := range entries {
		hdr := e.hdr
		hdr.Format = tar.FormatPAX
		if err := tw.WriteHeader(&hdr); err != nil {
			t.Fatal(err)
		}
		if _, err := io.WriteString(tw, e.body); err != nil {
			t.Fatal(err)
		}
	}
	if err := tw.Close(); err != nil {
		t.Fatal(err)
	}
	return buf.Bytes()
}

// streams turns tar streams into sources named by their digests; opened
// counts the calls to Open.
func streams(layers [][]byte, opened *int) []LayerSource {
	var out []LayerSource
	for _, b := range layers {
		sum := sha256.Sum256(b)
		out = append(out, LayerSource{Name: "sha256:" + hex.EncodeToString(sum[:]), Open: func() (io.ReadCloser, error) {
			*opened++
			return io.NopCloser(bytes.NewReader(b)), nil
		}})
	}
	return out
}

// overlay mounts layers (bottom first) read-only with overlayfs and returns
// the merged directory, unmounted at cleanup.
func overlay(t *testing.T, s *Store, dir string, layers []Layer) string {
	t.Helper()
	var lowerdirs []string
	for _, l := range layers {
		d, err := s.Mount(context.Background(), l.Digest)
		if err != nil {
			t.Fatal(err)
		}
		lowerdirs = append([]string{d}, lowerdirs...)
	}
	merged := filepath.Join(dir, "merged")
	if err := os.Mkdir(merged, 0o755); err != nil {
		t.Fatal(err)
	}
	if err := unix.Mount("overlay", merged, "overlay", unix.MS_RDONLY, "lowerdir="+strings.Join(lowerdirs, ":")); err != nil {
		t.Fatalf("mount overlay: %v", err)
	}
	t.Cleanup(func() {
		if err := unix.Unmount(merged, 0); err != nil {
			t.Errorf("unmount overlay: %v", err)
		}
	})
	return merged
}

func TestImportLayersWhiteouts(t *testing.T) {
	needImport(t)
	base := t.TempDir()
	s := newStore(t, filepath.Join(base, "store"))
	ctx := context.Background()
	below, err := s.Import(ctx, "below:1", KindBase, writeTar(t, base, "below.tar", false, []tarEntry{
		file("a/x", "below x\n"), file("d/below", "below\n"), file("gone/file", "below\n"), file("keep", "below keep\n"), file("e/f", "below\n"),
	}), ImportOptions{})
	if err != nil {
		t.Fatal(err)
	}
	l1 := tarBytes(t, []tarEntry{
		dirEnt("a/"), file("a/x", "l1 x\n"), file("a/y", "l1 y\n"),
		dirEnt("d/"), file("d/old", "old\n"), dirEnt("d/sub/"), file("d/sub/deep", "deep\n"),
		file("gone/other", "l1\n"),
		file("d2/sub/early", "l1\n"), file("d2/early", "l1\n"), file("e/g", "l1\n"),
	})
	l2 := tarBytes(t, []tarEntry{
		file("a/.wh.x", ""),
		dirEnt("d/"), file("d/.wh..wh..opq", ""), file("d/new", "new\n"),
		file(".wh.gone", ""),
		file("fresh", "fresh\n"), file(".wh.fresh", ""), // same layer: the whiteout is for lower layers only
		file("d2/sub/late", "l2\n"), file("d2/.wh..wh..opq", ""), // the opaque marker after the layer's own entries
		file(".wh.e", ""),
	})
	// Deleted directories made again, with and without a directory entry, are opaque.
	l3 := tarBytes(t, []tarEntry{file("gone/again", "l3\n"), dirEnt("e/"), file("e/h", "l3\n")})
	opened := 0
	top, err := s.ImportLayers(ctx, "", KindToolkit, streams([][]byte{l1, l2, l3}, &opened), ImportOptions{})
	if err != nil {
		t.Fatal(err)
	}
	assertTmpEmpty(t, s)
	merged := overlay(t, s, base, []Layer{below, top})
	want := map[string]string{"a/y": "l1 y\n", "d/new": "new\n", "keep": "below keep\n", "fresh": "fresh\n", "gone/again": "l3\n", "d2/sub/late": "l2\n", "e/h": "l3\n"}
	for name, body := range want {
		if b, err := os.ReadFile(filepath.Join(merged, name)); err != nil || string(b) != body {
			t.Errorf("%s = %q, %v; want %q", name, b, err, body)
		}
	}
	for _, name := range []string{"a/x", "d/old", "d/sub", "d/below", "gone/file", "gone/other", "d2/sub/early", "d2/early", "e/f", "e/g"} {
		if _, err := os.Lstat(filepath.Join(merged, name)); !errors.Is(err, os.ErrNotExist) {
			t.Errorf("%s through overlay: %v; want it deleted", name, err)
		}
	}

	// The same digest-named streams again: the layer is reused, not rebuilt.
	again, err := s.ImportLayers(ctx, "tk:again", KindToolkit, streams([][]byte{l1, l2, l3}, &opened), ImportOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if again.Digest != top.Digest || opened != 3 {
		t.Errorf("re-import gave %s after %d opens; want %s reused after 3", again.Digest, opened, top.Digest)
	}
}

func TestImportLayersRefuses(t *testing.T) {
	needImport(t)
	base := t.TempDir()
	s := newStore(t, filepath.Join(base, "store"))
	ctx := context.Background()
	opaqueXattr := dirEnt("o/")
	opaqueXattr.hdr.PAXRecords = map[string]string{"SCHILY.xattr.trusted.overlay.opaque": "y"}
	good := tarBytes(t, []tarEntry{file("f", "x")})
	for _, tc := range []struct {
		name string
		srcs []LayerSource
		want string
	}{
		{"device from the archive", streams([][]byte{tarBytes(t, []tarEntry{device("w", tar.TypeChar, 0, 0)})}, new(int)), "character device 0:0 outside /dev"},
		{"opaque xattr from the archive", streams([][]byte{tarBytes(t, []tarEntry{opaqueXattr})}, new(int)), "trusted.overlay.opaque"},
		{"whiteout of ..", streams([][]byte{tarBytes(t, []tarEntry{file("a/.wh...", "")})}, new(int)), "whiteout names no file"},
		{"traversal", streams([][]byte{tarBytes(t, []tarEntry{file("../x", "")})}, new(int)), ".."},
		{"digest mismatch", []LayerSource{{Name: "sha256:" + strings.Repeat("0", 64), Open: func() (io.ReadCloser, error) {
			return io.NopCloser(bytes.NewReader(good)), nil
		}}}, "content has digest"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, err := s.ImportLayers(ctx, "bad:1", KindBase, tc.srcs, ImportOptions{})
			if !errors.Is(err, errdefs.ErrInvalidArgument) || !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("ImportLayers: %v; want invalid argument mentioning %q", err, tc.want)
			}
			if _, err := s.Get("bad:1"); !errors.Is(err, errdefs.ErrNotFound) {
				t.Errorf("Get(bad:1) = %v; want not found", err)
			}
			assertTmpEmpty(t, s)
		})
	}
}

// An OCI layer's device nodes under /dev are left out, as Import leaves
// out a tree's.
func TestImportLayersSkipsDevNodes(t *testing.T) {
	needImport(t)
	s := newStore(t, filepath.Join(t.TempDir(), "store"))
	layer := tarBytes(t, []tarEntry{dirEnt("dev/"), device("dev/console", tar.TypeChar, 5, 1), device("dev/w", tar.TypeChar, 0, 0), file("f", "x")})
	l, err := s.ImportLayers(context.Background(), "oci:1", KindBase, streams([][]byte{layer}, new(int)), ImportOptions{})
	if err != nil {
		t.Fatalf("ImportLayers: %v", err)
	}
	if len(l.Warnings) != 1 || !strings.Contains(l.Warnings[0], "left out 2 device nodes or other special files under /dev (/dev/console, /dev/w)") {
		t.Errorf("Warnings = %q; want /dev/console and /dev/w left out", l.Warnings)
	}
}

func TestImagesInIndex(t *testing.T) {
	needImport(t)
	base := t.TempDir()
	root := filepath.Join(base, "store")
	// An index written before images existed stays readable.
	if err := os.MkdirAll(root, 0o700); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(root, "index.json"), []byte(`{"layers":{},"refs":{},"environments":{}}`), 0o600); err != nil {
		t.Fatal(err)
	}
	s := newStore(t, root)
	ctx := context.Background()
	imp := func(ref string, kind Kind, body string) Layer {
		l, err := s.Import(ctx, ref, kind, writeTar(t, base, strings.ReplaceAll(ref, ":", "_")+".tar", false, []tarEntry{file("f-"+body, body)}), ImportOptions{})
		if err != nil {
			t.Fatal(err)
		}
		return l
	}
	bottom, shared, tk := imp("", KindBase, "bottom"), imp("", KindBase, "shared"), imp("tk:1", KindToolkit, "tk")
	other := imp("", KindBase, "other")
	cfg := ImageConfig{Env: []string{"PATH=/bin"}, WorkingDir: "/w", User: "1000", Entrypoint: []string{"/bin/sh"}, Cmd: []string{"-c", "true"}}
	if err := s.SetImage(ctx, "img:1", []string{bottom.Digest, shared.Digest}, cfg); err != nil {
		t.Fatal(err)
	}
	if err := s.SetImage(ctx, "img2", []string{other.Digest, shared.Digest}, ImageConfig{}); err != nil {
		t.Fatal(err)
	}
	if err := s.SetImage(ctx, "bad:1", []string{bottom.Digest, bottom.Digest}, ImageConfig{}); !errors.Is(err, errdefs.ErrInvalidArgument) {
		t.Errorf("SetImage with a repeated layer: %v; want invalid argument", err)
	}
	if err := s.SetImage(ctx, "bad:1", []string{"sha256:" + strings.Repeat("1", 64)}, ImageConfig{}); !errors.Is(err, errdefs.ErrNotFound) {
		t.Errorf("SetImage with a missing layer: %v; want not found", err)
	}
	info, err := s.Image("img:1")
	if err != nil {
		t.Fatal(err)
	}
	if info.Ref != "img:1" || strings.Join(info.Digests, " ") != bottom.Digest+" "+shared.Digest || info.Config.WorkingDir != "/w" || strings.Join(info.Config.Cmd, " ") != "-c true" {
		t.Errorf("Image = %+v", info)
	}
	imgs, err := s.Images()
	if err != nil || len(imgs) != 2 || imgs[0].Ref != "img2:latest" || imgs[1].Ref != "img:1" {
		t.Errorf("Images = %+v, %v", imgs, err)
	}
	l, err := s.Get(shared.Digest)
	if err != nil || strings.Join(l.Images, " ") != "img2:latest img:1" {
		t.Errorf("shared layer = %+v, %v; want used by both images", l, err)
	}

	layers, err := s.ResolveEnvironment("img:1+tk:1")
	if err != nil {
		t.Fatal(err)
	}
	var got []string
	for _, l := range layers {
		got = append(got, l.Digest)
	}
	if strings.Join(got, " ") != bottom.Digest+" "+shared.Digest+" "+tk.Digest {
		t.Errorf("resolved %v", got)
	}
	for env, want := range map[string]error{
		"img:1+img2":             errdefs.ErrInvalidArgument, // two bases
		"img:1+" + other.Digest:  errdefs.ErrInvalidArgument, // a base layer on an image
		"img:1+" + shared.Digest: errdefs.ErrInvalidArgument, // a layer twice
		"tk:1+img:1":             nil,
		"nope:1":                 errdefs.ErrNotFound,
	} {
		if _, err := s.ResolveEnvironment(env); !errors.Is(err, want) && !(want == nil && err == nil) {
			t.Errorf("ResolveEnvironment(%q) = %v; want %v", env, err, want)
		}
	}

	if err := s.Remove(shared.Digest); !errors.Is(err, errdefs.ErrFailedPrecondition) {
		t.Errorf("Remove(layer of an image) = %v; want failed precondition", err)
	}
	if err := s.Remove("img:1"); err != nil {
		t.Fatal(err)
	}
	if _, err := s.Get(bottom.Digest); !errors.Is(err, errdefs.ErrNotFound) {
		t.Errorf("bottom layer after removing its image: %v; want removed", err)
	}
	if _, err := s.Get(shared.Digest); err != nil {
		t.Errorf("shared layer after removing one image: %v; want kept", err)
	}
	if _, err := os.Stat(s.blobPath(strings.TrimPrefix(bottom.Digest, "sha256:"))); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("bottom layer file: %v; want removed", err)
	}
	// A layer ref of an image's name replaces the image.
	if _, err := s.Import(ctx, "img2", KindBase, writeTar(t, base, "x.tar", false, []tarEntry{file("x", "x")}), ImportOptions{}); err != nil {
		t.Fatal(err)
	}
	if _, err := s.Image("img2"); !errors.Is(err, errdefs.ErrNotFound) {
		t.Errorf("Image(img2) after a layer took its name: %v", err)
	}
}

// whiteoutsIn lists the whiteouts and opaque directories of a layer.
func whiteoutsIn(t *testing.T, s *Store, l Layer) []string {
	t.Helper()
	dir, err := s.Mount(context.Background(), l.Digest)
	if err != nil {
		t.Fatal(err)
	}
	var out []string
	for _, e := range describe(t, dir) {
		if strings.HasSuffix(e, "!") || strings.HasSuffix(e, "/+") {
			out = append(out, e)
		}
	}
	return out
}

func TestImportLayersDropsWhiteoutsHidingNothing(t *testing.T) {
	needImport(t)
	base := t.TempDir()
	s := newStore(t, filepath.Join(base, "store"))
	ctx := context.Background()
	below, err := s.Import(ctx, "below:1", KindBase, writeTar(t, base, "below.tar", false, []tarEntry{
		file("a/x", "below x\n"), file("keep", "below keep\n"),
	}), ImportOptions{})
	if err != nil {
		t.Fatal(err)
	}
	l1 := tarBytes(t, []tarEntry{file("n/only", "l1\n"), file("a/y", "l1\n"), file("a/z", "l1\n"), file("o/old", "l1\n")})
	l2 := tarBytes(t, []tarEntry{
		file("n/.wh.only", ""), // hides l1's file only: nothing below the built layer
		file("a/.wh.x", ""),    // hides the layer below
		file("a/.wh.z", ""),
		dirEnt("o/"), file("o/.wh..wh..opq", ""), file("o/new", "l2\n"), // opaque over nothing below
	})
	opened := 0
	for _, tc := range []struct {
		name  string
		kind  Kind
		below []Layer
		want  []string // whiteouts and opaque directories in the built layer
	}{
		{"stacked on a layer", KindToolkit, []Layer{below}, []string{"a/x!"}},
		{"bottom-most", KindBase, nil, nil},
		{"stacked on what is not known", KindToolkit, nil, []string{"a/x!", "a/z!", "n/only!", "o/+"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var digests []string
			for _, l := range tc.below {
				digests = append(digests, l.Digest)
			}
			before := opened
			l, err := s.ImportLayers(ctx, "", tc.kind, streams([][]byte{l1, l2}, &opened), ImportOptions{Below: digests})
			if err != nil {
				t.Fatal(err)
			}
			if opened != before+2 {
				t.Errorf("built from %d streams; want 2 (no reuse of a build over other layers)", opened-before)
			}
			assertTmpEmpty(t, s)
			if got := whiteoutsIn(t, s, l); strings.Join(got, " ") != strings.Join(tc.want, " ") {
				t.Errorf("whiteouts and opaque dirs in the layer: %v; want %v", got, tc.want)
			}
			if tc.below == nil {
				return
			}
			dir := t.TempDir()
			merged := overlay(t, s, dir, append(tc.below, l))
			testutil.CheckListable(t, merged)
			for name, want := range map[string]string{"a/y": "l1\n", "keep": "below keep\n", "o/new": "l2\n"} {
				if b, err := os.ReadFile(filepath.Join(merged, name)); err != nil || string(b) != want {
					t.Errorf("%s = %q, %v; want %q", name, b, err, want)
				}
			}
			for _, d := range []string{"n", "a", "o"} {
				ents, err := os.ReadDir(filepath.Join(merged, d))
				var names []string
				for _, e := range ents {
					names = append(names, e.Name())
				}
				want := map[string]string{"n": "", "a": "y", "o": "new"}[d]
				if err != nil || strings.Join(names, " ") != want {
					t.Errorf("ls %s = %v, %v; want [%s]", d, names, err, want)
				}
			}
		})
	}
}

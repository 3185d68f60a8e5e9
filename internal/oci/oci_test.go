//go:build linux

package oci

import (
	"archive/tar"
	"bytes"
	"compress/gzip"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log"
	"log/slog"
	"math/rand/v2"
	"net/http/httptest"
	"os"
	"path/filepath"
	"sort"
	"strings"
	"testing"
	"time"

	"github.com/google/go-containerregistry/pkg/name"
	"github.com/google/go-containerregistry/pkg/registry"
	v1 "github.com/google/go-containerregistry/pkg/v1"
	"github.com/google/go-containerregistry/pkg/v1/empty"
	"github.com/google/go-containerregistry/pkg/v1/layout"
	"github.com/google/go-containerregistry/pkg/v1/mutate"
	"github.com/google/go-containerregistry/pkg/v1/remote"
	"github.com/google/go-containerregistry/pkg/v1/tarball"
	"golang.org/x/sys/unix"

	"dsec.dev/dsec/internal/edge/image"
	"dsec.dev/dsec/internal/errdefs"
	"dsec.dev/dsec/internal/testutil"
)

// needImport gates tests that import layers: they chown, mknod, set
// trusted.* xattrs, run mkfs.erofs and mount.
func needImport(t *testing.T) {
	t.Helper()
	testutil.RequireRoot(t)
	testutil.RequireCommand(t, "mkfs.erofs")
}

func newStore(t *testing.T, root string) *image.Store {
	t.Helper()
	s, err := image.Open(root, slog.New(slog.DiscardHandler))
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

// ent is one tar entry of a test layer.
type ent struct {
	name, body, link string
	typ              byte
	mode             int64
	size             int64 // declared size when body is empty, for tar bombs
}

func reg(name, body string) ent { return ent{name: name, body: body, typ: tar.TypeReg, mode: 0o644} }
func dir(name string) ent       { return ent{name: name, typ: tar.TypeDir, mode: 0o755} }
func sym(name, target string) ent {
	return ent{name: name, link: target, typ: tar.TypeSymlink, mode: 0o777}
}
func hard(name, target string) ent {
	return ent{name: name, link: target, typ: tar.TypeLink, mode: 0o644}
}

func tarOf(t *testing.T, ents []ent) []byte {
	t.Helper()
	var buf bytes.Buffer
	tw := tar.NewWriter(&buf)
	for _, e := range ents {
		size := int64(len(e.body))
		if e.typ != tar.TypeReg {
			size = 0
		}
		if e.size > 0 {
			size = e.size
		}
		hdr := &tar.Header{Typeflag: e.typ, Name: e.name, Linkname: e.link, Mode: e.mode, Size: size, ModTime: time.Unix(1600000000, 0), Format: tar.FormatPAX}
		if err := tw.WriteHeader(hdr); err != nil {
			t.Fatal(err)
		}
		if e.size > 0 {
			if _, err := io.CopyN(tw, zeros{}, e.size); err != nil {
				t.Fatal(err)
			}
		} else if _, err := io.WriteString(tw, e.body); err != nil {
			t.Fatal(err)
		}
	}
	if err := tw.Close(); err != nil {
		t.Fatal(err)
	}
	return buf.Bytes()
}

type zeros struct{}

func (zeros) Read(p []byte) (int, error) { clear(p); return len(p), nil }

func layerOf(t *testing.T, ents []ent) v1.Layer {
	t.Helper()
	b := tarOf(t, ents)
	l, err := tarball.LayerFromOpener(func() (io.ReadCloser, error) { return io.NopCloser(bytes.NewReader(b)), nil })
	if err != nil {
		t.Fatal(err)
	}
	return l
}

var testConfig = v1.Config{Env: []string{"PATH=/usr/bin:/bin", "LANG=C.UTF-8"}, WorkingDir: "/work", User: "1000:1000", Entrypoint: []string{"/bin/sh"}, Cmd: []string{"-c", "echo hi"}}

func imageOf(t *testing.T, layers ...[]ent) v1.Image {
	t.Helper()
	var ls []v1.Layer
	for _, ents := range layers {
		ls = append(ls, layerOf(t, ents))
	}
	img, err := mutate.AppendLayers(empty.Image, ls...)
	if err != nil {
		t.Fatal(err)
	}
	if img, err = mutate.Config(img, testConfig); err != nil {
		t.Fatal(err)
	}
	return img
}

// writeLayout writes img as an OCI layout named tag and returns its directory.
func writeLayout(t *testing.T, dir string, img v1.Image, tag string) string {
	t.Helper()
	p, err := layout.Write(dir, empty.Index)
	if err != nil {
		t.Fatal(err)
	}
	if err := p.AppendImage(img, layout.WithAnnotations(map[string]string{refNameAnnotation: tag})); err != nil {
		t.Fatal(err)
	}
	return dir
}

func writeArchive(t *testing.T, file string, img v1.Image) string {
	t.Helper()
	tag, err := name.NewTag("example.test/app:1")
	if err != nil {
		t.Fatal(err)
	}
	if err := tarball.WriteToFile(file, tag, img); err != nil {
		t.Fatal(err)
	}
	return file
}

// writeDockerSave writes img the way `docker save` does: uncompressed
// layer.tar files, the config named by its digest and a manifest.json.
func writeDockerSave(t *testing.T, file string, img v1.Image) string {
	t.Helper()
	var buf bytes.Buffer
	tw := tar.NewWriter(&buf)
	add := func(name string, data []byte) {
		if err := tw.WriteHeader(&tar.Header{Typeflag: tar.TypeReg, Name: name, Mode: 0o644, Size: int64(len(data))}); err != nil {
			t.Fatal(err)
		}
		if _, err := tw.Write(data); err != nil {
			t.Fatal(err)
		}
	}
	cfg, err := img.RawConfigFile()
	if err != nil {
		t.Fatal(err)
	}
	cfgName, err := img.ConfigName()
	if err != nil {
		t.Fatal(err)
	}
	add(cfgName.Hex+".json", cfg)
	layers, err := img.Layers()
	if err != nil {
		t.Fatal(err)
	}
	var paths []string
	for i, l := range layers {
		rc, err := l.Uncompressed()
		if err != nil {
			t.Fatal(err)
		}
		data, err := io.ReadAll(rc)
		rc.Close()
		if err != nil {
			t.Fatal(err)
		}
		p := fmt.Sprintf("layer%d/layer.tar", i)
		add(p, data)
		paths = append(paths, p)
	}
	m, err := json.Marshal([]map[string]any{{"Config": cfgName.Hex + ".json", "RepoTags": []string{"app:v1"}, "Layers": paths}})
	if err != nil {
		t.Fatal(err)
	}
	add("manifest.json", m)
	if err := tw.Close(); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(file, buf.Bytes(), 0o644); err != nil {
		t.Fatal(err)
	}
	return file
}

// serveRegistry runs a registry on loopback and pushes img as repo:tag; it
// returns the docker:// source.
func serveRegistry(t *testing.T, img v1.Image, repoTag string) string {
	t.Helper()
	srv := httptest.NewServer(registry.New(registry.Logger(log.New(io.Discard, "", 0))))
	t.Cleanup(srv.Close)
	host := strings.TrimPrefix(srv.URL, "http://")
	ref, err := name.ParseReference(host+"/"+repoTag, name.Insecure)
	if err != nil {
		t.Fatal(err)
	}
	if err := remote.Write(ref, img); err != nil {
		t.Fatal(err)
	}
	return "docker://" + host + "/" + repoTag
}

func sampleImage(t *testing.T) v1.Image {
	return imageOf(t,
		[]ent{dir("etc/"), reg("etc/secret", "base secret\n"), reg("etc/keep", "keep\n"), dir("opq/"), reg("opq/old", "old\n"), dir("opq/sub/"), reg("opq/sub/deep", "deep\n"), sym("etc/link", "keep")},
		[]ent{dir("etc/"), reg("etc/.wh.secret", ""), reg("etc/added", "added\n"), dir("opq/"), reg("opq/.wh..wh..opq", ""), reg("opq/new", "new\n")},
	)
}

// mountImage stacks the layers of environment env with overlayfs and returns
// the merged directory, unmounted at cleanup.
func mountImage(t *testing.T, s *image.Store, env, dir string) string {
	t.Helper()
	layers, err := s.ResolveEnvironment(env)
	if err != nil {
		t.Fatal(err)
	}
	var lowerdirs []string
	for _, l := range layers {
		d, err := s.Mount(context.Background(), l.Digest)
		if err != nil {
			t.Fatal(err)
		}
		lowerdirs = append([]string{d}, lowerdirs...) // overlay lists the top first
	}
	merged := filepath.Join(dir, "merged")
	if err := os.MkdirAll(merged, 0o755); err != nil {
		t.Fatal(err)
	}
	if len(lowerdirs) == 1 {
		// Without an upper directory overlayfs wants two lower ones.
		lowerdirs = append(lowerdirs, emptyDir(t, dir))
	}
	opts := "lowerdir=" + strings.Join(lowerdirs, ":")
	if err := unix.Mount("overlay", merged, "overlay", unix.MS_RDONLY, opts); err != nil {
		t.Fatalf("mount overlay %s: %v", opts, err)
	}
	t.Cleanup(func() {
		if err := unix.Unmount(merged, 0); err != nil {
			t.Errorf("unmount overlay: %v", err)
		}
	})
	return merged
}

func emptyDir(t *testing.T, dir string) string {
	d := filepath.Join(dir, "empty")
	if err := os.MkdirAll(d, 0o755); err != nil {
		t.Fatal(err)
	}
	return d
}

func TestSourcesGiveSameImage(t *testing.T) {
	needImport(t)
	base := t.TempDir()
	img := sampleImage(t)
	// A layout holding two images, the one wanted named by its tag.
	multi := writeLayout(t, filepath.Join(base, "multi"), imageOf(t, []ent{reg("other", "x\n")}), "other")
	if err := layout.Path(multi).AppendImage(img, layout.WithAnnotations(map[string]string{refNameAnnotation: "v1"})); err != nil {
		t.Fatal(err)
	}
	sources := map[string]string{
		"oci":            "oci:" + writeLayout(t, filepath.Join(base, "layout"), img, "v1"),
		"oci-tag":        "oci:" + multi + ":v1",
		"docker-archive": "docker-archive:" + writeArchive(t, filepath.Join(base, "img.tar"), img),
		"docker-save":    "docker-archive:" + writeDockerSave(t, filepath.Join(base, "save.tar"), img),
		"registry":       serveRegistry(t, img, "team/app:v1"),
	}
	s := newStore(t, filepath.Join(base, "store-untagged"))
	if _, err := Import(context.Background(), s, "app:v1", "oci:"+multi, Options{}); !errors.Is(err, errdefs.ErrInvalidArgument) || !strings.Contains(err.Error(), "oci:DIR:TAG") {
		t.Errorf("Import from a two-image layout without a tag: %v; want invalid argument asking for a tag", err)
	}
	first := map[int64][]string{}
	var names []string
	for n := range sources {
		names = append(names, n)
	}
	sort.Strings(names)
	for _, n := range names {
		for _, collapse := range []int64{0, -1} {
			s := newStore(t, filepath.Join(base, fmt.Sprintf("store-%s%d", n, collapse)))
			var phases []string
			res, err := Import(context.Background(), s, "app:v1", sources[n], Options{Insecure: true, CollapseBelow: collapse, Progress: func(p Progress) {
				if len(phases) == 0 || phases[len(phases)-1] != p.Phase {
					phases = append(phases, p.Phase)
				}
			}})
			if err != nil {
				t.Fatalf("%s (collapse %d): %v", n, collapse, err)
			}
			wantLayers := 1
			if collapse < 0 {
				wantLayers = 2
			}
			if res.Layers != wantLayers || res.Collapsed != 2 || len(res.Digests) != wantLayers || res.Ref != "app:v1" {
				t.Errorf("%s: result %+v; want %d EROFS layers from 2", n, res, wantLayers)
			}
			if got := strings.Join(phases, ","); got != "resolve,layer,publish,done" {
				t.Errorf("%s: progress phases %s", n, got)
			}
			info, err := s.Image("app:v1")
			if err != nil {
				t.Fatal(err)
			}
			if strings.Join(info.Digests, " ") != strings.Join(res.Digests, " ") ||
				strings.Join(info.Config.Env, " ") != strings.Join(testConfig.Env, " ") || info.Config.WorkingDir != "/work" ||
				info.Config.User != "1000:1000" || strings.Join(info.Config.Entrypoint, " ") != "/bin/sh" || strings.Join(info.Config.Cmd, " ") != "-c echo hi" {
				t.Errorf("%s: stored image %+v", n, info)
			}
			if first[collapse] == nil {
				first[collapse] = res.Digests
			} else if strings.Join(first[collapse], " ") != strings.Join(res.Digests, " ") {
				t.Errorf("%s (collapse %d) gave layers %v; %s gave %v", n, collapse, res.Digests, names[0], first[collapse])
			}
		}
	}
}

func TestWhiteoutsThroughOverlay(t *testing.T) {
	needImport(t)
	base := t.TempDir()
	src := "oci:" + writeLayout(t, filepath.Join(base, "layout"), sampleImage(t), "v1")
	for _, collapse := range []int64{0, -1} {
		t.Run(map[int64]string{0: "collapsed", -1: "separate"}[collapse], func(t *testing.T) {
			dir := t.TempDir()
			s := newStore(t, filepath.Join(dir, "store"))
			if _, err := Import(context.Background(), s, "app:v1", src, Options{CollapseBelow: collapse}); err != nil {
				t.Fatal(err)
			}
			merged := mountImage(t, s, "app:v1", dir)
			for name, want := range map[string]string{"etc/keep": "keep\n", "etc/added": "added\n", "opq/new": "new\n"} {
				if b, err := os.ReadFile(filepath.Join(merged, name)); err != nil || string(b) != want {
					t.Errorf("%s = %q, %v; want %q", name, b, err, want)
				}
			}
			if target, err := os.Readlink(filepath.Join(merged, "etc/link")); err != nil || target != "keep" {
				t.Errorf("etc/link -> %q, %v", target, err)
			}
			if _, err := os.Lstat(filepath.Join(merged, "etc/secret")); !errors.Is(err, os.ErrNotExist) {
				t.Errorf("etc/secret: %v; want deleted by the upper layer", err)
			}
			ents, err := os.ReadDir(filepath.Join(merged, "opq"))
			if err != nil || len(ents) != 1 || ents[0].Name() != "new" {
				t.Errorf("opq holds %v, %v; want only the upper layer's new", ents, err)
			}
			// A collapsed layer is the only one holding etc/: a whiteout
			// left in it would be listed there and fail to stat.
			if got := ls(t, filepath.Join(merged, "etc")); got != "added keep link" {
				t.Errorf("ls etc = %s; want added keep link", got)
			}
			testutil.CheckListable(t, merged)
		})
	}
}

// ls lists a directory's names, sorted, space-separated.
func ls(t *testing.T, dir string) string {
	t.Helper()
	ents, err := os.ReadDir(dir)
	if err != nil {
		t.Fatal(err)
	}
	var names []string
	for _, e := range ents {
		names = append(names, e.Name())
	}
	return strings.Join(names, " ")
}

// TestCollapsedGroupOverLayers collapses the upper two of three OCI layers
// into one EROFS layer over the first: whiteouts of files the group made
// itself hide nothing below it and are left out; those hiding the first
// layer's files stay.
func TestCollapsedGroupOverLayers(t *testing.T) {
	needImport(t)
	base := t.TempDir()
	noise := make([]byte, 256<<10) // incompressible, so the first layer is a group of its own
	rand.NewChaCha8([32]byte{}).Read(noise)
	img := imageOf(t,
		[]ent{dir("etc/"), reg("etc/base", "base\n"), reg("noise", string(noise))},
		[]ent{dir("opt/"), dir("opt/app/"), reg("opt/app/tmp", "l2\n"), reg("opt/app/bin", "l2\n"), reg("etc/l2", "l2\n")},
		[]ent{reg("opt/app/.wh.tmp", ""), reg("etc/.wh.l2", ""), reg("etc/.wh.base", "")},
	)
	src := "oci:" + writeLayout(t, filepath.Join(base, "layout"), img, "v1")
	dir := t.TempDir()
	s := newStore(t, filepath.Join(dir, "store"))
	res, err := Import(context.Background(), s, "app:v1", src, Options{CollapseBelow: 64 << 10})
	if err != nil {
		t.Fatal(err)
	}
	if res.Layers != 2 {
		t.Fatalf("%d EROFS layers; want 2 (the first OCI layer, then the other two collapsed)", res.Layers)
	}
	merged := mountImage(t, s, "app:v1", dir)
	testutil.CheckListable(t, merged)
	if got := ls(t, filepath.Join(merged, "opt/app")); got != "bin" {
		t.Errorf("ls opt/app = %s; want bin", got)
	}
	if got := ls(t, filepath.Join(merged, "etc")); got != "" {
		t.Errorf("ls etc = %s; want nothing (etc/base deleted by the top layer)", got)
	}
}

func TestImportRefusesHostileImages(t *testing.T) {
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
	ok := []ent{reg("ok", "fine\n")}

	layoutOf := func(t *testing.T, img v1.Image) string {
		return writeLayout(t, filepath.Join(t.TempDir(), "layout"), img, "v1")
	}
	// tamper replaces the blob at digest in the layout with data.
	tamper := func(t *testing.T, dir string, h v1.Hash, data []byte) {
		t.Helper()
		if err := os.WriteFile(filepath.Join(dir, "blobs", h.Algorithm, h.Hex), data, 0o644); err != nil {
			t.Fatal(err)
		}
	}
	for _, tc := range []struct {
		name string
		src  func(t *testing.T) string
		opts image.ImportOptions
		want string
	}{
		{"path traversal", func(t *testing.T) string {
			return "oci:" + layoutOf(t, imageOf(t, ok, []ent{reg("../../outside/passwd", "owned\n")}))
		}, image.ImportOptions{}, ".. component"},
		{"symlink escape", func(t *testing.T) string {
			return "oci:" + layoutOf(t, imageOf(t, ok, []ent{sym("esc", "../../../outside")}))
		}, image.ImportOptions{}, "climbs above the layer root"},
		{"write through a symlink", func(t *testing.T) string {
			// (In separate layers the upper's etc/ would be a directory
			// replacing the symlink, as overlayfs stacks them: no escape.)
			return "oci:" + layoutOf(t, imageOf(t, []ent{sym("etc", outside), reg("etc/passwd", "owned\n")}))
		}, image.ImportOptions{}, "symlink"},
		{"hard link out", func(t *testing.T) string {
			return "oci:" + layoutOf(t, imageOf(t, []ent{hard("pw", "../outside/passwd")}))
		}, image.ImportOptions{}, "outside the layer"},
		{"tar bomb", func(t *testing.T) string {
			return "oci:" + layoutOf(t, imageOf(t, ok, []ent{{name: "big", typ: tar.TypeReg, mode: 0o644, size: 1 << 20}}))
		}, image.ImportOptions{MaxBytes: 64 << 10}, "MaxBytes"},
		{"layer blob does not match its digest", func(t *testing.T) string {
			img := imageOf(t, ok, []ent{reg("a", "original\n")})
			dir := layoutOf(t, img)
			m, err := img.Manifest()
			if err != nil {
				t.Fatal(err)
			}
			var buf bytes.Buffer
			zw := gzip.NewWriter(&buf)
			zw.Write(tarOf(t, []ent{reg("a", "tampered\n")}))
			zw.Close()
			tamper(t, dir, m.Layers[1].Digest, buf.Bytes())
			return "oci:" + dir
		}, image.ImportOptions{}, "content has digest"},
		{"manifest does not match its digest", func(t *testing.T) string {
			img := imageOf(t, ok)
			dir := layoutOf(t, img)
			h, err := img.Digest()
			if err != nil {
				t.Fatal(err)
			}
			raw, err := img.RawManifest()
			if err != nil {
				t.Fatal(err)
			}
			tamper(t, dir, h, append(raw, '\n'))
			return "oci:" + dir
		}, image.ImportOptions{}, "verify manifest"},
		{"config does not match its digest", func(t *testing.T) string {
			img := imageOf(t, ok)
			dir := layoutOf(t, img)
			m, err := img.Manifest()
			if err != nil {
				t.Fatal(err)
			}
			raw, err := img.RawConfigFile()
			if err != nil {
				t.Fatal(err)
			}
			tamper(t, dir, m.Config.Digest, append(raw, ' '))
			return "oci:" + dir
		}, image.ImportOptions{}, "verify config"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, err := Import(context.Background(), s, "bad:1", tc.src(t), Options{CollapseBelow: -1, ImportOptions: tc.opts})
			if !errors.Is(err, errdefs.ErrInvalidArgument) || !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("Import: %v; want invalid argument mentioning %q", err, tc.want)
			}
			if _, err := s.Image("bad:1"); !errors.Is(err, errdefs.ErrNotFound) {
				t.Errorf("Image(bad:1) = %v; want not found", err)
			}
			if after := testutil.TreeSnapshot(t, outside); after != before {
				t.Errorf("outside changed:\n%s\nwas\n%s", after, before)
			}
			if ents, _ := os.ReadDir(filepath.Join(base, "store", "tmp")); len(ents) != 0 {
				t.Errorf("store tmp holds %d leftovers", len(ents))
			}
		})
	}
}

func TestCollapseThreshold(t *testing.T) {
	needImport(t)
	base := t.TempDir()
	src := "oci:" + writeLayout(t, filepath.Join(base, "layout"), imageOf(t,
		[]ent{reg("one", "1\n")}, []ent{reg("two", "2\n")}, []ent{reg("three", "3\n")}), "v1")
	for _, tc := range []struct {
		below int64
		want  int
	}{{0, 1}, {-1, 3}, {1 << 20, 1}} {
		s := newStore(t, filepath.Join(t.TempDir(), "store"))
		res, err := Import(context.Background(), s, "three:1", src, Options{CollapseBelow: tc.below})
		if err != nil {
			t.Fatal(err)
		}
		if res.Layers != tc.want || res.Collapsed != 3 {
			t.Errorf("CollapseBelow %d: %d EROFS layers from %d; want %d from 3", tc.below, res.Layers, res.Collapsed, tc.want)
		}
	}
}

func TestInterruptedImportResumes(t *testing.T) {
	needImport(t)
	base := t.TempDir()
	src := "oci:" + writeLayout(t, filepath.Join(base, "layout"), imageOf(t,
		[]ent{reg("one", "1\n")}, []ent{reg("two", "2\n")}, []ent{reg("three", "3\n")}), "v1")
	s := newStore(t, filepath.Join(base, "store"))
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	_, err := Import(ctx, s, "app:1", src, Options{CollapseBelow: -1, Progress: func(p Progress) {
		if p.Phase == "layer" && p.Layer == 2 {
			cancel()
		}
	}})
	if !errors.Is(err, context.Canceled) {
		t.Fatalf("interrupted Import: %v; want context.Canceled", err)
	}
	if _, err := s.Image("app:1"); !errors.Is(err, errdefs.ErrNotFound) {
		t.Errorf("Image after an interrupted import: %v; want not found", err)
	}
	if ents, _ := os.ReadDir(filepath.Join(base, "store", "tmp")); len(ents) != 0 {
		t.Errorf("store tmp holds %d leftovers", len(ents))
	}

	reused := 0
	res, err := Import(context.Background(), s, "app:1", src, Options{CollapseBelow: -1, Progress: func(p Progress) {
		if p.Phase == "reuse" {
			reused++
		}
	}})
	if err != nil {
		t.Fatal(err)
	}
	if res.Layers != 3 || reused != 1 {
		t.Errorf("re-run: %d layers, %d reused; want 3 layers, the first reused", res.Layers, reused)
	}
	dir := t.TempDir()
	merged := mountImage(t, s, "app:1", dir)
	for _, n := range []string{"one", "two", "three"} {
		if _, err := os.Stat(filepath.Join(merged, n)); err != nil {
			t.Error(err)
		}
	}
}

func TestParseSource(t *testing.T) {
	s, err := image.Open(t.TempDir(), nil)
	if err != nil {
		t.Fatal(err)
	}
	for _, src := range []string{"tar:/x", "oci", "docker://"} {
		if _, err := Import(context.Background(), s, "a:1", src, Options{}); !errors.Is(err, errdefs.ErrInvalidArgument) && !errors.Is(err, errdefs.ErrNotFound) {
			t.Errorf("Import(%q) = %v; want invalid argument", src, err)
		}
	}
	if _, err := Import(context.Background(), s, "Bad Ref", "oci:/nonexistent", Options{}); !errors.Is(err, errdefs.ErrInvalidArgument) {
		t.Errorf("Import with a bad ref = %v; want invalid argument", err)
	}
}

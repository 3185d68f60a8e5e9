package bench

import (
	"archive/tar"
	"context"
	"crypto/sha256"
	"errors"
	"io"
	"os"
	"path/filepath"
	"testing"

	"github.com/google/go-containerregistry/pkg/v1/layout"
	"golang.org/x/sys/unix"
)

func writeFile(t *testing.T, path, data string) {
	t.Helper()
	if err := os.MkdirAll(filepath.Dir(path), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(path, []byte(data), 0o644); err != nil {
		t.Fatal(err)
	}
}

// layerEntries lists a layer's tar entries by name.
func layerEntries(t *testing.T, rc io.ReadCloser) map[string]*tar.Header {
	t.Helper()
	defer rc.Close()
	out := map[string]*tar.Header{}
	tr := tar.NewReader(rc)
	for {
		h, err := tr.Next()
		if errors.Is(err, io.EOF) {
			return out
		}
		if err != nil {
			t.Fatal(err)
		}
		out[h.Name] = h
	}
}

func TestBuildOCI(t *testing.T) {
	dir := t.TempDir()
	base, upper := filepath.Join(dir, "base"), filepath.Join(dir, "upper")
	writeFile(t, filepath.Join(base, "etc", "os-release"), "ID=test\n")
	writeFile(t, filepath.Join(base, "usr", "bin", "tool"), "#!/bin/sh\n")
	writeFile(t, filepath.Join(base, "var", "gone"), "x")
	if err := os.Symlink("usr/bin", filepath.Join(base, "bin")); err != nil {
		t.Fatal(err)
	}
	if err := os.Link(filepath.Join(base, "usr", "bin", "tool"), filepath.Join(base, "usr", "bin", "tool2")); err != nil {
		t.Fatal(err)
	}
	writeFile(t, filepath.Join(upper, "bench", "step.sh"), "#!/bin/sh\necho hi\n")
	root := os.Geteuid() == 0
	if root {
		// Overlayfs whiteout and opaque directory, as an apt-get leaves them.
		if err := os.MkdirAll(filepath.Join(upper, "var"), 0o755); err != nil {
			t.Fatal(err)
		}
		if err := unix.Mknod(filepath.Join(upper, "var", "gone"), unix.S_IFCHR|0o000, 0); err != nil {
			t.Fatal(err)
		}
		if err := os.MkdirAll(filepath.Join(upper, "opaque"), 0o755); err != nil {
			t.Fatal(err)
		}
		if err := unix.Setxattr(filepath.Join(upper, "opaque"), "trusted.overlay.opaque", []byte("y"), 0); err != nil {
			t.Fatal(err)
		}
	}

	cache := filepath.Join(dir, "base.tar.gz")
	outs := []string{filepath.Join(dir, "one"), filepath.Join(dir, "two")}
	for _, out := range outs {
		if err := BuildOCI(context.Background(), OCIBuildOptions{Base: base, BaseCache: cache, Layer: upper, Out: out, Name: "bench-x:latest"}); err != nil {
			t.Fatal(err)
		}
	}

	var baseDigests []string
	for _, out := range outs {
		p, err := layout.FromPath(out)
		if err != nil {
			t.Fatal(err)
		}
		idx, err := p.ImageIndex()
		if err != nil {
			t.Fatal(err)
		}
		im, err := idx.IndexManifest()
		if err != nil {
			t.Fatal(err)
		}
		if len(im.Manifests) != 1 || im.Manifests[0].Annotations["org.opencontainers.image.ref.name"] != "bench-x:latest" {
			t.Fatalf("index = %+v", im)
		}
		img, err := p.Image(im.Manifests[0].Digest)
		if err != nil {
			t.Fatal(err)
		}
		cfg, err := img.ConfigFile()
		if err != nil {
			t.Fatal(err)
		}
		layers, err := img.Layers()
		if err != nil {
			t.Fatal(err)
		}
		if len(layers) != 2 || len(cfg.RootFS.DiffIDs) != 2 {
			t.Fatalf("got %d layers, %d diff_ids; want 2", len(layers), len(cfg.RootFS.DiffIDs))
		}
		for i, l := range layers {
			// The diff_id in the config must be the digest of the
			// uncompressed tar, as readers check.
			rc, err := l.Uncompressed()
			if err != nil {
				t.Fatal(err)
			}
			h := sha256.New()
			if _, err := io.Copy(h, rc); err != nil {
				t.Fatal(err)
			}
			rc.Close()
			if got := "sha256:" + sum(h); got != cfg.RootFS.DiffIDs[i].String() {
				t.Errorf("layer %d: diff_id %s, tar digest %s", i, cfg.RootFS.DiffIDs[i], got)
			}
		}
		d, err := layers[0].Digest()
		if err != nil {
			t.Fatal(err)
		}
		baseDigests = append(baseDigests, d.String())

		rc, err := layers[0].Uncompressed()
		if err != nil {
			t.Fatal(err)
		}
		be := layerEntries(t, rc)
		if h := be["bin"]; h == nil || h.Typeflag != tar.TypeSymlink || h.Linkname != "usr/bin" {
			t.Errorf("base bin = %+v, want symlink to usr/bin", h)
		}
		tool, tool2 := be["usr/bin/tool"], be["usr/bin/tool2"]
		if tool == nil || tool2 == nil || (tool.Typeflag != tar.TypeLink && tool2.Typeflag != tar.TypeLink) {
			t.Errorf("hard link lost: tool=%+v tool2=%+v", tool, tool2)
		}
		if be["usr/"] == nil || be["usr/"].Typeflag != tar.TypeDir {
			t.Errorf("base lacks directory usr/")
		}

		rc, err = layers[1].Uncompressed()
		if err != nil {
			t.Fatal(err)
		}
		ue := layerEntries(t, rc)
		if ue["bench/step.sh"] == nil {
			t.Errorf("upper lacks bench/step.sh: %v", ue)
		}
		if root {
			if ue["var/.wh.gone"] == nil || ue["var/gone"] != nil {
				t.Errorf("whiteout not converted: %v", ue)
			}
			if ue["opaque/.wh..wh..opq"] == nil {
				t.Errorf("opaque directory not marked: %v", ue)
			}
		}
	}
	if baseDigests[0] != baseDigests[1] {
		t.Errorf("base layer differs between images: %v", baseDigests)
	}
}

package bench

import (
	"archive/tar"
	"compress/gzip"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"hash"
	"io"
	"io/fs"
	"os"
	"path/filepath"
	"runtime"
	"strings"
	"syscall"

	"golang.org/x/sys/unix"

	"dsec.dev/dsec/internal/errdefs"
	"dsec.dev/dsec/internal/tarfile"
)

// OCIBuildOptions name the trees of one bench image.
type OCIBuildOptions struct {
	Base      string // root file system of the shared base layer
	BaseCache string // where the base layer's tar.gz is kept between images; empty = none
	Layer     string // the image's own layer: an overlayfs upper directory
	Out       string // OCI image layout directory to write
	Name      string // ref.name annotation, e.g. bench-go:latest
}

// ociBlob is one written blob.
type ociBlob struct {
	Digest string `json:"digest"`  // sha256:... of the stored bytes
	DiffID string `json:"diff_id"` // sha256:... of the uncompressed tar (layers only)
	Size   int64  `json:"size"`
}

// BuildOCI writes an OCI image layout of two layers, Base then Layer.
// Overlayfs whiteouts in Layer (0/0 character devices, opaque directories)
// become OCI whiteouts. The base layer's tar.gz is byte-identical across
// images built with the same BaseCache, so they share its digest.
func BuildOCI(ctx context.Context, o OCIBuildOptions) error {
	if o.Base == "" || o.Layer == "" || o.Out == "" {
		return fmt.Errorf("build oci: base, layer and out are required: %w", errdefs.ErrInvalidArgument)
	}
	blobs := filepath.Join(o.Out, "blobs", "sha256")
	if err := os.MkdirAll(blobs, 0o755); err != nil {
		return fmt.Errorf("build oci: %w", err)
	}
	base, err := baseLayer(ctx, o, blobs)
	if err != nil {
		return err
	}
	top, err := writeLayerBlob(ctx, o.Layer, true, blobs)
	if err != nil {
		return err
	}

	config := map[string]any{
		"architecture": runtime.GOARCH,
		"os":           "linux",
		"config": map[string]any{
			"Env":        []string{"PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"},
			"Cmd":        []string{"/bin/sh"},
			"WorkingDir": "/",
		},
		"rootfs": map[string]any{"type": "layers", "diff_ids": []string{base.DiffID, top.DiffID}},
	}
	cfg, err := writeJSONBlob(config, blobs)
	if err != nil {
		return err
	}
	layerDesc := func(b ociBlob) map[string]any {
		return map[string]any{"mediaType": "application/vnd.oci.image.layer.v1.tar+gzip", "digest": b.Digest, "size": b.Size}
	}
	manifest := map[string]any{
		"schemaVersion": 2,
		"mediaType":     "application/vnd.oci.image.manifest.v1+json",
		"config":        map[string]any{"mediaType": "application/vnd.oci.image.config.v1+json", "digest": cfg.Digest, "size": cfg.Size},
		"layers":        []any{layerDesc(base), layerDesc(top)},
	}
	man, err := writeJSONBlob(manifest, blobs)
	if err != nil {
		return err
	}
	desc := map[string]any{"mediaType": "application/vnd.oci.image.manifest.v1+json", "digest": man.Digest, "size": man.Size}
	if o.Name != "" {
		desc["annotations"] = map[string]string{"org.opencontainers.image.ref.name": o.Name}
	}
	index := map[string]any{"schemaVersion": 2, "mediaType": "application/vnd.oci.image.index.v1+json", "manifests": []any{desc}}
	if err := writeJSONFile(filepath.Join(o.Out, "oci-layout"), map[string]string{"imageLayoutVersion": "1.0.0"}); err != nil {
		return err
	}
	// index.json last: its presence marks a finished layout.
	return writeJSONFile(filepath.Join(o.Out, "index.json"), index)
}

// baseLayer writes (or reuses from o.BaseCache) the base layer blob.
func baseLayer(ctx context.Context, o OCIBuildOptions, blobs string) (ociBlob, error) {
	if o.BaseCache == "" {
		return writeLayerBlob(ctx, o.Base, false, blobs)
	}
	meta := o.BaseCache + ".json"
	var b ociBlob
	if data, err := os.ReadFile(meta); err == nil && json.Unmarshal(data, &b) == nil && b.Digest != "" {
		if err := linkOrCopy(o.BaseCache, filepath.Join(blobs, strings.TrimPrefix(b.Digest, "sha256:"))); err == nil {
			return b, nil
		}
	}
	dir := filepath.Dir(o.BaseCache)
	b, err := writeLayerBlob(ctx, o.Base, false, dir)
	if err != nil {
		return ociBlob{}, err
	}
	if err := os.Rename(filepath.Join(dir, strings.TrimPrefix(b.Digest, "sha256:")), o.BaseCache); err != nil {
		return ociBlob{}, fmt.Errorf("keep base layer: %w", err)
	}
	if err := writeJSONFile(meta, b); err != nil {
		return ociBlob{}, err
	}
	if err := linkOrCopy(o.BaseCache, filepath.Join(blobs, strings.TrimPrefix(b.Digest, "sha256:"))); err != nil {
		return ociBlob{}, err
	}
	return b, nil
}

// writeLayerBlob writes dir as a gzip tar into blobs/<digest>.
func writeLayerBlob(ctx context.Context, dir string, overlay bool, blobs string) (ociBlob, error) {
	tmp, err := os.CreateTemp(blobs, ".layer-*")
	if err != nil {
		return ociBlob{}, fmt.Errorf("write layer %s: %w", dir, err)
	}
	defer os.Remove(tmp.Name())
	defer tmp.Close()
	gzHash, tarHash := sha256.New(), sha256.New()
	cw := &countWriter{w: io.MultiWriter(tmp, gzHash)}
	gz, err := gzip.NewWriterLevel(cw, gzip.BestSpeed)
	if err != nil {
		return ociBlob{}, err
	}
	tw := tar.NewWriter(io.MultiWriter(gz, tarHash))
	if err := writeTree(ctx, tw, dir, overlay); err != nil {
		return ociBlob{}, fmt.Errorf("write layer %s: %w", dir, err)
	}
	if err := tw.Close(); err != nil {
		return ociBlob{}, fmt.Errorf("write layer %s: %w", dir, err)
	}
	if err := gz.Close(); err != nil {
		return ociBlob{}, fmt.Errorf("write layer %s: %w", dir, err)
	}
	if err := tmp.Close(); err != nil {
		return ociBlob{}, fmt.Errorf("write layer %s: %w", dir, err)
	}
	if err := os.Chmod(tmp.Name(), 0o644); err != nil {
		return ociBlob{}, fmt.Errorf("write layer %s: %w", dir, err)
	}
	b := ociBlob{Digest: "sha256:" + sum(gzHash), DiffID: "sha256:" + sum(tarHash), Size: cw.n}
	if err := os.Rename(tmp.Name(), filepath.Join(blobs, sum(gzHash))); err != nil {
		return ociBlob{}, fmt.Errorf("write layer %s: %w", dir, err)
	}
	return b, nil
}

// writeTree writes every entry under dir, in lexical order, into tw.
func writeTree(ctx context.Context, tw *tar.Writer, dir string, overlay bool) error {
	links := map[[2]uint64]string{} // (dev, ino) → first path, for hard links
	return filepath.WalkDir(dir, func(path string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		if err := ctx.Err(); err != nil {
			return err
		}
		rel, err := filepath.Rel(dir, path)
		if err != nil || rel == "." {
			return err
		}
		info, err := os.Lstat(path)
		if err != nil {
			return err
		}
		st, _ := info.Sys().(*syscall.Stat_t)
		mode := info.Mode()
		// Overlayfs whiteout: a 0/0 character device.
		if overlay && mode&fs.ModeCharDevice != 0 && st != nil && st.Rdev == 0 {
			return tw.WriteHeader(&tar.Header{Typeflag: tar.TypeReg, Name: filepath.Join(filepath.Dir(rel), ".wh."+filepath.Base(rel)), Mode: 0o644})
		}
		if mode&(fs.ModeDevice|fs.ModeNamedPipe|fs.ModeSocket) != 0 {
			return nil // a layer carries no special files
		}
		err = tarfile.WriteEntry(tw, path, rel, info, func(hdr *tar.Header) {
			hdr.Format = tar.FormatPAX
			if st == nil {
				return
			}
			hdr.Uid, hdr.Gid = int(st.Uid), int(st.Gid)
			if mode.IsRegular() && st.Nlink > 1 {
				key := [2]uint64{uint64(st.Dev), st.Ino}
				if first, ok := links[key]; ok {
					hdr.Typeflag, hdr.Linkname, hdr.Size = tar.TypeLink, first, 0
					return
				}
				links[key] = rel
			}
		})
		if err != nil {
			return err
		}
		if d.IsDir() && overlay && isOpaque(path) {
			return tw.WriteHeader(&tar.Header{Typeflag: tar.TypeReg, Name: filepath.Join(rel, ".wh..wh..opq"), Mode: 0o644})
		}
		return nil
	})
}

// isOpaque reports an overlayfs opaque directory.
func isOpaque(path string) bool {
	buf := make([]byte, 8)
	for _, name := range []string{"trusted.overlay.opaque", "user.overlay.opaque"} {
		n, err := unix.Lgetxattr(path, name, buf)
		if err == nil && n == 1 && buf[0] == 'y' {
			return true
		}
	}
	return false
}

func writeJSONBlob(v any, blobs string) (ociBlob, error) {
	data, err := json.Marshal(v)
	if err != nil {
		return ociBlob{}, err
	}
	h := sha256.Sum256(data)
	d := hex.EncodeToString(h[:])
	if err := os.WriteFile(filepath.Join(blobs, d), data, 0o644); err != nil {
		return ociBlob{}, fmt.Errorf("write blob: %w", err)
	}
	return ociBlob{Digest: "sha256:" + d, Size: int64(len(data))}, nil
}

func writeJSONFile(path string, v any) error {
	data, err := json.Marshal(v)
	if err != nil {
		return err
	}
	if err := os.WriteFile(path+".tmp", data, 0o644); err != nil {
		return fmt.Errorf("write %s: %w", path, err)
	}
	if err := os.Rename(path+".tmp", path); err != nil {
		return fmt.Errorf("write %s: %w", path, err)
	}
	return nil
}

// linkOrCopy makes dst hold src's bytes: a hard link, else a copy.
func linkOrCopy(src, dst string) error {
	if _, err := os.Stat(dst); err == nil {
		return nil
	}
	if err := os.Link(src, dst); err == nil {
		return nil
	} else if !errors.Is(err, unix.EXDEV) {
		return fmt.Errorf("link %s: %w", dst, err)
	}
	in, err := os.Open(src)
	if err != nil {
		return fmt.Errorf("copy %s: %w", src, err)
	}
	defer in.Close()
	out, err := os.Create(dst + ".tmp")
	if err != nil {
		return fmt.Errorf("copy %s: %w", src, err)
	}
	if _, err := io.Copy(out, in); err != nil {
		out.Close()
		return fmt.Errorf("copy %s: %w", src, err)
	}
	if err := out.Close(); err != nil {
		return fmt.Errorf("copy %s: %w", src, err)
	}
	return os.Rename(dst+".tmp", dst)
}

func sum(h hash.Hash) string { return hex.EncodeToString(h.Sum(nil)) }

type countWriter struct {
	w io.Writer
	n int64
}

func (c *countWriter) Write(p []byte) (int, error) {
	n, err := c.w.Write(p)
	c.n += int64(n)
	return n, err
}

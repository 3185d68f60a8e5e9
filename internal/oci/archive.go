package oci

import (
	"archive/tar"
	"bytes"
	"context"
	"fmt"
	"io"
	"os"
	"path"
	"regexp"
	"strings"

	v1 "github.com/google/go-containerregistry/pkg/v1"
	"github.com/google/go-containerregistry/pkg/v1/tarball"

	"dsec.dev/dsec/internal/errdefs"
)

var hexNameRE = regexp.MustCompile(`^[0-9a-f]{64}$`)

// resolveArchive reads a `docker save` archive holding one image. Such an
// archive has no manifest digests: its config is checked against the digest
// its file name carries, and each layer's uncompressed stream against the
// config's diff IDs (by image.Store.ImportLayers).
func resolveArchive(ctx context.Context, file string) (*resolved, error) {
	if _, err := os.Stat(file); err != nil {
		return nil, fmt.Errorf("open image archive %s: %w", file, errdefs.ErrNotFound)
	}
	opener := func() (io.ReadCloser, error) { return os.Open(file) }
	m, err := tarball.LoadManifest(opener)
	if err != nil {
		return nil, fmt.Errorf("read image archive %s: %v: %w", file, err, errdefs.ErrInvalidArgument)
	}
	if len(m) != 1 {
		return nil, fmt.Errorf("read image archive %s: it holds %d images, want one: %w", file, len(m), errdefs.ErrInvalidArgument)
	}
	img, err := tarball.Image(opener, nil)
	if err != nil {
		return nil, fmt.Errorf("read image archive %s: %v: %w", file, err, errdefs.ErrInvalidArgument)
	}
	raw, err := img.RawConfigFile()
	if err != nil {
		return nil, fmt.Errorf("read image archive %s: config: %v: %w", file, err, errdefs.ErrInvalidArgument)
	}
	if h := strings.TrimSuffix(path.Base(m[0].Config), ".json"); hexNameRE.MatchString(h) {
		if err := checkBytes("config", raw, v1.Hash{Algorithm: "sha256", Hex: h}); err != nil {
			return nil, err
		}
	}
	cf, err := v1.ParseConfigFile(bytes.NewReader(raw))
	if err != nil {
		return nil, fmt.Errorf("read image archive %s: config: %v: %w", file, err, errdefs.ErrInvalidArgument)
	}
	if len(cf.RootFS.DiffIDs) != len(m[0].Layers) {
		return nil, fmt.Errorf("read image archive %s: %d layers but the config lists %d diff IDs: %w", file, len(m[0].Layers), len(cf.RootFS.DiffIDs), errdefs.ErrInvalidArgument)
	}
	sizes, err := memberSizes(file)
	if err != nil {
		return nil, err
	}
	out := &resolved{config: imageConfig(cf)}
	for i, diffID := range cf.RootFS.DiffIDs {
		l, err := img.LayerByDiffID(diffID)
		if err != nil {
			return nil, fmt.Errorf("read image archive %s: layer %s: %v: %w", file, diffID, err, errdefs.ErrInvalidArgument)
		}
		size := sizes[path.Clean(m[0].Layers[i])]
		out.layers = append(out.layers, ociLayer{
			diffID: diffID,
			size:   size,
			est:    size,
			open: func(count func(int)) (io.ReadCloser, error) {
				rc, err := l.Uncompressed()
				if err != nil {
					return nil, fmt.Errorf("read image archive %s: layer %s: %w", file, diffID, err)
				}
				return &counter{ReadCloser: rc, count: count}, nil
			},
		})
	}
	return out, nil
}

// memberSizes returns the size of every file in a tar archive, by clean name,
// skipping over the contents.
func memberSizes(file string) (map[string]int64, error) {
	f, err := os.Open(file)
	if err != nil {
		return nil, fmt.Errorf("read image archive %s: %w", file, err)
	}
	defer f.Close()
	sizes := map[string]int64{}
	tr := tar.NewReader(f)
	for {
		hdr, err := tr.Next()
		if err == io.EOF {
			return sizes, nil
		}
		if err != nil {
			return nil, fmt.Errorf("read image archive %s: %v: %w", file, err, errdefs.ErrInvalidArgument)
		}
		sizes[path.Clean(hdr.Name)] = hdr.Size
	}
}

// counter reports the bytes read through it.
type counter struct {
	io.ReadCloser
	count func(int)
}

func (c *counter) Read(p []byte) (int, error) {
	n, err := c.ReadCloser.Read(p)
	if n > 0 && c.count != nil {
		c.count(n)
	}
	return n, err
}

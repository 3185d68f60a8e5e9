package image

import (
	"context"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"sort"
	"strings"
	"time"

	"dsec.dev/dsec/internal/errdefs"
)

// An image is a name:tag naming an ordered list of stored layers (bottom
// first) plus the configuration a sandbox started from it uses. Its layers
// are ordinary layer records, shared by every image that lists them, and
// together they form an environment's base: "IMAGE+toolkit:1" stacks the
// toolkit on top of all of the image's layers. Layers imported for images
// are of kind base (see internal/oci). A name:tag names either a layer or an
// image, never both: setting one replaces the other.

// ImageConfig is what an image says about the processes started from it
// (the OCI image config's Env, WorkingDir, User, Entrypoint and Cmd).
type ImageConfig struct {
	Env        []string `json:"env,omitempty"`
	WorkingDir string   `json:"working_dir,omitempty"`
	User       string   `json:"user,omitempty"`
	Entrypoint []string `json:"entrypoint,omitempty"`
	Cmd        []string `json:"cmd,omitempty"`
}

// ImageInfo describes one stored image.
type ImageInfo struct {
	Ref     string   // name:tag
	Digests []string // "sha256:<hex>" of its layers, bottom first
	Config  ImageConfig
	Created time.Time
}

// LayerSource is one uncompressed tar stream for ImportLayers. Name labels
// it in messages; a "sha256:<hex>" Name is also the digest the stream must
// have. Open is called once, and the stream closed, during the import.
type LayerSource struct {
	Name string
	Open func() (io.ReadCloser, error)
}

// image returns the image a part of an environment name names, or nil.
func (ix *index) image(part string) *imageRecord {
	if strings.HasPrefix(part, "sha256:") {
		return nil
	}
	ref, err := normalizeRef(part)
	if err != nil {
		return nil
	}
	return ix.Images[ref]
}

func (ix *index) imageInfo(ref string) ImageInfo {
	rec := ix.Images[ref]
	info := ImageInfo{Ref: ref, Config: rec.Config, Created: rec.Created, Digests: make([]string, len(rec.Digests))}
	for i, hex := range rec.Digests {
		info.Digests[i] = "sha256:" + hex
	}
	return info
}

// dropLayer forgets the layer hex and the builds that made it. The caller
// removes its mount and file.
func (ix *index) dropLayer(hex string) {
	delete(ix.Layers, hex)
	for k, h := range ix.Builds {
		if h == hex {
			delete(ix.Builds, k)
		}
	}
}

// SetImage points ref (name[:tag]) at an image made of the stored layers
// digests (bottom first) with configuration cfg, replacing an image or layer
// ref of that name. The layers must exist (errdefs.ErrNotFound otherwise) and
// be distinct (errdefs.ErrInvalidArgument). The index is fsync'd before
// SetImage returns, so an import that sets its ref last is complete once the
// ref is visible.
func (s *Store) SetImage(ctx context.Context, ref string, digests []string, cfg ImageConfig) error {
	nref, err := normalizeRef(ref)
	if err != nil {
		return fmt.Errorf("set image: %w", err)
	}
	if len(digests) == 0 {
		return fmt.Errorf("set image %s: no layers: %w", nref, errdefs.ErrInvalidArgument)
	}
	hexes := make([]string, len(digests))
	seen := map[string]bool{}
	for i, d := range digests {
		if hexes[i], err = parseDigest(d); err != nil {
			return fmt.Errorf("set image %s: %w", nref, err)
		}
		if seen[hexes[i]] {
			return fmt.Errorf("set image %s: layer %s listed twice: %w", nref, d, errdefs.ErrInvalidArgument)
		}
		seen[hexes[i]] = true
	}
	if err := ctx.Err(); err != nil {
		return fmt.Errorf("set image %s: %w", nref, err)
	}
	err = s.update(true, func(ix *index) error {
		for _, hex := range hexes {
			if ix.Layers[hex] == nil {
				return fmt.Errorf("layer sha256:%s: %w", hex, errdefs.ErrNotFound)
			}
		}
		delete(ix.Refs, nref)
		ix.Images[nref] = &imageRecord{Digests: hexes, Config: cloneConfig(cfg), Created: time.Now().UTC()}
		return nil
	})
	if err != nil {
		return fmt.Errorf("set image %s: %w", nref, err)
	}
	s.log.Info("set image", "ref", nref, "layers", len(hexes))
	return nil
}

// Image returns the image ref (tag defaults to latest) names, or an error
// wrapping errdefs.ErrNotFound.
func (s *Store) Image(ref string) (ImageInfo, error) {
	nref, err := normalizeRef(ref)
	if err != nil {
		return ImageInfo{}, fmt.Errorf("get image: %w", err)
	}
	ix, err := s.load()
	if err != nil {
		return ImageInfo{}, err
	}
	if ix.Images[nref] == nil {
		return ImageInfo{}, fmt.Errorf("get image %s: %w", nref, errdefs.ErrNotFound)
	}
	return ix.imageInfo(nref), nil
}

// Images returns every stored image, by ref.
func (s *Store) Images() ([]ImageInfo, error) {
	ix, err := s.load()
	if err != nil {
		return nil, err
	}
	out := make([]ImageInfo, 0, len(ix.Images))
	for ref := range ix.Images {
		out = append(out, ix.imageInfo(ref))
	}
	sort.Slice(out, func(i, j int) bool { return out[i].Ref < out[j].Ref })
	return out, nil
}

// removeImage deletes the image ref and those of its layers that no ref and
// no other image uses.
func (s *Store) removeImage(ref string) error {
	var gone []string
	err := s.update(true, func(ix *index) error {
		rec := ix.Images[ref]
		if rec == nil {
			return fmt.Errorf("find image %s: %w", ref, errdefs.ErrNotFound)
		}
		delete(ix.Images, ref)
		used := map[string]bool{}
		for _, h := range ix.Refs {
			used[h] = true
		}
		for _, img := range ix.Images {
			for _, h := range img.Digests {
				used[h] = true
			}
		}
		for _, hex := range rec.Digests {
			if used[hex] || ix.Layers[hex] == nil {
				continue
			}
			ix.dropLayer(hex)
			if err := s.unmountLayer(context.Background(), hex); err != nil {
				return err
			}
			if err := os.Remove(s.blobPath(hex)); err != nil && !errors.Is(err, fs.ErrNotExist) {
				return err
			}
			gone = append(gone, "sha256:"+hex)
		}
		return nil
	})
	if err != nil {
		return fmt.Errorf("remove image %s: %w", ref, err)
	}
	s.log.Info("removed image", "ref", ref, "removed_layers", gone)
	return nil
}

// RenameRef moves the name to onto what from names, a layer or an image,
// in one index update: to names its old version until it names from's,
// never nothing, and from goes. to's old version (its layers) stays stored,
// nameless, until removed by digest: a sandbox may run on it. from naming
// nothing wraps errdefs.ErrNotFound; a malformed name, or from equal to
// to, errdefs.ErrInvalidArgument. The index is fsync'd before RenameRef
// returns.
func (s *Store) RenameRef(from, to string) error {
	nfrom, err := normalizeRef(from)
	if err != nil {
		return fmt.Errorf("rename ref: %w", err)
	}
	nto, err := normalizeRef(to)
	if err != nil {
		return fmt.Errorf("rename ref %s: %w", nfrom, err)
	}
	if nfrom == nto {
		return fmt.Errorf("rename ref %s onto itself: %w", nfrom, errdefs.ErrInvalidArgument)
	}
	err = s.update(true, func(ix *index) error {
		if img := ix.Images[nfrom]; img != nil {
			delete(ix.Refs, nto)
			ix.Images[nto] = img
			delete(ix.Images, nfrom)
			return nil
		}
		hex, ok := ix.Refs[nfrom]
		if !ok || ix.Layers[hex] == nil {
			return ix.notFound(nfrom)
		}
		ix.setRef(nto, hex)
		delete(ix.Refs, nfrom)
		return nil
	})
	if err != nil {
		return fmt.Errorf("rename ref %s to %s: %w", nfrom, nto, err)
	}
	s.log.Info("renamed ref", "from", nfrom, "to", nto)
	return nil
}

func cloneConfig(c ImageConfig) ImageConfig {
	c.Env = append([]string(nil), c.Env...)
	c.Entrypoint = append([]string(nil), c.Entrypoint...)
	c.Cmd = append([]string(nil), c.Cmd...)
	return c
}

// ParseRef checks a name:tag ref and returns it with the tag defaulted to
// "latest"; a malformed ref wraps errdefs.ErrInvalidArgument.
func ParseRef(ref string) (string, error) { return normalizeRef(ref) }

package oci

import (
	"bufio"
	"bytes"
	"compress/gzip"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"hash"
	"io"
	"os"
	"runtime"
	"strings"

	"github.com/google/go-containerregistry/pkg/name"
	v1 "github.com/google/go-containerregistry/pkg/v1"
	"github.com/google/go-containerregistry/pkg/v1/layout"
	"github.com/google/go-containerregistry/pkg/v1/remote"
	"github.com/klauspost/compress/zstd"

	"dsec.dev/dsec/internal/errdefs"
)

// refNameAnnotation names a manifest in an OCI layout's index.json.
const refNameAnnotation = "org.opencontainers.image.ref.name"

// contentStore reads content-addressed manifests and blobs of one image
// source (an OCI layout or a registry repository). What it returns is not
// yet checked against the digest.
type contentStore interface {
	manifest(ctx context.Context, h v1.Hash) ([]byte, error)
	blob(ctx context.Context, h v1.Hash) (io.ReadCloser, error)
}

// resolveLayout reads DIR[:TAG], an OCI image layout.
func resolveLayout(ctx context.Context, spec string) (*resolved, error) {
	dir, tag := spec, ""
	if fi, err := os.Stat(spec); err != nil || !fi.IsDir() {
		if i := strings.LastIndex(spec, ":"); i > 0 {
			dir, tag = spec[:i], spec[i+1:]
		}
	}
	if fi, err := os.Stat(dir); err != nil || !fi.IsDir() {
		return nil, fmt.Errorf("open image layout %s: not a directory: %w", dir, errdefs.ErrNotFound)
	}
	p, err := layout.FromPath(dir)
	if err != nil {
		return nil, fmt.Errorf("open image layout %s: %v: %w", dir, err, errdefs.ErrInvalidArgument)
	}
	idx, err := p.ImageIndex()
	if err != nil {
		return nil, fmt.Errorf("open image layout %s: %v: %w", dir, err, errdefs.ErrInvalidArgument)
	}
	im, err := idx.IndexManifest()
	if err != nil {
		return nil, fmt.Errorf("read image layout index %s: %v: %w", dir, err, errdefs.ErrInvalidArgument)
	}
	desc, err := pickByTag(im, tag)
	if err != nil {
		return nil, fmt.Errorf("open image layout %s: %w", dir, err)
	}
	src := layoutStore{p}
	raw, err := src.manifest(ctx, desc.Digest)
	if err != nil {
		return nil, err
	}
	return fromManifest(ctx, src, desc, raw, 0)
}

// pickByTag selects the manifest a layout's index names tag, or its only one.
func pickByTag(im *v1.IndexManifest, tag string) (v1.Descriptor, error) {
	var names []string
	for _, d := range im.Manifests {
		n := d.Annotations[refNameAnnotation]
		if tag != "" && (n == tag || strings.HasSuffix(n, ":"+tag)) {
			return d, nil
		}
		names = append(names, n)
	}
	if tag != "" {
		return v1.Descriptor{}, fmt.Errorf("find manifest %q: the layout names %q: %w", tag, names, errdefs.ErrNotFound)
	}
	if len(im.Manifests) != 1 {
		return v1.Descriptor{}, fmt.Errorf("find manifest: the layout holds %d manifests (%q); name one as oci:DIR:TAG: %w", len(im.Manifests), names, errdefs.ErrInvalidArgument)
	}
	return im.Manifests[0], nil
}

type layoutStore struct{ p layout.Path }

func (s layoutStore) manifest(_ context.Context, h v1.Hash) ([]byte, error) {
	b, err := s.p.Bytes(h)
	if err != nil {
		return nil, fmt.Errorf("read manifest %s: %w", h, err)
	}
	return b, nil
}

func (s layoutStore) blob(_ context.Context, h v1.Hash) (io.ReadCloser, error) {
	rc, err := s.p.Blob(h)
	if err != nil {
		return nil, fmt.Errorf("open blob %s: %w", h, err)
	}
	return rc, nil
}

// resolveRemote reads HOST[:PORT]/REPO:TAG (or @sha256:...) from a registry.
func resolveRemote(ctx context.Context, spec string, insecure bool) (*resolved, error) {
	var nopts []name.Option
	if insecure {
		nopts = append(nopts, name.Insecure)
	}
	ref, err := name.ParseReference(spec, nopts...)
	if err != nil {
		return nil, fmt.Errorf("parse image reference %q: %v: %w", spec, err, errdefs.ErrInvalidArgument)
	}
	src := remoteStore{repo: ref.Context(), opts: []remote.Option{remote.WithContext(ctx)}}
	d, err := remote.Get(ref, src.opts...)
	if err != nil {
		return nil, fmt.Errorf("get manifest %s: %w", ref, registryError(err))
	}
	return fromManifest(ctx, src, d.Descriptor, d.Manifest, 0)
}

type remoteStore struct {
	repo name.Repository
	opts []remote.Option
}

func (s remoteStore) manifest(_ context.Context, h v1.Hash) ([]byte, error) {
	d, err := remote.Get(s.repo.Digest(h.String()), s.opts...)
	if err != nil {
		return nil, fmt.Errorf("get manifest %s: %w", h, registryError(err))
	}
	return d.Manifest, nil
}

func (s remoteStore) blob(_ context.Context, h v1.Hash) (io.ReadCloser, error) {
	l, err := remote.Layer(s.repo.Digest(h.String()), s.opts...)
	if err != nil {
		return nil, fmt.Errorf("get blob %s: %w", h, registryError(err))
	}
	rc, err := l.Compressed()
	if err != nil {
		return nil, fmt.Errorf("get blob %s: %w", h, registryError(err))
	}
	return rc, nil
}

// registryError marks registry failures as errdefs.ErrUnavailable, keeping
// the registry's message.
func registryError(err error) error {
	return fmt.Errorf("%v: %w", err, errdefs.ErrUnavailable)
}

// fromManifest checks raw against desc and reads the image it describes,
// choosing this platform's image from an index.
func fromManifest(ctx context.Context, src contentStore, desc v1.Descriptor, raw []byte, depth int) (*resolved, error) {
	if err := checkBytes("manifest", raw, desc.Digest); err != nil {
		return nil, err
	}
	if depth > 2 {
		return nil, fmt.Errorf("read manifest %s: indexes nested too deep: %w", desc.Digest, errdefs.ErrInvalidArgument)
	}
	var probe struct {
		Manifests []json.RawMessage `json:"manifests"`
	}
	if err := json.Unmarshal(raw, &probe); err != nil {
		return nil, fmt.Errorf("read manifest %s: %v: %w", desc.Digest, err, errdefs.ErrInvalidArgument)
	}
	if desc.MediaType.IsIndex() || (desc.MediaType == "" && probe.Manifests != nil) {
		im, err := v1.ParseIndexManifest(bytes.NewReader(raw))
		if err != nil {
			return nil, fmt.Errorf("read index %s: %v: %w", desc.Digest, err, errdefs.ErrInvalidArgument)
		}
		child, err := pickPlatform(im)
		if err != nil {
			return nil, fmt.Errorf("read index %s: %w", desc.Digest, err)
		}
		craw, err := src.manifest(ctx, child.Digest)
		if err != nil {
			return nil, err
		}
		return fromManifest(ctx, src, child, craw, depth+1)
	}
	m, err := v1.ParseManifest(bytes.NewReader(raw))
	if err != nil {
		return nil, fmt.Errorf("read manifest %s: %v: %w", desc.Digest, err, errdefs.ErrInvalidArgument)
	}
	cfgRC, err := src.blob(ctx, m.Config.Digest)
	if err != nil {
		return nil, err
	}
	cfgRaw, err := io.ReadAll(io.LimitReader(cfgRC, 16<<20))
	cfgRC.Close()
	if err != nil {
		return nil, fmt.Errorf("read config %s: %w", m.Config.Digest, err)
	}
	if err := checkBytes("config", cfgRaw, m.Config.Digest); err != nil {
		return nil, err
	}
	cf, err := v1.ParseConfigFile(bytes.NewReader(cfgRaw))
	if err != nil {
		return nil, fmt.Errorf("read config %s: %v: %w", m.Config.Digest, err, errdefs.ErrInvalidArgument)
	}
	if len(cf.RootFS.DiffIDs) != len(m.Layers) {
		return nil, fmt.Errorf("read manifest %s: %d layers but the config lists %d diff IDs: %w", desc.Digest, len(m.Layers), len(cf.RootFS.DiffIDs), errdefs.ErrInvalidArgument)
	}
	out := &resolved{config: imageConfig(cf)}
	for i, ld := range m.Layers {
		ld := ld
		est := ld.Size
		if mt := string(ld.MediaType); strings.Contains(mt, "gzip") || strings.Contains(mt, "zstd") {
			est *= compressRatio
		}
		out.layers = append(out.layers, ociLayer{
			diffID: cf.RootFS.DiffIDs[i],
			size:   ld.Size,
			est:    est,
			open: func(count func(int)) (io.ReadCloser, error) {
				rc, err := src.blob(ctx, ld.Digest)
				if err != nil {
					return nil, err
				}
				return decompress(&verifier{r: rc, c: rc, h: sha256.New(), want: ld.Digest, what: "layer", count: count})
			},
		})
	}
	return out, nil
}

// pickPlatform chooses linux/GOARCH from an index, or its only manifest.
func pickPlatform(im *v1.IndexManifest) (v1.Descriptor, error) {
	if len(im.Manifests) == 1 {
		return im.Manifests[0], nil
	}
	for _, d := range im.Manifests {
		if d.Platform != nil && d.Platform.OS == "linux" && d.Platform.Architecture == runtime.GOARCH {
			return d, nil
		}
	}
	return v1.Descriptor{}, fmt.Errorf("find linux/%s image among %d manifests: %w", runtime.GOARCH, len(im.Manifests), errdefs.ErrNotFound)
}

// verifier passes a blob through, counting it, and fails at its end when
// its sha256 is not want.
type verifier struct {
	r     io.Reader
	c     io.Closer
	h     hash.Hash
	want  v1.Hash
	what  string
	count func(int)
}

func (v *verifier) Read(p []byte) (int, error) {
	n, err := v.r.Read(p)
	v.h.Write(p[:n])
	if n > 0 && v.count != nil {
		v.count(n)
	}
	if err == io.EOF {
		if got := hex.EncodeToString(v.h.Sum(nil)); v.want.Algorithm != "sha256" || got != v.want.Hex {
			return n, fmt.Errorf("verify %s %s: content has digest sha256:%s: %w", v.what, v.want, got, errdefs.ErrInvalidArgument)
		}
	}
	return n, err
}

func (v *verifier) Close() error { return v.c.Close() }

// layerStream is a decompressed layer whose end reads the rest of the blob,
// so that the blob is always checked whole.
type layerStream struct {
	r     io.Reader
	blob  io.Reader
	close []func() error
}

func (s *layerStream) Read(p []byte) (int, error) {
	n, err := s.r.Read(p)
	if err == io.EOF {
		if _, derr := io.Copy(io.Discard, s.blob); derr != nil {
			return n, derr
		}
	}
	return n, err
}

func (s *layerStream) Close() error {
	var first error
	for _, c := range s.close {
		if err := c(); err != nil && first == nil {
			first = err
		}
	}
	return first
}

// decompress returns the tar stream in blob: gunzipped, zstd-decoded or as
// is, told apart by their magic numbers.
func decompress(blob io.ReadCloser) (io.ReadCloser, error) {
	br := bufio.NewReaderSize(blob, 1<<16)
	s := &layerStream{r: br, blob: br, close: []func() error{blob.Close}}
	magic, err := br.Peek(4)
	if err != nil && err != io.EOF {
		blob.Close()
		return nil, err
	}
	switch {
	case len(magic) >= 2 && magic[0] == 0x1f && magic[1] == 0x8b:
		zr, err := gzip.NewReader(br)
		if err != nil {
			blob.Close()
			return nil, fmt.Errorf("read layer: %v: %w", err, errdefs.ErrInvalidArgument)
		}
		s.r = zr
		s.close = append([]func() error{zr.Close}, s.close...)
	case len(magic) == 4 && bytes.Equal(magic, []byte{0x28, 0xb5, 0x2f, 0xfd}):
		zr, err := zstd.NewReader(br)
		if err != nil {
			blob.Close()
			return nil, fmt.Errorf("read layer: %v: %w", err, errdefs.ErrInvalidArgument)
		}
		s.r = zr
		s.close = append([]func() error{func() error { zr.Close(); return nil }}, s.close...)
	}
	return s, nil
}

// Package oci imports OCI and Docker images into a node's layer store
// (internal/edge/image): it reads an image from an OCI image layout, a
// `docker save` archive or a registry, checks every blob against its digest,
// applies its layers (whiteouts included) into EROFS layers, merging
// consecutive small layers into one, and records the image (its layers and
// config) under a name:tag in the store. An EROFS layer keeps only the
// whiteouts that hide something in the EROFS layers below it: the bottom
// one keeps none (overlayfs would list a whiteout that hides nothing).
//
// Every EROFS layer of an imported image is of kind base: together they are
// the base of an environment, so "IMAGE+toolkit:1" stacks a toolkit on top of
// all of them, and the layer kind rules (one base, then workspaces, then
// toolkits) apply to the image as a whole.
//
// An import is resumable: the image ref is set last, so an interrupted import
// leaves no ref, and the store remembers which EROFS layer each group of OCI
// layers (by diff IDs) built, so a re-run reuses them. Layers built by an
// import that never finished stay in the store, without a ref, until a
// re-run uses them.
package oci

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"io"
	"slices"
	"strings"
	"time"

	v1 "github.com/google/go-containerregistry/pkg/v1"

	"dsec.dev/dsec/internal/edge/image"
	"dsec.dev/dsec/internal/errdefs"
)

// Options tune Import.
type Options struct {
	Insecure bool // docker://: allow plain HTTP to the registry
	// CollapseBelow merges consecutive OCI layers into one EROFS layer while
	// their uncompressed total stays below it; 0 means 3 GiB, <0 never
	// merges. Sizes are known before download only as blob sizes: an
	// uncompressed blob counts its size, a compressed one compressRatio times.
	CollapseBelow int64
	Progress      func(Progress) // called from the importing goroutine; may be nil
	ImportOptions image.ImportOptions
}

// Progress reports an import's advance. Phase is "resolve" (reading the
// manifest and config), "layer" (reading layer Layer of Layers into an EROFS
// layer), "reuse" (a layer group already built), "publish" (setting the ref)
// or "done". Bytes and TotalBytes count blob bytes read over all layers.
type Progress struct {
	Phase             string
	Layer, Layers     int
	Bytes, TotalBytes int64
	Rate              float64 // bytes/s since the import started
}

// Result describes an imported image.
type Result struct {
	Ref       string
	Digests   []string // EROFS layers, bottom first
	Config    image.ImageConfig
	Collapsed int // OCI layers read
	// Warnings say what the import left out (device nodes under /dev…).
	Warnings []string
	Layers   int // EROFS layers made of them
}

const (
	defaultCollapseBelow = 3 << 30
	// compressRatio estimates a compressed layer's uncompressed size from
	// its blob size, for grouping only.
	compressRatio = 3
	// emptyLayer is the diff ID of an empty tar (1024 zero bytes), which
	// image builders emit for steps that change no file; it is skipped.
	emptyLayer = "sha256:5f70bf18a086007016e948b04aed3b82103a36bea41755b6cddfaf10ace3c6ef"
)

// ociLayer is one layer of a resolved image.
type ociLayer struct {
	diffID v1.Hash
	size   int64 // blob bytes, for progress
	est    int64 // estimated uncompressed bytes, for grouping
	// open returns the layer's uncompressed tar stream, checked against the
	// blob digest where the source has one; count is called with blob bytes.
	open func(count func(int)) (io.ReadCloser, error)
}

// resolved is an image read from a source, its manifest and config checked.
type resolved struct {
	config image.ImageConfig
	layers []ociLayer
}

// Import reads the image at source and records it in st under ref
// (name[:tag]). source is one of
//
//	oci:DIR[:TAG]            an OCI image layout; TAG selects the manifest by
//	                         its org.opencontainers.image.ref.name annotation
//	                         and may be left out when the layout holds one image
//	docker-archive:FILE      a `docker save` archive holding one image
//	docker://HOST[:PORT]/REPO:TAG   a registry (HTTPS unless opts.Insecure)
//
// A manifest, config or layer whose bytes do not match its digest is refused
// with an error wrapping errdefs.ErrInvalidArgument, as is a layer the store's
// importer refuses (see image.Store.Import); nothing is written outside st.
func Import(ctx context.Context, st *image.Store, ref, source string, opts Options) (Result, error) {
	nref, err := image.ParseRef(ref)
	if err != nil {
		return Result{}, fmt.Errorf("import image: %w", err)
	}
	start := time.Now()
	pr := &progress{fn: opts.Progress, start: start}
	pr.report("resolve", 0, 0)
	img, err := resolve(ctx, source, opts)
	if err != nil {
		return Result{}, fmt.Errorf("import image %s from %s: %w", nref, source, err)
	}
	var layers []ociLayer
	for _, l := range img.layers {
		if l.diffID.String() != emptyLayer {
			layers = append(layers, l)
		}
		pr.total += l.size
	}
	if len(layers) == 0 {
		return Result{}, fmt.Errorf("import image %s from %s: no layers with content: %w", nref, source, errdefs.ErrInvalidArgument)
	}
	pr.layers = len(layers)

	res := Result{Ref: nref, Config: img.config, Collapsed: len(img.layers)}
	seen := map[string]int{}
	done := 0
	for _, group := range groups(layers, opts.CollapseBelow) {
		srcs := make([]image.LayerSource, len(group))
		for i, l := range group {
			n := done + i + 1
			srcs[i] = image.LayerSource{
				Name: l.diffID.String(),
				Open: func() (io.ReadCloser, error) {
					pr.report("layer", n, 0)
					return l.open(func(k int) { pr.report("layer", n, int64(k)) })
				},
			}
		}
		before := pr.bytes
		// Each group is stacked on the groups before it: whiteouts that hide
		// nothing there are left out (the first group keeps none).
		iopts := opts.ImportOptions
		iopts.Below = slices.Clone(res.Digests)
		layer, err := st.ImportLayers(ctx, "", image.KindBase, srcs, iopts)
		if err != nil {
			return Result{}, fmt.Errorf("import image %s from %s: %w", nref, source, err)
		}
		done += len(group)
		if pr.bytes == before { // nothing read: an earlier build was reused
			for _, l := range group {
				pr.bytes += l.size
			}
			pr.report("reuse", done, 0)
		}
		if prev, ok := seen[layer.Digest]; ok {
			return Result{}, fmt.Errorf("import image %s from %s: layer groups %d and %d build the same layer %s; import with a larger CollapseBelow: %w",
				nref, source, prev+1, len(res.Digests)+1, layer.Digest, errdefs.ErrFailedPrecondition)
		}
		seen[layer.Digest] = len(res.Digests)
		res.Warnings = append(res.Warnings, layer.Warnings...)
		res.Digests = append(res.Digests, layer.Digest)
	}
	res.Layers = len(res.Digests)

	pr.report("publish", done, 0)
	// The ref last, in one index update: until here nothing of this import
	// is visible by name, and a cancelled import publishes nothing.
	if err := st.SetImage(ctx, nref, res.Digests, res.Config); err != nil {
		return Result{}, fmt.Errorf("import image %s from %s: %w", nref, source, err)
	}
	pr.report("done", done, 0)
	return res, nil
}

// groups splits layers into runs applied into one EROFS layer each.
func groups(layers []ociLayer, below int64) [][]ociLayer {
	if below == 0 {
		below = defaultCollapseBelow
	}
	var out [][]ociLayer
	var cur []ociLayer
	var total int64
	for _, l := range layers {
		if len(cur) > 0 && (below < 0 || total+l.est >= below) {
			out = append(out, cur)
			cur, total = nil, 0
		}
		cur = append(cur, l)
		total += l.est
	}
	return append(out, cur)
}

// resolve opens source and reads its manifest and config.
func resolve(ctx context.Context, source string, opts Options) (*resolved, error) {
	switch {
	case strings.HasPrefix(source, "oci:"):
		return resolveLayout(ctx, strings.TrimPrefix(source, "oci:"))
	case strings.HasPrefix(source, "docker-archive:"):
		return resolveArchive(ctx, strings.TrimPrefix(source, "docker-archive:"))
	case strings.HasPrefix(source, "docker://"):
		return resolveRemote(ctx, strings.TrimPrefix(source, "docker://"), opts.Insecure)
	default:
		return nil, fmt.Errorf("parse image source: want oci:DIR[:TAG], docker-archive:FILE or docker://HOST/REPO:TAG: %w", errdefs.ErrInvalidArgument)
	}
}

// imageConfig picks what a sandbox needs from an OCI config.
func imageConfig(cf *v1.ConfigFile) image.ImageConfig {
	c := cf.Config
	return image.ImageConfig{Env: c.Env, WorkingDir: c.WorkingDir, User: c.User, Entrypoint: c.Entrypoint, Cmd: c.Cmd}
}

// checkBytes refuses data whose sha256 is not want.
func checkBytes(what string, data []byte, want v1.Hash) error {
	if want.Algorithm != "sha256" {
		return fmt.Errorf("verify %s %s: unsupported digest algorithm: %w", what, want, errdefs.ErrInvalidArgument)
	}
	sum := sha256.Sum256(data)
	if got := hex.EncodeToString(sum[:]); got != want.Hex {
		return fmt.Errorf("verify %s %s: content has digest sha256:%s: %w", what, want, got, errdefs.ErrInvalidArgument)
	}
	return nil
}

// progress rate-limits and fills in Progress reports.
type progress struct {
	fn           func(Progress)
	start, last  time.Time
	layers       int
	bytes, total int64
}

func (p *progress) report(phase string, layer int, add int64) {
	p.bytes += add
	if p.fn == nil {
		return
	}
	now := time.Now()
	if phase == "layer" && add > 0 && now.Sub(p.last) < 200*time.Millisecond {
		return
	}
	p.last = now
	rate := 0.0
	if d := now.Sub(p.start).Seconds(); d > 0 {
		rate = float64(p.bytes) / d
	}
	p.fn(Progress{Phase: phase, Layer: layer, Layers: p.layers, Bytes: p.bytes, TotalBytes: p.total, Rate: rate})
}

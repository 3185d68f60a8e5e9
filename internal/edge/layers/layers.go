// Package layers is the node's layer service. It imports layers and OCI
// images into the local image store, publishes every layer file to the blob
// store as deduplicated chunks (with the chunks holding its metadata marked),
// and makes a layer available to a sandbox in the node's loading mode:
//
//   - ondemand: the layer file is served by the lazy FUSE file system, which
//     fetches a chunk from the blob store only when the kernel reads it;
//   - eager: the whole layer file is pulled from the blob store before the
//     first sandbox using it starts;
//   - local: the image store's own copy is mounted (a pre-cached node);
//   - tar: every sandbox extracts its own copy of each layer from a tar
//     archive in the blob store (a baseline for comparison only).
//
// It also keeps the access accounting the paper asks to measure first:
// per layer, bytes read against size, chunks fetched and cache hits; per
// environment, the fan-out.
//
// Nodes that share a blob store share refs too (refs.go): an import
// publishes what its ref names, and another node adopts it from the store
// without building anything.
package layers

import (
	"archive/tar"
	"compress/gzip"
	"context"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"log/slog"
	"maps"
	"os"
	"os/exec"
	"path/filepath"
	"sort"
	"strings"
	"sync"
	"time"

	"golang.org/x/sync/singleflight"
	"golang.org/x/sys/unix"

	"dsec.dev/dsec/internal/blob"
	"dsec.dev/dsec/internal/edge/backend"
	"dsec.dev/dsec/internal/edge/image"
	"dsec.dev/dsec/internal/edge/lazy"
	"dsec.dev/dsec/internal/errdefs"
	"dsec.dev/dsec/internal/oci"
	"dsec.dev/dsec/internal/tarfile"
)

// Mode is how a node loads layers.
type Mode string

const (
	ModeOnDemand Mode = "ondemand"
	ModeEager    Mode = "eager"
	ModeLocal    Mode = "local"
	ModeTar      Mode = "tar"
)

// ParseMode checks a mode name.
func ParseMode(s string) (Mode, error) {
	switch m := Mode(s); m {
	case ModeOnDemand, ModeEager, ModeLocal, ModeTar:
		return m, nil
	}
	return "", fmt.Errorf("layer mode %q: want ondemand, eager, local or tar: %w", s, errdefs.ErrInvalidArgument)
}

// Loader serves layer files on demand. *lazyd.Client implements it.
type Loader interface {
	Add(ctx context.Context, ix *blob.Index) (string, error)
	FetchAll(ctx context.Context, hex string) error
	PrefetchTrace(ctx context.Context, hex string) (int, error)
	SaveTrace(ctx context.Context, hex string) error
	PublishTrace(ctx context.Context, hex string) (bool, error)
	Stats(ctx context.Context, hex string) (lazy.LayerStats, error)
	MetaChunks(ctx context.Context, hex string) ([]int, error)
}

// Config is the layer service's configuration.
type Config struct {
	Mode      Mode
	Blobs     blob.Store
	BlobSpec  string // how the blob store was named, for reports
	ChunkSize int64  // 0 = blob.DefaultChunkSize
	Dir       string // service state: eager/ (pulled layer files), tar/ (per-sandbox trees)
	Loader    Loader // required in ondemand mode, and to mark metadata chunks
	// Tars also publishes each layer as a tar.gz, which tar mode needs.
	Tars bool
	// Machine is an ID of the host, which names a directory blob store
	// with its path (see blob.StoreName).
	Machine string
	// MaxUpload bounds an uploaded archive, and the tree it unpacks to;
	// 0 = DefaultMaxUpload.
	MaxUpload int64
	Log       *slog.Logger
}

// DefaultMaxUpload is the most an upload may carry unless configured.
const DefaultMaxUpload = 16 << 30

// MaxUploadFlag is how an operator raises Config.MaxUpload, for messages.
const MaxUploadFlag = "dsecd --max-upload-bytes"

// Service implements the node's layer operations on top of an image store.
type Service struct {
	cfg    Config
	images *image.Store
	log    *slog.Logger
	flight singleflight.Group

	mu        sync.Mutex
	sandboxes map[string]int64 // sandboxes started per layer digest since start
	// ready holds the layer digests ready to mount in this mode (ondemand
	// and eager), with the image file each was mounted from.
	ready   map[string]string
	mounted map[string][]string // layer digests each sandbox mounted
	closed  bool                // Close was called: no more background work
	// metaPending holds, per layer digest, a channel closed once the
	// background search for its metadata chunks ended (snapshots.go).
	metaPending map[string]chan struct{}

	// publishing counts the background work (trace publishes, metadata
	// marks) that Close waits for.
	publishing sync.WaitGroup
}

// New makes the service. images is the node's image store.
func New(cfg Config, images *image.Store) (*Service, error) {
	if cfg.Log == nil {
		cfg.Log = slog.New(slog.DiscardHandler)
	}
	if cfg.ChunkSize == 0 {
		cfg.ChunkSize = blob.DefaultChunkSize
	}
	if cfg.MaxUpload == 0 {
		cfg.MaxUpload = DefaultMaxUpload
	}
	if cfg.Blobs == nil {
		return nil, fmt.Errorf("layer service: no blob store: %w", errdefs.ErrInvalidArgument)
	}
	if cfg.Mode == ModeOnDemand && cfg.Loader == nil {
		return nil, fmt.Errorf("layer service: ondemand mode needs the lazy file system: %w", errdefs.ErrInvalidArgument)
	}
	for _, d := range []string{cfg.Dir, filepath.Join(cfg.Dir, "eager"), filepath.Join(cfg.Dir, "tar")} {
		if err := os.MkdirAll(d, 0o700); err != nil {
			return nil, fmt.Errorf("layer service: %w", err)
		}
	}
	return &Service{cfg: cfg, images: images, log: cfg.Log,
		sandboxes: map[string]int64{}, ready: map[string]string{}, mounted: map[string][]string{},
		metaPending: map[string]chan struct{}{}}, nil
}

// Mode is the service's loading mode.
func (s *Service) Mode() Mode { return s.cfg.Mode }

// BlobStoreName names the node's blob store alike on every node sharing it.
func (s *Service) BlobStoreName() string { return blob.StoreName(s.cfg.BlobSpec, s.cfg.Machine) }

// MaxUpload is the most an uploaded archive may carry.
func (s *Service) MaxUpload() int64 { return s.cfg.MaxUpload }

// Import builds a layer from a directory or tar archive and publishes it,
// and its ref.
func (s *Service) Import(ctx context.Context, ref string, kind image.Kind, src string, opts image.ImportOptions) (image.Layer, error) {
	l, err := s.images.Import(ctx, ref, kind, src, opts)
	if err != nil {
		return image.Layer{}, err
	}
	if err := s.publishLayer(ctx, ref, l.Digest); err != nil {
		return image.Layer{}, err
	}
	return l, nil
}

// ImportArchive builds a layer from the tar archive (plain or gzip) r
// streams, an upload, as it arrives, and publishes it and its ref.
func (s *Service) ImportArchive(ctx context.Context, ref string, kind image.Kind, r io.Reader, opts image.ImportOptions) (image.Layer, error) {
	l, err := s.images.ImportArchive(ctx, ref, kind, r, "upload", opts)
	if err != nil {
		return image.Layer{}, err
	}
	if err := s.publishLayer(ctx, ref, l.Digest); err != nil {
		return image.Layer{}, err
	}
	return l, nil
}

// publishLayer publishes an imported layer, then the ref naming it.
func (s *Service) publishLayer(ctx context.Context, ref, digest string) error {
	if err := s.publish(ctx, digest, false); err != nil {
		return err
	}
	s.warm(ctx, digest)
	if ref == "" {
		return nil
	}
	return s.publishRef(ctx, ref)
}

// ImportImage imports an OCI image as the environment ref and publishes its
// layers. progress gets oci's progress, then one "upload" step per layer.
func (s *Service) ImportImage(ctx context.Context, ref, source string, opts oci.Options) (oci.Result, error) {
	res, err := oci.Import(ctx, s.images, ref, source, opts)
	if err != nil {
		return oci.Result{}, err
	}
	for i, d := range res.Digests {
		if opts.Progress != nil {
			opts.Progress(oci.Progress{Phase: "upload", Layer: i + 1, Layers: len(res.Digests)})
		}
		if err := s.publish(ctx, d, false); err != nil {
			return oci.Result{}, err
		}
		s.warm(ctx, d)
	}
	if err := s.publishRef(ctx, ref); err != nil {
		return oci.Result{}, err
	}
	return res, nil
}

// publish stores a layer file in the blob store as chunks, marks the chunks
// holding its metadata, and (with Tars) stores it as a tar.gz. Publishing a
// layer that is already there costs a Stat.
//
// The chunks and an index naming them are written first: from then on the
// layer is in the store, whole. Marking its metadata chunks (Index.Meta,
// which only tells other nodes what to prefetch) means walking the layer
// through the lazy file system and writing the index again; with
// metaLater set publish returns before it and the mark is made in the
// background (markMetaLater), as a snapshot does to publish sooner.
func (s *Service) publish(ctx context.Context, digest string, metaLater bool) error {
	hex := strings.TrimPrefix(digest, "sha256:")
	if _, err := blob.GetIndex(ctx, s.cfg.Blobs, hex); err == nil {
		return s.publishTar(ctx, digest)
	}
	file, err := s.images.LayerFile(digest)
	if err != nil {
		return err
	}
	start := time.Now()
	ix, st, err := blob.PutLayer(ctx, s.cfg.Blobs, file, s.cfg.ChunkSize)
	if err != nil {
		return fmt.Errorf("publish layer %s: %w", digest, err)
	}
	if ix.Digest != digest {
		return fmt.Errorf("publish layer %s: the stored file has digest %s: %w", digest, ix.Digest, errdefs.ErrInvalidArgument)
	}
	put := time.Since(start)
	if s.cfg.Loader != nil {
		if _, err := s.cfg.Loader.Add(ctx, ix); err != nil {
			return fmt.Errorf("publish layer %s: %w", digest, err)
		}
		if metaLater {
			s.markMetaLater(ctx, ix)
		} else if err := s.markMeta(ctx, ix); err != nil {
			return err
		}
	}
	s.log.Info("published layer", "digest", digest, "chunks", st.Chunks, "uploaded", st.Uploaded,
		"skipped", st.Skipped, "bytes", st.BytesUploaded, "stored_bytes", st.StoredBytes,
		"compression", ix.Compression, "meta_chunks", len(ix.Meta), "meta_later", metaLater,
		"put", put, "took", time.Since(start))
	return s.publishTar(ctx, digest)
}

// markMeta finds the chunks of the published layer ix that hold its
// metadata, through the lazy file system (it must have the layer), and
// writes the index again with them.
func (s *Service) markMeta(ctx context.Context, ix *blob.Index) error {
	meta, err := s.cfg.Loader.MetaChunks(ctx, strings.TrimPrefix(ix.Digest, "sha256:"))
	if err != nil {
		return fmt.Errorf("publish layer %s: find metadata chunks: %w", ix.Digest, err)
	}
	ix.Meta = meta
	if err := blob.PutIndex(ctx, s.cfg.Blobs, ix); err != nil {
		return fmt.Errorf("publish layer %s: %w", ix.Digest, err)
	}
	return nil
}

// markMetaLater runs markMeta in the background and then, on demand,
// mounts the layer for sandboxes (prepare). Until both end, Mount of a
// layer read through the lazy file system waits (the search walks the
// layer and resets its access trace, which a sandbox's reads would
// disturb); a snapshot of this node's, mounted from its own file, does not
// (ownSnapshot). Close waits for them too. A node
// that adopts the layer meanwhile finds it without Meta, which costs it
// only the prefetch of its metadata. If dsecd dies first, the layer stays
// without Meta.
func (s *Service) markMetaLater(ctx context.Context, ix *blob.Index) {
	digest := ix.Digest
	done := make(chan struct{})
	s.mu.Lock()
	if s.closed {
		s.mu.Unlock()
		return
	}
	s.metaPending[digest] = done
	s.publishing.Add(1)
	s.mu.Unlock()
	go func() {
		defer s.publishing.Done()
		defer func() {
			s.mu.Lock()
			delete(s.metaPending, digest)
			s.mu.Unlock()
			close(done)
		}()
		ctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 10*time.Minute)
		defer cancel()
		start := time.Now()
		if err := s.markMeta(ctx, ix); err != nil {
			s.log.Warn("mark metadata chunks", "digest", digest, "err", err)
			return
		}
		marked := time.Since(start)
		// The layer is new and this node has it registered: make it ready
		// to mount now, so that the first sandbox on it (a restore, a
		// fork's children) finds it mounted like its base.
		if s.cfg.Mode == ModeOnDemand {
			if _, err, _ := s.flight.Do(digest, func() (any, error) { return s.prepare(ctx, digest) }); err != nil {
				s.log.Warn("prepare layer", "digest", digest, "err", err)
			}
		}
		s.log.Info("marked metadata chunks", "digest", digest, "meta_chunks", len(ix.Meta), "took", marked,
			"prepared", time.Since(start)-marked)
	}()
}

// waitMeta waits until no background search for layer digest's metadata
// chunks runs, or ctx ends.
func (s *Service) waitMeta(ctx context.Context, digest string) error {
	s.mu.Lock()
	done := s.metaPending[digest]
	s.mu.Unlock()
	if done == nil {
		return nil
	}
	select {
	case <-done:
		return nil
	case <-ctx.Done():
		return fmt.Errorf("mount layer %s: wait for its metadata mark: %w", digest, ctx.Err())
	}
}

// Stats reports per layer and per environment what sandboxes read.
func (s *Service) Stats(ctx context.Context) (Stats, error) {
	out := Stats{Mode: s.cfg.Mode, BlobStore: s.cfg.BlobSpec}
	all, err := s.images.List()
	if err != nil {
		return out, err
	}
	sizes := map[string]int64{}
	read := map[string]int64{}
	s.mu.Lock()
	fanout := maps.Clone(s.sandboxes)
	s.mu.Unlock()
	for _, l := range all {
		u := LayerUsage{Digest: l.Digest, Refs: l.Refs, Size: l.Size, Sandboxes: fanout[l.Digest]}
		hex := strings.TrimPrefix(l.Digest, "sha256:")
		if s.cfg.Loader != nil {
			if st, err := s.cfg.Loader.Stats(ctx, hex); err == nil {
				u.LayerStats = st
			}
		}
		// The lazy file system knows the chunk count of layers it serves;
		// only the others need their index read from the store.
		if u.ChunksTotal == 0 {
			if ix, err := blob.GetIndex(ctx, s.cfg.Blobs, hex); err == nil {
				u.ChunksTotal = int64(len(ix.Chunks))
			}
		}
		sizes[l.Digest], read[l.Digest] = l.Size, u.BytesRead
		out.Layers = append(out.Layers, u)
	}
	envs, err := s.images.Environments()
	if err != nil {
		return out, err
	}
	for _, e := range envs {
		u := EnvironmentUsage{Name: e.Name, Digests: e.Digests, Sandboxes: e.Sandboxes}
		for _, d := range e.Digests {
			u.Size += sizes[d]
			u.BytesRead += read[d]
		}
		out.Environments = append(out.Environments, u)
	}
	sort.Slice(out.Layers, func(i, j int) bool { return out.Layers[i].Digest < out.Layers[j].Digest })
	return out, nil
}

// Stats is what LayerStats reports.
type Stats struct {
	Mode         Mode
	BlobStore    string
	Layers       []LayerUsage
	Environments []EnvironmentUsage
}

// LayerUsage is one layer's accounting.
type LayerUsage struct {
	lazy.LayerStats
	Digest    string
	Refs      []string
	Size      int64
	Sandboxes int64
}

// EnvironmentUsage is one environment's accounting; Sandboxes is its fan-out.
type EnvironmentUsage struct {
	Name      string
	Digests   []string
	Size      int64
	BytesRead int64
	Sandboxes int64
}

// ResolveEnvironment resolves BASE[+LAYER...] to layers, bottom first. A
// part the node lacks is adopted from the blob store when another node
// published it there (refs.go).
func (s *Service) ResolveEnvironment(ctx context.Context, env string) ([]image.Layer, error) {
	layers, err := s.images.ResolveEnvironment(env)
	if !errors.Is(err, errdefs.ErrNotFound) {
		return layers, err
	}
	if err := s.adoptMissing(ctx, env); err != nil {
		return nil, fmt.Errorf("environment %q: adopt from the blob store: %w", env, err)
	}
	// Resolved again even when this call adopted nothing: a create beside
	// it may have adopted the missing part meanwhile.
	return s.images.ResolveEnvironment(env)
}

// RecordEnvironment counts a sandbox started from env.
func (s *Service) RecordEnvironment(env string, digests []string) error {
	s.mu.Lock()
	for _, d := range digests {
		s.sandboxes[d]++
	}
	s.mu.Unlock()
	return s.images.RecordEnvironment(env, digests)
}

// Mount makes layer digest available to sandbox id in the node's mode and
// describes it: the directory to stack, and the EROFS image file it is
// mounted from (for a runtime that attaches files rather than stacking
// dirs). In ondemand mode a snapshot this node took is mounted from its
// own whole file (ownSnapshot), as in local mode: its children start
// without waiting for the metadata mark, and read nothing through the lazy
// file system. In tar mode the layer is an extracted tree and has no file.
func (s *Service) Mount(ctx context.Context, id, digest string) (backend.Layer, error) {
	own := s.cfg.Mode == ModeOnDemand && s.ownSnapshot(digest)
	if !own {
		if err := s.waitMeta(ctx, digest); err != nil {
			return backend.Layer{}, err
		}
	}
	s.mu.Lock()
	s.mounted[id] = append(s.mounted[id], digest)
	s.mu.Unlock()
	switch {
	case s.cfg.Mode == ModeLocal, own:
		dir, err := s.images.Mount(ctx, digest)
		if err != nil {
			return backend.Layer{}, err
		}
		file, err := s.images.LayerFile(digest)
		if err != nil {
			return backend.Layer{}, err
		}
		return describe(digest, file, dir)
	case s.cfg.Mode == ModeTar:
		dir, err := s.extractFor(ctx, id, digest)
		if err != nil {
			return backend.Layer{}, err
		}
		return backend.Layer{Digest: digest, FSType: backend.FSTypeDir, Dir: dir}, nil
	}
	s.mu.Lock()
	file, ready := s.ready[digest]
	s.mu.Unlock()
	if !ready {
		// One sandbox pulls or registers a layer; the others wait for it.
		f, err, _ := s.flight.Do(digest, func() (any, error) { return s.prepare(ctx, digest) })
		if err != nil {
			return backend.Layer{}, err
		}
		file = f.(string)
	}
	mp, err := s.images.MountPoint(digest)
	if err != nil {
		return backend.Layer{}, err
	}
	return describe(digest, file, mp)
}

// describe is layer digest's description: its EROFS image file, mounted
// at dir.
func describe(digest, file, dir string) (backend.Layer, error) {
	fi, err := os.Stat(file)
	if err != nil {
		return backend.Layer{}, fmt.Errorf("describe layer %s: %w", digest, err)
	}
	return backend.Layer{Digest: digest, File: file, FSType: backend.FSTypeEROFS, Size: fi.Size(), Dir: dir}, nil
}

// prepare makes digest mountable: in ondemand mode it registers the layer
// with the lazy file system and mounts EROFS from the FUSE file; in eager
// mode it pulls the whole file, verified, and mounts it. It returns the
// file it mounted.
func (s *Service) prepare(ctx context.Context, digest string) (string, error) {
	hex := strings.TrimPrefix(digest, "sha256:")
	ix, err := blob.GetIndex(ctx, s.cfg.Blobs, hex)
	if errors.Is(err, errdefs.ErrNotFound) {
		// A layer imported before the blob store was in use: publish the
		// node's own copy first.
		if err := s.publish(ctx, digest, false); err != nil {
			return "", fmt.Errorf("prepare layer %s: %w", digest, err)
		}
		ix, err = blob.GetIndex(ctx, s.cfg.Blobs, hex)
	}
	if err != nil {
		return "", fmt.Errorf("prepare layer %s: %w", digest, err)
	}
	var file string
	switch {
	case s.cfg.Mode == ModeOnDemand && s.ownSnapshot(digest):
		// The store's own file: what Mount mounts for this layer.
		if file, err = s.images.LayerFile(digest); err != nil {
			return "", fmt.Errorf("prepare layer %s: %w", digest, err)
		}
	case s.cfg.Mode == ModeOnDemand:
		if file, err = s.cfg.Loader.Add(ctx, ix); err != nil {
			return "", fmt.Errorf("prepare layer %s: %w", digest, err)
		}
		// A layer imported or adopted in this run was warmed then;
		// one known from before (or by a restarted lazyfs) is now.
		s.prefetchTrace(ctx, digest)
	case s.cfg.Mode == ModeEager:
		file = filepath.Join(s.cfg.Dir, "eager", hex)
		if _, err := os.Stat(file); err != nil {
			if err := pullFile(ctx, s.cfg.Blobs, ix, file); err != nil {
				return "", fmt.Errorf("prepare layer %s: %w", digest, err)
			}
		}
	}
	if _, err := s.images.MountFile(ctx, digest, file); err != nil {
		return "", err
	}
	s.mu.Lock()
	s.ready[digest] = file
	s.mu.Unlock()
	return file, nil
}

// ownSnapshot reports whether layer digest is a snapshot whose whole file
// this node's store holds: one it packed itself (a layer adopted from the
// blob store has no file here). In ondemand mode such a layer is mounted
// from that file, as in local mode; the lazy file system serves it to the
// metadata mark only.
func (s *Service) ownSnapshot(digest string) bool {
	l, err := s.images.Get(digest)
	return err == nil && l.Kind == image.KindSnapshot && s.images.HasLayerFile(digest)
}

// warm readies, on demand, a layer the node has just learnt of (imported,
// or adopted from the blob store): it registers the layer with the lazy file
// system and prefetches in the background what its trace names, so that
// the first sandbox on it finds those chunks in memory. It is the on-demand
// counterpart of local mode pulling whole files on adoption, at the cost of
// the chunks the trace names (what sandboxes on other nodes read, not the
// image). Failing only costs that head start.
func (s *Service) warm(ctx context.Context, digest string) {
	if s.cfg.Mode != ModeOnDemand {
		return
	}
	ix, err := blob.GetIndex(ctx, s.cfg.Blobs, strings.TrimPrefix(digest, "sha256:"))
	if err == nil {
		_, err = s.cfg.Loader.Add(ctx, ix)
	}
	if err != nil {
		s.log.Warn("warm layer", "digest", digest, "err", err)
		return
	}
	s.prefetchTrace(ctx, digest)
}

// prefetchTrace fetches in the background what earlier runs on this node
// read first of layer digest, or on a node new to the layer what the trace
// other nodes published names; nobody waits for it. Asking again while a
// prefetch runs costs little: cached chunks are skipped, and chunks being
// fetched are waited for.
func (s *Service) prefetchTrace(ctx context.Context, digest string) {
	go func() {
		ctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 10*time.Minute)
		defer cancel()
		if n, err := s.cfg.Loader.PrefetchTrace(ctx, strings.TrimPrefix(digest, "sha256:")); err != nil {
			s.log.Warn("prefetch layer from its trace", "digest", digest, "err", err)
		} else if n > 0 {
			s.log.Info("prefetched layer from its trace", "digest", digest, "chunks", n)
		}
	}()
}

// pullFile writes the whole layer file, every chunk verified, atomically.
func pullFile(ctx context.Context, st blob.Store, ix *blob.Index, dst string) error {
	f, err := os.CreateTemp(filepath.Dir(dst), ".pull-*")
	if err != nil {
		return err
	}
	defer os.Remove(f.Name())
	if err := blob.GetLayer(ctx, st, ix, f); err != nil {
		f.Close()
		return err
	}
	if err := f.Sync(); err != nil {
		f.Close()
		return err
	}
	if err := f.Close(); err != nil {
		return err
	}
	return os.Rename(f.Name(), dst)
}

// Release forgets what sandbox id mounted: on demand, the access trace of
// its layers is saved for later prefetching on this node and, in the
// background, merged into the traces published in the blob store for other
// nodes; in tar mode its extracted trees are removed.
func (s *Service) Release(ctx context.Context, id string) {
	s.mu.Lock()
	digests := s.mounted[id]
	delete(s.mounted, id)
	s.mu.Unlock()
	if s.cfg.Mode == ModeOnDemand {
		for _, d := range digests {
			if err := s.cfg.Loader.SaveTrace(ctx, strings.TrimPrefix(d, "sha256:")); err != nil {
				s.log.Debug("save layer access trace", "digest", d, "err", err)
			}
		}
		s.publishTraces(context.WithoutCancel(ctx), digests)
	}
	if s.cfg.Mode != ModeTar {
		return
	}
	if err := os.RemoveAll(filepath.Join(s.cfg.Dir, "tar", id)); err != nil {
		s.log.Warn("remove extracted layers", "id", id, "err", err)
	}
}

// publishTraces merges the traces of digests into the blob store in the
// background. A trace is a hint: failing to publish one is logged only.
func (s *Service) publishTraces(ctx context.Context, digests []string) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if len(digests) == 0 || s.closed {
		return
	}
	s.publishing.Add(1)
	go func() {
		defer s.publishing.Done()
		ctx, cancel := context.WithTimeout(ctx, 30*time.Second)
		defer cancel()
		for _, d := range digests {
			wrote, err := s.cfg.Loader.PublishTrace(ctx, strings.TrimPrefix(d, "sha256:"))
			if err != nil {
				s.log.Warn("publish layer access trace", "digest", d, "err", err)
			} else if wrote {
				s.log.Debug("published layer access trace", "digest", d)
			}
		}
	}()
}

// Close waits, until ctx ends, for the trace publishes Release started and
// the metadata marks of snapshots published.
// The service must not be used after it.
func (s *Service) Close(ctx context.Context) error {
	s.mu.Lock()
	s.closed = true
	s.mu.Unlock()
	done := make(chan struct{})
	go func() {
		s.publishing.Wait()
		close(done)
	}()
	select {
	case <-done:
		return nil
	case <-ctx.Done():
		return fmt.Errorf("close layer service: trace publishes or metadata marks still running: %w", ctx.Err())
	}
}

func tarKey(hex string) string { return "tars/sha256/" + hex + ".tar.gz" }

// publishTar stores the layer's tree as a tar.gz, read from its EROFS mount.
func (s *Service) publishTar(ctx context.Context, digest string) error {
	if !s.cfg.Tars {
		return nil
	}
	hex := strings.TrimPrefix(digest, "sha256:")
	if _, err := s.cfg.Blobs.Stat(ctx, tarKey(hex)); err == nil {
		return nil
	}
	dir, err := s.images.Mount(ctx, digest)
	if err != nil {
		return err
	}
	tmp, err := os.CreateTemp(s.cfg.Dir, ".tar-*")
	if err != nil {
		return err
	}
	defer os.Remove(tmp.Name())
	defer tmp.Close()
	zw := gzip.NewWriter(tmp)
	if err := writeTree(ctx, zw, dir); err != nil {
		return fmt.Errorf("publish layer %s as tar: %w", digest, err)
	}
	if err := zw.Close(); err != nil {
		return err
	}
	size, err := tmp.Seek(0, io.SeekCurrent)
	if err != nil {
		return err
	}
	if _, err := tmp.Seek(0, io.SeekStart); err != nil {
		return err
	}
	return s.cfg.Blobs.Put(ctx, tarKey(hex), tmp, size)
}

// writeTree writes dir as a tar stream, keeping overlay whiteouts (0:0
// character devices) and the opaque xattr.
func writeTree(ctx context.Context, w io.Writer, dir string) error {
	tw := tar.NewWriter(w)
	err := filepath.WalkDir(dir, func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		if ctx.Err() != nil {
			return ctx.Err()
		}
		rel, _ := filepath.Rel(dir, p)
		if rel == "." {
			return nil
		}
		info, err := d.Info()
		if err != nil {
			return err
		}
		return tarfile.WriteEntry(tw, p, rel, info, func(hdr *tar.Header) {
			if info.IsDir() {
				if v, err := getxattr(p, "trusted.overlay.opaque"); err == nil && v == "y" {
					hdr.PAXRecords = map[string]string{"SCHILY.xattr.trusted.overlay.opaque": "y"}
				}
			}
		})
	})
	if err != nil {
		return err
	}
	return tw.Close()
}

func getxattr(p, name string) (string, error) {
	buf := make([]byte, 64)
	n, err := unix.Lgetxattr(p, name, buf)
	if err != nil {
		return "", err
	}
	return string(buf[:n]), nil
}

// extractFor extracts layer digest's tar for sandbox id alone (tar mode).
func (s *Service) extractFor(ctx context.Context, id, digest string) (string, error) {
	hex := strings.TrimPrefix(digest, "sha256:")
	dst := filepath.Join(s.cfg.Dir, "tar", id, hex)
	if err := os.MkdirAll(dst, 0o755); err != nil {
		return "", err
	}
	rc, err := s.cfg.Blobs.Get(ctx, tarKey(hex))
	if errors.Is(err, errdefs.ErrNotFound) {
		return "", fmt.Errorf("layer %s has no tar in the blob store (import with tars on): %w", digest, errdefs.ErrFailedPrecondition)
	}
	if err != nil {
		return "", err
	}
	defer rc.Close()
	// The archive is the node's own (publishTar wrote it from the verified
	// layer), so GNU tar extracts it as the baseline the paper measured,
	// whiteout devices and the opaque xattr included.
	cmd := exec.CommandContext(ctx, "tar", "-xzf", "-", "-C", dst, "--numeric-owner", "--xattrs", "--xattrs-include=trusted.*")
	cmd.Stdin = rc
	if out, err := cmd.CombinedOutput(); err != nil {
		return "", fmt.Errorf("extract layer %s for %s: %v: %s", digest, id, err, out)
	}
	return dst, nil
}

// List lists the node's layers.
func (s *Service) List() ([]image.Layer, error) { return s.images.List() }

// Image finds an image by name:tag.
func (s *Service) Image(ref string) (image.ImageInfo, error) { return s.images.Image(ref) }

// Get finds a layer by name:tag or digest.
func (s *Service) Get(refOrDigest string) (image.Layer, error) { return s.images.Get(refOrDigest) }

// Remove drops a ref, or a layer by digest, from the node's image store,
// and the blob store's records of the refs that went. Blobs stay in the
// blob store, which other nodes may share.
func (s *Service) Remove(ctx context.Context, refOrDigest string) error {
	gone := map[string][]string{} // ref -> the digests it named
	if strings.HasPrefix(refOrDigest, "sha256:") {
		if l, err := s.images.Get(refOrDigest); err == nil {
			for _, r := range l.Refs {
				gone[r] = []string{l.Digest}
			}
		}
	} else if ref, err := image.ParseRef(refOrDigest); err == nil {
		if rec, err := s.localRecord(ref); err == nil {
			gone[ref] = rec.digests()
		}
	}
	if err := s.images.Remove(refOrDigest); err != nil {
		return err
	}
	var errs []error
	for ref, digests := range gone {
		if s.knows(ref) {
			continue // removing a layer by digest leaves refs of images
		}
		if err := s.dropRef(ctx, ref, digests); err != nil {
			errs = append(errs, err)
		}
		if err := s.dropSnapshot(ctx, ref); err != nil {
			errs = append(errs, err)
		}
	}
	if err := errors.Join(errs...); err != nil {
		return fmt.Errorf("remove %s: %w", refOrDigest, err)
	}
	return nil
}

// Environments lists the environments sandboxes were made from.
func (s *Service) Environments() ([]image.Environment, error) { return s.images.Environments() }

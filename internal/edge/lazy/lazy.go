package lazy

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"log/slog"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"golang.org/x/sync/errgroup"
	"golang.org/x/sync/singleflight"

	"dsec.dev/dsec/internal/blob"
	"dsec.dev/dsec/internal/errdefs"
)

// Config configures an FS. Zero values take the defaults noted.
type Config struct {
	Store        blob.Store
	MountPoint   string        // FUSE mount dir; a layer with sha256 hex H appears as MountPoint/H
	CacheDir     string        // chunk cache, kept across restarts
	CacheBytes   int64         // LRU size limit; 0 = 10 GiB
	FetchTimeout time.Duration // per attempt; 0 = 10 s
	Retries      int           // attempts per chunk before EIO; 0 = 3
	Log          *slog.Logger  // nil = discard
}

const (
	defaultCacheBytes   = 10 << 30
	defaultFetchTimeout = 10 * time.Second
	defaultRetries      = 3
	prefetchWorkers     = 4
	maxBackoff          = 2 * time.Second
)

// LayerStats are one layer's counters since it was added.
type LayerStats struct {
	Size      int64 // bytes of the layer file
	BytesRead int64 // bytes returned to readers of the file
	// BytesFetched is the bytes of verified chunk objects read from the
	// store: what crossed the network, compressed for a zstd layer.
	BytesFetched int64
	// BytesFetchedPlain is the plain (uncompressed) bytes of those chunks;
	// equal to BytesFetched for a raw layer.
	BytesFetchedPlain int64
	ChunksTotal       int64
	ChunksFetched     int64 // chunks fetched from the store (verified)
	CacheHits         int64 // chunk reads served from the local cache
	CacheMisses       int64 // chunk reads that had to wait for a fetch
	FetchErrors       int64 // failed fetch attempts (store errors, timeouts, bad chunks)
}

// FS is a mounted lazy layer file system. Its methods are safe for
// concurrent use; none may be called after Close returns.
type FS struct {
	cfg   Config
	log   *slog.Logger
	cache *chunkCache
	sf    singleflight.Group

	// ctx bounds every fetch; cancelled by Close. Fetches run on it rather
	// than on a reader's context so that one reader giving up does not fail
	// the others waiting for the same chunk.
	ctx    context.Context
	cancel context.CancelFunc

	mu     sync.Mutex
	layers map[string]*layer // by file sha256 hex

	mnt mountState // the FUSE side, per OS
}

// layer is one registered layer file.
type layer struct {
	hex string
	ix  *blob.Index

	bytesRead, bytesFetched, chunksFetched atomic.Int64
	bytesFetchedPlain                      atomic.Int64
	cacheHits, cacheMisses, fetchErrors    atomic.Int64

	// seen marks chunks read since the trace was last reset; order lists
	// them in the order first read.
	seen    []atomic.Bool
	traceMu sync.Mutex
	order   []int
}

func (l *layer) trace(i int) {
	if l.seen[i].Load() || !l.seen[i].CompareAndSwap(false, true) {
		return
	}
	l.traceMu.Lock()
	l.order = append(l.order, i)
	l.traceMu.Unlock()
}

func (l *layer) resetTrace() {
	l.traceMu.Lock()
	defer l.traceMu.Unlock()
	for i := range l.seen {
		l.seen[i].Store(false)
	}
	l.order = nil
}

func (l *layer) traced() []int {
	l.traceMu.Lock()
	defer l.traceMu.Unlock()
	return append([]int(nil), l.order...)
}

func (cfg *Config) setDefaults() error {
	if cfg.Store == nil || cfg.MountPoint == "" || cfg.CacheDir == "" {
		return fmt.Errorf("configure lazy fs: store, mount point and cache dir are required: %w", errdefs.ErrInvalidArgument)
	}
	if cfg.CacheBytes <= 0 {
		cfg.CacheBytes = defaultCacheBytes
	}
	if cfg.FetchTimeout <= 0 {
		cfg.FetchTimeout = defaultFetchTimeout
	}
	if cfg.Retries <= 0 {
		cfg.Retries = defaultRetries
	}
	if cfg.Log == nil {
		cfg.Log = slog.New(slog.DiscardHandler)
	}
	return nil
}

// newFS sets up everything but the FUSE mount.
func newFS(cfg Config) (*FS, error) {
	if err := cfg.setDefaults(); err != nil {
		return nil, err
	}
	cache, err := openCache(filepath.Join(cfg.CacheDir, "chunks"), cfg.CacheBytes, cfg.Log)
	if err != nil {
		return nil, err
	}
	traces := filepath.Join(cfg.CacheDir, "traces")
	if err := os.MkdirAll(traces, 0o700); err != nil {
		return nil, fmt.Errorf("create trace dir: %w", err)
	}
	if leftovers, err := filepath.Glob(filepath.Join(traces, ".tmp-*")); err == nil {
		for _, p := range leftovers {
			os.Remove(p)
		}
	}
	ctx, cancel := context.WithCancel(context.Background())
	return &FS{
		cfg:    cfg,
		log:    cfg.Log,
		cache:  cache,
		ctx:    ctx,
		cancel: cancel,
		layers: map[string]*layer{},
	}, nil
}

// layerHex returns the sha256 hex of an index's file.
func layerHex(ix *blob.Index) (string, error) {
	h, ok := strings.CutPrefix(ix.Digest, "sha256:")
	if !ok || !hexName.MatchString(h) {
		return "", fmt.Errorf("add layer %q: digest is not sha256: %w", ix.Digest, errdefs.ErrInvalidArgument)
	}
	return h, nil
}

func (f *FS) layer(hex string) (*layer, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	l, ok := f.layers[hex]
	if !ok {
		return nil, fmt.Errorf("find layer %s: %w", hex, errdefs.ErrNotFound)
	}
	return l, nil
}

// Add registers a layer file (read-only, ix.Size bytes), pins its metadata
// chunks (ix.Meta) in the cache, and returns the file's path under the mount
// point. Nothing is fetched here: a metadata chunk is fetched when the kernel
// first reads it, like any other, and then stays local while the layer is
// registered. A task that walks one corner of a tree so fetches the metadata
// of that corner only. Adding a registered layer again returns its path.
func (f *FS) Add(ctx context.Context, ix *blob.Index) (string, error) {
	if err := ix.Validate(); err != nil {
		return "", fmt.Errorf("add layer: %w: %w", err, errdefs.ErrInvalidArgument)
	}
	hex, err := layerHex(ix)
	if err != nil {
		return "", err
	}
	p := filepath.Join(f.cfg.MountPoint, hex)
	f.mu.Lock()
	_, ok := f.layers[hex]
	f.mu.Unlock()
	if ok {
		return p, nil
	}

	l := &layer{hex: hex, ix: ix, seen: make([]atomic.Bool, len(ix.Chunks))}
	for _, m := range ix.Meta {
		f.cache.pin(ix.Chunks[m])
	}

	f.mu.Lock()
	if _, ok := f.layers[hex]; ok {
		// Lost a race with a concurrent Add of the same layer.
		f.mu.Unlock()
		f.unpinMeta(l)
		return p, nil
	}
	f.layers[hex] = l
	f.mu.Unlock()
	if err := f.mnt.addFile(f, l); err != nil {
		f.mu.Lock()
		delete(f.layers, hex)
		f.mu.Unlock()
		f.unpinMeta(l)
		return "", fmt.Errorf("add layer %s: %w", hex, err)
	}
	f.log.Debug("layer added", "layer", hex, "size", ix.Size, "meta_chunks", len(ix.Meta))
	return p, nil
}

func (f *FS) unpinMeta(l *layer) {
	for _, m := range l.ix.Meta {
		f.cache.unpin(l.ix.Chunks[m])
	}
}

// Remove unregisters a layer: its file disappears from the mount and its
// metadata chunks are unpinned (they stay cached until evicted). Files
// already open keep working.
func (f *FS) Remove(hex string) {
	f.mu.Lock()
	l, ok := f.layers[hex]
	delete(f.layers, hex)
	f.mu.Unlock()
	if !ok {
		return
	}
	f.mnt.removeFile(hex)
	f.unpinMeta(l)
}

// FetchAll fetches every chunk of the layer into the cache (eager mode).
func (f *FS) FetchAll(ctx context.Context, hex string) error {
	l, err := f.layer(hex)
	if err != nil {
		return err
	}
	all := make([]int, len(l.ix.Chunks))
	for i := range all {
		all[i] = i
	}
	if err := f.prefetch(ctx, l, all); err != nil {
		return fmt.Errorf("fetch layer %s: %w", hex, err)
	}
	return nil
}

// Prefetch fetches the given chunks of the layer into the cache.
func (f *FS) Prefetch(ctx context.Context, hex string, chunks []int) error {
	l, err := f.layer(hex)
	if err != nil {
		return err
	}
	for _, i := range chunks {
		if i < 0 || i >= len(l.ix.Chunks) {
			return fmt.Errorf("prefetch layer %s: chunk %d out of range: %w", hex, i, errdefs.ErrInvalidArgument)
		}
	}
	if err := f.prefetch(ctx, l, chunks); err != nil {
		return fmt.Errorf("prefetch layer %s: %w", hex, err)
	}
	return nil
}

func (f *FS) prefetch(ctx context.Context, l *layer, chunks []int) error {
	g, gctx := errgroup.WithContext(ctx)
	g.SetLimit(prefetchWorkers)
	for _, i := range chunks {
		if f.cache.has(l.ix.Chunks[i]) {
			continue
		}
		g.Go(func() error {
			_, err := f.fetch(gctx, l, i)
			return err
		})
	}
	return g.Wait()
}

// traceFile is the JSON saved by SaveTrace.
type traceFile struct {
	Digest    string `json:"digest"`
	ChunkSize int64  `json:"chunk_size"`
	Chunks    []int  `json:"chunks"` // in the order first read
}

func (f *FS) tracePath(hex string) string {
	return filepath.Join(f.cfg.CacheDir, "traces", hex+".json")
}

// SaveTrace records the chunk numbers of the layer read so far, in the order
// first read, under CacheDir/traces/<hex>.json, for PrefetchTrace in a later
// run.
func (f *FS) SaveTrace(hex string) error {
	l, err := f.layer(hex)
	if err != nil {
		return err
	}
	data, err := json.Marshal(traceFile{Digest: l.ix.Digest, ChunkSize: l.ix.ChunkSize, Chunks: l.traced()})
	if err != nil {
		return fmt.Errorf("save trace %s: %w", hex, err)
	}
	if err := writeFileAtomic(f.tracePath(hex), data); err != nil {
		return fmt.Errorf("save trace %s: %w", hex, err)
	}
	return nil
}

// PrefetchTrace prefetches the chunks recorded by an earlier SaveTrace of the
// layer and returns how many it asked for. No saved trace is not an error:
// it returns 0.
func (f *FS) PrefetchTrace(ctx context.Context, hex string) (int, error) {
	l, err := f.layer(hex)
	if err != nil {
		return 0, err
	}
	data, err := os.ReadFile(f.tracePath(hex))
	if errors.Is(err, fs.ErrNotExist) {
		return 0, nil
	}
	if err != nil {
		return 0, fmt.Errorf("read trace %s: %w", hex, err)
	}
	var tf traceFile
	if err := json.Unmarshal(data, &tf); err != nil {
		return 0, fmt.Errorf("read trace %s: %w", hex, err)
	}
	if tf.Digest != l.ix.Digest || tf.ChunkSize != l.ix.ChunkSize {
		f.log.Warn("ignore stale trace", "layer", hex, "chunk_size", tf.ChunkSize)
		return 0, nil
	}
	var chunks []int
	for _, i := range tf.Chunks {
		if i >= 0 && i < len(l.ix.Chunks) {
			chunks = append(chunks, i)
		}
	}
	if err := f.prefetch(ctx, l, chunks); err != nil {
		return 0, fmt.Errorf("prefetch trace %s: %w", hex, err)
	}
	return len(chunks), nil
}

// Stats returns the layer's counters; zero for an unknown layer.
func (f *FS) Stats(hex string) LayerStats {
	l, err := f.layer(hex)
	if err != nil {
		return LayerStats{}
	}
	return LayerStats{
		Size:              l.ix.Size,
		BytesRead:         l.bytesRead.Load(),
		BytesFetched:      l.bytesFetched.Load(),
		BytesFetchedPlain: l.bytesFetchedPlain.Load(),
		ChunksTotal:       int64(len(l.ix.Chunks)),
		ChunksFetched:     l.chunksFetched.Load(),
		CacheHits:         l.cacheHits.Load(),
		CacheMisses:       l.cacheMisses.Load(),
		FetchErrors:       l.fetchErrors.Load(),
	}
}

// readAt fills dest from the layer file at off, fetching the chunks it
// covers that are not cached. It returns the bytes read (short only at the
// end of the file).
func (f *FS) readAt(ctx context.Context, l *layer, dest []byte, off int64) (int, error) {
	if off >= l.ix.Size {
		return 0, nil
	}
	if end := l.ix.Size - off; int64(len(dest)) > end {
		dest = dest[:end]
	}
	cs := l.ix.ChunkSize
	done := 0
	for done < len(dest) {
		pos := off + int64(done)
		i := int(pos / cs)
		within := pos - int64(i)*cs
		n := min(int64(len(dest)-done), l.ix.ChunkLen(i)-within)
		part := dest[done : done+int(n)]
		l.trace(i)
		if f.cache.readAt(l.ix.Chunks[i], part, within) {
			l.cacheHits.Add(1)
		} else {
			l.cacheMisses.Add(1)
			data, err := f.fetch(ctx, l, i)
			if err != nil {
				return done, err
			}
			copy(part, data[within:])
		}
		done += int(n)
	}
	l.bytesRead.Add(int64(done))
	return done, nil
}

// fetch returns chunk i of the layer, verified, fetching it from the store
// at most once at a time per chunk digest and storing it in the cache. The
// returned bytes come from memory, so a full cache never fails a read.
func (f *FS) fetch(ctx context.Context, l *layer, i int) ([]byte, error) {
	hex := l.ix.Chunks[i]
	want := l.ix.ChunkLen(i)
	ch := f.sf.DoChan(hex, func() (any, error) {
		// A fetch that finished between our cache miss and this call.
		if data, ok := f.cache.readAll(hex); ok && int64(len(data)) == want {
			return data, nil
		}
		data, err := f.fetchRetry(l, i)
		if err != nil {
			return nil, err
		}
		if err := f.cache.put(hex, data); err != nil {
			f.log.Warn("cache chunk", "layer", l.hex, "chunk", i, "err", err)
		}
		return data, nil
	})
	select {
	case r := <-ch:
		if r.Err != nil {
			return nil, r.Err
		}
		return r.Val.([]byte), nil
	case <-ctx.Done():
		return nil, fmt.Errorf("fetch chunk %d of layer %s: %w", i, l.hex, ctx.Err())
	}
}

// fetchRetry fetches and verifies chunk i, trying up to Retries times with
// each attempt bounded by FetchTimeout.
func (f *FS) fetchRetry(l *layer, i int) ([]byte, error) {
	var lastErr error
	backoff := 50 * time.Millisecond
	for attempt := 1; attempt <= f.cfg.Retries; attempt++ {
		data, stored, err := f.fetchOnce(l, i)
		if err == nil {
			l.chunksFetched.Add(1)
			l.bytesFetched.Add(stored)
			l.bytesFetchedPlain.Add(int64(len(data)))
			return data, nil
		}
		l.fetchErrors.Add(1)
		lastErr = err
		f.log.Warn("fetch chunk", "layer", l.hex, "chunk", i, "attempt", attempt, "err", err)
		if attempt == f.cfg.Retries {
			break
		}
		select {
		case <-time.After(backoff):
		case <-f.ctx.Done():
			return nil, fmt.Errorf("fetch chunk %d of layer %s: %w", i, l.hex, f.ctx.Err())
		}
		backoff = min(2*backoff, maxBackoff)
	}
	return nil, fmt.Errorf("fetch chunk %d of layer %s after %d attempts: %w", i, l.hex, f.cfg.Retries, lastErr)
}

// errCorrupt marks a chunk whose stored object does not decode to the bytes
// its index entry names (the error also wraps blob.ErrCorrupt).
var errCorrupt = errors.New("chunk does not match its digest")

// fetchOnce reads chunk i's object from the store, decodes it (bounded by
// the chunk's length) and verifies it. It returns the chunk and the number
// of bytes read from the store.
func (f *FS) fetchOnce(l *layer, i int) ([]byte, int64, error) {
	ctx, cancel := context.WithTimeout(f.ctx, f.cfg.FetchTimeout)
	defer cancel()
	hex := l.ix.Chunks[i]
	stored, err := blob.ReadChunkObject(ctx, f.cfg.Store, l.ix, i)
	if errors.Is(err, blob.ErrCorrupt) {
		return nil, 0, fmt.Errorf("verify chunk %s: %w: %w", hex, errCorrupt, err)
	}
	if err != nil {
		return nil, 0, err
	}
	data, err := blob.DecodeChunk(l.ix, i, stored)
	if errors.Is(err, blob.ErrCorrupt) {
		return nil, 0, fmt.Errorf("verify chunk %s: %w: %w", hex, errCorrupt, err)
	}
	if err != nil {
		return nil, 0, err
	}
	return data, int64(len(stored)), nil
}

// writeFileAtomic writes data to path through a temp file and a rename.
func writeFileAtomic(path string, data []byte) error {
	tmp, err := os.CreateTemp(filepath.Dir(path), ".tmp-")
	if err != nil {
		return err
	}
	_, werr := tmp.Write(data)
	cerr := tmp.Close()
	if err := errors.Join(werr, cerr); err != nil {
		os.Remove(tmp.Name())
		return err
	}
	if err := os.Rename(tmp.Name(), path); err != nil {
		os.Remove(tmp.Name())
		return err
	}
	return nil
}

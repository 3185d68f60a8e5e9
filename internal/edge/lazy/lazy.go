package lazy

import (
	"context"
	"errors"
	"fmt"
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
	CacheDir     string        // chunk cache's disk tier and traces, kept across restarts
	CacheBytes   int64         // disk tier's LRU size limit; 0 = 10 GiB
	MemoryBytes  int64         // memory tier's limit (chunk objects as fetched and decoded copies); 0 = 256 MiB
	FetchTimeout time.Duration // per attempt; 0 = 10 s
	Retries      int           // attempts per chunk before EIO; 0 = 3
	// NoPagePush keeps the rest of a chunk's pages from the kernel's page
	// cache after a read of some of them (see push_linux.go): every page
	// is then read through the file system.
	NoPagePush bool
	Log        *slog.Logger // nil = discard
}

const (
	defaultCacheBytes   = 10 << 30
	defaultMemoryBytes  = 256 << 20
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
	CacheHits         int64 // chunk reads served from the local cache: MemoryHits + DiskHits
	MemoryHits        int64 // chunk reads served from the memory tier
	DiskHits          int64 // chunk reads served from the disk tier
	CacheMisses       int64 // chunk reads that had to wait for a fetch
	FetchErrors       int64 // failed fetch attempts (store errors, timeouts, bad chunks)
	// BytesWrittenDisk is the bytes of this layer's chunks written to the
	// cache's disk tier (hot chunks leaving memory, compressed).
	BytesWrittenDisk int64
	// BytesPushed is the bytes handed to the kernel's page cache unasked:
	// the rest of each chunk a read took some of. Readers' reads of them
	// are not in BytesRead.
	BytesPushed int64
}

// FS is a mounted lazy layer file system. Its methods are safe for
// concurrent use; none may be called after Close returns.
type FS struct {
	cfg   Config
	log   *slog.Logger
	cache *chunkCache
	sf    singleflight.Group
	// prefetching bounds the chunk fetches of prefetches (traces, FetchAll)
	// node-wide, leaving the store's bandwidth to the reads sandboxes wait on.
	prefetching chan struct{}

	// ctx bounds every fetch; cancelled by Close. Fetches run on it rather
	// than on a reader's context so that one reader giving up does not fail
	// the others waiting for the same chunk.
	ctx    context.Context
	cancel context.CancelFunc

	mu     sync.Mutex
	layers map[string]*layer // by file sha256 hex
	gone   Totals            // the counters of layers removed, when they were

	mnt mountState // the FUSE side, per OS
}

// layer is one registered layer file.
type layer struct {
	hex string
	ix  *blob.Index

	bytesRead, bytesFetched, chunksFetched atomic.Int64
	bytesFetchedPlain, bytesWrittenDisk    atomic.Int64
	memoryHits, diskHits                   atomic.Int64
	cacheMisses, fetchErrors               atomic.Int64
	// fetchErrors by the step that failed (fetchStep's index).
	stepErrors  [3]atomic.Int64
	bytesPushed atomic.Int64

	// pushedAt is, per chunk, when its pages were last queued for the
	// kernel (unix ns; 0: never). pushGen counts the times the kernel was
	// told to drop the file's pages; pushMu fences pushes off while it is.
	pushedAt []atomic.Int64
	pushGen  atomic.Uint64
	pushMu   sync.RWMutex

	// seen marks chunks read since the trace was last reset; order lists
	// them in the order first read.
	seen    []atomic.Bool
	traceMu sync.Mutex
	order   []int

	// publishMu serializes PublishTrace of the layer; published and
	// publishedAt say what the last one merged and when.
	publishMu   sync.Mutex
	published   int
	publishedAt time.Time
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
	// The next PublishTrace must not take the new trace for the one it
	// merged last because they are as long.
	l.publishMu.Lock()
	l.published = 0
	l.publishMu.Unlock()
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
	if cfg.MemoryBytes <= 0 {
		cfg.MemoryBytes = defaultMemoryBytes
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
	cache, err := openCache(filepath.Join(cfg.CacheDir, "chunks"), cfg.MemoryBytes, cfg.CacheBytes, cfg.Log)
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
		cfg:         cfg,
		log:         cfg.Log,
		cache:       cache,
		prefetching: make(chan struct{}, prefetchWorkers),
		ctx:         ctx,
		cancel:      cancel,
		layers:      map[string]*layer{},
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

	l := &layer{hex: hex, ix: ix, seen: make([]atomic.Bool, len(ix.Chunks)), pushedAt: make([]atomic.Int64, len(ix.Chunks))}
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
	if ok {
		l.addTo(&f.gone)
	}
	f.mu.Unlock()
	if !ok {
		return
	}
	f.mnt.removeFile(hex)
	f.unpinMeta(l)
}

// FetchAll fetches every chunk of the layer into the cache (eager mode).
// Chunks asked for this way are hot: they go to disk when memory evicts them.
func (f *FS) FetchAll(ctx context.Context, hex string) error {
	l, err := f.layer(hex)
	if err != nil {
		return err
	}
	all := make([]int, len(l.ix.Chunks))
	for i := range all {
		all[i] = i
	}
	if err := f.prefetch(ctx, l, all, true); err != nil {
		return fmt.Errorf("fetch layer %s: %w", hex, err)
	}
	return nil
}

// Prefetch fetches the given chunks of the layer into the memory tier.
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
	if err := f.prefetch(ctx, l, chunks, false); err != nil {
		return fmt.Errorf("prefetch layer %s: %w", hex, err)
	}
	return nil
}

// prefetch fetches the chunks not cached yet, in the order given, at most
// prefetchWorkers at a time across the node; hot marks them hot. A reader
// of a chunk being prefetched joins that fetch.
func (f *FS) prefetch(ctx context.Context, l *layer, chunks []int, hot bool) error {
	g, gctx := errgroup.WithContext(ctx)
	for _, i := range chunks {
		hex := l.ix.Chunks[i]
		if f.cache.has(hex) {
			if hot {
				f.cache.setHot(hex)
			}
			continue
		}
		select {
		case f.prefetching <- struct{}{}:
		case <-gctx.Done():
			return g.Wait()
		}
		g.Go(func() error {
			defer func() { <-f.prefetching }()
			if _, err := f.fetch(gctx, l, i); err != nil {
				return err
			}
			if hot {
				f.cache.setHot(hex)
			}
			return nil
		})
	}
	return g.Wait()
}

// MemoryBytes returns the memory tier's limit (Config.MemoryBytes, or its
// default): the bytes of chunk objects and decoded copies it holds at most.
func (f *FS) MemoryBytes() int64 { return f.cfg.MemoryBytes }

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
		CacheHits:         l.memoryHits.Load() + l.diskHits.Load(),
		MemoryHits:        l.memoryHits.Load(),
		DiskHits:          l.diskHits.Load(),
		CacheMisses:       l.cacheMisses.Load(),
		FetchErrors:       l.fetchErrors.Load(),
		BytesWrittenDisk:  l.bytesWrittenDisk.Load(),
		BytesPushed:       l.bytesPushed.Load(),
	}
}

// Totals are the file system's counters over every layer since it
// mounted (a removed layer's as they were when it was removed), and its
// cache's size now: what the node's /metrics exports.
type Totals struct {
	BytesRead     int64 // bytes returned to readers
	BytesFetched  int64 // bytes of chunk objects read from the store (compressed for zstd layers)
	ChunksFetched int64
	MemoryHits    int64 // chunk reads served from the memory tier
	DiskHits      int64 // chunk reads served from the disk tier
	CacheMisses   int64 // chunk reads that waited for a fetch
	FetchErrors   int64 // failed fetch attempts
	// FetchErrors by the step that failed: the store's Get (refused or
	// timed out), the read of the object's bytes (broke off or timed out),
	// the chunk's verification (the bytes did not decode to its digest).
	GetErrors, ReadErrors, VerifyErrors int64
	// MemoryBytes and DiskBytes are what the cache's tiers hold now.
	MemoryBytes, DiskBytes int64
}

func (l *layer) addTo(t *Totals) {
	t.BytesRead += l.bytesRead.Load()
	t.BytesFetched += l.bytesFetched.Load()
	t.ChunksFetched += l.chunksFetched.Load()
	t.MemoryHits += l.memoryHits.Load()
	t.DiskHits += l.diskHits.Load()
	t.CacheMisses += l.cacheMisses.Load()
	t.FetchErrors += l.fetchErrors.Load()
	t.GetErrors += l.stepErrors[stepGet].Load()
	t.ReadErrors += l.stepErrors[stepRead].Load()
	t.VerifyErrors += l.stepErrors[stepVerify].Load()
}

// Totals returns the counters summed over every layer and the cache's
// size now.
func (f *FS) Totals() Totals {
	f.mu.Lock()
	t := f.gone
	for _, l := range f.layers {
		l.addTo(&t)
	}
	f.mu.Unlock()
	cs := f.cache.stats()
	t.MemoryBytes, t.DiskBytes = cs.MemoryBytes, cs.DiskBytes
	return t
}

// readAt returns the bytes of the layer file at off, len(dest) of them
// (fewer only at the end of the file), fetching the chunks they cover that
// are not cached. A read within one chunk returns a slice of the cached
// chunk, which the caller must not modify; a read across chunks is copied
// into dest.
func (f *FS) readAt(ctx context.Context, l *layer, dest []byte, off int64) ([]byte, error) {
	if off >= l.ix.Size {
		return nil, nil
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
		l.trace(i)
		data, err := f.chunk(ctx, l, i)
		if err != nil {
			return dest[:done], err
		}
		f.cache.served(l.ix.Chunks[i], within, n)
		f.pushRest(l, i, data, within, n)
		if done == 0 && n == int64(len(dest)) {
			// The whole read is in this chunk: hand out its bytes, uncopied.
			l.bytesRead.Add(n)
			return data[within : within+n : within+n], nil
		}
		copy(dest[done:done+int(n)], data[within:])
		done += int(n)
	}
	l.bytesRead.Add(int64(done))
	return dest[:done], nil
}

// chunk returns the plain bytes of chunk i of the layer from the cache, or
// fetched, counting the hit or miss.
func (f *FS) chunk(ctx context.Context, l *layer, i int) ([]byte, error) {
	data, t := f.cache.get(l.ix.Chunks[i], l.ix.ChunkLen(i))
	switch t {
	case tierMemory:
		l.memoryHits.Add(1)
		return data, nil
	case tierDisk:
		l.diskHits.Add(1)
		return data, nil
	}
	l.cacheMisses.Add(1)
	return f.fetch(ctx, l, i)
}

// fetch returns chunk i of the layer, verified, fetching it from the store
// at most once at a time per chunk digest and keeping it in the memory
// tier. The returned bytes are the fetch's own, so a full cache never fails
// a read.
func (f *FS) fetch(ctx context.Context, l *layer, i int) ([]byte, error) {
	hex := l.ix.Chunks[i]
	want := l.ix.ChunkLen(i)
	ch := f.sf.DoChan(hex, func() (any, error) {
		// A fetch that finished between our cache miss and this call.
		if data, t := f.cache.get(hex, want); t != tierNone {
			return data, nil
		}
		stored, data, err := f.fetchRetry(l, i)
		if err != nil {
			return nil, err
		}
		f.cache.put(hex, l.ix.Compression, stored, data, false, &l.bytesWrittenDisk)
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
// each attempt bounded by FetchTimeout. It returns the object as stored and
// the chunk's plain bytes.
func (f *FS) fetchRetry(l *layer, i int) ([]byte, []byte, error) {
	var lastErr error
	backoff := 50 * time.Millisecond
	for attempt := 1; attempt <= f.cfg.Retries; attempt++ {
		stored, data, err := f.fetchOnce(l, i)
		if err == nil {
			l.chunksFetched.Add(1)
			l.bytesFetched.Add(int64(len(stored)))
			l.bytesFetchedPlain.Add(int64(len(data)))
			return stored, data, nil
		}
		l.fetchErrors.Add(1)
		l.stepErrors[fetchStep(err)].Add(1)
		lastErr = err
		f.log.Warn("fetch chunk", "layer", l.hex, "chunk", i, "attempt", attempt, "err", err)
		if attempt == f.cfg.Retries {
			break
		}
		select {
		case <-time.After(backoff):
		case <-f.ctx.Done():
			return nil, nil, fmt.Errorf("fetch chunk %d of layer %s: %w", i, l.hex, f.ctx.Err())
		}
		backoff = min(2*backoff, maxBackoff)
	}
	return nil, nil, fmt.Errorf("fetch chunk %d of layer %s after %d attempts: %w", i, l.hex, f.cfg.Retries, lastErr)
}

// The steps of a chunk fetch, for its errors' count by step.
const (
	stepGet    = iota // the store's Get
	stepRead          // reading the object's bytes
	stepVerify        // decoding and verifying them
)

// fetchStep is the step of fetchOnce that err, its error, came from.
func fetchStep(err error) int {
	switch {
	case errors.Is(err, errCorrupt):
		return stepVerify
	case errors.Is(err, blob.ErrBodyBroke):
		return stepRead
	}
	return stepGet
}

// errCorrupt marks a chunk whose stored object does not decode to the bytes
// its index entry names (the error also wraps blob.ErrCorrupt).
var errCorrupt = errors.New("chunk does not match its digest")

// fetchOnce reads chunk i's object from the store, decodes it (bounded by
// the chunk's length) and verifies it. It returns the object as stored and
// the chunk.
func (f *FS) fetchOnce(l *layer, i int) ([]byte, []byte, error) {
	ctx, cancel := context.WithTimeout(f.ctx, f.cfg.FetchTimeout)
	defer cancel()
	hex := l.ix.Chunks[i]
	stored, err := blob.ReadChunkObject(ctx, f.cfg.Store, l.ix, i)
	if errors.Is(err, blob.ErrCorrupt) {
		return nil, nil, fmt.Errorf("verify chunk %s: %w: %w", hex, errCorrupt, err)
	}
	if err != nil {
		return nil, nil, err
	}
	data, err := blob.DecodeChunk(l.ix, i, stored)
	if errors.Is(err, blob.ErrCorrupt) {
		return nil, nil, fmt.Errorf("verify chunk %s: %w: %w", hex, errCorrupt, err)
	}
	if err != nil {
		return nil, nil, err
	}
	return stored, data, nil
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

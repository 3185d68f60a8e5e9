package lazy

import (
	"bytes"
	"log/slog"
	"sync"
	"sync/atomic"

	"dsec.dev/dsec/internal/blob"
)

// minDecodedBytes is the floor of decoded copies a memory tier of memLimit
// bytes keeps before it evicts chunks for them: an eighth of it, between 32
// and 256 MiB, and at most half of it. The kernel reads a 1 MiB chunk in
// 128 KiB requests, which sixteen sandboxes starting at once interleave:
// with 32 MiB of decoded chunks, the storage benchmark's lazyfs decoded each
// fetched chunk about 2.8 times (once to verify it, then for reads), and
// decoding took 40 % of its CPU.
func minDecodedBytes(memLimit int64) int64 {
	return min(max(memLimit/8, 32<<20), 256<<20, memLimit/2)
}

// tier says where a chunk read was served from.
type tier int

const (
	tierNone tier = iota
	tierMemory
	tierDisk
)

// chunkCache keeps verified chunks in two tiers so that a burst of fetches
// does not cost the node its disk bandwidth:
//
//   - memory: every chunk fetched (or prefetched) goes here, as the object
//     the store served (a zstd frame; plain bytes for a raw layer) and,
//     while they fit, the frame's decoded bytes, which verifying it made
//     anyway: a read then only copies, and a chunk prefetched from a trace
//     costs the burst that reads it no decoding. Both count against one
//     limit; decoded copies are dropped first (least recently used, down to
//     an eighth, see minDecodedBytes), then whole chunks, so memory holds as
//     many chunks as it can without a refetch and decodes only those whose
//     decoded copy did not fit.
//   - disk: files under dir, bounded and LRU, kept across restarts. A chunk
//     is written here only when it is hot and leaves memory (evicted, or
//     the file system closes), and always as one zstd frame.
//
// A chunk is hot when it proved to be needed more than once: the kernel
// asked again for a page it had been given (its page cache dropped it), it
// was fetched again soon after memory evicted it cold, it came back from
// disk, it was asked for explicitly (FetchAll), or a registered layer pins
// it (its metadata). A cold chunk evicted from memory is dropped; a second
// need for it costs a refetch and makes it hot. Pinned chunks are evicted
// from either tier only when nothing unpinned is left. Whatever the tiers
// hold, the bytes a fetch returns come from memory, so a full cache never
// fails a read.
type chunkCache struct {
	mem  *memTier
	disk *diskTier
	pins *pinSet
	log  *slog.Logger

	bytesWritten  atomic.Int64 // to the disk tier
	chunksWritten atomic.Int64
}

// openCache opens the disk tier under dir (rebuilding its LRU from what an
// earlier run left) and an empty memory tier.
func openCache(dir string, memLimit, diskLimit int64, log *slog.Logger) (*chunkCache, error) {
	pins := &pinSet{n: map[string]int{}}
	disk, err := openDiskTier(dir, diskLimit, pins.pinned, log)
	if err != nil {
		return nil, err
	}
	return &chunkCache{
		mem:  newMemTier(memLimit, minDecodedBytes(memLimit), pins.pinned),
		disk: disk,
		pins: pins,
		log:  log,
	}, nil
}

// get returns the plain bytes of chunk hex (plainLen long) and the tier
// that held it, or tierNone. Chunks read from disk are decoded and verified
// (a bad file is dropped) and come back into memory.
func (c *chunkCache) get(hex string, plainLen int64) ([]byte, tier) {
	if plain, frame, ok := c.mem.get(hex); ok {
		if plain != nil {
			return plain, tierMemory
		}
		// Verified when it was fetched or read from disk: decoding alone
		// gives the same bytes again.
		data, err := blob.DecodeObject(blob.CompressionZstd, frame, plainLen)
		if err != nil {
			c.log.Warn("drop chunk held in memory", "chunk", hex, "err", err)
			c.mem.drop(hex)
			return nil, tierNone
		}
		c.evicted(c.mem.keepDecoded(hex, data))
		return data, tierMemory
	}
	stored, zstd, ok := c.disk.read(hex)
	if !ok {
		return nil, tierNone
	}
	compression := blob.CompressionNone
	if zstd {
		compression = blob.CompressionZstd
	}
	data, err := blob.DecodeObject(compression, stored, plainLen)
	if err == nil {
		err = blob.VerifyChunk(hex, data)
	}
	if err != nil {
		c.log.Warn("drop corrupt cached chunk", "chunk", hex, "bytes", len(stored), "err", err)
		c.disk.drop(hex)
		return nil, tierNone
	}
	c.add(&memEntry{hex: hex, obj: stored, zstd: zstd, plainLen: plainLen, plain: data, hot: true})
	return data, tierDisk
}

// put adds a chunk fetched from the store and verified: obj is the object
// as stored with compression, plain its decoded bytes (kept as the frame's
// decoded copy while memory has room; neither may be modified afterwards).
// hot marks it hot at once; written (may be nil) will count what it costs
// the disk tier.
func (c *chunkCache) put(hex, compression string, obj, plain []byte, hot bool, written *atomic.Int64) {
	e := &memEntry{hex: hex, obj: obj, plainLen: int64(len(plain)), hot: hot, written: written}
	if compression == blob.CompressionZstd {
		// The read buffer has room for the plain chunk; keep only the frame.
		e.obj, e.zstd, e.plain = bytes.Clone(obj), true, plain
	}
	c.add(e)
}

func (c *chunkCache) add(e *memEntry) { c.evicted(c.mem.add(e)) }

// evicted writes the hot ones of the entries memory evicted to disk.
func (c *chunkCache) evicted(out []*memEntry) {
	for _, ev := range out {
		if ev.hot {
			c.promote(ev)
		}
	}
}

// promote writes a hot chunk leaving memory to the disk tier as one zstd
// frame, unless the disk holds it already. A failure only costs a refetch.
func (c *chunkCache) promote(e *memEntry) {
	if c.disk.has(e.hex) {
		return
	}
	frame := e.obj
	if !e.zstd {
		var err error
		if frame, err = blob.EncodeChunk(blob.CompressionZstd, e.obj); err != nil {
			c.log.Warn("compress chunk for the disk cache", "chunk", e.hex, "err", err)
			return
		}
	}
	n, err := c.disk.write(e.hex, frame)
	if err != nil {
		c.log.Warn("write chunk to the disk cache", "chunk", e.hex, "err", err)
		return
	}
	if n > 0 {
		c.bytesWritten.Add(n)
		c.chunksWritten.Add(1)
		if e.written != nil {
			e.written.Add(n)
		}
	}
}

// served records that bytes [off, off+n) of chunk hex reached a reader.
func (c *chunkCache) served(hex string, off, n int64) { c.mem.serve(hex, off, n) }

// setHot marks a chunk in memory hot.
func (c *chunkCache) setHot(hex string) { c.mem.setHot(hex) }

// has reports whether either tier holds the chunk.
func (c *chunkCache) has(hex string) bool { return c.mem.has(hex) || c.disk.has(hex) }

func (c *chunkCache) pin(hex string)   { c.pins.add(hex, 1) }
func (c *chunkCache) unpin(hex string) { c.pins.add(hex, -1) }

// flush writes the hot chunks held only in memory to the disk tier, least
// recently used first (so the disk's LRU keeps the memory's order), so that
// a restart keeps them; the file system calls it when it stops serving.
func (c *chunkCache) flush() {
	for _, e := range c.mem.hotEntries() {
		c.promote(e)
	}
}

// cacheStats are a chunk cache's figures.
type cacheStats struct {
	MemoryBytes   int64 // chunk objects and decoded copies held in memory
	DecodedBytes  int64 // of MemoryBytes, the decoded copies
	DiskBytes     int64 // chunk files held on disk
	BytesWritten  int64 // written to the disk tier since the cache opened
	ChunksWritten int64
}

func (c *chunkCache) stats() cacheStats {
	all, decoded := c.mem.usage()
	return cacheStats{
		MemoryBytes:   all,
		DecodedBytes:  decoded,
		DiskBytes:     c.disk.usage(),
		BytesWritten:  c.bytesWritten.Load(),
		ChunksWritten: c.chunksWritten.Load(),
	}
}

// pinSet counts pins by chunk hex, cached or not.
type pinSet struct {
	mu sync.Mutex
	n  map[string]int
}

func (p *pinSet) add(hex string, d int) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.n[hex]+d <= 0 {
		delete(p.n, hex)
		return
	}
	p.n[hex] += d
}

func (p *pinSet) pinned(hex string) bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.n[hex] > 0
}

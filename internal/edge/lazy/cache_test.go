package lazy

import (
	"bytes"
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync/atomic"
	"testing"

	"github.com/google/go-cmp/cmp"

	"dsec.dev/dsec/internal/blob"
)

// The chunk cache's tiers, driven directly (no FUSE, no root).

const cacheChunk = 64 << 10

type testWriter struct{ t *testing.T }

func (w testWriter) Write(p []byte) (int, error) {
	w.t.Log(strings.TrimRight(string(p), "\n"))
	return len(p), nil
}

func fileExists(p string) bool {
	_, err := os.Stat(p)
	return err == nil
}

// testChunkData is a chunk of text-like bytes (zstd shrinks it) unique to n.
type testChunkData struct {
	hex   string
	plain []byte
	frame []byte // one zstd frame of plain
}

func makeChunk(t *testing.T, n int) testChunkData {
	t.Helper()
	var b bytes.Buffer
	for i := 0; b.Len() < cacheChunk; i++ {
		fmt.Fprintf(&b, "chunk %d line %d: open read close mmap\n", n, i)
	}
	plain := b.Bytes()[:cacheChunk]
	sum := sha256.Sum256(plain)
	frame, err := blob.EncodeChunk(blob.CompressionZstd, plain)
	if err != nil {
		t.Fatal(err)
	}
	return testChunkData{hex: hex.EncodeToString(sum[:]), plain: plain, frame: frame}
}

func newTestCache(t *testing.T, dir string, memLimit, diskLimit int64) *chunkCache {
	t.Helper()
	c, err := openCache(dir, memLimit, diskLimit, slog.New(slog.NewTextHandler(testWriter{t}, nil)))
	if err != nil {
		t.Fatal(err)
	}
	return c
}

// putChunk adds a fetched zstd chunk, as FS.fetch does.
func putChunk(c *chunkCache, ch testChunkData, written *atomic.Int64) {
	// A read buffer with room for the plain chunk, as ReadChunkObject makes.
	buf := append(make([]byte, 0, len(ch.plain)+1), ch.frame...)
	c.put(ch.hex, blob.CompressionZstd, buf, ch.plain, false, written)
}

// diskFiles lists the disk tier's file names.
func diskFiles(t *testing.T, dir string) []string {
	t.Helper()
	des, err := os.ReadDir(dir)
	if err != nil {
		t.Fatal(err)
	}
	var out []string
	for _, de := range des {
		out = append(out, de.Name())
	}
	slices.Sort(out)
	return out
}

func TestMemoryTierBound(t *testing.T) {
	dir := t.TempDir()
	chunks := make([]testChunkData, 40)
	for i := range chunks {
		chunks[i] = makeChunk(t, i)
	}
	frame := int64(len(chunks[0].frame))
	limit := 10 * frame
	c := newTestCache(t, dir, limit, 1<<30)
	for _, ch := range chunks {
		putChunk(c, ch, nil)
		if got, _ := c.mem.usage(); got > limit {
			t.Fatalf("memory tier holds %d bytes, limit %d", got, limit)
		}
	}
	// Frames are kept without the read buffer's slack: the bound counts
	// what the tier holds.
	if got, _ := c.mem.usage(); got < limit-frame {
		t.Errorf("memory tier holds %d bytes, want about its limit %d", got, limit)
	}
	// The last ten fit (frames differ by a few bytes: nine surely do).
	for i, ch := range chunks {
		data, tr := c.get(ch.hex, cacheChunk)
		switch {
		case i < len(chunks)-11 && tr != tierNone:
			t.Errorf("chunk %d still cached (tier %d)", i, tr)
		case i >= len(chunks)-9 && (tr != tierMemory || !bytes.Equal(data, ch.plain)):
			t.Errorf("chunk %d: tier %d, want memory", i, tr)
		}
	}
	// Every chunk was used once: none was hot, nothing went to disk.
	if st := c.stats(); st.BytesWritten != 0 || st.DiskBytes != 0 || len(diskFiles(t, dir)) != 0 {
		t.Errorf("cold chunks reached disk: %+v, files %v", st, diskFiles(t, dir))
	}
}

func TestPromotionOnlyWhenHot(t *testing.T) {
	dir := t.TempDir()
	a, b, g, x := makeChunk(t, 1), makeChunk(t, 2), makeChunk(t, 3), makeChunk(t, 4)
	frame := int64(len(a.frame))
	c := newTestCache(t, dir, 2*frame+frame/2, 1<<30) // room for two
	var aWritten, others atomic.Int64

	// a: the kernel asks again for a page it was given (its page cache
	// dropped it). b: its pages are handed out once each, in pieces.
	putChunk(c, a, &aWritten)
	c.served(a.hex, 0, 128<<10)
	c.served(a.hex, 4096, 100)
	putChunk(c, b, &others)
	c.served(b.hex, 0, 8192)
	c.served(b.hex, 8192, cacheChunk-8192)
	if !c.mem.isHot(a.hex) || c.mem.isHot(b.hex) {
		t.Fatalf("hot: a %v, b %v; want a only", c.mem.isHot(a.hex), c.mem.isHot(b.hex))
	}
	// g and x push a and b out: a is written, compressed; b is dropped.
	putChunk(c, g, &others)
	putChunk(c, x, &others)
	if diff := cmp.Diff([]string{a.hex + ".zst"}, diskFiles(t, dir)); diff != "" {
		t.Fatalf("disk tier (-want +got):\n%s", diff)
	}
	onDisk, err := os.ReadFile(filepath.Join(dir, a.hex+".zst"))
	if err != nil || !bytes.Equal(onDisk, a.frame) {
		t.Fatalf("a on disk: %d bytes, %v; want its %d-byte zstd frame", len(onDisk), err, len(a.frame))
	}
	if st := c.stats(); st.BytesWritten != frame || st.ChunksWritten != 1 || aWritten.Load() != frame || others.Load() != 0 {
		t.Errorf("disk writes: %+v, a's layer %d, others %d; want one frame of %d for a", st, aWritten.Load(), others.Load(), frame)
	}

	// b, fetched again soon after it was evicted cold, comes back hot.
	putChunk(c, b, &others)
	if !c.mem.isHot(b.hex) {
		t.Error("b fetched again after its eviction is not hot")
	}
	// a comes back from disk (a disk hit) and stays hot; leaving memory
	// again costs no second write.
	if data, tr := c.get(a.hex, cacheChunk); tr != tierDisk || !bytes.Equal(data, a.plain) {
		t.Fatalf("a after eviction: tier %d", tr)
	}
	for i := 5; i < 8; i++ {
		putChunk(c, makeChunk(t, i), &others)
	}
	if st := c.stats(); st.ChunksWritten != 2 || aWritten.Load() != frame || c.mem.has(a.hex) || c.mem.has(b.hex) {
		t.Errorf("after a second round: %+v, a's layer %d; want b written, a not again", st, aWritten.Load())
	}
}

func TestRawChunksCompressedOnDisk(t *testing.T) {
	dir := t.TempDir()
	ch := makeChunk(t, 1)
	c := newTestCache(t, dir, 1<<20, 1<<30)
	// A raw layer's object is the plain chunk itself.
	c.put(ch.hex, blob.CompressionNone, ch.plain, ch.plain, true, nil)
	c.flush()
	onDisk, err := os.ReadFile(filepath.Join(dir, ch.hex+".zst"))
	if err != nil {
		t.Fatal(err)
	}
	if len(onDisk) >= len(ch.plain)/2 {
		t.Errorf("raw chunk written as %d bytes for %d plain, want compressed", len(onDisk), len(ch.plain))
	}
	got, err := blob.DecodeObject(blob.CompressionZstd, onDisk, cacheChunk)
	if err != nil || !bytes.Equal(got, ch.plain) {
		t.Fatalf("decode the file: %v", err)
	}
	// A second cache on the directory serves it from disk.
	d := newTestCache(t, dir, 1<<20, 1<<30)
	if data, tr := d.get(ch.hex, cacheChunk); tr != tierDisk || !bytes.Equal(data, ch.plain) {
		t.Fatalf("after reopening: tier %d", tr)
	}
}

func TestPinnedChunksStay(t *testing.T) {
	dir := t.TempDir()
	meta, m2 := makeChunk(t, 100), makeChunk(t, 101)
	frame := int64(len(meta.frame))
	c := newTestCache(t, dir, 3*frame+frame/2, 1<<30) // room for three
	c.pin(meta.hex)
	c.pin(m2.hex)
	putChunk(c, meta, nil)
	putChunk(c, m2, nil)
	for i := range 10 {
		putChunk(c, makeChunk(t, i), nil)
	}
	if !c.mem.has(meta.hex) || !c.mem.has(m2.hex) {
		t.Fatal("pinned chunks were evicted from memory while unpinned ones were left")
	}
	if files := diskFiles(t, dir); len(files) != 0 {
		t.Errorf("disk tier holds %v; cold chunks were written", files)
	}
	// With memory too small for the pinned chunks alone, they move to
	// disk (they are hot by definition); the read that brought in the
	// last one still has its bytes.
	small := newTestCache(t, t.TempDir(), frame+frame/2, 1<<30)
	small.pin(meta.hex)
	small.pin(m2.hex)
	putChunk(small, meta, nil)
	putChunk(small, m2, nil)
	if st := small.stats(); st.ChunksWritten != 1 || st.MemoryBytes > frame+frame/2 {
		t.Errorf("pinned chunks in a tiny memory tier: %+v, want one written to disk", st)
	}
	for _, ch := range []testChunkData{meta, m2} {
		if data, tr := small.get(ch.hex, cacheChunk); tr == tierNone || !bytes.Equal(data, ch.plain) {
			t.Errorf("pinned chunk %s lost", ch.hex[:8])
		}
	}
	// Unpinned, they leave memory like any other (still hot: to disk).
	c.unpin(meta.hex)
	c.unpin(m2.hex)
	for i := 10; i < 14; i++ {
		putChunk(c, makeChunk(t, i), nil)
	}
	if c.mem.has(meta.hex) || c.mem.has(m2.hex) {
		t.Error("unpinned chunks stayed in a full memory tier")
	}
	if !c.disk.has(meta.hex) || !c.disk.has(m2.hex) {
		t.Error("unpinned metadata chunks were dropped, not written to disk")
	}
}

func TestDiskTierFoundAtStartup(t *testing.T) {
	dir := t.TempDir()
	good, legacy, bad, short, both := makeChunk(t, 1), makeChunk(t, 2), makeChunk(t, 3), makeChunk(t, 4), makeChunk(t, 5)
	write := func(name string, data []byte) {
		if err := os.WriteFile(filepath.Join(dir, name), data, 0o600); err != nil {
			t.Fatal(err)
		}
	}
	write(good.hex+".zst", good.frame)
	write(legacy.hex, legacy.plain) // plain chunks, as caches before the tiers wrote them
	// A frame of other bytes under bad's name: it decodes, to the wrong
	// digest. A frame cut short does not decode.
	write(bad.hex+".zst", good.frame)
	write(short.hex+".zst", short.frame[:len(short.frame)-10])
	write(both.hex, both.plain)
	write(both.hex+".zst", both.frame)
	write(".tmp-123", []byte("partial"))
	write("not-a-chunk", []byte("x"))

	c := newTestCache(t, dir, 1<<20, 1<<30)
	want := []string{bad.hex + ".zst", both.hex + ".zst", good.hex + ".zst", legacy.hex, short.hex + ".zst"}
	slices.Sort(want)
	if diff := cmp.Diff(want, diskFiles(t, dir)); diff != "" {
		t.Errorf("files after opening (-want +got):\n%s", diff)
	}
	for _, ch := range []testChunkData{good, legacy, both} {
		data, tr := c.get(ch.hex, cacheChunk)
		if tr != tierDisk || !bytes.Equal(data, ch.plain) {
			t.Errorf("chunk %s: tier %d, want served from disk", ch.hex[:8], tr)
		}
		// Back in memory now, and hot.
		if data, tr := c.get(ch.hex, cacheChunk); tr != tierMemory || !bytes.Equal(data, ch.plain) || !c.mem.isHot(ch.hex) {
			t.Errorf("chunk %s read again: tier %d, want memory (hot)", ch.hex[:8], tr)
		}
	}
	for _, ch := range []testChunkData{bad, short} {
		if _, tr := c.get(ch.hex, cacheChunk); tr != tierNone {
			t.Errorf("damaged chunk %s served from tier %d", ch.hex[:8], tr)
		}
		if fileExists(filepath.Join(dir, ch.hex+".zst")) || c.has(ch.hex) {
			t.Errorf("damaged chunk %s still cached", ch.hex[:8])
		}
	}
}

func TestMinDecodedBytes(t *testing.T) {
	for _, tc := range []struct{ mem, want int64 }{
		{1 << 20, 512 << 10},
		{64 << 20, 32 << 20},
		{1536 << 20, 192 << 20},
		{4 << 30, 256 << 20},
	} {
		if got := minDecodedBytes(tc.mem); got != tc.want {
			t.Errorf("minDecodedBytes(%d) = %d, want %d", tc.mem, got, tc.want)
		}
	}
}

func TestDiskTierBound(t *testing.T) {
	dir := t.TempDir()
	first := makeChunk(t, 0)
	frame := int64(len(first.frame))
	limit := 3*frame + frame/2
	c := newTestCache(t, dir, 1<<20, limit)
	c.pin(first.hex)
	for i := range 8 {
		ch := makeChunk(t, i)
		c.put(ch.hex, blob.CompressionZstd, ch.frame, ch.plain, true, nil)
	}
	c.flush()
	files := diskFiles(t, dir)
	if st := c.stats(); st.DiskBytes > limit || len(files) != 3 || !slices.Contains(files, first.hex+".zst") {
		t.Errorf("disk tier: %+v, files %v; want 3 within %d, the pinned one kept", st, files, limit)
	}
	if st := c.stats(); st.ChunksWritten != 8 || !strings.HasSuffix(files[0], ".zst") {
		t.Errorf("disk writes: %+v", st)
	}
}

// Fetched chunks stay decoded while memory has room for their frames and
// decoded copies; beyond it the decoded copies go first, least recently used
// first, down to the floor, and only then whole chunks.
func TestMemoryTierKeepsDecoded(t *testing.T) {
	chunks := make([]testChunkData, 8)
	for i := range chunks {
		chunks[i] = makeChunk(t, i)
	}
	frame, plain := int64(len(chunks[0].frame)), int64(cacheChunk)
	decoded := func(c *chunkCache, ch testChunkData) bool {
		p, _, ok := c.mem.get(ch.hex)
		return ok && p != nil
	}

	// Room for all eight, decoded: reads only copy.
	roomy := newTestCache(t, t.TempDir(), 8*(frame+plain)+frame, 1<<30)
	for _, ch := range chunks {
		putChunk(roomy, ch, nil)
	}
	for i, ch := range chunks {
		if !decoded(roomy, ch) {
			t.Errorf("chunk %d not kept decoded in a tier with room", i)
		}
		if data, tr := roomy.get(ch.hex, cacheChunk); tr != tierMemory || !bytes.Equal(data, ch.plain) {
			t.Errorf("chunk %d: tier %d", i, tr)
		}
	}
	var frames int64
	for _, ch := range chunks {
		frames += int64(len(ch.frame))
	}
	if all, dec := roomy.mem.usage(); dec != 8*plain || all != frames+8*plain {
		t.Errorf("usage %d, decoded %d; want %d and %d", all, dec, frames+8*plain, 8*plain)
	}

	// Room for eight frames and four decoded copies (the floor is two):
	// every chunk stays, the four used last decoded.
	limit := 8*frame + 4*plain + frame/2
	c := newTestCache(t, t.TempDir(), limit, 1<<30)
	c.mem.minDecoded = 2 * plain
	for _, ch := range chunks {
		putChunk(c, ch, nil)
		if got, _ := c.mem.usage(); got > limit {
			t.Fatalf("memory tier holds %d bytes, limit %d", got, limit)
		}
	}
	for i, ch := range chunks {
		if !c.mem.has(ch.hex) {
			t.Errorf("chunk %d evicted while decoded copies were left", i)
		}
		if want := i >= 4; decoded(c, ch) != want {
			t.Errorf("chunk %d decoded %v, want %v", i, !want, want)
		}
	}
	// Reading chunk 0 decodes it again and keeps that copy, dropping the
	// least recently used one (chunk 4).
	if data, tr := c.get(chunks[0].hex, cacheChunk); tr != tierMemory || !bytes.Equal(data, chunks[0].plain) {
		t.Fatalf("chunk 0: tier %d", tr)
	}
	if !decoded(c, chunks[0]) || decoded(c, chunks[4]) {
		t.Errorf("after reading chunk 0: decoded %v, chunk 4 decoded %v; want true, false", decoded(c, chunks[0]), decoded(c, chunks[4]))
	}

	// With the decoded copies at their floor, a new chunk evicts the least
	// recently used chunk (chunk 1) rather than a decoded copy.
	c.mem.minDecoded = 4 * plain
	putChunk(c, makeChunk(t, 100), nil)
	if c.mem.has(chunks[1].hex) {
		t.Error("chunk 1 kept while the decoded copies were at their floor")
	}
	if _, dec := c.mem.usage(); dec < 4*plain {
		t.Errorf("decoded copies %d, want at least the floor %d", dec, 4*plain)
	}
	// Dropping a chunk drops its decoded copy's bytes too.
	before, decBefore := c.mem.usage()
	c.mem.drop(chunks[7].hex)
	f7 := int64(len(chunks[7].frame))
	if all, dec := c.mem.usage(); all != before-f7-plain || dec != decBefore-plain {
		t.Errorf("after drop: usage %d, decoded %d; want %d, %d", all, dec, before-f7-plain, decBefore-plain)
	}
}

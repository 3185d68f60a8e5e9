package lazy

import (
	"bytes"
	"context"
	"math/rand/v2"
	"os"
	"path/filepath"
	"testing"

	"dsec.dev/dsec/internal/blob"
)

// putZstdLayer stores data with blob.PutLayer (zstd chunks) and returns its
// index.
func putZstdLayer(t *testing.T, st blob.Store, data []byte, chunkSize int64) *blob.Index {
	t.Helper()
	path := filepath.Join(t.TempDir(), "layer")
	if err := os.WriteFile(path, data, 0o644); err != nil {
		t.Fatal(err)
	}
	ix, _, err := blob.PutLayer(context.Background(), st, path, chunkSize)
	if err != nil {
		t.Fatal(err)
	}
	if ix.Compression != blob.CompressionZstd {
		t.Fatalf("PutLayer wrote compression %q, want zstd", ix.Compression)
	}
	return ix
}

// textBytes returns n bytes of text-like data that zstd compresses a few
// times.
func textBytes(seed uint64, n int) []byte {
	r := rand.New(rand.NewPCG(seed, seed+1))
	words := []string{"open ", "read ", "close ", "mmap ", "ENOENT\n", "stat ", "write ", "fsync ", "exit\n", "0x7f3a "}
	var b bytes.Buffer
	for b.Len() < n {
		b.WriteString(words[r.IntN(len(words))])
	}
	return b.Bytes()[:n]
}

func TestZstdLayerReadsThroughFUSE(t *testing.T) {
	ctx := context.Background()
	data := textBytes(7, 8*testChunk+999) // last chunk is short
	st := newMemStore()
	ix := putZstdLayer(t, st, data, testChunk)
	f, p := mountLayer(t, Config{Store: st}, ix)
	hex := ix.Digest[7:]

	// Two chunks first: only their objects count.
	got, err := preadDirect(p, 2*testChunk, 2*testChunk)
	if err != nil || !bytes.Equal(got, data[2*testChunk:4*testChunk]) {
		t.Fatalf("read chunks 2-3: %v", err)
	}
	var stored int64
	for _, i := range []int{2, 3} {
		n, err := st.Stat(ctx, ix.ChunkKey(i))
		if err != nil {
			t.Fatal(err)
		}
		stored += n
	}
	s := f.Stats(hex)
	if s.ChunksFetched != 2 || s.BytesFetched != stored || s.BytesFetchedPlain != 2*testChunk {
		t.Errorf("after two chunks: %+v, want BytesFetched %d (stored), BytesFetchedPlain %d", s, stored, 2*testChunk)
	}

	// The whole file.
	all, err := os.ReadFile(p)
	if err != nil || !bytes.Equal(all, data) {
		t.Fatalf("read whole file: %d bytes, %v", len(all), err)
	}
	stored = 0
	for i := range ix.Chunks {
		n, err := st.Stat(ctx, ix.ChunkKey(i))
		if err != nil {
			t.Fatal(err)
		}
		stored += n
	}
	s = f.Stats(hex)
	if s.ChunksFetched != s.ChunksTotal || s.BytesFetched != stored || s.BytesFetchedPlain != int64(len(data)) {
		t.Errorf("after the whole file: %+v, want BytesFetched %d, BytesFetchedPlain %d", s, stored, len(data))
	}
	if s.BytesFetched*2 > s.BytesFetchedPlain {
		t.Errorf("fetched %d bytes for %d plain, want under half", s.BytesFetched, s.BytesFetchedPlain)
	}
	for i, n := range st.chunkGets(ix) {
		if n != 1 {
			t.Errorf("chunk %d fetched %d times", i, n)
		}
	}
	// Read again past the page cache, the chunks are hot: closing writes
	// them to the disk tier, compressed, and a second FS on the same cache
	// dir serves them without the store.
	if got, err := preadDirect(p, 0, len(data)); err != nil || !bytes.Equal(got, data) {
		t.Fatalf("read whole file again: %v", err)
	}
	cacheDir := f.cfg.CacheDir
	closeFS(t, f)
	cached, onDisk := cachedChunks(t, cacheDir)
	if len(cached) != len(ix.Chunks) || onDisk != stored {
		t.Errorf("disk tier holds %d chunks, %d bytes; want %d chunks, %d bytes (as stored)", len(cached), onDisk, len(ix.Chunks), stored)
	}
	st.setMode("error")
	g := mountFS(t, Config{Store: st, CacheDir: cacheDir, Retries: 1})
	p, err = g.Add(ctx, ix)
	if err != nil {
		t.Fatal(err)
	}
	if all, err := os.ReadFile(p); err != nil || !bytes.Equal(all, data) {
		t.Fatalf("read from the cache: %d bytes, %v", len(all), err)
	}
	if s := g.Stats(hex); s.BytesFetched != 0 {
		t.Errorf("cached read fetched %d bytes", s.BytesFetched)
	}
}

func TestZstdCorruptChunkNeverServed(t *testing.T) {
	encode := func(b []byte) []byte {
		e, err := blob.EncodeChunk(blob.CompressionZstd, b)
		if err != nil {
			t.Fatal(err)
		}
		return e
	}
	data := textBytes(8, 4*testChunk)
	chunk1 := data[testChunk : 2*testChunk]
	for _, tc := range []struct {
		name string
		bad  func(good []byte) []byte
	}{
		{"garbage", func([]byte) []byte { return randomBytes(9, 500) }},
		{"flipped byte", func(b []byte) []byte { c := bytes.Clone(b); c[len(c)/2] ^= 0xff; return c }},
		{"truncated", func(b []byte) []byte { return bytes.Clone(b[:len(b)-3]) }},
		{"raw chunk", func([]byte) []byte { return bytes.Clone(chunk1) }},
		{"frame of other bytes", func([]byte) []byte { return encode(textBytes(10, testChunk)) }},
		{"frame of one byte more", func([]byte) []byte { return encode(append(bytes.Clone(chunk1), 'x')) }},
		{"frame of a prefix", func([]byte) []byte { return encode(chunk1[:testChunk-1]) }},
		{"bomb", func([]byte) []byte { return encode(make([]byte, 32<<20)) }},
	} {
		t.Run(tc.name, func(t *testing.T) {
			st := newMemStore()
			ix := putZstdLayer(t, st, data, testChunk)
			f, p := mountLayer(t, Config{Store: st, Retries: 2}, ix)
			checkCorruptChunkNeverServed(t, st, f, p, ix, data, tc.bad)
		})
	}
}

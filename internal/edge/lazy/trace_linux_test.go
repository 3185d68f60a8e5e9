package lazy

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"maps"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"

	"dsec.dev/dsec/internal/blob"
	"dsec.dev/dsec/internal/errdefs"
)

// readChunks reads a few bytes of each chunk, in order, past the page cache.
func readChunks(t *testing.T, p string, data []byte, chunks ...int) {
	t.Helper()
	for _, c := range chunks {
		off := int64(c) * testChunk
		got, err := preadDirect(p, off, 4096)
		if err != nil || !bytes.Equal(got, data[off:off+4096]) {
			t.Fatalf("read chunk %d: %v", c, err)
		}
	}
}

// TestPublishedTraceFreshNode: two nodes publish what they read to a real
// (directory) blob store; a third, with an empty cache, prefetches the
// union into memory before anything reads it, costing the disk nothing.
func TestPublishedTraceFreshNode(t *testing.T) {
	ctx := context.Background()
	st, err := blob.NewDir(t.TempDir())
	if err != nil {
		t.Fatal(err)
	}
	data := textBytes(11, 10*testChunk)
	ix := putZstdLayer(t, st, data, testChunk)
	hex := ix.Digest[7:]

	a, pa := mountLayer(t, Config{Store: st}, ix)
	readChunks(t, pa, data, 7, 2, 5, 2)
	if wrote, err := a.PublishTrace(ctx, hex); err != nil || !wrote {
		t.Fatalf("first node publishes: %v, %v", wrote, err)
	}
	if wrote, err := a.PublishTrace(ctx, hex); err != nil || wrote {
		t.Fatalf("publishing again with nothing new: %v, %v; want no write", wrote, err)
	}
	b, pb := mountLayer(t, Config{Store: st}, ix)
	readChunks(t, pb, data, 2, 9)
	if wrote, err := b.PublishTrace(ctx, hex); err != nil || !wrote {
		t.Fatalf("second node publishes: %v, %v", wrote, err)
	}
	tr, err := blob.GetTrace(ctx, st, ix)
	if err != nil {
		t.Fatal(err)
	}
	want := []blob.TraceChunk{{Chunk: 2, Rank: 0}, {Chunk: 7, Rank: 0}, {Chunk: 9, Rank: 1}, {Chunk: 5, Rank: 2}}
	if diff := cmp.Diff(want, tr.Chunks); diff != "" {
		t.Errorf("published trace (-want +got):\n%s", diff)
	}

	cacheDir := t.TempDir()
	c, pc := mountLayer(t, Config{Store: st, CacheDir: cacheDir}, ix)
	if n, err := c.PrefetchTrace(ctx, hex); err != nil || n != 4 {
		t.Fatalf("PrefetchTrace on a fresh node = %d, %v; want the 4 published chunks", n, err)
	}
	for _, tc := range want {
		if !c.cache.mem.has(ix.Chunks[tc.Chunk]) {
			t.Errorf("chunk %d was not prefetched into memory", tc.Chunk)
		}
	}
	if s := c.Stats(hex); s.ChunksFetched != 4 || s.BytesWrittenDisk != 0 {
		t.Errorf("stats after prefetching: %+v", s)
	}
	if cached, _ := cachedChunks(t, cacheDir); len(cached) != 0 {
		t.Errorf("prefetching wrote %v to disk", cached)
	}
	readChunks(t, pc, data, 9, 3)
	if s := c.Stats(hex); s.MemoryHits != 1 || s.CacheMisses != 1 || s.ChunksFetched != 5 {
		t.Errorf("stats after reading a prefetched and another chunk: %+v", s)
	}

	// The node's own trace, once saved, comes before the published one.
	if err := c.SaveTrace(hex); err != nil {
		t.Fatal(err)
	}
	closeFS(t, c)
	again, _ := mountLayer(t, Config{Store: st, CacheDir: cacheDir}, ix)
	if n, err := again.PrefetchTrace(ctx, hex); err != nil || n != 2 {
		t.Errorf("PrefetchTrace with a saved trace of 2 chunks = %d, %v", n, err)
	}
}

// TestUnusablePublishedTraceIgnored: a stale, foreign or damaged trace
// object prefetches nothing, fails nothing, and the next publish replaces it.
func TestUnusablePublishedTraceIgnored(t *testing.T) {
	ctx := context.Background()
	data := randomBytes(12, 6*testChunk)
	other := putLayer(t, newMemStore(), randomBytes(13, 2*testChunk), testChunk)
	encode := func(tr blob.Trace) []byte {
		b, err := json.Marshal(tr)
		if err != nil {
			t.Fatal(err)
		}
		return b
	}
	for _, tc := range []struct {
		name   string
		object func(ix *blob.Index) []byte
	}{
		{"not JSON", func(*blob.Index) []byte { return []byte("\x00garbage") }},
		{"foreign", func(ix *blob.Index) []byte {
			return encode(blob.Trace{Version: blob.TraceVersion, Digest: other.Digest, ChunkSize: testChunk, Chunks: []blob.TraceChunk{{Chunk: 1}}})
		}},
		{"stale chunking", func(ix *blob.Index) []byte {
			return encode(blob.Trace{Version: blob.TraceVersion, Digest: ix.Digest, ChunkSize: 2 * testChunk, Chunks: []blob.TraceChunk{{Chunk: 1}}})
		}},
		{"chunk out of range", func(ix *blob.Index) []byte {
			return encode(blob.Trace{Version: blob.TraceVersion, Digest: ix.Digest, ChunkSize: testChunk, Chunks: []blob.TraceChunk{{Chunk: 6}}})
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			st := newMemStore()
			ix := putLayer(t, st, data, testChunk)
			hex := ix.Digest[7:]
			obj := tc.object(ix)
			if err := st.Put(ctx, blob.TraceKey(hex), bytes.NewReader(obj), int64(len(obj))); err != nil {
				t.Fatal(err)
			}
			f, p := mountLayer(t, Config{Store: st}, ix)
			if n, err := f.PrefetchTrace(ctx, hex); err != nil || n != 0 {
				t.Fatalf("PrefetchTrace over an unusable trace = %d, %v; want 0, nil", n, err)
			}
			if gets := st.chunkGets(ix); len(gets) != 0 {
				t.Errorf("fetched %v", gets)
			}
			readChunks(t, p, data, 3)
			if wrote, err := f.PublishTrace(ctx, hex); err != nil || !wrote {
				t.Fatalf("publish over an unusable trace: %v, %v", wrote, err)
			}
			tr, err := blob.GetTrace(ctx, st, ix)
			if err != nil || !slices.Equal(tr.Chunks, []blob.TraceChunk{{Chunk: 3, Rank: 0}}) {
				t.Errorf("trace after publishing: %+v, %v", tr, err)
			}
		})
	}
	t.Run("none", func(t *testing.T) {
		st := newMemStore()
		ix := putLayer(t, st, data, testChunk)
		f, _ := mountLayer(t, Config{Store: st}, ix)
		if n, err := f.PrefetchTrace(ctx, ix.Digest[7:]); err != nil || n != 0 {
			t.Errorf("PrefetchTrace with no trace = %d, %v", n, err)
		}
		if _, err := blob.GetTrace(ctx, st, ix); !errors.Is(err, errdefs.ErrNotFound) {
			t.Errorf("a node that read nothing published a trace: %v", err)
		}
		if wrote, err := f.PublishTrace(ctx, ix.Digest[7:]); err != nil || wrote {
			t.Errorf("publish with nothing read: %v, %v", wrote, err)
		}
	})
}

// TestPrefetchJoinsReads: a sandbox reading a chunk the prefetch is
// fetching waits for that fetch instead of starting its own, and the
// prefetch asks for at most half the memory tier.
func TestPrefetchJoinsReads(t *testing.T) {
	ctx := context.Background()
	data := randomBytes(14, 8*testChunk)
	st := newMemStore()
	ix := putLayer(t, st, data, testChunk)
	hex := ix.Digest[7:]
	if err := blob.PutTrace(ctx, st, ix, blob.TraceFromOrder([]int{3, 4, 6, 1})); err != nil {
		t.Fatal(err)
	}
	release := make(chan struct{})
	st.mu.Lock()
	st.gate[ix.ChunkKey(3)] = release
	st.mu.Unlock()
	// Half the memory tier is three chunks.
	f, p := mountLayer(t, Config{Store: st, MemoryBytes: 6 * testChunk}, ix)

	var wg sync.WaitGroup
	var n int
	var prefetchErr error
	wg.Go(func() { n, prefetchErr = f.PrefetchTrace(ctx, hex) })
	<-st.entered // the prefetch is fetching chunk 3
	read := make(chan error, 1)
	go func() {
		off := int64(3*testChunk + 100)
		got, err := preadDirect(p, off, 1000)
		if err == nil && !bytes.Equal(got, data[off:off+1000]) {
			err = errors.New("content differs")
		}
		read <- err
	}()
	// Give the read time to reach the file system and join the fetch in
	// flight; the assertion holds whether or not it did.
	time.Sleep(200 * time.Millisecond)
	close(release)
	if err := <-read; err != nil {
		t.Fatal(err)
	}
	wg.Wait()
	if prefetchErr != nil || n != 3 {
		t.Fatalf("PrefetchTrace = %d, %v; want 3 (half the memory tier)", n, prefetchErr)
	}
	gets := st.chunkGets(ix)
	if diff := cmp.Diff([]int{3, 4, 6}, slices.Sorted(maps.Keys(gets))); diff != "" || gets[3] != 1 {
		t.Errorf("fetched %v; want chunks 3, 4, 6 once each (-want +got):\n%s", gets, diff)
	}
}

package lazy

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"maps"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"slices"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"
	"golang.org/x/sys/unix"

	"dsec.dev/dsec/internal/blob"
	"dsec.dev/dsec/internal/testutil"
)

const testChunk = 64 << 10

func TestErofsThroughFUSE(t *testing.T) {
	img, big := buildErofs(t)
	st := newMemStore()
	ix := putLayer(t, st, img, testChunk)
	f, p := mountLayer(t, Config{Store: st}, ix)
	if info, err := os.Stat(p); err != nil || info.Size() != int64(len(img)) || info.Mode() != 0o444 {
		t.Fatalf("stat layer file: %v %v", info, err)
	}
	des, err := os.ReadDir(filepath.Dir(p))
	if err != nil || len(des) != 1 || des[0].Name() != ix.Digest[7:] {
		t.Fatalf("read mount root: %v %v", des, err)
	}
	if err := os.WriteFile(p, []byte("x"), 0o644); err == nil {
		t.Fatal("write to layer file succeeded")
	}

	dir := mountErofs(t, p)
	// Small files cost a few chunks, not the image.
	if b, err := os.ReadFile(filepath.Join(dir, "usr/lib/small.bin")); err != nil || len(b) != 70000 {
		t.Fatalf("read usr/lib/small.bin: %d bytes, %v", len(b), err)
	}
	if s := f.Stats(ix.Digest[7:]); s.ChunksFetched == 0 || s.ChunksFetched > s.ChunksTotal/4 {
		t.Errorf("reading a 70 kB file fetched %d of %d chunks", s.ChunksFetched, s.ChunksTotal)
	} else {
		t.Logf("reading a 70 kB file fetched %d of %d chunks", s.ChunksFetched, s.ChunksTotal)
	}
	got, err := os.ReadFile(filepath.Join(dir, "usr/lib/big.bin"))
	if err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(got, big) {
		t.Fatalf("big.bin through EROFS over FUSE differs (%d bytes, want %d)", len(got), len(big))
	}
	if b, err := os.ReadFile(filepath.Join(dir, "etc/hostname")); err != nil || string(b) != "sandbox\n" {
		t.Fatalf("read etc/hostname: %q %v", b, err)
	}
	s := f.Stats(ix.Digest[7:])
	if s.ChunksFetched == 0 || s.ChunksFetched > s.ChunksTotal || s.BytesRead == 0 {
		t.Fatalf("stats after reading: %+v", s)
	}
	t.Logf("image %d bytes, %d chunks; stats %+v", len(img), len(ix.Chunks), s)
}

func TestReadFetchesCoveredChunks(t *testing.T) {
	data := randomBytes(1, 16*testChunk+1234) // last chunk is short
	st := newMemStore()
	ix := putLayer(t, st, data, testChunk)
	f, p := mountLayer(t, Config{Store: st}, ix)
	hex := ix.Digest[7:]
	// Cases touch disjoint chunks, so that each one's fetches are its own.
	for _, tc := range []struct {
		name string
		off  int64
		n    int
		want []int
	}{
		{"inside one chunk", 3*testChunk + 100, 1000, []int{3}},
		{"across a boundary", 6*testChunk - 10, 20, []int{5, 6}},
		{"two whole chunks", 8 * testChunk, 2 * testChunk, []int{8, 9}},
		{"first byte", 0, 1, []int{0}},
		{"tail past the end", 16*testChunk + 1000, 4096, []int{16}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			before := f.Stats(hex)
			got, err := preadDirect(p, tc.off, tc.n)
			if err != nil {
				t.Fatal(err)
			}
			end := min(tc.off+int64(tc.n), int64(len(data)))
			if !bytes.Equal(got, data[tc.off:end]) {
				t.Fatalf("read %d bytes at %d: content differs (got %d bytes)", tc.n, tc.off, len(got))
			}
			var fetched []int
			for i, n := range st.chunkGets(ix) {
				if n != 1 {
					t.Errorf("chunk %d fetched %d times", i, n)
				}
				fetched = append(fetched, i)
			}
			slices.Sort(fetched)
			if diff := cmp.Diff(tc.want, fetched); diff != "" {
				t.Errorf("fetched chunks (-want +got):\n%s", diff)
			}
			after := f.Stats(hex)
			if d := after.ChunksFetched - before.ChunksFetched; d != int64(len(tc.want)) {
				t.Errorf("ChunksFetched grew by %d, want %d", d, len(tc.want))
			}
			if d := after.BytesRead - before.BytesRead; d != end-tc.off {
				t.Errorf("BytesRead grew by %d, want %d", d, end-tc.off)
			}
		})
	}
	// Reading the same ranges again is served from the cache.
	if _, err := preadDirect(p, 3*testChunk, 2*testChunk); err == nil {
		// chunk 4 was never read: one fetch; chunk 3 is a hit.
		if diff := cmp.Diff(map[int]int{4: 1}, st.chunkGets(ix)); diff != "" {
			t.Errorf("second read fetched (-want +got):\n%s", diff)
		}
	} else {
		t.Fatal(err)
	}
}

func TestConcurrentReadsFetchOnce(t *testing.T) {
	data := randomBytes(2, 4*testChunk)
	st := newMemStore()
	ix := putLayer(t, st, data, testChunk)
	f, p := mountLayer(t, Config{Store: st}, ix)
	key := blob.ChunkKey(ix.Chunks[2])
	release := make(chan struct{})
	st.mu.Lock()
	st.gate[key] = release
	st.mu.Unlock()

	const readers = 8
	var wg sync.WaitGroup
	errs := make(chan error, readers)
	for r := range readers {
		wg.Go(func() {
			off := int64(2*testChunk + r*1000)
			got, err := preadDirect(p, off, 500)
			if err == nil && !bytes.Equal(got, data[off:off+500]) {
				err = errors.New("content differs")
			}
			errs <- err
		})
	}
	<-st.entered // the first fetch is in the store
	// Give the other readers time to reach the file system and join the
	// fetch in flight; the assertion holds however many of them did.
	time.Sleep(200 * time.Millisecond)
	close(release)
	wg.Wait()
	close(errs)
	for err := range errs {
		if err != nil {
			t.Error(err)
		}
	}
	if diff := cmp.Diff(map[int]int{2: 1}, st.chunkGets(ix)); diff != "" {
		t.Errorf("fetches (-want +got):\n%s", diff)
	}
	s := f.Stats(ix.Digest[7:])
	if s.ChunksFetched != 1 || s.CacheMisses+s.CacheHits != readers {
		t.Errorf("stats: %+v", s)
	}
}

func TestCorruptChunkNeverServed(t *testing.T) {
	for _, tc := range []struct {
		name string
		bad  func([]byte) []byte
	}{
		{"flipped byte", func(b []byte) []byte { c := bytes.Clone(b); c[100] ^= 1; return c }},
		{"truncated", func(b []byte) []byte { return bytes.Clone(b[:len(b)-1]) }},
		{"extended", func(b []byte) []byte { return append(bytes.Clone(b), 0) }},
		{"empty", func(b []byte) []byte { return nil }},
	} {
		t.Run(tc.name, func(t *testing.T) {
			data := randomBytes(3, 4*testChunk)
			st := newMemStore()
			ix := putLayer(t, st, data, testChunk)
			f, p := mountLayer(t, Config{Store: st, Retries: 2}, ix)
			checkCorruptChunkNeverServed(t, st, f, p, ix, data, tc.bad)
		})
	}
}

func TestStoreDownFailsBoundedAndHeals(t *testing.T) {
	ctx := context.Background()
	for _, mode := range []string{"error", "hang"} {
		t.Run(mode, func(t *testing.T) {
			st := newMemStore()
			data := randomBytes(4, 4*testChunk)
			other := randomBytes(5, 3*testChunk)
			ix := putLayer(t, st, data, testChunk)
			oix := putLayer(t, st, other, testChunk)
			f, p := mountLayer(t, Config{Store: st, Retries: 2, FetchTimeout: 300 * time.Millisecond}, ix)
			op, err := f.Add(ctx, oix)
			if err != nil {
				t.Fatal(err)
			}
			if err := f.FetchAll(ctx, oix.Digest[7:]); err != nil {
				t.Fatal(err)
			}

			st.setMode(mode)
			done := make(chan error, 1)
			go func() {
				_, err := preadDirect(p, 0, 4096)
				done <- err
			}()
			select {
			case err := <-done:
				if !errors.Is(err, syscall.EIO) {
					t.Fatalf("read with store down: %v, want EIO", err)
				}
			case <-time.After(60 * time.Second):
				t.Fatal("read with store down did not fail in 60 s")
			}
			if s := f.Stats(ix.Digest[7:]); s.FetchErrors != 2 {
				t.Errorf("FetchErrors = %d, want 2", s.FetchErrors)
			}
			// The file system and the cached layer are fine.
			if _, err := os.ReadDir(f.cfg.MountPoint); err != nil {
				t.Fatal(err)
			}
			if got, err := preadDirect(op, testChunk, testChunk); err != nil || !bytes.Equal(got, other[testChunk:2*testChunk]) {
				t.Fatalf("read cached layer with store down: %v", err)
			}

			st.setMode("")
			got, err := preadDirect(p, 0, 4096)
			if err != nil || !bytes.Equal(got, data[:4096]) {
				t.Fatalf("read after store came back: %v", err)
			}
		})
	}
}

func TestTinyCacheEvicts(t *testing.T) {
	data := randomBytes(6, 20*testChunk)
	st := newMemStore()
	ix := putLayer(t, st, data, testChunk)
	const limit = 3 * testChunk
	f, p := mountLayer(t, Config{Store: st, CacheBytes: limit, MemoryBytes: limit}, ix)
	for pass := range 2 {
		got, err := preadDirect(p, 0, len(data))
		if err != nil || !bytes.Equal(got, data) {
			t.Fatalf("pass %d: read whole file through a tiny cache: %v", pass, err)
		}
		if mem := f.cache.stats().MemoryBytes; mem > limit || mem == 0 {
			t.Fatalf("pass %d: memory tier holds %d bytes; limit %d", pass, mem, limit)
		}
		cached, total := cachedChunks(t, f.cfg.CacheDir)
		// Read once, every chunk is cold: evicted from memory, it is
		// dropped. Read again after that, chunks are hot and reach disk.
		if pass == 0 && len(cached) != 0 || pass == 1 && (len(cached) == 0 || total > limit) {
			t.Fatalf("pass %d: disk tier holds %d chunks, %d bytes; limit %d", pass, len(cached), total, limit)
		}
	}
	got, err := os.ReadFile(p) // through the page cache too
	if err != nil || !bytes.Equal(got, data) {
		t.Fatalf("buffered read: %v", err)
	}
	if s := f.Stats(ix.Digest[7:]); s.ChunksFetched < 2*20-3 {
		t.Errorf("evicted chunks were not refetched: %+v", s)
	}
}

func TestRestartReusesCache(t *testing.T) {
	ctx := context.Background()
	data := randomBytes(9, 8*testChunk)
	st := newMemStore()
	ix := putLayer(t, st, data, testChunk)
	hex := ix.Digest[7:]
	cacheDir := t.TempDir()

	f, p := mountLayer(t, Config{Store: st, CacheDir: cacheDir}, ix)
	// Read twice (the second time from memory), chunks 0-4 are hot: closing
	// writes them to disk.
	for range 2 {
		if _, err := preadDirect(p, 0, 5*testChunk); err != nil {
			t.Fatal(err)
		}
	}
	if _, err := preadDirect(p, 6*testChunk, testChunk); err != nil { // cold
		t.Fatal(err)
	}
	if s := f.Stats(hex); s.MemoryHits != 5 || s.BytesWrittenDisk != 0 {
		t.Errorf("stats before closing: %+v", s)
	}
	closeFS(t, f)
	if cached, _ := cachedChunks(t, cacheDir); len(cached) != 5 || !cached[ix.Chunks[0]+".zst"] {
		t.Fatalf("disk tier after closing holds %v, want chunks 0-4 as zstd frames", cached)
	}
	st.chunkGets(ix)

	// A crash left a temp file; a disk error damaged chunk 4.
	leftover := filepath.Join(cacheDir, "chunks", ".tmp-12345")
	if err := os.WriteFile(leftover, []byte("partial"), 0o600); err != nil {
		t.Fatal(err)
	}
	bad := filepath.Join(cacheDir, "chunks", ix.Chunks[4]+".zst")
	if err := os.WriteFile(bad, make([]byte, testChunk), 0o600); err != nil {
		t.Fatal(err)
	}

	f = mountFS(t, Config{Store: st, CacheDir: cacheDir})
	if fileExists(leftover) {
		t.Error("temp leftover survived the restart")
	}
	p, err := f.Add(ctx, ix)
	if err != nil {
		t.Fatal(err)
	}
	got, err := preadDirect(p, 0, 5*testChunk)
	if err != nil || !bytes.Equal(got, data[:5*testChunk]) {
		t.Fatalf("read after restart: %v", err)
	}
	if diff := cmp.Diff(map[int]int{4: 1}, st.chunkGets(ix)); diff != "" {
		t.Errorf("fetches after restart (-want +got):\n%s", diff)
	}
	if s := f.Stats(hex); s.CacheHits != 4 || s.DiskHits != 4 || s.ChunksFetched != 1 {
		t.Errorf("stats after restart: %+v", s)
	}
	if cached, _ := cachedChunks(t, cacheDir); cached[ix.Chunks[4]+".zst"] {
		t.Error("the damaged chunk file is still in the disk tier")
	}
}

func TestTraceAndFetchAll(t *testing.T) {
	ctx := context.Background()
	data := randomBytes(10, 10*testChunk)
	st := newMemStore()
	ix := putLayer(t, st, data, testChunk)
	hex := ix.Digest[7:]
	cacheDir := t.TempDir()

	f, p := mountLayer(t, Config{Store: st, CacheDir: cacheDir}, ix)
	for _, c := range []int{7, 2, 5, 2} {
		if _, err := preadDirect(p, int64(c)*testChunk+10, 10); err != nil {
			t.Fatal(err)
		}
	}
	if err := f.SaveTrace(hex); err != nil {
		t.Fatal(err)
	}
	raw, err := os.ReadFile(filepath.Join(cacheDir, "traces", hex+".json"))
	if err != nil {
		t.Fatal(err)
	}
	var tf traceFile
	if err := json.Unmarshal(raw, &tf); err != nil {
		t.Fatal(err)
	}
	if diff := cmp.Diff([]int{7, 2, 5}, tf.Chunks); diff != "" {
		t.Errorf("saved trace (-want +got):\n%s", diff)
	}
	closeFS(t, f)

	// A new node with the trace but an empty chunk cache.
	if err := os.RemoveAll(filepath.Join(cacheDir, "chunks")); err != nil {
		t.Fatal(err)
	}
	st.chunkGets(ix)
	f = mountFS(t, Config{Store: st, CacheDir: cacheDir})
	if _, err := f.Add(ctx, ix); err != nil {
		t.Fatal(err)
	}
	n, err := f.PrefetchTrace(ctx, hex)
	if err != nil || n != 3 {
		t.Fatalf("PrefetchTrace = %d, %v; want 3", n, err)
	}
	if diff := cmp.Diff(map[int]int{2: 1, 5: 1, 7: 1}, st.chunkGets(ix)); diff != "" {
		t.Errorf("prefetch fetched (-want +got):\n%s", diff)
	}
	if err := f.FetchAll(ctx, hex); err != nil {
		t.Fatal(err)
	}
	if gets := st.chunkGets(ix); len(gets) != 7 {
		t.Errorf("FetchAll fetched %d chunks, want the 7 not prefetched", len(gets))
	}
	if got, err := os.ReadFile(filepath.Join(f.cfg.MountPoint, hex)); err != nil || !bytes.Equal(got, data) {
		t.Fatalf("read after FetchAll: %v", err)
	}
	if gets := st.chunkGets(ix); len(gets) != 0 {
		t.Errorf("read after FetchAll fetched %v", gets)
	}
	if err := f.Prefetch(ctx, hex, []int{10}); err == nil {
		t.Error("Prefetch of chunk out of range succeeded")
	}

	// The node's totals (its /metrics) sum the layers' counters and keep a
	// removed layer's.
	st1 := f.Stats(hex)
	before := f.Totals()
	if before.BytesRead != st1.BytesRead || before.BytesFetched != st1.BytesFetched || before.ChunksFetched != st1.ChunksFetched ||
		before.MemoryHits+before.DiskHits != st1.CacheHits || before.CacheMisses != st1.CacheMisses {
		t.Errorf("totals %+v of one layer's stats %+v", before, st1)
	}
	if before.BytesRead == 0 || before.ChunksFetched == 0 || before.MemoryBytes+before.DiskBytes == 0 {
		t.Errorf("totals after reads and a FetchAll: %+v", before)
	}
	f.Remove(hex)
	if _, err := os.Stat(filepath.Join(f.cfg.MountPoint, hex)); !errors.Is(err, fs.ErrNotExist) {
		t.Errorf("stat removed layer: %v", err)
	}
	if s := f.Stats(hex); s != (LayerStats{}) {
		t.Errorf("stats of removed layer: %+v", s)
	}
	if after := f.Totals(); after.BytesRead != before.BytesRead || after.ChunksFetched != before.ChunksFetched {
		t.Errorf("totals after the layer's removal: %+v, before %+v", after, before)
	}
}

func TestMetaChunksPinned(t *testing.T) {
	ctx := context.Background()
	img, _ := buildErofs(t)
	st := newMemStore()
	ix := putLayer(t, st, img, testChunk)
	hex := ix.Digest[7:]

	f := mountFS(t, Config{Store: st})
	if _, err := f.Add(ctx, ix); err != nil {
		t.Fatal(err)
	}
	meta, err := MetaChunks(ctx, f, hex, t.TempDir())
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("metadata chunks: %v of %d", meta, len(ix.Chunks))
	if len(meta) == 0 || len(meta) >= len(ix.Chunks) || meta[0] != 0 {
		t.Fatalf("MetaChunks = %v for %d chunks", meta, len(ix.Chunks))
	}
	// Running it again finds the same set, even with everything cached.
	again, err := MetaChunks(ctx, f, hex, t.TempDir())
	if err != nil {
		t.Fatal(err)
	}
	if diff := cmp.Diff(meta, again); diff != "" {
		t.Errorf("second MetaChunks (-first +second):\n%s", diff)
	}
	closeFS(t, f)

	// A fresh node: Add fetches nothing and pins the metadata; a walk of the
	// tree fetches exactly the metadata chunks (some of which also hold small
	// file data), and a cache with room for little more keeps them while file
	// data streams through.
	withMeta := *ix
	withMeta.Meta = meta
	st.chunkGets(ix)
	limit := int64(len(meta)+2) * testChunk
	f = mountFS(t, Config{Store: st, CacheBytes: limit, MemoryBytes: limit})
	p, err := f.Add(ctx, &withMeta)
	if err != nil {
		t.Fatal(err)
	}
	if gets := st.chunkGets(ix); len(gets) != 0 {
		t.Errorf("Add fetched %v, want nothing until the kernel reads", gets)
	}
	dir := mountErofs(t, p)
	if err := walkMeta(ctx, dir); err != nil {
		t.Fatal(err)
	}
	if diff := cmp.Diff(meta, slices.Sorted(maps.Keys(st.chunkGets(ix)))); diff != "" {
		t.Errorf("walking the tree fetched other than the metadata chunks (-meta +fetched):\n%s", diff)
	}
	if got, err := preadDirect(p, 0, len(img)); err != nil || !bytes.Equal(got, img) {
		t.Fatalf("read whole image: %v", err)
	}
	for _, m := range meta {
		if !f.cache.mem.has(ix.Chunks[m]) {
			t.Errorf("metadata chunk %d was evicted from memory", m)
		}
	}
	st.chunkGets(ix)
	dropCaches(t)
	if err := walkMeta(ctx, dir); err != nil {
		t.Fatal(err)
	}
	if gets := st.chunkGets(ix); len(gets) != 0 {
		t.Errorf("walking the tree again fetched %v; metadata should be local", gets)
	}
}

func TestCloseBusyDetaches(t *testing.T) {
	ctx := context.Background()
	img, _ := buildErofs(t)
	st := newMemStore()
	ix := putLayer(t, st, img, testChunk)
	f, p := mountLayer(t, Config{Store: st}, ix)
	dir := t.TempDir()
	if err := unix.Mount(p, dir, "erofs", unix.MS_RDONLY, ""); err != nil {
		t.Fatal(err)
	}
	erofsMounted := true
	t.Cleanup(func() {
		if erofsMounted {
			unix.Unmount(dir, unix.MNT_DETACH)
		}
	})

	short, cancel := context.WithTimeout(ctx, 300*time.Millisecond)
	defer cancel()
	if err := f.Close(short); !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("Close while EROFS uses a layer: %v, want still in use", err)
	}
	if mounted(t, f.cfg.MountPoint) {
		t.Fatal("lazy fs still attached after Close")
	}
	// The detached mount still serves its EROFS user.
	if b, err := os.ReadFile(filepath.Join(dir, "etc/hostname")); err != nil || string(b) != "sandbox\n" {
		t.Fatalf("read through detached mount: %q %v", b, err)
	}
	if err := unix.Unmount(dir, 0); err != nil {
		t.Fatal(err)
	}
	erofsMounted = false
	wait, cancel2 := context.WithTimeout(ctx, 30*time.Second)
	defer cancel2()
	if err := f.Close(wait); err != nil {
		t.Fatalf("Close after the last user left: %v", err)
	}
}

func mounted(t *testing.T, dir string) bool {
	t.Helper()
	b, err := os.ReadFile("/proc/self/mountinfo")
	if err != nil {
		t.Fatal(err)
	}
	for _, line := range strings.Split(string(b), "\n") {
		if fields := strings.Fields(line); len(fields) > 4 && fields[4] == dir {
			return true
		}
	}
	return false
}

// A signal to the reading thread while its chunk is being fetched must not
// fail the read: programs (and mount(2) reading a superblock) do not expect
// EINTR from a regular file. The fetch goes on and the read returns data.
func TestReadSurvivesSignals(t *testing.T) {
	data := randomBytes(3, 2*testChunk)
	st := newMemStore()
	ix := putLayer(t, st, data, testChunk)
	_, p := mountLayer(t, Config{Store: st}, ix)
	release := make(chan struct{})
	st.mu.Lock()
	st.gate[blob.ChunkKey(ix.Chunks[1])] = release
	st.mu.Unlock()

	tids := make(chan int, 1)
	type result struct {
		got []byte
		err error
	}
	done := make(chan result, 1)
	go func() {
		runtime.LockOSThread() // the thread ends with the goroutine
		tids <- unix.Gettid()
		got, err := preadDirect(p, testChunk, 4096)
		done <- result{got, err}
	}()
	tid := <-tids
	<-st.entered // the read waits on the store
	for range 20 {
		if err := unix.Tgkill(unix.Getpid(), tid, unix.SIGURG); err != nil {
			t.Fatal(err)
		}
		time.Sleep(5 * time.Millisecond)
	}
	close(release)
	r := <-done
	if r.err != nil {
		t.Fatalf("read interrupted by signals: %v", r.err)
	}
	if !bytes.Equal(r.got, data[testChunk:testChunk+4096]) {
		t.Fatal("content differs")
	}
}

// TestReadPushesRestOfChunk reads one page of a chunk through the page
// cache: the file system answers that read, then hands the kernel the rest
// of the chunk, so reading the whole chunk afterwards reaches the file
// system no more. With NoPagePush every page is read through it.
func TestReadPushesRestOfChunk(t *testing.T) {
	const chunk = 1 << 20
	data := randomBytes(12, 3*chunk+300_000) // the last chunk is short
	for _, tc := range []struct {
		name string
		cfg  Config
		push bool
	}{
		{"pushed", Config{}, true},
		{"not pushed", Config{NoPagePush: true}, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			st := newMemStore()
			ix := putLayer(t, st, data, chunk)
			tc.cfg.Store = st
			f, p := mountLayer(t, tc.cfg, ix)
			hex := ix.Digest[7:]
			file, err := os.Open(p)
			if err != nil {
				t.Fatal(err)
			}
			defer file.Close()

			for _, c := range []int{1, 3} {
				start := int64(c) * chunk
				end := min(start+chunk, int64(len(data)))
				s0 := f.Stats(hex)
				if _, err := file.ReadAt(make([]byte, 4096), start+8192); err != nil {
					t.Fatal(err)
				}
				// The read took its readahead window; the push, if any,
				// the rest of the chunk.
				window := f.Stats(hex).BytesRead - s0.BytesRead
				want := s0.BytesPushed
				if tc.push {
					want += end - start - window
				}
				testutil.WaitFor(t, 10*time.Second, "pages pushed", func() bool { return f.Stats(hex).BytesPushed == want })
				before := f.Stats(hex)
				got := make([]byte, end-start)
				if n, err := file.ReadAt(got, start); n != len(got) || err != nil && !errors.Is(err, io.EOF) {
					t.Fatalf("read chunk %d: %d bytes, %v", c, n, err)
				}
				if !bytes.Equal(got, data[start:end]) {
					t.Fatalf("chunk %d read back differs", c)
				}
				grew := f.Stats(hex).BytesRead - before.BytesRead
				if tc.push && grew != 0 {
					t.Errorf("chunk %d: reading it all after its pages were pushed reached the file system for %d bytes", c, grew)
				} else if !tc.push && grew == 0 {
					t.Errorf("chunk %d: without pushes, reading it all never reached the file system", c)
				}
				t.Logf("chunk %d: window %d bytes, then %d read through the file system", c, window, grew)
			}
			// The pushes never grew the file.
			if info, err := file.Stat(); err != nil || info.Size() != int64(len(data)) {
				t.Fatalf("stat after pushes: %v, %v", info, err)
			}
			if n, err := file.ReadAt(make([]byte, 10), int64(len(data))); n != 0 || !errors.Is(err, io.EOF) {
				t.Errorf("read at the end: %d, %v", n, err)
			}
		})
	}
}

// TestDropPagesFencesPushes: a push queued before the layer's pages were
// dropped does not land after the drop (MetaChunks drops the walk's pages
// so that sandboxes' reads reach the trace); one queued after it does, and
// its pages are then read without reaching the file system.
func TestDropPagesFencesPushes(t *testing.T) {
	const chunk = 1 << 20
	data := randomBytes(13, 2*chunk)
	st := newMemStore()
	ix := putLayer(t, st, data, chunk)
	// No workers: the test runs the pushes itself.
	f, p := mountLayer(t, Config{Store: st, NoPagePush: true}, ix)
	hex := ix.Digest[7:]
	file, err := os.Open(p) // the kernel must know the file to take its pages
	if err != nil {
		t.Fatal(err)
	}
	defer file.Close()
	l, err := f.layer(hex)
	if err != nil {
		t.Fatal(err)
	}
	plain, err := f.chunk(context.Background(), l, 1)
	if err != nil {
		t.Fatal(err)
	}

	stale := pushJob{l: l, i: 1, gen: l.pushGen.Load(), data: plain}
	if err := f.mnt.dropPages(l); err != nil {
		t.Fatal(err)
	}
	f.push(stale)
	if s := f.Stats(hex); s.BytesPushed != 0 {
		t.Fatalf("a push queued before the drop landed after it: %d bytes", s.BytesPushed)
	}

	f.push(pushJob{l: l, i: 1, gen: l.pushGen.Load(), data: plain})
	if s := f.Stats(hex); s.BytesPushed != chunk {
		t.Fatalf("pushed %d bytes, want the chunk's %d", s.BytesPushed, chunk)
	}
	got := make([]byte, chunk)
	if _, err := file.ReadAt(got, chunk); err != nil && !errors.Is(err, io.EOF) {
		t.Fatal(err)
	}
	if !bytes.Equal(got, data[chunk:]) {
		t.Fatal("pushed pages differ from the chunk")
	}
	if s := f.Stats(hex); s.BytesRead != 0 {
		t.Errorf("reading pushed pages reached the file system for %d bytes", s.BytesRead)
	}
}

// TestSharedMmap: a layer file maps shared and read-only, as QEMU maps a
// microVM's pmem layer (memory-backend-file, share=on, readonly=on), and
// reads through the mapping fetch the chunks they touch.
func TestSharedMmap(t *testing.T) {
	data := randomBytes(3, 8*testChunk)
	st := newMemStore()
	ix := putLayer(t, st, data, testChunk)
	_, p := mountLayer(t, Config{Store: st}, ix)
	// The mapping is read in a child process: a page fault on a FUSE file
	// blocks its thread outside any safe point, so in the process serving
	// that file a garbage collection starting meanwhile stops the server's
	// goroutines for good (seen: the test hung in folio_wait_bit_common).
	cmd := exec.Command(os.Args[0], "-test.run=^$")
	cmd.Env = append(os.Environ(), mmapChildEnv+"="+p)
	out, err := cmd.Output()
	if err != nil {
		t.Fatalf("map the layer file shared in a child: %v", err)
	}
	if !bytes.Equal(out, data) {
		t.Fatalf("the shared mapping of the layer file differs from the layer (%d bytes read, %d written)", len(out), len(data))
	}
}

// mmapChildEnv names the file a child of TestSharedMmap maps.
const mmapChildEnv = "DSEC_LAZY_TEST_MMAP"

// TestMain runs the test binary as TestSharedMmap's child when
// mmapChildEnv is set.
func TestMain(m *testing.M) {
	if p := os.Getenv(mmapChildEnv); p != "" {
		if err := copyMapped(p, os.Stdout); err != nil {
			fmt.Fprintln(os.Stderr, err)
			os.Exit(1)
		}
		os.Exit(0)
	}
	os.Exit(m.Run())
}

// copyMapped maps file p shared and read-only, as QEMU maps a pmem layer,
// and writes the mapping to w.
func copyMapped(p string, w io.Writer) error {
	f, err := os.Open(p)
	if err != nil {
		return err
	}
	defer f.Close()
	fi, err := f.Stat()
	if err != nil {
		return err
	}
	m, err := unix.Mmap(int(f.Fd()), 0, int(fi.Size()), unix.PROT_READ, unix.MAP_SHARED)
	if err != nil {
		return fmt.Errorf("mmap %s shared: %w", p, err)
	}
	defer unix.Munmap(m)
	_, err = w.Write(m)
	return err
}

package lazy

import (
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"math/rand/v2"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"

	"dsec.dev/dsec/internal/blob"
	"dsec.dev/dsec/internal/errdefs"
	"dsec.dev/dsec/internal/testutil"
)

// memStore is a map-backed blob.Store with knobs to make it misbehave.
type memStore struct {
	mu      sync.Mutex
	objects map[string][]byte
	gets    map[string]int    // Get calls by key
	corrupt map[string][]byte // served instead of the real object
	mode    string            // "" ok, "error": ErrUnavailable, "hang": block until ctx ends
	gate    map[string]chan struct{}
	entered chan string // receives a key when a Get on a gated key starts
}

var _ blob.Store = (*memStore)(nil)

func newMemStore() *memStore {
	return &memStore{
		objects: map[string][]byte{},
		gets:    map[string]int{},
		corrupt: map[string][]byte{},
		gate:    map[string]chan struct{}{},
		entered: make(chan string, 100),
	}
}

func (s *memStore) Put(ctx context.Context, key string, r io.Reader, size int64) error {
	data, err := io.ReadAll(r)
	if err != nil {
		return err
	}
	if int64(len(data)) != size {
		return fmt.Errorf("put %s: %d bytes, want %d", key, len(data), size)
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	s.objects[key] = data
	return nil
}

func (s *memStore) Get(ctx context.Context, key string) (io.ReadCloser, error) {
	s.mu.Lock()
	s.gets[key]++
	mode := s.mode
	gate := s.gate[key]
	data, ok := s.objects[key]
	if c, bad := s.corrupt[key]; bad {
		data = c
	}
	s.mu.Unlock()
	if gate != nil {
		s.entered <- key
		select {
		case <-gate:
		case <-ctx.Done():
			return nil, ctx.Err()
		}
	}
	switch mode {
	case "error":
		return nil, fmt.Errorf("get %s: %w", key, errdefs.ErrUnavailable)
	case "hang":
		<-ctx.Done()
		return nil, fmt.Errorf("get %s: %w", key, ctx.Err())
	}
	if !ok {
		return nil, fmt.Errorf("get %s: %w", key, errdefs.ErrNotFound)
	}
	return io.NopCloser(bytes.NewReader(data)), nil
}

func (s *memStore) GetRange(ctx context.Context, key string, offset, length int64) (io.ReadCloser, error) {
	rc, err := s.Get(ctx, key)
	if err != nil {
		return nil, err
	}
	data, _ := io.ReadAll(rc)
	if offset > int64(len(data)) {
		offset = int64(len(data))
	}
	data = data[offset:]
	if length >= 0 && length < int64(len(data)) {
		data = data[:length]
	}
	return io.NopCloser(bytes.NewReader(data)), nil
}

func (s *memStore) Stat(ctx context.Context, key string) (int64, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	data, ok := s.objects[key]
	if !ok {
		return 0, fmt.Errorf("stat %s: %w", key, errdefs.ErrNotFound)
	}
	return int64(len(data)), nil
}

func (s *memStore) Delete(ctx context.Context, key string) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	delete(s.objects, key)
	return nil
}

func (s *memStore) List(ctx context.Context, prefix string, fn func(key string, size int64) error) error {
	s.mu.Lock()
	var keys []string
	for k := range s.objects {
		if strings.HasPrefix(k, prefix) {
			keys = append(keys, k)
		}
	}
	s.mu.Unlock()
	for _, k := range keys {
		n, err := s.Stat(ctx, k)
		if err != nil {
			continue
		}
		if err := fn(k, n); err != nil {
			return err
		}
	}
	return nil
}

func (s *memStore) setMode(m string) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.mode = m
}

// chunkGets returns the Get counts of the layer's chunks, by chunk number,
// and resets all counts.
func (s *memStore) chunkGets(ix *blob.Index) map[int]int {
	s.mu.Lock()
	defer s.mu.Unlock()
	out := map[int]int{}
	for i := range ix.Chunks {
		if n := s.gets[ix.ChunkKey(i)]; n > 0 {
			out[i] = n
		}
	}
	s.gets = map[string]int{}
	return out
}

// putLayer chunks data into the store as raw chunks (the layout of indexes
// without compression) and returns its index.
func putLayer(t *testing.T, st blob.Store, data []byte, chunkSize int64) *blob.Index {
	t.Helper()
	ctx := context.Background()
	sum := sha256.Sum256(data)
	ix := &blob.Index{Digest: "sha256:" + hex.EncodeToString(sum[:]), Size: int64(len(data)), ChunkSize: chunkSize}
	for off := int64(0); off < int64(len(data)); off += chunkSize {
		c := data[off:min(off+chunkSize, int64(len(data)))]
		h := digestHex(c)
		ix.Chunks = append(ix.Chunks, h)
		if err := st.Put(ctx, blob.ChunkKey(h), bytes.NewReader(c), int64(len(c))); err != nil {
			t.Fatal(err)
		}
	}
	if err := ix.Validate(); err != nil {
		t.Fatal(err)
	}
	js, _ := json.Marshal(ix)
	if err := st.Put(ctx, blob.IndexKey(ix.Digest[7:]), bytes.NewReader(js), int64(len(js))); err != nil {
		t.Fatal(err)
	}
	return ix
}

func digestHex(data []byte) string {
	sum := sha256.Sum256(data)
	return hex.EncodeToString(sum[:])
}

func randomBytes(seed uint64, n int) []byte {
	r := rand.New(rand.NewPCG(seed, seed+1))
	b := make([]byte, n)
	for i := range b {
		b[i] = byte(r.Uint32())
	}
	return b
}

// mountFS mounts a lazy FS on a fresh dir, unmounted in t.Cleanup.
func mountFS(t *testing.T, cfg Config) *FS {
	t.Helper()
	testutil.RequireRoot(t)
	testutil.Require(t, fileExists("/dev/fuse"), "/dev/fuse is missing")
	if cfg.MountPoint == "" {
		cfg.MountPoint = t.TempDir()
	}
	if cfg.CacheDir == "" {
		cfg.CacheDir = t.TempDir()
	}
	if cfg.Log == nil {
		cfg.Log = slog.New(slog.NewTextHandler(testWriter{t}, &slog.HandlerOptions{Level: slog.LevelWarn}))
	}
	f, err := Mount(context.Background(), cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		// Close is idempotent: tests that restart have closed it already.
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		if err := f.Close(ctx); err != nil {
			t.Errorf("close: %v", err)
		}
	})
	return f
}

// closeFS closes f now, as a restart would.
func closeFS(t *testing.T, f *FS) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if err := f.Close(ctx); err != nil {
		t.Fatal(err)
	}
}

// preadDirect reads n bytes at off with O_DIRECT, bypassing the page cache
// (and readahead) so that exactly these bytes reach the file system.
func preadDirect(path string, off int64, n int) ([]byte, error) {
	fd, err := unix.Open(path, unix.O_RDONLY|unix.O_DIRECT|unix.O_CLOEXEC, 0)
	if err != nil {
		return nil, err
	}
	defer unix.Close(fd)
	buf := alignedBuf(n)
	got := 0
	for got < n {
		m, err := unix.Pread(fd, buf[got:], off+int64(got))
		if err != nil {
			return buf[:got], err
		}
		if m == 0 {
			break
		}
		got += m
	}
	return buf[:got], nil
}

func alignedBuf(n int) []byte {
	raw := make([]byte, n+4096)
	addr := uintptr(unsafe.Pointer(&raw[0]))
	skip := (4096 - int(addr%4096)) % 4096
	return raw[skip : skip+n]
}

// buildErofs makes an EROFS image of a small tree holding one file of
// several MiB, returning the image bytes and the big file's contents.
func buildErofs(t *testing.T) (img []byte, big []byte) {
	t.Helper()
	mkfs := testutil.RequireCommand(t, "mkfs.erofs")
	src := t.TempDir()
	big = randomBytes(7, 3<<20+12345)
	files := map[string][]byte{
		"etc/hostname":      []byte("sandbox\n"),
		"etc/os-release":    []byte("NAME=test\n"),
		"usr/lib/big.bin":   big,
		"usr/lib/small.bin": randomBytes(8, 70000),
		"usr/share/doc/a":   []byte("a"),
		"usr/share/doc/b":   []byte("b"),
	}
	for name, data := range files {
		p := filepath.Join(src, name)
		if err := os.MkdirAll(filepath.Dir(p), 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(p, data, 0o644); err != nil {
			t.Fatal(err)
		}
	}
	for i := range 200 {
		p := filepath.Join(src, "usr/share/many", fmt.Sprintf("file-%03d", i))
		if err := os.MkdirAll(filepath.Dir(p), 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(p, []byte(strings.Repeat("x", i)), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	if err := os.Symlink("../lib/big.bin", filepath.Join(src, "usr/share/link")); err != nil {
		t.Fatal(err)
	}
	out := filepath.Join(t.TempDir(), "layer.erofs")
	if b, err := exec.Command(mkfs, out, src).CombinedOutput(); err != nil {
		t.Fatalf("mkfs.erofs: %v\n%s", err, b)
	}
	img, err := os.ReadFile(out)
	if err != nil {
		t.Fatal(err)
	}
	return img, big
}

// mountErofs mounts the EROFS image file at src read-only on a fresh dir,
// unmounted in t.Cleanup.
func mountErofs(t *testing.T, src string) string {
	t.Helper()
	dir := t.TempDir()
	if err := unix.Mount(src, dir, "erofs", unix.MS_RDONLY, ""); err != nil {
		t.Fatalf("mount erofs from %s: %v", src, err)
	}
	t.Cleanup(func() {
		if err := unix.Unmount(dir, 0); err != nil {
			t.Errorf("unmount erofs: %v", err)
			unix.Unmount(dir, unix.MNT_DETACH)
		}
	})
	return dir
}

// checkCorruptChunkNeverServed makes the store serve bad(object) for chunk 1
// of the layer at p (data is the whole layer file) and checks that reads of
// it fail with EIO after the retries, that nothing corrupt is cached or
// counted as fetched, that other chunks read meanwhile, and that the chunk
// reads once the store serves it right again.
func checkCorruptChunkNeverServed(t *testing.T, st *memStore, f *FS, p string, ix *blob.Index, data []byte, bad func([]byte) []byte) {
	t.Helper()
	key := ix.ChunkKey(1)
	st.mu.Lock()
	st.corrupt[key] = bad(st.objects[key])
	st.mu.Unlock()

	if _, err := preadDirect(p, testChunk, 4096); !errors.Is(err, syscall.EIO) {
		t.Fatalf("read corrupt chunk: %v, want EIO", err)
	}
	if gets := st.chunkGets(ix); gets[1] != 2 {
		t.Errorf("corrupt chunk fetched %d times, want 2 (Retries)", gets[1])
	}
	if f.cache.has(ix.Chunks[1]) {
		t.Error("corrupt chunk is in the cache")
	}
	if s := f.Stats(ix.Digest[7:]); s.FetchErrors != 2 || s.ChunksFetched != 0 || s.BytesFetched != 0 {
		t.Errorf("stats: %+v", s)
	}
	if got, err := preadDirect(p, 2*testChunk, 4096); err != nil || !bytes.Equal(got, data[2*testChunk:2*testChunk+4096]) {
		t.Fatalf("read good chunk: %v", err)
	}

	st.mu.Lock()
	delete(st.corrupt, key)
	st.mu.Unlock()
	got, err := preadDirect(p, testChunk, testChunk)
	if err != nil || !bytes.Equal(got, data[testChunk:2*testChunk]) {
		t.Fatalf("read fixed chunk: %v", err)
	}
}

// mountLayer mounts a file system with cfg and adds the layer ix to it,
// returning the file system and the layer file's path.
func mountLayer(t *testing.T, cfg Config, ix *blob.Index) (*FS, string) {
	t.Helper()
	f := mountFS(t, cfg)
	p, err := f.Add(context.Background(), ix)
	if err != nil {
		t.Fatal(err)
	}
	return f, p
}

// dropCaches empties the page, dentry and inode caches, so that the next
// read of a mounted layer reaches the FUSE file system again.
func dropCaches(t *testing.T) {
	t.Helper()
	unix.Sync()
	if err := os.WriteFile("/proc/sys/vm/drop_caches", []byte("3"), 0); err != nil {
		t.Fatalf("drop caches: %v", err)
	}
}

// cachedChunks lists the chunk files in the cache dir's disk tier
// (HEX.zst, or HEX for a plain file) and their total size.
func cachedChunks(t *testing.T, cacheDir string) (map[string]bool, int64) {
	t.Helper()
	des, err := os.ReadDir(filepath.Join(cacheDir, "chunks"))
	if err != nil {
		t.Fatal(err)
	}
	out := map[string]bool{}
	var total int64
	for _, de := range des {
		info, err := de.Info()
		if err != nil {
			t.Fatal(err)
		}
		out[de.Name()] = true
		total += info.Size()
	}
	return out, total
}

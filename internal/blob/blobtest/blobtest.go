// Package blobtest is the conformance suite every blob.Store implementation
// runs: call Run from the implementation's tests with a constructor that
// returns an empty store and removes its objects when the test ends.
package blobtest

import (
	"bytes"
	"context"
	"crypto/rand"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"dsec.dev/dsec/internal/blob"
	"dsec.dev/dsec/internal/errdefs"
)

// promptly is how long a call with a cancelled context may take.
const promptly = 5 * time.Second

// Run runs the conformance suite. newStore is called once per subtest and
// must return an empty store (its own directory, bucket or prefix).
func Run(t *testing.T, newStore func(t *testing.T) blob.Store) {
	tests := []struct {
		name string
		fn   func(t *testing.T, st blob.Store)
	}{
		{"RoundTrip", testRoundTrip},
		{"Overwrite", testOverwrite},
		{"GetRange", testGetRange},
		{"Stat", testStat},
		{"Delete", testDelete},
		{"List", testList},
		{"NotFound", testNotFound},
		{"FailedPutLeavesNothing", testFailedPut},
		{"ConcurrentPuts", testConcurrentPuts},
		{"Cancelled", testCancelled},
		{"InvalidKeys", testInvalidKeys},
		{"PutLayerDedup", testPutLayerDedup},
		{"LayerRoundTrip", testLayerRoundTrip},
		{"CorruptChunk", testCorruptChunk},
		{"CorruptIndex", testCorruptIndex},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			tc.fn(t, newStore(t))
		})
	}
}

func randBytes(t *testing.T, n int) []byte {
	t.Helper()
	b := make([]byte, n)
	if _, err := rand.Read(b); err != nil {
		t.Fatal(err)
	}
	return b
}

func put(t *testing.T, st blob.Store, key string, data []byte) {
	t.Helper()
	if err := st.Put(t.Context(), key, bytes.NewReader(data), int64(len(data))); err != nil {
		t.Fatalf("Put %s: %v", key, err)
	}
}

func get(t *testing.T, st blob.Store, key string) []byte {
	t.Helper()
	rc, err := st.Get(t.Context(), key)
	if err != nil {
		t.Fatalf("Get %s: %v", key, err)
	}
	defer rc.Close()
	data, err := io.ReadAll(rc)
	if err != nil {
		t.Fatalf("read %s: %v", key, err)
	}
	return data
}

func getRange(t *testing.T, st blob.Store, key string, off, n int64) ([]byte, error) {
	t.Helper()
	rc, err := st.GetRange(t.Context(), key, off, n)
	if err != nil {
		return nil, err
	}
	defer rc.Close()
	return io.ReadAll(rc)
}

func keys(t *testing.T, st blob.Store, prefix string) []string {
	t.Helper()
	var got []string
	err := st.List(t.Context(), prefix, func(key string, size int64) error {
		got = append(got, key)
		return nil
	})
	if err != nil {
		t.Fatalf("List %q: %v", prefix, err)
	}
	return got
}

func testRoundTrip(t *testing.T, st blob.Store) {
	for _, tc := range []struct {
		name string
		key  string
		data []byte
	}{
		{"empty", "rt/empty", []byte{}},
		{"small", "rt/small.json", []byte(`{"hello":"world"}`)},
		{"5MiB", "rt/deep/er/big", randBytes(t, 5<<20)},
	} {
		t.Run(tc.name, func(t *testing.T) {
			put(t, st, tc.key, tc.data)
			if got := get(t, st, tc.key); !bytes.Equal(got, tc.data) {
				t.Fatalf("Get %s: %d bytes differ from the %d put", tc.key, len(got), len(tc.data))
			}
		})
	}
	// An unsized Put (size -1) stores what the reader holds.
	data := randBytes(t, 100_000)
	if err := st.Put(t.Context(), "rt/unsized", io.MultiReader(bytes.NewReader(data)), -1); err != nil {
		t.Fatalf("Put unsized: %v", err)
	}
	if got := get(t, st, "rt/unsized"); !bytes.Equal(got, data) {
		t.Fatalf("Get unsized: %d bytes differ from the %d put", len(got), len(data))
	}
}

func testOverwrite(t *testing.T, st blob.Store) {
	put(t, st, "ow", []byte("first version, longer"))
	put(t, st, "ow", []byte("second"))
	if got := string(get(t, st, "ow")); got != "second" {
		t.Fatalf("after overwrite got %q, want %q", got, "second")
	}
}

func testGetRange(t *testing.T, st blob.Store) {
	data := randBytes(t, 1000)
	put(t, st, "range", data)
	for _, tc := range []struct {
		name      string
		off, n    int64
		want      []byte
		wantError error
	}{
		{"middle", 100, 200, data[100:300], nil},
		{"start", 0, 10, data[:10], nil},
		{"to end", 900, -1, data[900:], nil},
		{"whole", 0, -1, data, nil},
		{"past end is cut", 950, 200, data[950:], nil},
		{"empty range", 10, 0, []byte{}, nil},
		{"at end", 1000, -1, []byte{}, nil},
		{"offset past end", 1001, 10, nil, errdefs.ErrInvalidArgument},
	} {
		t.Run(tc.name, func(t *testing.T) {
			got, err := getRange(t, st, "range", tc.off, tc.n)
			if tc.wantError != nil {
				if !errors.Is(err, tc.wantError) {
					t.Fatalf("GetRange(%d, %d) error %v, want %v", tc.off, tc.n, err, tc.wantError)
				}
				return
			}
			if err != nil {
				t.Fatalf("GetRange(%d, %d): %v", tc.off, tc.n, err)
			}
			if !bytes.Equal(got, tc.want) {
				t.Fatalf("GetRange(%d, %d) = %d bytes, want %d", tc.off, tc.n, len(got), len(tc.want))
			}
		})
	}
	put(t, st, "range-empty", nil)
	if got, err := getRange(t, st, "range-empty", 0, -1); err != nil || len(got) != 0 {
		t.Fatalf("GetRange of empty object = %d bytes, %v", len(got), err)
	}
}

func testStat(t *testing.T, st blob.Store) {
	for _, n := range []int{0, 1, 12345} {
		key := fmt.Sprintf("stat/%d", n)
		put(t, st, key, randBytes(t, n))
		size, err := st.Stat(t.Context(), key)
		if err != nil {
			t.Fatalf("Stat %s: %v", key, err)
		}
		if size != int64(n) {
			t.Fatalf("Stat %s = %d, want %d", key, size, n)
		}
	}
}

func testDelete(t *testing.T, st blob.Store) {
	put(t, st, "del/a", []byte("a"))
	put(t, st, "del/b", []byte("b"))
	if err := st.Delete(t.Context(), "del/a"); err != nil {
		t.Fatalf("Delete: %v", err)
	}
	if _, err := st.Stat(t.Context(), "del/a"); !errors.Is(err, errdefs.ErrNotFound) {
		t.Fatalf("Stat after Delete: %v, want not found", err)
	}
	if got := keys(t, st, "del/"); !slices.Equal(got, []string{"del/b"}) {
		t.Fatalf("List after Delete = %q", got)
	}
	for _, key := range []string{"del/a", "del/never", "never/at/all"} {
		if err := st.Delete(t.Context(), key); err != nil {
			t.Fatalf("Delete missing %s: %v", key, err)
		}
	}
}

func testList(t *testing.T, st blob.Store) {
	// Put in an order that is neither lexical nor reversed; "a/b" and
	// "a.c" catch a store that lists in directory-walk order.
	all := []string{"b", "a/b", "ab/x", "a.c", "a/a", "c/d/e", "a-"}
	for i, k := range all {
		put(t, st, k, bytes.Repeat([]byte{'x'}, i))
	}
	sizes := map[string]int64{}
	var got []string
	err := st.List(t.Context(), "", func(key string, size int64) error {
		got = append(got, key)
		sizes[key] = size
		return nil
	})
	if err != nil {
		t.Fatalf("List: %v", err)
	}
	want := slices.Clone(all)
	slices.Sort(want)
	if !slices.Equal(got, want) {
		t.Fatalf("List = %q, want %q", got, want)
	}
	for i, k := range all {
		if sizes[k] != int64(i) {
			t.Fatalf("List size of %s = %d, want %d", k, sizes[k], i)
		}
	}
	for _, tc := range []struct {
		prefix string
		want   []string
	}{
		{"a/", []string{"a/a", "a/b"}},
		{"a", []string{"a-", "a.c", "a/a", "a/b", "ab/x"}},
		{"c/d", []string{"c/d/e"}},
		{"c/d/e", []string{"c/d/e"}},
		{"zzz", nil},
		{"nothing/here/", nil},
	} {
		if got := keys(t, st, tc.prefix); !slices.Equal(got, tc.want) {
			t.Errorf("List(%q) = %q, want %q", tc.prefix, got, tc.want)
		}
	}
	stop := errors.New("stop")
	n := 0
	err = st.List(t.Context(), "", func(string, int64) error { n++; return stop })
	if !errors.Is(err, stop) || n != 1 {
		t.Fatalf("List with a failing callback: %v after %d calls, want stop after 1", err, n)
	}
}

func testNotFound(t *testing.T, st blob.Store) {
	ctx := t.Context()
	put(t, st, "nf/present", []byte("x"))
	if _, err := st.Get(ctx, "nf/missing"); !errors.Is(err, errdefs.ErrNotFound) {
		t.Errorf("Get missing: %v, want not found", err)
	}
	if _, err := st.GetRange(ctx, "nf/missing", 1, 2); !errors.Is(err, errdefs.ErrNotFound) {
		t.Errorf("GetRange missing: %v, want not found", err)
	}
	if _, err := st.Stat(ctx, "nf/missing"); !errors.Is(err, errdefs.ErrNotFound) {
		t.Errorf("Stat missing: %v, want not found", err)
	}
	// A key below an existing object does not exist either.
	if _, err := st.Stat(ctx, "nf/present/below"); !errors.Is(err, errdefs.ErrNotFound) {
		t.Errorf("Stat below an object: %v, want not found", err)
	}
	// A "directory" of keys is not an object.
	if _, err := st.Get(ctx, "nf"); !errors.Is(err, errdefs.ErrNotFound) {
		t.Errorf("Get of a key prefix: %v, want not found", err)
	}
}

// failingReader returns n bytes, then err.
type failingReader struct {
	n   int
	err error
}

func (f *failingReader) Read(p []byte) (int, error) {
	if f.n == 0 {
		return 0, f.err
	}
	k := min(len(p), f.n)
	for i := range p[:k] {
		p[i] = 'z'
	}
	f.n -= k
	return k, nil
}

func testFailedPut(t *testing.T, st blob.Store) {
	ctx := t.Context()
	boom := errors.New("disk on fire")
	if err := st.Put(ctx, "fail/midway", &failingReader{n: 1 << 20, err: boom}, 2<<20); err == nil {
		t.Fatal("Put from a failing reader succeeded")
	}
	if err := st.Put(ctx, "fail/short", &failingReader{n: 1000, err: io.EOF}, 2000); err == nil {
		t.Fatal("Put from a reader shorter than size succeeded")
	}
	for _, key := range []string{"fail/midway", "fail/short"} {
		if _, err := st.Stat(ctx, key); !errors.Is(err, errdefs.ErrNotFound) {
			t.Errorf("Stat %s after failed Put: %v, want not found", key, err)
		}
	}
	if got := keys(t, st, ""); len(got) != 0 {
		t.Errorf("List after failed Puts = %q, want nothing", got)
	}
	// A failed overwrite keeps the old object.
	put(t, st, "fail/keep", []byte("old"))
	if err := st.Put(ctx, "fail/keep", &failingReader{n: 10, err: boom}, 100); err == nil {
		t.Fatal("overwrite from a failing reader succeeded")
	}
	if got := string(get(t, st, "fail/keep")); got != "old" {
		t.Errorf("after failed overwrite got %q, want %q", got, "old")
	}
}

func testConcurrentPuts(t *testing.T, st blob.Store) {
	const writers, size = 8, 256 << 10
	var wg sync.WaitGroup
	errs := make([]error, writers)
	for i := range writers {
		wg.Go(func() {
			data := bytes.Repeat([]byte{byte('a' + i)}, size)
			errs[i] = st.Put(t.Context(), "race/key", bytes.NewReader(data), size)
		})
	}
	wg.Wait()
	for i, err := range errs {
		if err != nil {
			t.Fatalf("writer %d: %v", i, err)
		}
	}
	got := get(t, st, "race/key")
	if len(got) != size {
		t.Fatalf("after concurrent Puts got %d bytes, want %d", len(got), size)
	}
	if !bytes.Equal(got, bytes.Repeat(got[:1], size)) {
		t.Fatal("after concurrent Puts the object mixes writers' bytes")
	}
	if got := keys(t, st, ""); !slices.Equal(got, []string{"race/key"}) {
		t.Fatalf("List after concurrent Puts = %q", got)
	}
}

func testCancelled(t *testing.T, st blob.Store) {
	put(t, st, "cancel/x", randBytes(t, 1<<20))
	ctx, cancel := context.WithCancel(t.Context())
	cancel()
	check := func(op string, err error, start time.Time) {
		t.Helper()
		if err == nil {
			t.Errorf("%s with a cancelled context succeeded", op)
		} else if !errors.Is(err, context.Canceled) {
			t.Errorf("%s with a cancelled context: %v, want context.Canceled", op, err)
		}
		if d := time.Since(start); d > promptly {
			t.Errorf("%s with a cancelled context took %v", op, d)
		}
	}
	start := time.Now()
	check("Put", st.Put(ctx, "cancel/y", bytes.NewReader([]byte("y")), 1), start)
	start = time.Now()
	_, err := st.Get(ctx, "cancel/x")
	check("Get", err, start)
	start = time.Now()
	_, err = st.Stat(ctx, "cancel/x")
	check("Stat", err, start)
	start = time.Now()
	check("List", st.List(ctx, "", func(string, int64) error { return nil }), start)
	if _, err := st.Stat(t.Context(), "cancel/y"); !errors.Is(err, errdefs.ErrNotFound) {
		t.Errorf("Stat after cancelled Put: %v, want not found", err)
	}

	// Cancelling while a body is being read stops the read.
	ctx, cancel = context.WithCancel(t.Context())
	defer cancel()
	rc, err := st.Get(ctx, "cancel/x")
	if err != nil {
		t.Fatalf("Get: %v", err)
	}
	defer rc.Close()
	if _, err := io.ReadFull(rc, make([]byte, 10)); err != nil {
		t.Fatalf("read: %v", err)
	}
	cancel()
	start = time.Now()
	_, err = io.Copy(io.Discard, rc)
	check("reading a body", err, start)
}

func testInvalidKeys(t *testing.T, st blob.Store) {
	ctx := t.Context()
	for _, key := range []string{"", "/abs", "trailing/", "a//b", "..", "../up", "a/../b", "a/..", ".", "./a", "a/./b", "nul\x00byte"} {
		if err := st.Put(ctx, key, bytes.NewReader([]byte("x")), 1); !errors.Is(err, errdefs.ErrInvalidArgument) {
			t.Errorf("Put %q: %v, want invalid argument", key, err)
		}
		if _, err := st.Get(ctx, key); !errors.Is(err, errdefs.ErrInvalidArgument) {
			t.Errorf("Get %q: %v, want invalid argument", key, err)
		}
		if _, err := st.GetRange(ctx, key, 0, 1); !errors.Is(err, errdefs.ErrInvalidArgument) {
			t.Errorf("GetRange %q: %v, want invalid argument", key, err)
		}
		if _, err := st.Stat(ctx, key); !errors.Is(err, errdefs.ErrInvalidArgument) {
			t.Errorf("Stat %q: %v, want invalid argument", key, err)
		}
		if err := st.Delete(ctx, key); !errors.Is(err, errdefs.ErrInvalidArgument) {
			t.Errorf("Delete %q: %v, want invalid argument", key, err)
		}
	}
	if got := keys(t, st, ""); len(got) != 0 {
		t.Errorf("List after invalid Puts = %q, want nothing", got)
	}
}

func writeFile(t *testing.T, data []byte) string {
	t.Helper()
	p := filepath.Join(t.TempDir(), "layer")
	if err := os.WriteFile(p, data, 0o644); err != nil {
		t.Fatal(err)
	}
	return p
}

func countKeys(t *testing.T, st blob.Store, prefix string) int {
	t.Helper()
	return len(keys(t, st, prefix))
}

// compressions are the chunk encodings every layer test runs with.
var compressions = []struct{ name, c string }{
	{"raw", blob.CompressionNone},
	{"zstd", blob.CompressionZstd},
}

func putLayer(t *testing.T, st blob.Store, data []byte, cs int64, compression string) (*blob.Index, blob.PutStats) {
	t.Helper()
	ix, stats, err := blob.PutLayerWith(t.Context(), st, writeFile(t, data), blob.PutOptions{ChunkSize: cs, Compression: compression})
	if err != nil {
		t.Fatalf("PutLayerWith: %v", err)
	}
	if ix.Compression != compression {
		t.Fatalf("index compression %q, want %q", ix.Compression, compression)
	}
	return ix, stats
}

// compressible returns n bytes of text-like data that zstd shrinks a few
// times but that has no long repeats.
func compressible(t *testing.T, n int) []byte {
	t.Helper()
	words := []string{"alpha ", "beta ", "gamma ", "delta ", "epsilon\n", "zeta ", "eta ", "theta ", "iota ", "kappa\n"}
	r := randBytes(t, n)
	var b bytes.Buffer
	for i := 0; b.Len() < n; i++ {
		b.WriteString(words[int(r[i%n])%len(words)])
		if i%n == n-1 {
			r = randBytes(t, n)
		}
	}
	return b.Bytes()[:n]
}

func testPutLayerDedup(t *testing.T, st blob.Store) {
	for _, comp := range compressions {
		t.Run(comp.name, func(t *testing.T) {
			// Both encodings share the store: each has its own key prefix.
			testPutLayerDedupWith(t, st, comp.c)
		})
	}
}

func testPutLayerDedupWith(t *testing.T, st blob.Store, compression string) {
	const cs = 64 << 10
	x, y, z, w := randBytes(t, cs), randBytes(t, cs), randBytes(t, cs/2), randBytes(t, cs)
	// Layer A: x y x z (x repeats inside the layer); layer B: x y w w.
	a := slices.Concat(x, y, x, z)
	b := slices.Concat(x, y, w, w)
	prefix := strings.TrimSuffix(blob.ChunkKeyFor(compression, "x"), "x")
	ixA, statsA := putLayer(t, st, a, cs, compression)
	if want := (blob.PutStats{Chunks: 4, Uploaded: 3, Skipped: 1, BytesUploaded: 2*cs + cs/2}); statsA.Chunks != want.Chunks ||
		statsA.Uploaded != want.Uploaded || statsA.Skipped != want.Skipped || statsA.BytesUploaded != want.BytesUploaded {
		t.Errorf("PutLayer A stats = %+v, want %+v", statsA, want)
	}
	if stored := sumSizes(t, st, prefix); statsA.StoredBytes != stored {
		t.Errorf("PutLayer A stored %d bytes, store holds %d under %s", statsA.StoredBytes, stored, prefix)
	}
	if compression == blob.CompressionNone && statsA.StoredBytes != statsA.BytesUploaded {
		t.Errorf("raw PutLayer stored %d bytes for %d plain", statsA.StoredBytes, statsA.BytesUploaded)
	}
	if ixA.Size != int64(len(a)) || len(ixA.Chunks) != 4 || ixA.ChunkLen(3) != cs/2 {
		t.Errorf("index A = size %d, %d chunks, last %d bytes", ixA.Size, len(ixA.Chunks), ixA.ChunkLen(3))
	}
	_, statsB := putLayer(t, st, b, cs, compression)
	if statsB.Chunks != 4 || statsB.Uploaded != 1 || statsB.Skipped != 3 || statsB.BytesUploaded != cs {
		t.Errorf("PutLayer B stats = %+v, want 4 chunks, 1 uploaded (%d bytes), 3 skipped", statsB, cs)
	}
	// x, y, z, w: each stored once.
	if n := countKeys(t, st, prefix); n != 4 {
		t.Errorf("store holds %d chunks under %s, want 4", n, prefix)
	}
	// Putting A again uploads nothing.
	_, again := putLayer(t, st, a, cs, compression)
	if again.Uploaded != 0 || again.Skipped != 4 || again.StoredBytes != 0 {
		t.Errorf("PutLayer A again stats = %+v, want all skipped", again)
	}
}

func sumSizes(t *testing.T, st blob.Store, prefix string) int64 {
	t.Helper()
	var n int64
	if err := st.List(t.Context(), prefix, func(_ string, size int64) error {
		n += size
		return nil
	}); err != nil {
		t.Fatal(err)
	}
	return n
}

func testLayerRoundTrip(t *testing.T, st blob.Store) {
	for _, comp := range compressions {
		for _, tc := range []struct {
			name string
			size int
			cs   int64
			text bool
		}{
			{"empty", 0, 4096, false},
			{"one partial chunk", 100, 4096, false},
			{"exact chunks", 3 * 4096, 4096, false},
			{"compressible", 3*4096 + 5, 4096, true},
			{"default chunk size", blob.DefaultChunkSize + 17, 0, false},
		} {
			t.Run(comp.name+"/"+tc.name, func(t *testing.T) {
				data := randBytes(t, tc.size)
				if tc.text {
					data = compressible(t, tc.size)
				}
				ix, stats := putLayer(t, st, data, tc.cs, comp.c)
				hex := ix.Digest[len("sha256:"):]
				got, err := blob.GetIndex(t.Context(), st, hex)
				if err != nil {
					t.Fatalf("GetIndex: %v", err)
				}
				if got.Digest != ix.Digest || got.Size != int64(tc.size) || !slices.Equal(got.Chunks, ix.Chunks) || got.Compression != comp.c {
					t.Fatalf("GetIndex = %+v, want %+v", got, ix)
				}
				if tc.text && comp.c == blob.CompressionZstd {
					// Every full chunk's object is smaller than the chunk.
					for i := range got.Chunks[:len(got.Chunks)-1] {
						size, err := st.Stat(t.Context(), got.ChunkKey(i))
						if err != nil {
							t.Fatal(err)
						}
						if size >= got.ChunkLen(i) {
							t.Errorf("chunk %d stored in %d bytes, plain %d", i, size, got.ChunkLen(i))
						}
					}
					if stats.StoredBytes*2 > stats.BytesUploaded {
						t.Errorf("compressible layer stored %d bytes for %d plain, want under half", stats.StoredBytes, stats.BytesUploaded)
					}
				}
				var buf bytes.Buffer
				if err := blob.GetLayer(t.Context(), st, got, &buf); err != nil {
					t.Fatalf("GetLayer: %v", err)
				}
				if !bytes.Equal(buf.Bytes(), data) {
					t.Fatalf("GetLayer returned %d bytes differing from the %d put", buf.Len(), len(data))
				}
				for i := range got.Chunks {
					c, err := blob.FetchChunk(t.Context(), st, got, i)
					if err != nil {
						t.Fatalf("FetchChunk %d: %v", i, err)
					}
					off := int64(i) * got.ChunkSize
					if !bytes.Equal(c, data[off:off+got.ChunkLen(i)]) {
						t.Fatalf("FetchChunk %d differs from the file", i)
					}
				}
				if _, err := blob.FetchChunk(t.Context(), st, got, len(got.Chunks)); !errors.Is(err, errdefs.ErrInvalidArgument) {
					t.Fatalf("FetchChunk past the end: %v, want invalid argument", err)
				}
			})
		}
	}
}

func testCorruptChunk(t *testing.T, st blob.Store) {
	for _, comp := range compressions {
		t.Run(comp.name, func(t *testing.T) {
			testCorruptChunkWith(t, st, comp.c)
		})
	}
	t.Run("zstd frames", func(t *testing.T) { testCorruptZstd(t, st) })
	t.Run("encodings apart", func(t *testing.T) { testEncodingsApart(t, st) })
}

func encode(t *testing.T, compression string, data []byte) []byte {
	t.Helper()
	b, err := blob.EncodeChunk(compression, data)
	if err != nil {
		t.Fatal(err)
	}
	return b
}

func testCorruptChunkWith(t *testing.T, st blob.Store, compression string) {
	const cs = 4096
	data := randBytes(t, 3*cs)
	ix, _ := putLayer(t, st, data, cs, compression)
	// Same length, other bytes.
	put(t, st, ix.ChunkKey(1), encode(t, compression, randBytes(t, cs)))
	if _, err := blob.FetchChunk(t.Context(), st, ix, 1); !errors.Is(err, blob.ErrCorrupt) {
		t.Fatalf("FetchChunk of a changed chunk: %v, want ErrCorrupt", err)
	}
	if err := blob.GetLayer(t.Context(), st, ix, io.Discard); !errors.Is(err, blob.ErrCorrupt) {
		t.Fatalf("GetLayer with a changed chunk: %v, want ErrCorrupt", err)
	}
	// Truncated, and too long.
	for _, bad := range [][]byte{data[2*cs : 2*cs+10], append(slices.Clone(data[2*cs:]), 'x')} {
		put(t, st, ix.ChunkKey(2), encode(t, compression, bad))
		if _, err := blob.FetchChunk(t.Context(), st, ix, 2); !errors.Is(err, blob.ErrCorrupt) {
			t.Fatalf("FetchChunk of a %d-byte chunk: %v, want ErrCorrupt", len(bad), err)
		}
	}
	// Missing.
	if err := st.Delete(t.Context(), ix.ChunkKey(0)); err != nil {
		t.Fatal(err)
	}
	if _, err := blob.FetchChunk(t.Context(), st, ix, 0); !errors.Is(err, errdefs.ErrNotFound) {
		t.Fatalf("FetchChunk of a missing chunk: %v, want not found", err)
	}
}

// testCorruptZstd stores damaged zstd objects for a chunk: each must be
// refused with ErrCorrupt.
func testCorruptZstd(t *testing.T, st blob.Store) {
	const cs = 4096
	data := compressible(t, 2*cs)
	ix, _ := putLayer(t, st, data, cs, blob.CompressionZstd)
	good := encode(t, blob.CompressionZstd, data[:cs])
	flipped := slices.Clone(good)
	flipped[len(flipped)/2] ^= 0xff
	for _, tc := range []struct {
		name string
		obj  []byte
	}{
		{"garbage", randBytes(t, 100)},
		{"empty", []byte{}},
		{"raw chunk", data[:cs]},
		{"truncated frame", good[:len(good)-5]},
		{"flipped byte", flipped},
		{"frame of other bytes", encode(t, blob.CompressionZstd, compressible(t, cs))},
		{"frame of a prefix", encode(t, blob.CompressionZstd, data[:cs-1])},
		{"frame of more bytes", encode(t, blob.CompressionZstd, data[:cs+1])},
		{"two frames", slices.Concat(good, good)},
		{"bomb", encode(t, blob.CompressionZstd, make([]byte, 64<<20))},
		{"too long", slices.Concat(good, make([]byte, 2*cs))},
	} {
		t.Run(tc.name, func(t *testing.T) {
			put(t, st, ix.ChunkKey(0), tc.obj)
			if _, err := blob.FetchChunk(t.Context(), st, ix, 0); !errors.Is(err, blob.ErrCorrupt) {
				t.Fatalf("FetchChunk: %v, want ErrCorrupt", err)
			}
		})
	}
	put(t, st, ix.ChunkKey(0), good)
	if got, err := blob.FetchChunk(t.Context(), st, ix, 0); err != nil || !bytes.Equal(got, data[:cs]) {
		t.Fatalf("FetchChunk of the repaired chunk: %v", err)
	}
}

// testEncodingsApart checks that a raw and a zstd index of the same file
// read their own objects: damaging one encoding's object does not affect
// readers of the other.
func testEncodingsApart(t *testing.T, st blob.Store) {
	const cs = 4096
	data := compressible(t, 2*cs+1)
	raw, _ := putLayer(t, st, data, cs, blob.CompressionNone)
	z, _ := putLayer(t, st, data, cs, blob.CompressionZstd)
	if raw.ChunkKey(0) == z.ChunkKey(0) || !slices.Equal(raw.Chunks, z.Chunks) {
		t.Fatalf("raw key %s, zstd key %s; chunks equal %v", raw.ChunkKey(0), z.ChunkKey(0), slices.Equal(raw.Chunks, z.Chunks))
	}
	put(t, st, raw.ChunkKey(0), []byte("damaged"))
	var buf bytes.Buffer
	if err := blob.GetLayer(t.Context(), st, z, &buf); err != nil || !bytes.Equal(buf.Bytes(), data) {
		t.Fatalf("GetLayer zstd after damaging the raw object: %v", err)
	}
	if _, err := blob.FetchChunk(t.Context(), st, raw, 0); !errors.Is(err, blob.ErrCorrupt) {
		t.Fatalf("FetchChunk raw: %v, want ErrCorrupt", err)
	}
}

func testCorruptIndex(t *testing.T, st blob.Store) {
	const h = "aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa"
	if _, err := blob.GetIndex(t.Context(), st, h); !errors.Is(err, errdefs.ErrNotFound) {
		t.Fatalf("GetIndex missing: %v, want not found", err)
	}
	if _, err := blob.GetIndex(t.Context(), st, "../../etc"); !errors.Is(err, errdefs.ErrInvalidArgument) {
		t.Fatalf("GetIndex of a bad digest: %v, want invalid argument", err)
	}
	for _, tc := range []struct{ name, body string }{
		{"not JSON", `{"digest": "sha256:` + h},
		{"other digest", `{"digest":"sha256:` + h[:63] + `b","size":0,"chunk_size":4096,"chunks":[]}`},
		{"chunk count", `{"digest":"sha256:` + h + `","size":5000,"chunk_size":4096,"chunks":["` + h + `"]}`},
		{"bad chunk digest", `{"digest":"sha256:` + h + `","size":10,"chunk_size":4096,"chunks":["xyz"]}`},
		{"unknown compression", `{"digest":"sha256:` + h + `","size":10,"chunk_size":4096,"chunks":["` + h + `"],"compression":"lz4"}`},
	} {
		t.Run(tc.name, func(t *testing.T) {
			put(t, st, blob.IndexKey(h), []byte(tc.body))
			if _, err := blob.GetIndex(t.Context(), st, h); !errors.Is(err, blob.ErrCorrupt) {
				t.Fatalf("GetIndex: %v, want ErrCorrupt", err)
			}
		})
	}
}

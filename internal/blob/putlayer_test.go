package blob

import (
	"bytes"
	"context"
	"crypto/rand"
	"errors"
	"io"
	"os"
	"path/filepath"
	"sync/atomic"
	"testing"
)

// failingPuts fails every Put of a chunk after the first few.
type failingPuts struct {
	Store
	left atomic.Int32
}

var errInjected = errors.New("injected put failure")

func (f *failingPuts) Put(ctx context.Context, key string, r io.Reader, size int64) error {
	if bytes.HasPrefix([]byte(key), []byte("chunks/")) && f.left.Add(-1) < 0 {
		return errInjected
	}
	return f.Store.Put(ctx, key, r, size)
}

// TestPutLayerParallelFailure: a chunk that fails to upload fails the
// whole put, and no index names the layer.
func TestPutLayerParallelFailure(t *testing.T) {
	ctx := t.Context()
	dir, err := NewDir(t.TempDir())
	if err != nil {
		t.Fatal(err)
	}
	data := make([]byte, 40<<10+123)
	rand.Read(data)
	path := filepath.Join(t.TempDir(), "layer")
	if err := os.WriteFile(path, data, 0o600); err != nil {
		t.Fatal(err)
	}
	st := &failingPuts{Store: dir}
	st.left.Store(3)
	_, _, err = PutLayerWith(ctx, st, path, PutOptions{ChunkSize: 1 << 10, Compression: CompressionZstd, Parallel: 4})
	if !errors.Is(err, errInjected) {
		t.Fatalf("PutLayerWith = %v, want the injected failure", err)
	}
	n := 0
	if err := dir.List(ctx, "layers/", func(string, int64) error { n++; return nil }); err != nil {
		t.Fatal(err)
	}
	if n != 0 {
		t.Errorf("%d indexes written after a failed put", n)
	}

	// The same file put again, parallel, makes the index a sequential
	// put makes.
	ix, stats, err := PutLayerWith(ctx, dir, path, PutOptions{ChunkSize: 1 << 10, Compression: CompressionZstd, Parallel: 4})
	if err != nil {
		t.Fatal(err)
	}
	one, _, err := PutLayerWith(ctx, dir, path, PutOptions{ChunkSize: 1 << 10, Compression: CompressionZstd, Parallel: 1})
	if err != nil {
		t.Fatal(err)
	}
	if ix.Digest != one.Digest || len(ix.Chunks) != len(one.Chunks) || stats.Chunks != 41 {
		t.Fatalf("parallel index %s with %d chunks (stats %+v), sequential %s with %d", ix.Digest, len(ix.Chunks), stats, one.Digest, len(one.Chunks))
	}
	for i := range ix.Chunks {
		if ix.Chunks[i] != one.Chunks[i] {
			t.Fatalf("chunk %d: %s parallel, %s sequential", i, ix.Chunks[i], one.Chunks[i])
		}
	}
	var got bytes.Buffer
	if err := GetLayer(ctx, dir, ix, &got); err != nil || !bytes.Equal(got.Bytes(), data) {
		t.Fatalf("GetLayer: %v (%d bytes back of %d)", err, got.Len(), len(data))
	}
}

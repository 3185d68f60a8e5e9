package lazy

import (
	"bytes"
	"context"
	"os"
	"path/filepath"
	"testing"

	"dsec.dev/dsec/internal/blob"
)

// TestDirStoreImportFlow runs the importer's path against the real local
// directory store: chunk an EROFS image into the store, find its metadata
// chunks, then serve it to a fresh node that pins them.
func TestDirStoreImportFlow(t *testing.T) {
	ctx := context.Background()
	img, big := buildErofs(t)
	path := filepath.Join(t.TempDir(), "layer.erofs")
	if err := os.WriteFile(path, img, 0o644); err != nil {
		t.Fatal(err)
	}
	st, err := blob.NewDir(t.TempDir())
	if err != nil {
		t.Fatal(err)
	}
	ix, _, err := blob.PutLayer(ctx, st, path, testChunk)
	if err != nil {
		t.Fatal(err)
	}
	hex := ix.Digest[7:]

	importer := mountFS(t, Config{Store: st})
	if _, err := importer.Add(ctx, ix); err != nil {
		t.Fatal(err)
	}
	meta, err := MetaChunks(ctx, importer, hex, t.TempDir())
	if err != nil {
		t.Fatal(err)
	}
	closeFS(t, importer)
	ix.Meta = meta

	node := mountFS(t, Config{Store: st})
	p, err := node.Add(ctx, ix)
	if err != nil {
		t.Fatal(err)
	}
	if s := node.Stats(hex); s.ChunksFetched != 0 {
		t.Errorf("Add fetched %d chunks, want none before the first read", s.ChunksFetched)
	}
	dir := mountErofs(t, p)
	got, err := os.ReadFile(filepath.Join(dir, "usr/lib/big.bin"))
	if err != nil || !bytes.Equal(got, big) {
		t.Fatalf("read big.bin from the directory store: %v", err)
	}
}

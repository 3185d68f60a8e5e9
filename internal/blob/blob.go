// Package blob holds dsec's content store: an interface over a flat key space
// of immutable objects, with a local-directory and an S3 implementation, and
// the chunked layout that layer files are stored in (fixed-size chunks
// addressed by their sha256, so identical chunks across layers are stored once,
// optionally zstd-compressed, plus one index object per layer listing its
// chunks).
package blob

import (
	"context"
	"fmt"
	"io"
	"regexp"
)

// Store is an object store of immutable blobs under slash-separated keys.
// Implementations are safe for concurrent use. Missing keys return errors
// wrapping errdefs.ErrNotFound; an unreachable store returns errors wrapping
// errdefs.ErrUnavailable.
type Store interface {
	// Put stores size bytes read from r under key, atomically: a reader
	// never sees a partial object. Putting an existing key replaces it.
	Put(ctx context.Context, key string, r io.Reader, size int64) error
	// Get opens the whole object.
	Get(ctx context.Context, key string) (io.ReadCloser, error)
	// GetRange opens length bytes from offset (length < 0: to the end).
	GetRange(ctx context.Context, key string, offset, length int64) (io.ReadCloser, error)
	// Stat returns the object's size.
	Stat(ctx context.Context, key string) (int64, error)
	// Delete removes the object; deleting a missing key is not an error.
	Delete(ctx context.Context, key string) error
	// List calls fn for every key starting with prefix, in lexical order.
	List(ctx context.Context, prefix string, fn func(key string, size int64) error) error
}

// DefaultChunkSize is the size of a layer file's chunks unless configured.
const DefaultChunkSize = 1 << 20

var hexDigest = regexp.MustCompile(`^[0-9a-f]{64}$`)

// ChunkKey is the key of the raw (uncompressed) chunk whose sha256 is hex;
// ChunkKeyFor gives the key for any compression.
func ChunkKey(hex string) string { return "chunks/sha256/" + hex }

// IndexKey is the key of the index of the layer file whose sha256 is hex.
func IndexKey(hex string) string { return "layers/sha256/" + hex + ".json" }

// Index lists the chunks of one layer file, in file order. Every chunk but
// the last is ChunkSize bytes long. Chunk digests, sizes and ChunkLen are of
// the plain (uncompressed) bytes whatever the Compression, so identical
// chunks dedupe across layers and are verified after decoding; Compression
// only says how each chunk object is encoded in the store and under which
// key (ChunkKeyFor).
type Index struct {
	Digest    string   `json:"digest"`     // "sha256:<hex>" of the whole file
	Size      int64    `json:"size"`       // bytes of the whole file
	ChunkSize int64    `json:"chunk_size"` // bytes per chunk
	Chunks    []string `json:"chunks"`     // sha256 hex of each chunk
	// Meta lists the chunk numbers holding the file system's metadata
	// (superblock, inodes, directories), which the edge keeps local.
	Meta []int `json:"meta,omitempty"`
	// Compression is how the chunk objects are encoded: CompressionNone
	// ("", plain bytes under ChunkKey, the only format before compression
	// existed) or CompressionZstd ("zstd", one zstd frame per chunk).
	Compression string `json:"compression,omitempty"`
}

// ChunkKey is the key of the object of chunk i.
func (ix *Index) ChunkKey(i int) string { return ChunkKeyFor(ix.Compression, ix.Chunks[i]) }

// ChunkLen is the length of chunk i.
func (ix *Index) ChunkLen(i int) int64 {
	if i == len(ix.Chunks)-1 {
		return ix.Size - int64(i)*ix.ChunkSize
	}
	return ix.ChunkSize
}

// Validate checks that the index is self-consistent.
func (ix *Index) Validate() error {
	if ix.ChunkSize <= 0 {
		return fmt.Errorf("layer index %s: chunk size %d", ix.Digest, ix.ChunkSize)
	}
	want := (ix.Size + ix.ChunkSize - 1) / ix.ChunkSize
	if int64(len(ix.Chunks)) != want {
		return fmt.Errorf("layer index %s: %d chunks for %d bytes in chunks of %d, want %d",
			ix.Digest, len(ix.Chunks), ix.Size, ix.ChunkSize, want)
	}
	for i, c := range ix.Chunks {
		if !hexDigest.MatchString(c) {
			return fmt.Errorf("layer index %s: chunk %d digest %q is not sha256 hex", ix.Digest, i, c)
		}
	}
	if err := checkCompression(ix.Compression); err != nil {
		return fmt.Errorf("layer index %s: %w", ix.Digest, err)
	}
	for _, m := range ix.Meta {
		if m < 0 || m >= len(ix.Chunks) {
			return fmt.Errorf("layer index %s: metadata chunk %d out of range", ix.Digest, m)
		}
	}
	return nil
}

package blob

import (
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"strings"

	"dsec.dev/dsec/internal/errdefs"
)

// ErrCorrupt is wrapped by errors about stored data that does not match its
// digest or length.
var ErrCorrupt = errors.New("corrupt blob")

// maxIndexSize bounds an index object read from a store (a 1 TiB layer in
// 1 MiB chunks has an index of about 70 MiB).
const maxIndexSize = 256 << 20

// PutStats counts what PutLayer did.
type PutStats struct {
	Chunks        int   // chunks in the layer
	Uploaded      int   // chunks written to the store
	Skipped       int   // chunks already in the store
	BytesUploaded int64 // plain (uncompressed) bytes of the uploaded chunks
	StoredBytes   int64 // bytes written to the store for them (compressed)
}

// PutOptions are the choices of PutLayerWith.
type PutOptions struct {
	ChunkSize   int64  // bytes per chunk; <= 0: DefaultChunkSize
	Compression string // CompressionZstd or CompressionNone (raw chunks)
}

// PutLayer stores the layer file at path in st as zstd-compressed chunks of
// chunkSize bytes (DefaultChunkSize if <= 0); see PutLayerWith.
func PutLayer(ctx context.Context, st Store, path string, chunkSize int64) (*Index, PutStats, error) {
	return PutLayerWith(ctx, st, path, PutOptions{ChunkSize: chunkSize, Compression: CompressionZstd})
}

// PutLayerWith stores the layer file at path in st: it splits the file into
// chunks of opts.ChunkSize bytes, encodes them with opts.Compression, uploads
// the chunk objects the store does not hold yet, and writes the layer's
// index last, so a reader that finds an index finds all its chunks.
func PutLayerWith(ctx context.Context, st Store, path string, opts PutOptions) (*Index, PutStats, error) {
	var stats PutStats
	chunkSize := opts.ChunkSize
	if chunkSize <= 0 {
		chunkSize = DefaultChunkSize
	}
	if err := checkCompression(opts.Compression); err != nil {
		return nil, stats, fmt.Errorf("put layer %s: %w", path, err)
	}
	f, err := os.Open(path)
	if err != nil {
		return nil, stats, fmt.Errorf("put layer %s: %w", path, err)
	}
	defer f.Close()
	fi, err := f.Stat()
	if err != nil {
		return nil, stats, fmt.Errorf("put layer %s: %w", path, err)
	}
	ix := &Index{Size: fi.Size(), ChunkSize: chunkSize, Chunks: []string{}, Compression: opts.Compression}
	whole := sha256.New()
	buf := make([]byte, chunkSize)
	for off := int64(0); off < ix.Size; off += chunkSize {
		n := min(chunkSize, ix.Size-off)
		if _, err := io.ReadFull(f, buf[:n]); err != nil {
			return nil, stats, fmt.Errorf("put layer %s: read at %d: %w", path, off, err)
		}
		chunk := buf[:n]
		whole.Write(chunk)
		sum := sha256.Sum256(chunk)
		h := hex.EncodeToString(sum[:])
		ix.Chunks = append(ix.Chunks, h)
		stats.Chunks++

		stored, err := EncodeChunk(ix.Compression, chunk)
		if err != nil {
			return nil, stats, fmt.Errorf("put layer %s: %w", path, err)
		}
		key := ChunkKeyFor(ix.Compression, h)
		size, err := st.Stat(ctx, key)
		switch {
		case err == nil && size == int64(len(stored)):
			stats.Skipped++
			continue
		case err == nil:
			// A chunk object of another size is damage (or the work of
			// another encoder version); replace it.
		case !errors.Is(err, errdefs.ErrNotFound):
			return nil, stats, fmt.Errorf("put layer %s: %w", path, err)
		}
		if err := st.Put(ctx, key, bytes.NewReader(stored), int64(len(stored))); err != nil {
			return nil, stats, fmt.Errorf("put layer %s: %w", path, err)
		}
		stats.Uploaded++
		stats.BytesUploaded += n
		stats.StoredBytes += int64(len(stored))
	}
	ix.Digest = "sha256:" + hex.EncodeToString(whole.Sum(nil))
	if err := PutIndex(ctx, st, ix); err != nil {
		return nil, stats, fmt.Errorf("put layer %s: %w", path, err)
	}
	return ix, stats, nil
}

// PutIndex validates ix and writes it under IndexKey of its digest. Its
// chunks must already be in st.
func PutIndex(ctx context.Context, st Store, ix *Index) error {
	h, err := indexHex(ix)
	if err != nil {
		return err
	}
	if err := ix.Validate(); err != nil {
		return fmt.Errorf("put index: %w: %w", errdefs.ErrInvalidArgument, err)
	}
	if err := putJSON(ctx, st, IndexKey(h), ix); err != nil {
		return fmt.Errorf("put index %s: %w", ix.Digest, err)
	}
	return nil
}

// putJSON stores v as JSON under key.
func putJSON(ctx context.Context, st Store, key string, v any) error {
	data, err := json.Marshal(v)
	if err != nil {
		return err
	}
	return st.Put(ctx, key, bytes.NewReader(data), int64(len(data)))
}

func indexHex(ix *Index) (string, error) {
	h, ok := strings.CutPrefix(ix.Digest, "sha256:")
	if !ok || !hexDigest.MatchString(h) {
		return "", fmt.Errorf("check index: digest %q is not sha256:<hex>: %w", ix.Digest, errdefs.ErrInvalidArgument)
	}
	return h, nil
}

// GetIndex reads and validates the index of the layer whose sha256 is hex.
// A missing index wraps errdefs.ErrNotFound; a damaged one wraps ErrCorrupt.
func GetIndex(ctx context.Context, st Store, hex string) (*Index, error) {
	if !hexDigest.MatchString(hex) {
		return nil, fmt.Errorf("get layer index %q: not sha256 hex: %w", hex, errdefs.ErrInvalidArgument)
	}
	var ix Index
	if err := getJSON(ctx, st, IndexKey(hex), maxIndexSize, &ix); err != nil {
		return nil, fmt.Errorf("get layer index %s: %w", hex, err)
	}
	if ix.Digest != "sha256:"+hex {
		return nil, fmt.Errorf("get layer index %s: index names digest %q: %w", hex, ix.Digest, ErrCorrupt)
	}
	if err := ix.Validate(); err != nil {
		return nil, fmt.Errorf("get layer index %s: %w: %w", hex, ErrCorrupt, err)
	}
	return &ix, nil
}

// getJSON reads the object under key, at most limit bytes, and decodes it
// as JSON into v. A larger object or one that does not decode wraps
// ErrCorrupt.
func getJSON(ctx context.Context, st Store, key string, limit int64, v any) error {
	rc, err := st.Get(ctx, key)
	if err != nil {
		return err
	}
	defer rc.Close()
	data, err := io.ReadAll(io.LimitReader(rc, limit+1))
	if err != nil {
		return err
	}
	if int64(len(data)) > limit {
		return fmt.Errorf("larger than %d bytes: %w", limit, ErrCorrupt)
	}
	if err := json.Unmarshal(data, v); err != nil {
		return fmt.Errorf("decode JSON: %w: %w", ErrCorrupt, err)
	}
	return nil
}

// FetchChunk reads chunk i of the layer, decodes it and checks its length
// and sha256 (DecodeChunk); a mismatch wraps ErrCorrupt.
func FetchChunk(ctx context.Context, st Store, ix *Index, i int) ([]byte, error) {
	if i < 0 || i >= len(ix.Chunks) {
		return nil, fmt.Errorf("fetch chunk %d of %s: out of range [0,%d): %w", i, ix.Digest, len(ix.Chunks), errdefs.ErrInvalidArgument)
	}
	stored, err := ReadChunkObject(ctx, st, ix, i)
	if err != nil {
		return nil, fmt.Errorf("fetch chunk %d of %s: %w", i, ix.Digest, err)
	}
	data, err := DecodeChunk(ix, i, stored)
	if err != nil {
		return nil, fmt.Errorf("fetch chunk %d of %s: %w", i, ix.Digest, err)
	}
	return data, nil
}

// ReadChunkObject reads the stored (possibly compressed) object of chunk i
// of the layer, undecoded and unverified; pass it to DecodeChunk. An object
// longer than MaxStoredChunkLen wraps ErrCorrupt without being read whole.
func ReadChunkObject(ctx context.Context, st Store, ix *Index, i int) ([]byte, error) {
	if i < 0 || i >= len(ix.Chunks) {
		return nil, fmt.Errorf("read chunk %d of %s: out of range [0,%d): %w", i, ix.Digest, len(ix.Chunks), errdefs.ErrInvalidArgument)
	}
	limit := MaxStoredChunkLen(ix.Compression, ix.ChunkLen(i))
	rc, err := st.Get(ctx, ix.ChunkKey(i))
	if err != nil {
		return nil, fmt.Errorf("read chunk %s: %w", ix.Chunks[i], err)
	}
	defer rc.Close()
	// Read one byte more than allowed to notice an object that is too long.
	buf := bytes.NewBuffer(make([]byte, 0, ix.ChunkLen(i)+1))
	if _, err := io.Copy(buf, io.LimitReader(rc, limit+1)); err != nil {
		return nil, fmt.Errorf("read chunk %s: %w", ix.Chunks[i], err)
	}
	if int64(buf.Len()) > limit {
		return nil, fmt.Errorf("read chunk %s: more than %d stored bytes: %w", ix.Chunks[i], limit, ErrCorrupt)
	}
	return buf.Bytes(), nil
}

// GetLayer writes the whole layer file to w, checking every chunk and the
// whole file's digest.
func GetLayer(ctx context.Context, st Store, ix *Index, w io.Writer) error {
	if err := ix.Validate(); err != nil {
		return fmt.Errorf("get layer: %w: %w", errdefs.ErrInvalidArgument, err)
	}
	whole := sha256.New()
	for i := range ix.Chunks {
		data, err := FetchChunk(ctx, st, ix, i)
		if err != nil {
			return fmt.Errorf("get layer: %w", err)
		}
		whole.Write(data)
		if _, err := w.Write(data); err != nil {
			return fmt.Errorf("get layer %s: write: %w", ix.Digest, err)
		}
	}
	if got := "sha256:" + hex.EncodeToString(whole.Sum(nil)); got != ix.Digest {
		return fmt.Errorf("get layer %s: chunks add up to %s: %w", ix.Digest, got, ErrCorrupt)
	}
	return nil
}

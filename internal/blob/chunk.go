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
	"sync"

	"dsec.dev/dsec/internal/errdefs"
)

// ErrCorrupt is wrapped by errors about stored data that does not match its
// digest or length.
var ErrCorrupt = errors.New("corrupt blob")

// ErrBodyBroke is wrapped by ReadChunkObject's error when the store's Get
// answered but the object's bytes broke off (or timed out) while read, so
// that a caller can tell it from a Get the store refused.
var ErrBodyBroke = errors.New("the object's bytes broke off")

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
	// Parallel is how many chunks are hashed, encoded and uploaded at
	// once; <= 0: DefaultPutParallel.
	Parallel int
}

// DefaultPutParallel is how many chunks PutLayerWith has in flight unless
// told: enough to overlap a store's per-object latency (a directory
// store's fsyncs, an S3 round trip) and to use a second core for the
// hashing and encoding, with little memory (one chunk each).
const DefaultPutParallel = 4

// PutLayer stores the layer file at path in st as zstd-compressed chunks of
// chunkSize bytes (DefaultChunkSize if <= 0); see PutLayerWith.
func PutLayer(ctx context.Context, st Store, path string, chunkSize int64) (*Index, PutStats, error) {
	return PutLayerWith(ctx, st, path, PutOptions{ChunkSize: chunkSize, Compression: CompressionZstd})
}

// PutLayerWith stores the layer file at path in st: it splits the file into
// chunks of opts.ChunkSize bytes, encodes them with opts.Compression, uploads
// the chunk objects the store does not hold yet, and writes the layer's
// index last, so a reader that finds an index finds all its chunks. The
// file is read once, in order (for the whole file's digest); opts.Parallel
// chunks are hashed, encoded and uploaded at a time. On an error nothing
// more is uploaded and no index is written.
func PutLayerWith(ctx context.Context, st Store, path string, opts PutOptions) (*Index, PutStats, error) {
	chunkSize, parallel := opts.ChunkSize, opts.Parallel
	if chunkSize <= 0 {
		chunkSize = DefaultChunkSize
	}
	if parallel <= 0 {
		parallel = DefaultPutParallel
	}
	if err := checkCompression(opts.Compression); err != nil {
		return nil, PutStats{}, fmt.Errorf("put layer %s: %w", path, err)
	}
	f, err := os.Open(path)
	if err != nil {
		return nil, PutStats{}, fmt.Errorf("put layer %s: %w", path, err)
	}
	defer f.Close()
	fi, err := f.Stat()
	if err != nil {
		return nil, PutStats{}, fmt.Errorf("put layer %s: %w", path, err)
	}
	ix := &Index{Size: fi.Size(), ChunkSize: chunkSize, Compression: opts.Compression}
	n := int((ix.Size + chunkSize - 1) / chunkSize)
	ix.Chunks = make([]string, n)

	ctx, cancel := context.WithCancelCause(ctx)
	defer cancel(nil)
	type job struct {
		i   int
		buf []byte
	}
	jobs := make(chan job)
	free := make(chan []byte, parallel+1) // buffers back from the workers
	for range parallel + 1 {
		free <- make([]byte, chunkSize)
	}
	var (
		mu    sync.Mutex
		stats = PutStats{Chunks: n}
		// seen holds a channel per chunk digest met, closed once that
		// chunk is stored: a chunk the layer repeats is stored once.
		seen = map[string]chan struct{}{}
		wg   sync.WaitGroup
	)
	put := func(chunk []byte) (string, error) {
		sum := sha256.Sum256(chunk)
		h := hex.EncodeToString(sum[:])
		mu.Lock()
		done, dup := seen[h]
		if !dup {
			done = make(chan struct{})
			seen[h] = done
		}
		mu.Unlock()
		if dup {
			select {
			case <-done:
			case <-ctx.Done():
				return "", context.Cause(ctx)
			}
			mu.Lock()
			stats.Skipped++
			mu.Unlock()
			return h, nil
		}
		defer close(done)
		stored, err := putChunk(ctx, st, ix.Compression, h, chunk)
		if err != nil {
			return "", err
		}
		mu.Lock()
		if stored > 0 {
			stats.Uploaded++
			stats.BytesUploaded += int64(len(chunk))
			stats.StoredBytes += stored
		} else {
			stats.Skipped++
		}
		mu.Unlock()
		return h, nil
	}
	for range parallel {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for j := range jobs {
				if ctx.Err() == nil {
					if h, err := put(j.buf); err != nil {
						cancel(err)
					} else {
						ix.Chunks[j.i] = h // each worker its own i
					}
				}
				free <- j.buf[:cap(j.buf)]
			}
		}()
	}
	whole := sha256.New()
	var readErr error
	for i := 0; i < n && readErr == nil; i++ {
		var buf []byte
		select {
		case buf = <-free:
		case <-ctx.Done():
			readErr = context.Cause(ctx)
			continue
		}
		off := int64(i) * chunkSize
		buf = buf[:min(chunkSize, ix.Size-off)]
		if _, err := io.ReadFull(f, buf); err != nil {
			readErr = fmt.Errorf("read at %d: %w", off, err)
			continue
		}
		whole.Write(buf)
		select {
		case jobs <- job{i, buf}:
		case <-ctx.Done():
			readErr = context.Cause(ctx)
		}
	}
	close(jobs)
	wg.Wait()
	if readErr == nil {
		readErr = context.Cause(ctx) // a worker's error
	}
	if readErr != nil {
		return nil, stats, fmt.Errorf("put layer %s: %w", path, readErr)
	}
	ix.Digest = "sha256:" + hex.EncodeToString(whole.Sum(nil))
	if err := PutIndex(ctx, st, ix); err != nil {
		return nil, stats, fmt.Errorf("put layer %s: %w", path, err)
	}
	return ix, stats, nil
}

// putChunk stores the chunk whose sha256 is h, encoded with compression,
// unless the store has it, and returns the bytes it stored (0: skipped).
func putChunk(ctx context.Context, st Store, compression, h string, chunk []byte) (int64, error) {
	stored, err := EncodeChunk(compression, chunk)
	if err != nil {
		return 0, err
	}
	key := ChunkKeyFor(compression, h)
	size, err := st.Stat(ctx, key)
	switch {
	case err == nil && size == int64(len(stored)):
		return 0, nil
	case err == nil:
		// A chunk object of another size is damage (or the work of
		// another encoder version); replace it.
	case !errors.Is(err, errdefs.ErrNotFound):
		return 0, err
	}
	if err := st.Put(ctx, key, bytes.NewReader(stored), int64(len(stored))); err != nil {
		return 0, err
	}
	return int64(len(stored)), nil
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
		return nil, fmt.Errorf("read chunk %s: %w: %w", ix.Chunks[i], ErrBodyBroke, err)
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

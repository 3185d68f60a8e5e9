package blob

import (
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"sync"

	"github.com/klauspost/compress/zstd"

	"dsec.dev/dsec/internal/errdefs"
)

// Chunk encodings, the values of Index.Compression.
const (
	// CompressionNone stores each chunk object as the chunk's plain bytes,
	// under ChunkKey.
	CompressionNone = ""
	// CompressionZstd stores each chunk object as one zstd frame that
	// decodes to the chunk, under "chunks/sha256-zstd/<hex>".
	CompressionZstd = "zstd"
)

// ChunkKeyFor is the key of the chunk whose (uncompressed) sha256 is hex,
// stored with the given compression. Each compression has its own key
// prefix, so a reader never gets an object encoded other than it expects.
// An unknown compression yields a key no writer uses.
func ChunkKeyFor(compression, hex string) string {
	switch compression {
	case CompressionNone:
		return ChunkKey(hex)
	case CompressionZstd:
		return "chunks/sha256-zstd/" + hex
	default:
		return "chunks/sha256-unknown/" + hex
	}
}

// MaxStoredChunkLen bounds the size of a chunk object that encodes plain
// bytes with the given compression: a larger object is corrupt. Readers
// read at most one byte more than this.
func MaxStoredChunkLen(compression string, plain int64) int64 {
	if compression == CompressionNone {
		return plain
	}
	// A zstd frame of incompressible data is stored in raw blocks: a
	// frame header, 3 bytes per block of up to 128 KiB and a checksum.
	return plain + plain/1024 + 64
}

func checkCompression(compression string) error {
	switch compression {
	case CompressionNone, CompressionZstd:
		return nil
	}
	return fmt.Errorf("check compression %q: unknown: %w", compression, errdefs.ErrNotSupported)
}

// The zstd encoder and decoder are created once and shared: EncodeAll and
// DecodeAll are safe for concurrent use and reuse their internal state.
var (
	zstdEncoder = sync.OnceValues(func() (*zstd.Encoder, error) {
		return zstd.NewWriter(nil,
			zstd.WithEncoderLevel(zstd.SpeedFastest),
			zstd.WithEncoderCRC(false), // chunks are verified by sha256
			zstd.WithZeroFrames(true))
	})
	// WithDecodeAllCapLimit makes DecodeAll stop at the capacity of its
	// destination, which DecodeChunk sets to the expected chunk length.
	zstdDecoder = sync.OnceValues(func() (*zstd.Decoder, error) {
		return zstd.NewReader(nil,
			zstd.WithDecodeAllCapLimit(true),
			zstd.WithDecoderConcurrency(0))
	})
)

// EncodeChunk returns the object stored for chunk with the given
// compression. The result may alias chunk (CompressionNone).
func EncodeChunk(compression string, chunk []byte) ([]byte, error) {
	switch compression {
	case CompressionNone:
		return chunk, nil
	case CompressionZstd:
		enc, err := zstdEncoder()
		if err != nil {
			return nil, fmt.Errorf("encode chunk: %w", err)
		}
		return enc.EncodeAll(chunk, make([]byte, 0, len(chunk)/2+64)), nil
	}
	return nil, fmt.Errorf("encode chunk: %w", checkCompression(compression))
}

// DecodeChunk turns the stored object of chunk i of the layer back into the
// chunk's bytes and checks their length and sha256. An object that does not
// decode, decodes to more or fewer than ChunkLen(i) bytes (decoding stops at
// that length) or to other bytes wraps ErrCorrupt. The result may alias
// stored (CompressionNone).
func DecodeChunk(ix *Index, i int, stored []byte) ([]byte, error) {
	if i < 0 || i >= len(ix.Chunks) {
		return nil, fmt.Errorf("decode chunk %d of %s: out of range [0,%d): %w", i, ix.Digest, len(ix.Chunks), errdefs.ErrInvalidArgument)
	}
	h := ix.Chunks[i]
	data, err := DecodeObject(ix.Compression, stored, ix.ChunkLen(i))
	if err != nil {
		return nil, fmt.Errorf("decode chunk %s: %w", h, err)
	}
	if err := VerifyChunk(h, data); err != nil {
		return nil, fmt.Errorf("decode chunk %s: %w", h, err)
	}
	return data, nil
}

// DecodeObject decodes a chunk object stored with the given compression
// into the chunk's plain bytes, which must be plain bytes long: decoding
// stops there, and an object that does not decode or decodes to another
// length wraps ErrCorrupt. It does not check the digest (VerifyChunk does):
// it is for objects verified before, as a cache holds them. The result may
// alias stored (CompressionNone).
func DecodeObject(compression string, stored []byte, plain int64) ([]byte, error) {
	if int64(len(stored)) > MaxStoredChunkLen(compression, plain) {
		return nil, fmt.Errorf("decode chunk object: %d stored bytes for %d: %w", len(stored), plain, ErrCorrupt)
	}
	var data []byte
	switch compression {
	case CompressionNone:
		data = stored
	case CompressionZstd:
		dec, err := zstdDecoder()
		if err != nil {
			return nil, fmt.Errorf("decode chunk object: %w", err)
		}
		data, err = dec.DecodeAll(stored, make([]byte, 0, plain))
		if errors.Is(err, zstd.ErrDecoderSizeExceeded) {
			return nil, fmt.Errorf("decode chunk object: decodes to more than %d bytes: %w", plain, ErrCorrupt)
		}
		if err != nil {
			return nil, fmt.Errorf("decode chunk object: %w: %w", ErrCorrupt, err)
		}
	default:
		return nil, fmt.Errorf("decode chunk object: %w", checkCompression(compression))
	}
	if int64(len(data)) != plain {
		return nil, fmt.Errorf("decode chunk object: %d bytes, want %d: %w", len(data), plain, ErrCorrupt)
	}
	return data, nil
}

// VerifyChunk checks that data is the chunk whose sha256 hex is want; a
// mismatch wraps ErrCorrupt.
func VerifyChunk(want string, data []byte) error {
	sum := sha256.Sum256(data)
	if got := hex.EncodeToString(sum[:]); got != want {
		return fmt.Errorf("verify chunk %s: sha256 %s: %w", want, got, ErrCorrupt)
	}
	return nil
}

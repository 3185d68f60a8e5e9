package blob_test

import (
	"bytes"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"strings"
	"testing"

	"github.com/klauspost/compress/zstd"

	"dsec.dev/dsec/internal/blob"
	"dsec.dev/dsec/internal/errdefs"
)

// streamFrame encodes data as a streamed zstd frame, which carries no
// content size, so a decoder learns the output size only by decoding.
func streamFrame(t *testing.T, data []byte) []byte {
	t.Helper()
	var buf bytes.Buffer
	w, err := zstd.NewWriter(&buf, zstd.WithEncoderConcurrency(1))
	if err != nil {
		t.Fatal(err)
	}
	// Flushing before the end writes the frame header with the size unknown.
	if _, err := w.Write(data[:1]); err != nil {
		t.Fatal(err)
	}
	if err := w.Flush(); err != nil {
		t.Fatal(err)
	}
	if _, err := w.Write(data[1:]); err != nil {
		t.Fatal(err)
	}
	if err := w.Close(); err != nil {
		t.Fatal(err)
	}
	h := buf.Bytes()
	var hdr zstd.Header
	if err := hdr.Decode(h); err != nil || hdr.HasFCS {
		t.Fatalf("stream frame header: %+v, %v; want no content size", hdr, err)
	}
	return h
}

func chunkIndex(chunk []byte) *blob.Index {
	sum := sha256.Sum256(chunk)
	h := hex.EncodeToString(sum[:])
	return &blob.Index{Digest: "sha256:" + h, Size: int64(len(chunk)), ChunkSize: int64(len(chunk)),
		Chunks: []string{h}, Compression: blob.CompressionZstd}
}

func TestDecodeChunk(t *testing.T) {
	chunk := []byte(strings.Repeat("dsec chunk ", 3000))
	ix := chunkIndex(chunk)
	enc, err := blob.EncodeChunk(blob.CompressionZstd, chunk)
	if err != nil {
		t.Fatal(err)
	}
	if len(enc) >= len(chunk)/4 {
		t.Errorf("%d bytes of repeated text encoded to %d", len(chunk), len(enc))
	}
	for _, tc := range []struct {
		name    string
		stored  []byte
		corrupt bool
	}{
		{"frame", enc, false},
		{"stream frame", streamFrame(t, chunk), false},
		{"stream frame of more bytes", streamFrame(t, append(bytes.Clone(chunk), 'x')), true},
		{"stream bomb", streamFrame(t, make([]byte, 256<<20)), true},
		{"stream frame of fewer bytes", streamFrame(t, chunk[:len(chunk)-1]), true},
		{"garbage", []byte("not a zstd frame at all"), true},
		{"nothing", nil, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			got, err := blob.DecodeChunk(ix, 0, tc.stored)
			if tc.corrupt {
				if !errors.Is(err, blob.ErrCorrupt) {
					t.Fatalf("DecodeChunk: %v, want ErrCorrupt", err)
				}
				return
			}
			if err != nil || !bytes.Equal(got, chunk) {
				t.Fatalf("DecodeChunk: %d bytes, %v", len(got), err)
			}
		})
	}
}

func TestCompressionChoices(t *testing.T) {
	if blob.ChunkKeyFor(blob.CompressionNone, "ab") != blob.ChunkKey("ab") ||
		blob.ChunkKeyFor(blob.CompressionZstd, "ab") != "chunks/sha256-zstd/ab" {
		t.Fatalf("chunk keys: %s %s", blob.ChunkKeyFor(blob.CompressionNone, "ab"), blob.ChunkKeyFor(blob.CompressionZstd, "ab"))
	}
	if _, err := blob.EncodeChunk("lz4", []byte("x")); !errors.Is(err, errdefs.ErrNotSupported) {
		t.Errorf("EncodeChunk lz4: %v, want not supported", err)
	}
	ix := chunkIndex([]byte("x"))
	ix.Compression = "lz4"
	if err := ix.Validate(); err == nil {
		t.Error("Validate accepted compression lz4")
	}
	if _, _, err := blob.PutLayerWith(t.Context(), newDir(t), "unused", blob.PutOptions{Compression: "lz4"}); !errors.Is(err, errdefs.ErrNotSupported) {
		t.Errorf("PutLayerWith lz4: %v, want not supported", err)
	}
}

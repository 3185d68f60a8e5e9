package blob

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"slices"

	"dsec.dev/dsec/internal/errdefs"
)

// TraceVersion is the version of the trace objects this package writes; a
// trace of another version is refused as unusable.
const TraceVersion = 1

// maxTraceSize bounds a trace object read from a store. A trace lists each
// chunk of its layer at most once, at about 20 bytes per chunk: 16 MiB
// covers a layer of 800,000 chunks.
const maxTraceSize = 16 << 20

// TraceKey is the key of the published access trace of the layer file whose
// sha256 is hex.
func TraceKey(hex string) string { return "traces/sha256/" + hex + ".json" }

// Trace is a layer's access trace as published in the blob store: the
// chunks that sandboxes on any node read, each with its rank, the earliest
// position at which a node first read it (0 = the first chunk a node read).
// Nodes merge their own traces into it (MergeTrace), so it is the union of
// every node's reads, ordered by how early they are needed.
type Trace struct {
	Version   int          `json:"version"`
	Digest    string       `json:"digest"`     // "sha256:<hex>" of the layer file
	ChunkSize int64        `json:"chunk_size"` // of the index the chunk numbers refer to
	Chunks    []TraceChunk `json:"chunks"`     // by Rank, then Chunk; each chunk once
}

// TraceChunk is one chunk of a Trace.
type TraceChunk struct {
	Chunk int `json:"c"` // chunk number in the layer's index
	Rank  int `json:"r"` // earliest position at which a node first read it
}

// TraceFromOrder makes trace entries from one node's reads: order lists
// chunk numbers in the order first read, and a chunk's rank is its position.
// Repeated chunks keep their first position.
func TraceFromOrder(order []int) []TraceChunk {
	out := make([]TraceChunk, 0, len(order))
	for pos, c := range order {
		out = append(out, TraceChunk{Chunk: c, Rank: pos})
	}
	return MergeTrace(nil, out)
}

// MergeTrace returns the union of two traces' chunks, each chunk with the
// lower of its ranks, ordered by rank then chunk number. Merging is
// commutative, associative and idempotent, so nodes merging their traces in
// any order, any number of times, converge on the same object.
func MergeTrace(a, b []TraceChunk) []TraceChunk {
	best := make(map[int]int, len(a)+len(b))
	for _, tc := range slices.Concat(a, b) {
		if r, ok := best[tc.Chunk]; !ok || tc.Rank < r {
			best[tc.Chunk] = tc.Rank
		}
	}
	out := make([]TraceChunk, 0, len(best))
	for c, r := range best {
		out = append(out, TraceChunk{Chunk: c, Rank: r})
	}
	slices.SortFunc(out, func(x, y TraceChunk) int {
		return cmp.Or(cmp.Compare(x.Rank, y.Rank), cmp.Compare(x.Chunk, y.Chunk))
	})
	return out
}

// Check reports whether the trace is usable for the layer of ix: of this
// version, naming ix's digest and chunk size, every chunk in range and
// listed once, in MergeTrace's order. A stale trace (another chunking of the
// same file), a foreign one (another layer's) or a damaged one wraps
// ErrCorrupt.
func (t *Trace) Check(ix *Index) error {
	if t.Version != TraceVersion {
		return fmt.Errorf("check trace of %s: version %d, want %d: %w", ix.Digest, t.Version, TraceVersion, ErrCorrupt)
	}
	if t.Digest != ix.Digest {
		return fmt.Errorf("check trace of %s: it names layer %q: %w", ix.Digest, t.Digest, ErrCorrupt)
	}
	if t.ChunkSize != ix.ChunkSize {
		return fmt.Errorf("check trace of %s: chunk size %d, the index has %d: %w", ix.Digest, t.ChunkSize, ix.ChunkSize, ErrCorrupt)
	}
	seen := make(map[int]bool, len(t.Chunks))
	for i, tc := range t.Chunks {
		if tc.Chunk < 0 || tc.Chunk >= len(ix.Chunks) || tc.Rank < 0 {
			return fmt.Errorf("check trace of %s: entry %d (chunk %d, rank %d) out of range: %w", ix.Digest, i, tc.Chunk, tc.Rank, ErrCorrupt)
		}
		if seen[tc.Chunk] {
			return fmt.Errorf("check trace of %s: chunk %d listed twice: %w", ix.Digest, tc.Chunk, ErrCorrupt)
		}
		seen[tc.Chunk] = true
		if i > 0 {
			p := t.Chunks[i-1]
			if p.Rank > tc.Rank || p.Rank == tc.Rank && p.Chunk > tc.Chunk {
				return fmt.Errorf("check trace of %s: entry %d out of order: %w", ix.Digest, i, ErrCorrupt)
			}
		}
	}
	return nil
}

// GetTrace reads the published trace of the layer of ix and checks it
// (Trace.Check). No trace wraps errdefs.ErrNotFound; an unusable one wraps
// ErrCorrupt.
func GetTrace(ctx context.Context, st Store, ix *Index) (*Trace, error) {
	h, err := indexHex(ix)
	if err != nil {
		return nil, err
	}
	t, err := ReadTrace(ctx, st, TraceKey(h))
	if err != nil {
		return nil, fmt.Errorf("get trace of %s: %w", ix.Digest, err)
	}
	if err := t.Check(ix); err != nil {
		return nil, err
	}
	return t, nil
}

// ReadTrace reads the trace object at key as it is, unchecked (GetTrace
// checks it against its layer's index): for tools that list traces
// without their layers. An object too large or not JSON wraps ErrCorrupt.
func ReadTrace(ctx context.Context, st Store, key string) (*Trace, error) {
	var t Trace
	if err := getJSON(ctx, st, key, maxTraceSize, &t); err != nil {
		return nil, err
	}
	return &t, nil
}

// PutTrace writes chunks, in MergeTrace's order, as the published trace of
// the layer of ix, replacing what was there.
func PutTrace(ctx context.Context, st Store, ix *Index, chunks []TraceChunk) error {
	h, err := indexHex(ix)
	if err != nil {
		return err
	}
	t := Trace{Version: TraceVersion, Digest: ix.Digest, ChunkSize: ix.ChunkSize, Chunks: chunks}
	if err := t.Check(ix); err != nil {
		return fmt.Errorf("put trace: %w: %w", errdefs.ErrInvalidArgument, err)
	}
	if err := putJSON(ctx, st, TraceKey(h), t); err != nil {
		return fmt.Errorf("put trace of %s: %w", ix.Digest, err)
	}
	return nil
}

// TracePublish says what PublishTrace did.
type TracePublish struct {
	Wrote bool // the object was written: it lacked some of the chunks, or a better rank
	// Replaced, when not empty, is why the object found in the store was
	// unusable (Trace.Check) and was replaced rather than merged.
	Replaced string
	Chunks   int // chunks in the trace now
}

// PublishTrace merges chunks into the published trace of the layer of ix:
// it reads the object, merges (MergeTrace) and writes the result back when
// it differs. Merging never loses another node's chunks, but two nodes
// publishing at the same moment can: the later write wins. A node that
// publishes again later puts its chunks back, so traces converge.
func PublishTrace(ctx context.Context, st Store, ix *Index, chunks []TraceChunk) (TracePublish, error) {
	var res TracePublish
	var have []TraceChunk
	t, err := GetTrace(ctx, st, ix)
	switch {
	case err == nil:
		have = t.Chunks
	case errors.Is(err, ErrCorrupt):
		res.Replaced = err.Error()
	case !errors.Is(err, errdefs.ErrNotFound):
		return res, fmt.Errorf("publish trace: %w", err)
	}
	merged := MergeTrace(have, chunks)
	res.Chunks = len(merged)
	if t != nil && slices.Equal(merged, have) {
		return res, nil
	}
	if err := PutTrace(ctx, st, ix, merged); err != nil {
		return res, fmt.Errorf("publish trace: %w", err)
	}
	res.Wrote = true
	return res, nil
}

package blob_test

import (
	"bytes"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"strings"
	"sync"
	"testing"

	"github.com/google/go-cmp/cmp"

	"dsec.dev/dsec/internal/blob"
	"dsec.dev/dsec/internal/errdefs"
)

func TestMergeTrace(t *testing.T) {
	a := blob.TraceFromOrder([]int{7, 2, 5, 2})
	b := blob.TraceFromOrder([]int{2, 9})
	c := blob.TraceFromOrder([]int{9, 1, 7})
	want := []blob.TraceChunk{{Chunk: 2, Rank: 0}, {Chunk: 7, Rank: 0}, {Chunk: 9, Rank: 0}, {Chunk: 1, Rank: 1}, {Chunk: 5, Rank: 2}}
	for name, got := range map[string][]blob.TraceChunk{
		"a+b+c":         blob.MergeTrace(blob.MergeTrace(a, b), c),
		"c+b+a":         blob.MergeTrace(c, blob.MergeTrace(b, a)),
		"(a+c)+(b+a)":   blob.MergeTrace(blob.MergeTrace(a, c), blob.MergeTrace(b, a)),
		"twice a+b+c":   blob.MergeTrace(blob.MergeTrace(blob.MergeTrace(a, b), c), blob.MergeTrace(blob.MergeTrace(a, b), c)),
		"with nothing":  blob.MergeTrace(nil, blob.MergeTrace(blob.MergeTrace(a, b), c)),
		"one at a time": blob.MergeTrace(blob.MergeTrace(blob.MergeTrace(nil, a), b), c),
	} {
		if diff := cmp.Diff(want, got); diff != "" {
			t.Errorf("%s (-want +got):\n%s", name, diff)
		}
	}
	if diff := cmp.Diff([]blob.TraceChunk{{Chunk: 7, Rank: 0}, {Chunk: 2, Rank: 1}, {Chunk: 5, Rank: 2}}, a); diff != "" {
		t.Errorf("TraceFromOrder keeps a repeated chunk's first position (-want +got):\n%s", diff)
	}
}

// traceIndex is an index of a 10-chunk layer whose chunks need not exist:
// traces refer to chunk numbers only.
func traceIndex(seed string) *blob.Index {
	sum := sha256.Sum256([]byte(seed))
	ix := &blob.Index{Digest: "sha256:" + hex.EncodeToString(sum[:]), Size: 10 << 20, ChunkSize: 1 << 20}
	for i := range 10 {
		c := sha256.Sum256([]byte(fmt.Sprint(seed, i)))
		ix.Chunks = append(ix.Chunks, hex.EncodeToString(c[:]))
	}
	return ix
}

// runTraceStore publishes and merges traces in st the way nodes do, and
// checks that unusable trace objects are refused and then replaced.
func runTraceStore(t *testing.T, st blob.Store) {
	ix := traceIndex("layer")
	key := blob.TraceKey(ix.Digest[7:])

	t.Run("publish and merge", func(t *testing.T) {
		ctx := t.Context()
		if _, err := blob.GetTrace(ctx, st, ix); !errors.Is(err, errdefs.ErrNotFound) {
			t.Fatalf("GetTrace before any publish: %v, want not found", err)
		}
		res, err := blob.PublishTrace(ctx, st, ix, blob.TraceFromOrder([]int{7, 2, 5}))
		if err != nil || !res.Wrote || res.Chunks != 3 || res.Replaced != "" {
			t.Fatalf("first publish: %+v, %v", res, err)
		}
		// A second node adds its reads; a third has nothing new.
		if res, err := blob.PublishTrace(ctx, st, ix, blob.TraceFromOrder([]int{2, 9})); err != nil || !res.Wrote || res.Chunks != 4 {
			t.Fatalf("second publish: %+v, %v", res, err)
		}
		if res, err := blob.PublishTrace(ctx, st, ix, blob.TraceFromOrder([]int{7, 9})); err != nil || res.Wrote {
			t.Fatalf("publish of nothing new: %+v, %v; want no write", res, err)
		}
		tr, err := blob.GetTrace(ctx, st, ix)
		if err != nil {
			t.Fatal(err)
		}
		want := blob.Trace{Version: blob.TraceVersion, Digest: ix.Digest, ChunkSize: ix.ChunkSize,
			Chunks: []blob.TraceChunk{{Chunk: 2, Rank: 0}, {Chunk: 7, Rank: 0}, {Chunk: 9, Rank: 1}, {Chunk: 5, Rank: 2}}}
		if diff := cmp.Diff(want, *tr); diff != "" {
			t.Errorf("published trace (-want +got):\n%s", diff)
		}
		// Read by key, unchecked, it is the same object.
		raw, err := blob.ReadTrace(ctx, st, blob.TraceKey(strings.TrimPrefix(ix.Digest, "sha256:")))
		if err != nil {
			t.Fatal(err)
		}
		if diff := cmp.Diff(want, *raw); diff != "" {
			t.Errorf("trace read by key (-want +got):\n%s", diff)
		}
		if _, err := blob.ReadTrace(ctx, st, blob.TraceKey("0000")); !errors.Is(err, errdefs.ErrNotFound) {
			t.Errorf("ReadTrace of a missing key: %v, want not found", err)
		}
	})

	t.Run("concurrent nodes converge", func(t *testing.T) {
		ctx := t.Context()
		other := traceIndex("concurrent")
		orders := [][]int{{0, 1, 2}, {3, 1}, {4, 5, 0}, {6}, {7, 8, 9}, {2, 3}}
		var wg sync.WaitGroup
		for _, o := range orders {
			wg.Go(func() {
				if _, err := blob.PublishTrace(ctx, st, other, blob.TraceFromOrder(o)); err != nil {
					t.Error(err)
				}
			})
		}
		wg.Wait()
		// Racing writers may have lost each other's chunks; each node
		// publishing once more restores them.
		for _, o := range orders {
			if _, err := blob.PublishTrace(ctx, st, other, blob.TraceFromOrder(o)); err != nil {
				t.Fatal(err)
			}
		}
		var all []blob.TraceChunk
		for _, o := range orders {
			all = blob.MergeTrace(all, blob.TraceFromOrder(o))
		}
		tr, err := blob.GetTrace(ctx, st, other)
		if err != nil {
			t.Fatal(err)
		}
		if diff := cmp.Diff(all, tr.Chunks); diff != "" {
			t.Errorf("converged trace (-want +got):\n%s", diff)
		}
	})

	good := func(mod func(*blob.Trace)) []byte {
		tr := blob.Trace{Version: blob.TraceVersion, Digest: ix.Digest, ChunkSize: ix.ChunkSize,
			Chunks: []blob.TraceChunk{{Chunk: 1, Rank: 0}, {Chunk: 3, Rank: 1}}}
		mod(&tr)
		b, err := json.Marshal(tr)
		if err != nil {
			t.Fatal(err)
		}
		return b
	}
	for _, tc := range []struct {
		name   string
		object []byte
	}{
		{"not JSON", []byte("{\"version\":1,")},
		{"foreign", good(func(tr *blob.Trace) { tr.Digest = traceIndex("other").Digest })},
		{"stale chunking", good(func(tr *blob.Trace) { tr.ChunkSize = 256 << 10 })},
		{"unknown version", good(func(tr *blob.Trace) { tr.Version = 99 })},
		{"chunk out of range", good(func(tr *blob.Trace) { tr.Chunks[1].Chunk = 10 })},
		{"negative rank", good(func(tr *blob.Trace) { tr.Chunks[0].Rank = -1 })},
		{"chunk twice", good(func(tr *blob.Trace) { tr.Chunks[1].Chunk = 1 })},
		{"out of order", good(func(tr *blob.Trace) { tr.Chunks[0].Rank = 5 })},
		{"too large", append([]byte(`{"version":1,"chunks":[`), bytes.Repeat([]byte(" "), 17<<20)...)},
	} {
		t.Run(tc.name, func(t *testing.T) {
			ctx := t.Context()
			if err := st.Put(ctx, key, bytes.NewReader(tc.object), int64(len(tc.object))); err != nil {
				t.Fatal(err)
			}
			if _, err := blob.GetTrace(ctx, st, ix); !errors.Is(err, blob.ErrCorrupt) {
				t.Fatalf("GetTrace: %v, want corrupt", err)
			}
			res, err := blob.PublishTrace(ctx, st, ix, blob.TraceFromOrder([]int{4}))
			if err != nil || !res.Wrote || res.Replaced == "" {
				t.Fatalf("publish over an unusable trace: %+v, %v; want it replaced", res, err)
			}
			tr, err := blob.GetTrace(ctx, st, ix)
			if err != nil {
				t.Fatal(err)
			}
			if diff := cmp.Diff([]blob.TraceChunk{{Chunk: 4, Rank: 0}}, tr.Chunks); diff != "" {
				t.Errorf("trace after replacing (-want +got):\n%s", diff)
			}
		})
	}

	t.Run("refuses to write a bad trace", func(t *testing.T) {
		err := blob.PutTrace(t.Context(), st, ix, []blob.TraceChunk{{Chunk: 11, Rank: 0}})
		if !errors.Is(err, errdefs.ErrInvalidArgument) || !strings.Contains(err.Error(), "out of range") {
			t.Errorf("PutTrace of chunk 11 of 10: %v", err)
		}
	})
}

func TestTraceDir(t *testing.T) {
	runTraceStore(t, newDir(t))
}

func TestTraceS3(t *testing.T) {
	runTraceStore(t, newS3(t))
}

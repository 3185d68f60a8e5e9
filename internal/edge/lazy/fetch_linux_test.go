package lazy

import (
	"context"
	"io"
	"log/slog"
	"testing"
	"testing/iotest"
	"time"

	"dsec.dev/dsec/internal/blob"
)

// brokenBodies is a store whose objects' bytes break off after the first
// 16, as a connection to S3 that drops mid-object.
type brokenBodies struct{ *memStore }

func (s brokenBodies) Get(ctx context.Context, key string) (io.ReadCloser, error) {
	rc, err := s.memStore.Get(ctx, key)
	if err != nil {
		return nil, err
	}
	return io.NopCloser(io.MultiReader(io.LimitReader(rc, 16), iotest.ErrReader(io.ErrUnexpectedEOF))), nil
}

// TestFetchErrorsByStep checks that a failed chunk fetch counts under the
// step that failed: the store's Get (an error, a timeout), the read of the
// object's bytes, the chunk's verification. No FUSE mount is needed: it
// calls the fetch directly.
func TestFetchErrorsByStep(t *testing.T) {
	data := randomBytes(9, 2*testChunk)
	for _, tc := range []struct {
		name  string
		setup func(st *memStore, ix *blob.Index) blob.Store
		want  [3]int64 // get, read, verify
	}{
		{"get refused", func(st *memStore, _ *blob.Index) blob.Store { st.setMode("error"); return st }, [3]int64{2, 0, 0}},
		{"get timed out", func(st *memStore, _ *blob.Index) blob.Store { st.setMode("hang"); return st }, [3]int64{2, 0, 0}},
		{"bytes broke off", func(st *memStore, _ *blob.Index) blob.Store { return brokenBodies{st} }, [3]int64{0, 2, 0}},
		{"corrupt", func(st *memStore, ix *blob.Index) blob.Store {
			st.corrupt[ix.ChunkKey(0)] = append([]byte("x"), st.objects[ix.ChunkKey(0)][1:]...)
			return st
		}, [3]int64{0, 0, 2}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			st := newMemStore()
			ix := putLayer(t, st, data, testChunk)
			f := &FS{cfg: Config{Store: tc.setup(st, ix), Retries: 2, FetchTimeout: 50 * time.Millisecond},
				log: slog.New(slog.DiscardHandler), ctx: t.Context()}
			l := &layer{hex: ix.Digest[7:], ix: ix}
			if _, _, err := f.fetchRetry(l, 0); err == nil {
				t.Fatal("the fetch succeeded")
			}
			var got Totals
			l.addTo(&got)
			if have := [3]int64{got.GetErrors, got.ReadErrors, got.VerifyErrors}; have != tc.want || got.FetchErrors != 2 {
				t.Errorf("errors by step (get, read, verify) = %v of %d, want %v of 2", have, got.FetchErrors, tc.want)
			}
		})
	}
}

package blob_test

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"sync"
	"testing"

	"dsec.dev/dsec/internal/blob"
	"dsec.dev/dsec/internal/blob/blobtest"
	"dsec.dev/dsec/internal/errdefs"
)

// TestObservedDir: a store wrapped for its error counter passes the
// conformance suite; a missing key and a listing its callback stopped are
// not failures, a store that cannot answer is.
func TestObservedDir(t *testing.T) {
	blobtest.Run(t, func(t *testing.T) blob.Store { return blob.Observe(newDir(t), func(string) {}) })

	var mu sync.Mutex
	failed := map[string]int{}
	count := func(op string) {
		mu.Lock()
		defer mu.Unlock()
		failed[op]++
	}
	ctx := t.Context()
	st := blob.Observe(newDir(t), count)
	if err := st.Put(ctx, "a/b", bytes.NewReader([]byte("ok")), 2); err != nil {
		t.Fatal(err)
	}
	if _, err := st.Get(ctx, "no/such/key"); !errors.Is(err, errdefs.ErrNotFound) {
		t.Fatalf("Get of a missing key: %v", err)
	}
	stop := errors.New("enough")
	if err := st.List(ctx, "a/", func(string, int64) error { return stop }); !errors.Is(err, stop) {
		t.Fatalf("List stopped by its callback: %v", err)
	}
	if len(failed) != 0 {
		t.Errorf("answers counted as failures: %v", failed)
	}
	down := blob.Observe(downStore{}, count)
	if _, err := down.Stat(ctx, "a/b"); err == nil {
		t.Fatal("Stat of a store that is down succeeded")
	}
	if _, err := down.GetRange(context.Background(), "a/b", 0, 1); err == nil {
		t.Fatal("GetRange of a store that is down succeeded")
	}
	if failed["stat"] != 1 || failed["get_range"] != 1 {
		t.Errorf("failures = %v, want one stat and one get_range", failed)
	}
	if blob.Backend("s3://bucket/p?endpoint=h:1") != "s3" || blob.Backend("/srv/blobs") != "dir" {
		t.Error("Backend names the wrong kind")
	}
}

// downStore is a store that cannot be reached.
type downStore struct{ blob.Store }

func (downStore) Stat(context.Context, string) (int64, error) {
	return 0, fmt.Errorf("stat: connection refused: %w", errdefs.ErrUnavailable)
}

func (downStore) GetRange(context.Context, string, int64, int64) (io.ReadCloser, error) {
	return nil, fmt.Errorf("get: connection refused: %w", errdefs.ErrUnavailable)
}

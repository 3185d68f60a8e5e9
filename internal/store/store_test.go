package store

import (
	"context"
	"errors"
	"path/filepath"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"

	"dsec.dev/dsec/internal/errdefs"
)

func TestIdempotencyRoundTrip(t *testing.T) {
	ctx := context.Background()
	path := filepath.Join(t.TempDir(), "meta.db")
	s, err := Open(ctx, path)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := s.GetIdempotency(ctx, "k1"); !errors.Is(err, errdefs.ErrNotFound) {
		t.Fatalf("missing key: got %v, want ErrNotFound", err)
	}
	want := Idempotency{Key: "k1", RequestHash: "h", IDs: []string{"sb-a-1", "sb-a-2"}, Created: time.UnixMilli(time.Now().UnixMilli())}
	if err := s.PutIdempotency(ctx, want); err != nil {
		t.Fatal(err)
	}
	s.Close()

	// A reopened store still has it: the record is durable.
	s, err = Open(ctx, path)
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	got, err := s.GetIdempotency(ctx, "k1")
	if err != nil {
		t.Fatal(err)
	}
	if diff := cmp.Diff(want, got); diff != "" {
		t.Fatalf("record mismatch (-want +got):\n%s", diff)
	}
	if err := s.ExpireIdempotency(ctx, time.Now().Add(time.Hour)); err != nil {
		t.Fatal(err)
	}
	if _, err := s.GetIdempotency(ctx, "k1"); !errors.Is(err, errdefs.ErrNotFound) {
		t.Fatalf("expired key: got %v, want ErrNotFound", err)
	}
}

package blob_test

import (
	"bytes"
	"errors"
	"io"
	"os"
	"path/filepath"
	"testing"
	"time"

	"dsec.dev/dsec/internal/blob"
	"dsec.dev/dsec/internal/blob/blobtest"
	"dsec.dev/dsec/internal/errdefs"
)

func newDir(t *testing.T) *blob.Dir {
	t.Helper()
	d, err := blob.NewDir(t.TempDir())
	if err != nil {
		t.Fatal(err)
	}
	return d
}

func TestDir(t *testing.T) {
	blobtest.Run(t, func(t *testing.T) blob.Store { return newDir(t) })
}

func TestThrottledDir(t *testing.T) {
	// Fast enough that the suite's 5 MiB objects take no noticeable time.
	blobtest.Run(t, func(t *testing.T) blob.Store { return blob.Throttle(newDir(t), 1<<30) })
}

func TestDirLeavesNoTempFiles(t *testing.T) {
	d := newDir(t)
	ctx := t.Context()
	if err := d.Put(ctx, "a/b", bytes.NewReader([]byte("ok")), 2); err != nil {
		t.Fatal(err)
	}
	if err := d.Put(ctx, "a/c", io.MultiReader(bytes.NewReader([]byte("x")), errReader{}), 10); err == nil {
		t.Fatal("Put from a failing reader succeeded")
	}
	tmp, err := os.ReadDir(filepath.Join(d.Root(), ".tmp"))
	if err != nil {
		t.Fatal(err)
	}
	if len(tmp) != 0 {
		t.Fatalf("temporary files left behind: %v", tmp)
	}
	if got, err := os.ReadFile(filepath.Join(d.Root(), "a", "b")); err != nil || string(got) != "ok" {
		t.Fatalf("object file = %q, %v", got, err)
	}
}

type errReader struct{}

func (errReader) Read([]byte) (int, error) { return 0, errors.New("broken") }

func TestDirKeyConflicts(t *testing.T) {
	d := newDir(t)
	ctx := t.Context()
	for _, key := range []string{".tmp", ".tmp/x"} {
		if err := d.Put(ctx, key, bytes.NewReader(nil), 0); !errors.Is(err, errdefs.ErrInvalidArgument) {
			t.Errorf("Put %q: %v, want invalid argument", key, err)
		}
	}
	if err := d.Put(ctx, "a/b", bytes.NewReader(nil), 0); err != nil {
		t.Fatal(err)
	}
	// A directory store cannot hold both "a" and "a/b"; it says so.
	if err := d.Put(ctx, "a", bytes.NewReader(nil), 0); !errors.Is(err, errdefs.ErrFailedPrecondition) {
		t.Errorf("Put over a key prefix: %v, want failed precondition", err)
	}
	if err := d.Put(ctx, "a/b/c", bytes.NewReader(nil), 0); !errors.Is(err, errdefs.ErrFailedPrecondition) {
		t.Errorf("Put below an object: %v, want failed precondition", err)
	}
	if err := d.List(ctx, "../", func(string, int64) error { return nil }); !errors.Is(err, errdefs.ErrInvalidArgument) {
		t.Errorf("List(../): %v, want invalid argument", err)
	}
}

func TestThrottleLimitsReads(t *testing.T) {
	d := newDir(t)
	data := bytes.Repeat([]byte{1}, 1<<20)
	if err := d.Put(t.Context(), "x", bytes.NewReader(data), int64(len(data))); err != nil {
		t.Fatal(err)
	}
	// 1 MiB at 4 MiB/s with a 256 KiB burst needs at least 187 ms; only a
	// lower bound is checked, which a slow machine cannot break.
	st := blob.Throttle(d, 4<<20)
	start := time.Now()
	rc, err := st.Get(t.Context(), "x")
	if err != nil {
		t.Fatal(err)
	}
	defer rc.Close()
	got, err := io.ReadAll(rc)
	if err != nil || !bytes.Equal(got, data) {
		t.Fatalf("throttled read: %d bytes, %v", len(got), err)
	}
	if d := time.Since(start); d < 150*time.Millisecond {
		t.Fatalf("1 MiB read at 4 MiB/s took only %v", d)
	}
	if blob.Throttle(d, 0) != blob.Store(d) {
		t.Fatal("Throttle with no limit should return the store itself")
	}
}

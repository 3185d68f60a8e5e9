package image

import (
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"os"
	"path/filepath"
	"testing"

	"dsec.dev/dsec/internal/errdefs"
)

// TestAddLayerFile moves a staged file in by rename and refuses what is not
// staged, not recorded or not the recorded size, leaving nothing behind.
func TestAddLayerFile(t *testing.T) {
	ctx := t.Context()
	s := newStore(t, t.TempDir())
	body := []byte("not really an EROFS image, but the store only moves it")
	sum := sha256.Sum256(body)
	digest := "sha256:" + hex.EncodeToString(sum[:])
	stage := func(name string, data []byte) string {
		p := s.StagePath(name)
		if err := os.WriteFile(p, data, 0o600); err != nil {
			t.Fatal(err)
		}
		return p
	}

	// Not recorded yet.
	p := stage("a", body)
	if err := s.AddLayerFile(ctx, digest, p); !errors.Is(err, errdefs.ErrNotFound) {
		t.Fatalf("AddLayerFile of an unrecorded layer = %v, want NotFound", err)
	}
	if _, err := os.Stat(p); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("the refused file stays at %s", p)
	}
	if err := s.Adopt(ctx, "snap:x", []Adopted{{Digest: digest, Kind: KindSnapshot, Size: int64(len(body))}}, nil); err != nil {
		t.Fatal(err)
	}

	// Not in the staging directory.
	outside := filepath.Join(t.TempDir(), "f")
	if err := os.WriteFile(outside, body, 0o600); err != nil {
		t.Fatal(err)
	}
	if err := s.AddLayerFile(ctx, digest, outside); !errors.Is(err, errdefs.ErrInvalidArgument) {
		t.Fatalf("AddLayerFile of a file outside the staging dir = %v, want InvalidArgument", err)
	}

	// Another size than recorded.
	if err := s.AddLayerFile(ctx, digest, stage("b", body[1:])); !errors.Is(err, errdefs.ErrInvalidArgument) {
		t.Fatalf("AddLayerFile of a short file = %v, want InvalidArgument", err)
	}
	if s.HasLayerFile(digest) {
		t.Fatal("the store took a file of the wrong size")
	}

	p = stage("c", body)
	if err := s.AddLayerFile(ctx, digest, p); err != nil {
		t.Fatal(err)
	}
	got, err := os.ReadFile(s.blobPath(hex.EncodeToString(sum[:])))
	if err != nil || string(got) != string(body) {
		t.Fatalf("stored file = %q, %v", got, err)
	}
	// A second copy of a layer the store has is dropped.
	p = stage("d", body)
	if err := s.AddLayerFile(ctx, digest, p); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(p); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("the second copy stays at %s", p)
	}
	assertTmpEmpty(t, s)
}

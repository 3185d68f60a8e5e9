package layers

import (
	"context"
	"errors"
	"os"
	"path/filepath"
	"testing"
	"time"

	"dsec.dev/dsec/internal/blob"
	"dsec.dev/dsec/internal/edge/image"
	"dsec.dev/dsec/internal/edge/lazy"
	"dsec.dev/dsec/internal/testutil"
)

// addLayer builds an EROFS layer of one file into the node's store as ref,
// of kind k, and returns its digest.
func addLayer(t *testing.T, s *Service, ref string, k image.Kind, content string) string {
	t.Helper()
	src := t.TempDir()
	if err := os.WriteFile(filepath.Join(src, "hello"), []byte(content), 0o644); err != nil {
		t.Fatal(err)
	}
	stage := s.images.StagePath(filepath.Base(src) + ".erofs")
	digest, size, err := image.BuildLayerFile(t.Context(), src, stage)
	if err != nil {
		t.Fatal(err)
	}
	if err := s.images.Adopt(t.Context(), ref, []image.Adopted{{Digest: digest, Kind: k, Size: size, Source: "test"}}, nil); err != nil {
		t.Fatal(err)
	}
	if err := s.images.AddLayerFile(t.Context(), digest, stage); err != nil {
		t.Fatal(err)
	}
	return digest
}

// unusedLoader is a lazy file system the test must not reach.
type unusedLoader struct{ t *testing.T }

func (l unusedLoader) fail(call string) error {
	l.t.Errorf("the lazy file system was asked to %s", call)
	return errors.New("no lazy file system here")
}

func (l unusedLoader) Add(context.Context, *blob.Index) (string, error) { return "", l.fail("add") }
func (l unusedLoader) FetchAll(context.Context, string) error           { return l.fail("fetch all") }
func (l unusedLoader) PrefetchTrace(context.Context, string) (int, error) {
	return 0, l.fail("prefetch")
}
func (l unusedLoader) SaveTrace(context.Context, string) error { return l.fail("save a trace") }
func (l unusedLoader) PublishTrace(context.Context, string) (bool, error) {
	return false, l.fail("publish a trace")
}
func (l unusedLoader) Stats(context.Context, string) (lazy.LayerStats, error) {
	return lazy.LayerStats{}, l.fail("report stats")
}
func (l unusedLoader) MetaChunks(context.Context, string) ([]int, error) {
	return nil, l.fail("find metadata chunks")
}

// On an on-demand node, a snapshot the node took itself is mounted from
// its own file at once, though the mark of its metadata chunks still runs;
// any other layer waits for that mark.
func TestOwnSnapshotMountsFromItsFile(t *testing.T) {
	testutil.RequireRoot(t)
	testutil.RequireCommand(t, "mkfs.erofs")
	blobs, err := blob.NewDir(t.TempDir())
	if err != nil {
		t.Fatal(err)
	}
	images, err := image.Open(filepath.Join(t.TempDir(), "layers"), nil)
	if err != nil {
		t.Fatal(err)
	}
	s, err := New(Config{Mode: ModeOnDemand, Blobs: blobs, BlobSpec: "test", Dir: t.TempDir(), Loader: unusedLoader{t}}, images)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { s.images.UnmountAll(context.Background()) })
	snap := addLayer(t, s, "snap:mine", image.KindSnapshot, "from the snapshot")
	base := addLayer(t, s, "base:other", image.KindBase, "from the base")
	if !s.ownSnapshot(snap) || s.ownSnapshot(base) {
		t.Fatalf("ownSnapshot: snapshot %v, base %v; want true, false", s.ownSnapshot(snap), s.ownSnapshot(base))
	}
	// A mark that never ends, for both.
	s.mu.Lock()
	s.metaPending[snap] = make(chan struct{})
	s.metaPending[base] = make(chan struct{})
	s.mu.Unlock()

	ctx, cancel := context.WithTimeout(t.Context(), 5*time.Second)
	defer cancel()
	l, err := s.Mount(ctx, "sb-1", snap)
	if err != nil {
		t.Fatalf("mount the node's own snapshot while its mark runs: %v", err)
	}
	// Described with the store's own file, which a VM would attach.
	if fi, err := os.Stat(l.File); err != nil || l.FSType != "erofs" || fi.Size() != l.Size || l.Digest != snap {
		t.Fatalf("the snapshot's description %+v: file %v", l, err)
	}
	if got, err := os.ReadFile(filepath.Join(l.Dir, "hello")); err != nil || string(got) != "from the snapshot" {
		t.Fatalf("the mounted snapshot holds %q, %v", got, err)
	}

	short, cancel2 := context.WithTimeout(t.Context(), 200*time.Millisecond)
	defer cancel2()
	if _, err := s.Mount(short, "sb-2", base); !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("mount of a base layer while its mark runs: %v, want it to wait (deadline exceeded)", err)
	}
}

package layers

import (
	"bytes"
	"context"
	"crypto/rand"
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"connectrpc.com/connect"
	"github.com/google/go-cmp/cmp"

	dsecv1 "dsec.dev/dsec/api/gen/dsec/v1"
	"dsec.dev/dsec/internal/blob"
	"dsec.dev/dsec/internal/edge/image"
	"dsec.dev/dsec/internal/errdefs"
)

// newNode is one node's layer service over blobs, with an image store of
// its own.
func newNode(t *testing.T, mode Mode, blobs blob.Store) *Service {
	t.Helper()
	images, err := image.Open(filepath.Join(t.TempDir(), "layers"), nil)
	if err != nil {
		t.Fatal(err)
	}
	s, err := New(Config{Mode: mode, Blobs: blobs, BlobSpec: "test", Dir: t.TempDir()}, images)
	if err != nil {
		t.Fatal(err)
	}
	return s
}

// publishFile puts a layer file of n random bytes in blobs, as publish
// does, and returns what a node that imported it records.
func publishFile(t *testing.T, blobs blob.Store, n int) (image.Adopted, []byte) {
	t.Helper()
	data := make([]byte, n)
	rand.Read(data)
	p := filepath.Join(t.TempDir(), "layer.erofs")
	if err := os.WriteFile(p, data, 0o600); err != nil {
		t.Fatal(err)
	}
	ix, _, err := blob.PutLayer(t.Context(), blobs, p, 1<<20)
	if err != nil {
		t.Fatal(err)
	}
	return image.Adopted{Digest: ix.Digest, Kind: image.KindBase, Size: ix.Size, Source: "test"}, data
}

// TestAdoptFromTheBlobStore: what one node imported and published, with its
// ref, another node sharing the blob store adopts without building anything
// (pulling the files only in local mode); one that lacks a ref adopts it
// when an environment names it; a store that is not the importer's has
// nothing to adopt; a removed ref is adopted by no one.
func TestAdoptFromTheBlobStore(t *testing.T) {
	ctx := t.Context()
	blobs, err := blob.NewDir(t.TempDir())
	if err != nil {
		t.Fatal(err)
	}
	base, baseData := publishFile(t, blobs, 3<<20+17)
	top, _ := publishFile(t, blobs, 5000)
	// The importer's image store has them as its imports left them.
	importer := newNode(t, ModeEager, blobs)
	cfg := image.ImageConfig{Env: []string{"A=1"}, WorkingDir: "/w", Cmd: []string{"sh"}}
	if err := importer.images.Adopt(ctx, "base:1", []image.Adopted{base}, nil); err != nil {
		t.Fatal(err)
	}
	if err := importer.images.Adopt(ctx, "img:1", []image.Adopted{base, top}, &cfg); err != nil {
		t.Fatal(err)
	}
	for _, ref := range []string{"base:1", "img:1"} {
		if err := importer.publishRef(ctx, ref); err != nil {
			t.Fatal(err)
		}
	}

	local := newNode(t, ModeLocal, blobs)
	if err := local.Adopt(ctx, "base:1", []string{base.Digest}); err != nil {
		t.Fatal(err)
	}
	if err := local.Adopt(ctx, "img:1", []string{base.Digest, top.Digest}); err != nil {
		t.Fatal(err)
	}
	l, err := local.Get("base:1")
	if err != nil || l.Digest != base.Digest || l.Kind != image.KindBase || l.Size != base.Size {
		t.Fatalf("adopted layer %+v, %v", l, err)
	}
	img, err := local.images.Image("img:1")
	if err != nil || !cmp.Equal(img.Config, cfg) || !cmp.Equal(img.Digests, []string{base.Digest, top.Digest}) {
		t.Fatalf("adopted image %+v, %v", img, err)
	}
	file, _ := local.images.LayerFile(base.Digest)
	if got, err := os.ReadFile(file); err != nil || !bytes.Equal(got, baseData) {
		t.Errorf("local mode: the pulled layer file differs (%v)", err)
	}

	if err := local.Adopt(ctx, "base:1", []string{top.Digest}); !errors.Is(err, errdefs.ErrFailedPrecondition) || !strings.Contains(err.Error(), "imported again") {
		t.Errorf("adopt naming other digests: %v", err)
	}
	elsewhere, err := blob.NewDir(t.TempDir())
	if err != nil {
		t.Fatal(err)
	}
	if err := newNode(t, ModeEager, elsewhere).Adopt(ctx, "base:1", []string{base.Digest}); !errors.Is(err, errdefs.ErrNotFound) {
		t.Errorf("adopt from another store: %v, want not found", err)
	}

	// A node that lacks a ref adopts it on first use; in eager mode it
	// pulls nothing until a sandbox mounts the layers.
	late := newNode(t, ModeEager, blobs)
	layers, err := late.ResolveEnvironment(ctx, "img:1")
	if err != nil || len(layers) != 2 || layers[1].Digest != top.Digest {
		t.Fatalf("resolve on first use: %v, %v", layers, err)
	}
	if late.images.HasLayerFile(base.Digest) {
		t.Errorf("eager mode: adoption pulled a layer file")
	}
	if _, err := late.ResolveEnvironment(ctx, "img:2"); !errors.Is(err, errdefs.ErrNotFound) || !strings.Contains(err.Error(), "no layer or image is named img:2") {
		t.Errorf("an environment no node published: %v", err)
	}

	// Removing a ref removes its record: no node adopts it after.
	if err := importer.Remove(ctx, "base:1"); err != nil {
		t.Fatal(err)
	}
	if _, err := newNode(t, ModeEager, blobs).ResolveEnvironment(ctx, "base:1"); !errors.Is(err, errdefs.ErrNotFound) {
		t.Errorf("a removed ref was adopted: %v", err)
	}
	if _, err := newNode(t, ModeEager, blobs).ResolveEnvironment(ctx, "img:1"); err != nil {
		t.Errorf("the image, still published: %v", err)
	}
	// A ref only the blob store has (its importer left) can be removed too.
	if dropped, err := newNode(t, ModeEager, blobs).DropRecord(ctx, "img:1"); err != nil || !dropped {
		t.Errorf("DropRecord = %v, %v", dropped, err)
	}
	if _, err := newNode(t, ModeEager, blobs).ResolveEnvironment(ctx, "img:1"); !errors.Is(err, errdefs.ErrNotFound) {
		t.Errorf("a dropped record was adopted: %v", err)
	}
}

// Creates that resolve an environment at once on a node that lacks one of
// its parts all find it: one adopts it, and the others, which may find it
// adopted before they look, resolve it as well.
func TestConcurrentResolvesAdoptOnce(t *testing.T) {
	ctx := t.Context()
	blobs, err := blob.NewDir(t.TempDir())
	if err != nil {
		t.Fatal(err)
	}
	base, _ := publishFile(t, blobs, 5000)
	top, _ := publishFile(t, blobs, 3000)
	importer := newNode(t, ModeEager, blobs)
	if err := importer.images.Adopt(ctx, "base:1", []image.Adopted{base}, nil); err != nil {
		t.Fatal(err)
	}
	top.Kind = image.KindSnapshot
	if err := importer.images.Adopt(ctx, "snap:s", []image.Adopted{top}, nil); err != nil {
		t.Fatal(err)
	}
	for _, ref := range []string{"base:1", "snap:s"} {
		if err := importer.publishRef(ctx, ref); err != nil {
			t.Fatal(err)
		}
	}
	for round := range 20 {
		node := newNode(t, ModeEager, blobs)
		if err := node.Adopt(ctx, "base:1", []string{base.Digest}); err != nil {
			t.Fatal(err)
		}
		errs := make(chan error, 8)
		for range 8 {
			go func() {
				_, err := node.ResolveEnvironment(ctx, "base:1+snap:s")
				errs <- err
			}()
		}
		for range 8 {
			if err := <-errs; err != nil {
				t.Fatalf("round %d: a create beside others: %v", round, err)
			}
		}
	}
}

// TestRemoveImage: removing an image by its name through the node's
// LayerService removes it from the node and its record from the blob
// store, with its layers no other name holds, and is refused while a live
// sandbox runs on such a layer. (An image's name was looked up as a
// layer's: only the blob store's record went, and the image stayed on the
// node, answering every create, while the apiserver had given back its
// charge and forgotten its project.)
func TestRemoveImage(t *testing.T) {
	ctx := t.Context()
	blobs, err := blob.NewDir(t.TempDir())
	if err != nil {
		t.Fatal(err)
	}
	base, _ := publishFile(t, blobs, 4000)
	top, _ := publishFile(t, blobs, 3000)
	node := newNode(t, ModeEager, blobs)
	cfg := image.ImageConfig{Cmd: []string{"sh"}}
	if err := node.images.Adopt(ctx, "base:1", []image.Adopted{base}, nil); err != nil {
		t.Fatal(err)
	}
	if err := node.images.Adopt(ctx, "img:1", []image.Adopted{base, top}, &cfg); err != nil {
		t.Fatal(err)
	}
	if err := node.publishRef(ctx, "img:1"); err != nil {
		t.Fatal(err)
	}
	busy := ""
	h := NewHandler(node, func(ctx context.Context, digest string) (string, error) {
		if digest == busy {
			return "sb-busy", nil
		}
		return "", nil
	})
	remove := func(ref string) error {
		_, err := h.RemoveLayer(ctx, connect.NewRequest(&dsecv1.RemoveLayerRequest{Ref: ref}))
		return err
	}

	busy = top.Digest
	if err := remove("img:1"); !errors.Is(err, errdefs.ErrFailedPrecondition) || !strings.Contains(err.Error(), "sb-busy") {
		t.Errorf("remove an image a live sandbox runs on: %v, want refused naming the sandbox", err)
	}
	if _, err := node.images.Image("img:1"); err != nil {
		t.Fatalf("the image refused removal is gone: %v", err)
	}
	busy = base.Digest // base:1 keeps it: not the image's to take away
	if err := remove("img:1"); err != nil {
		t.Fatalf("remove img:1: %v", err)
	}
	if _, err := node.images.Image("img:1"); !errors.Is(err, errdefs.ErrNotFound) {
		t.Errorf("the removed image is still on the node: %v", err)
	}
	if _, err := node.Get(top.Digest); !errors.Is(err, errdefs.ErrNotFound) {
		t.Errorf("the removed image's own layer is still on the node: %v", err)
	}
	if l, err := node.Get("base:1"); err != nil || l.Digest != base.Digest {
		t.Errorf("base:1, which the image shared a layer with: %+v, %v", l, err)
	}
	if _, err := newNode(t, ModeEager, blobs).ResolveEnvironment(ctx, "img:1"); !errors.Is(err, errdefs.ErrNotFound) {
		t.Errorf("the removed image was adopted from the blob store: %v", err)
	}
	if err := remove("img:1"); !errors.Is(err, errdefs.ErrNotFound) {
		t.Errorf("remove it again: %v, want not found", err)
	}
}

// TestRenameRef: a name moved onto what a staging ref names (an
// overwrite, once charged) names the new version on this node and in the
// blob store, so another node adopts the new one; the staging ref goes
// there too; the old version's layers stay stored, nameless, until
// removed; renaming again finds nothing.
func TestRenameRef(t *testing.T) {
	ctx := t.Context()
	blobs, err := blob.NewDir(t.TempDir())
	if err != nil {
		t.Fatal(err)
	}
	oldBase, _ := publishFile(t, blobs, 4000)
	newBase, _ := publishFile(t, blobs, 3000)
	top, _ := publishFile(t, blobs, 2000)
	node := newNode(t, ModeEager, blobs)
	cfg := image.ImageConfig{Cmd: []string{"sh"}}
	for _, a := range []struct {
		ref    string
		layers []image.Adopted
		img    *image.ImageConfig
	}{
		{"env:1", []image.Adopted{oldBase}, nil},
		{"dsec-staging/1:1", []image.Adopted{newBase}, nil},
		{"img:1", []image.Adopted{oldBase, top}, &cfg},
		{"dsec-staging/2:1", []image.Adopted{newBase, top}, &cfg},
	} {
		if err := node.images.Adopt(ctx, a.ref, a.layers, a.img); err != nil {
			t.Fatal(err)
		}
		if err := node.publishRef(ctx, a.ref); err != nil {
			t.Fatal(err)
		}
	}
	if err := node.RenameRef(ctx, "dsec-staging/1:1", "env:1"); err != nil {
		t.Fatalf("rename a layer's staging ref: %v", err)
	}
	if err := node.RenameRef(ctx, "dsec-staging/2:1", "img:1"); err != nil {
		t.Fatalf("rename an image's staging ref: %v", err)
	}
	if l, err := node.Get("env:1"); err != nil || l.Digest != newBase.Digest {
		t.Errorf("env:1 after the rename: %+v, %v; want %s", l, err, newBase.Digest)
	}
	if img, err := node.Image("img:1"); err != nil || !cmp.Equal(img.Digests, []string{newBase.Digest, top.Digest}) {
		t.Errorf("img:1 after the rename: %+v, %v", img, err)
	}
	if l, err := node.Get(oldBase.Digest); err != nil || len(l.Refs) != 0 || len(l.Images) != 0 {
		t.Errorf("the old version's layer: %+v, %v; want it stored, nameless", l, err)
	}
	other := newNode(t, ModeEager, blobs)
	if layers, err := other.ResolveEnvironment(ctx, "img:1"); err != nil || len(layers) != 2 || layers[0].Digest != newBase.Digest {
		t.Errorf("another node adopts img:1 as %v, %v; want the new version", layers, err)
	}
	if layers, err := other.ResolveEnvironment(ctx, "env:1"); err != nil || layers[0].Digest != newBase.Digest {
		t.Errorf("another node adopts env:1 as %v, %v; want the new version", layers, err)
	}
	for _, ref := range []string{"dsec-staging/1:1", "dsec-staging/2:1"} {
		if _, err := newNode(t, ModeEager, blobs).ResolveEnvironment(ctx, ref); !errors.Is(err, errdefs.ErrNotFound) {
			t.Errorf("the staging ref %s after the rename: %v, want not found", ref, err)
		}
		if err := node.RenameRef(ctx, ref, "env:1"); !errors.Is(err, errdefs.ErrNotFound) {
			t.Errorf("rename %s again: %v, want not found", ref, err)
		}
	}
	if err := node.RenameRef(ctx, "env:1", "env:1"); !errors.Is(err, errdefs.ErrInvalidArgument) {
		t.Errorf("rename onto itself: %v, want invalid argument", err)
	}
}

package layers

import (
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"slices"
	"strings"

	"dsec.dev/dsec/internal/blob"
	"dsec.dev/dsec/internal/edge/image"
	"dsec.dev/dsec/internal/errdefs"
)

// Refs across nodes. Every import that names a ref publishes, after the
// layers, a record of what the ref names to the blob store (refs/, one
// object per ref): the layers' digests, kinds and sizes and, for an image,
// its configuration. A node sharing the store adopts the ref from it
// (Adopt): it records the layers and the ref in its own image store and
// reads nothing else until a sandbox mounts a layer. An apiserver has every
// other node adopt what one node imported; a node that lacks a ref when a
// create names it (it joined the cluster later, or was unroutable during
// the import) adopts it then. Removing a ref removes its record, so that
// nothing brings it back.

// refRecord is what the blob store keeps of one ref.
type refRecord struct {
	Ref string `json:"ref"` // name:tag
	// Image says the ref names an image of the layers, bottom first, with
	// Config; otherwise it names the one layer.
	Image  bool              `json:"image,omitempty"`
	Config image.ImageConfig `json:"config,omitempty"`
	Layers []refLayer        `json:"layers"`
}

type refLayer struct {
	Digest string     `json:"digest"`
	Kind   image.Kind `json:"kind"`
	Size   int64      `json:"size"`
	Source string     `json:"source,omitempty"`
}

// maxRefRecord bounds a record read from the store.
const maxRefRecord = 1 << 20

// refKey is the record's key: refs are mutable names, so the key is a hash
// of the name rather than of the content.
func refKey(ref string) string {
	sum := sha256.Sum256([]byte(ref))
	return "refs/" + hex.EncodeToString(sum[:]) + ".json"
}

func (r *refRecord) digests() []string {
	out := make([]string, len(r.Layers))
	for i, l := range r.Layers {
		out[i] = l.Digest
	}
	return out
}

// localRecord is what the node's image store says ref names.
func (s *Service) localRecord(ref string) (*refRecord, error) {
	rec := &refRecord{Ref: ref}
	var digests []string
	if img, err := s.images.Image(ref); err == nil {
		rec.Image, rec.Config, digests = true, img.Config, img.Digests
	} else if l, err := s.images.Get(ref); err == nil {
		digests = []string{l.Digest}
	} else {
		return nil, err
	}
	for _, d := range digests {
		l, err := s.images.Get(d)
		if err != nil {
			return nil, err
		}
		rec.Layers = append(rec.Layers, refLayer{Digest: l.Digest, Kind: l.Kind, Size: l.Size, Source: l.Source})
	}
	return rec, nil
}

// publishRef writes the record of ref, as the node's image store has it,
// to the blob store. Its layers must be published already.
func (s *Service) publishRef(ctx context.Context, ref string) error {
	nref, err := image.ParseRef(ref)
	if err != nil {
		return err
	}
	rec, err := s.localRecord(nref)
	if err != nil {
		return fmt.Errorf("publish ref %s: %w", nref, err)
	}
	data, err := json.Marshal(rec)
	if err != nil {
		return fmt.Errorf("publish ref %s: %w", nref, err)
	}
	if err := s.cfg.Blobs.Put(ctx, refKey(nref), bytes.NewReader(data), int64(len(data))); err != nil {
		return fmt.Errorf("publish ref %s: %w", nref, err)
	}
	return nil
}

// readRef reads the record of ref (normalized) from the blob store; a
// missing one wraps errdefs.ErrNotFound.
func (s *Service) readRef(ctx context.Context, ref string) (*refRecord, error) {
	rc, err := s.cfg.Blobs.Get(ctx, refKey(ref))
	if err != nil {
		return nil, fmt.Errorf("read the record of %s in the blob store %s: %w", ref, s.cfg.BlobSpec, err)
	}
	defer rc.Close()
	data, err := io.ReadAll(io.LimitReader(rc, maxRefRecord+1))
	if err != nil {
		return nil, fmt.Errorf("read the record of %s in the blob store %s: %w", ref, s.cfg.BlobSpec, err)
	}
	rec := &refRecord{}
	if len(data) > maxRefRecord {
		return nil, fmt.Errorf("the record of %s in the blob store is over %d bytes: %w", ref, maxRefRecord, errdefs.ErrInvalidArgument)
	}
	if err := json.Unmarshal(data, rec); err != nil {
		return nil, fmt.Errorf("the record of %s in the blob store: %v: %w", ref, err, errdefs.ErrInvalidArgument)
	}
	if rec.Ref != ref || len(rec.Layers) == 0 || (!rec.Image && len(rec.Layers) != 1) {
		return nil, fmt.Errorf("the record of %s in the blob store names %q with %d layers: %w", ref, rec.Ref, len(rec.Layers), errdefs.ErrInvalidArgument)
	}
	return rec, nil
}

// dropRef removes the record of ref from the blob store if it still names
// digests: a ref imported again meanwhile keeps its new record.
func (s *Service) dropRef(ctx context.Context, ref string, digests []string) error {
	rec, err := s.readRef(ctx, ref)
	if errors.Is(err, errdefs.ErrNotFound) {
		return nil
	}
	if err != nil {
		return err
	}
	if !slices.Equal(rec.digests(), digests) {
		return nil
	}
	if err := s.cfg.Blobs.Delete(ctx, refKey(ref)); err != nil {
		return fmt.Errorf("remove the record of %s from the blob store: %w", ref, err)
	}
	return nil
}

// DropRecord removes the blob store's record of ref, whatever it names,
// and reports whether there was one. A digest names no record.
func (s *Service) DropRecord(ctx context.Context, ref string) (bool, error) {
	nref, err := image.ParseRef(ref)
	if err != nil {
		return false, nil
	}
	rec, err := s.readRef(ctx, nref)
	if errors.Is(err, errdefs.ErrNotFound) {
		return false, nil
	}
	if err != nil {
		return false, err
	}
	if err := s.dropRef(ctx, nref, rec.digests()); err != nil {
		return true, err
	}
	return true, s.dropSnapshot(ctx, nref)
}

// Adopt records ref, which another node sharing the blob store imported,
// in this node's image store, with the layers the store's record names;
// they must be digests (bottom first), or errdefs.ErrFailedPrecondition
// (the ref was imported again meanwhile). A store without the record or a
// layer's index wraps errdefs.ErrNotFound: it is not the importer's store.
// Only the record and the indexes are read, except in local mode, where
// the layer files are pulled (a local node mounts its own copies), and on
// demand, where what the layers' traces name is prefetched into memory in
// the background (warm).
func (s *Service) Adopt(ctx context.Context, ref string, digests []string) error {
	nref, err := image.ParseRef(ref)
	if err != nil {
		return fmt.Errorf("adopt: %w", err)
	}
	rec, err := s.readRef(ctx, nref)
	if err != nil {
		return fmt.Errorf("adopt %s: %w", nref, err)
	}
	if got := rec.digests(); !slices.Equal(got, digests) {
		return fmt.Errorf("adopt %s: the blob store's record names %s, not %s: it was imported again meanwhile: %w",
			nref, strings.Join(got, ","), strings.Join(digests, ","), errdefs.ErrFailedPrecondition)
	}
	return s.adopt(ctx, rec)
}

func (s *Service) adopt(ctx context.Context, rec *refRecord) error {
	layers := make([]image.Adopted, len(rec.Layers))
	for i, l := range rec.Layers {
		ix, err := blob.GetIndex(ctx, s.cfg.Blobs, strings.TrimPrefix(l.Digest, "sha256:"))
		if err != nil {
			return fmt.Errorf("adopt %s: layer %s: %w", rec.Ref, l.Digest, err)
		}
		if ix.Digest != l.Digest || ix.Size != l.Size {
			return fmt.Errorf("adopt %s: layer %s: the blob store's index is of %s, %d bytes, the record says %d: %w",
				rec.Ref, l.Digest, ix.Digest, ix.Size, l.Size, errdefs.ErrInvalidArgument)
		}
		layers[i] = image.Adopted{Digest: l.Digest, Kind: l.Kind, Size: l.Size, Source: l.Source}
	}
	var img *image.ImageConfig
	if rec.Image {
		img = &rec.Config
	}
	if err := s.images.Adopt(ctx, rec.Ref, layers, img); err != nil {
		return err
	}
	for _, l := range rec.Layers {
		s.warm(ctx, l.Digest)
	}
	if s.cfg.Mode != ModeLocal {
		return nil
	}
	for _, l := range rec.Layers {
		if err := s.fetchFile(ctx, l.Digest); err != nil {
			return fmt.Errorf("adopt %s: %w", rec.Ref, err)
		}
	}
	return nil
}

// fetchFile pulls layer digest's whole file into the image store (local
// mode mounts the store's own copy), once however many ask at a time.
func (s *Service) fetchFile(ctx context.Context, digest string) error {
	if s.images.HasLayerFile(digest) {
		return nil
	}
	_, err, _ := s.flight.Do("file "+digest, func() (any, error) {
		ix, err := blob.GetIndex(ctx, s.cfg.Blobs, strings.TrimPrefix(digest, "sha256:"))
		if err != nil {
			return nil, err
		}
		return nil, s.images.FetchLayerFile(ctx, digest, func(w io.Writer) error {
			return blob.GetLayer(ctx, s.cfg.Blobs, ix, w)
		})
	})
	return err
}

// adoptMissing adopts from the blob store every part of environment env
// (BASE[+LAYER...]) this node has no layer or image of. A part the store
// has no record of is left for the environment's resolution to report.
func (s *Service) adoptMissing(ctx context.Context, env string) error {
	for _, part := range strings.Split(env, "+") {
		ref, err := image.ParseRef(strings.TrimSpace(part))
		if err != nil || s.knows(ref) {
			continue // a digest, a malformed name, or one the node has
		}
		rec, err := s.readRef(ctx, ref)
		if errors.Is(err, errdefs.ErrNotFound) {
			continue
		}
		if err != nil {
			return err
		}
		if err := s.adopt(ctx, rec); err != nil {
			return err
		}
		s.log.Info("adopted on first use", "ref", ref, "layers", len(rec.Layers))
	}
	return nil
}

// knows reports whether the image store has a layer or an image named ref.
func (s *Service) knows(ref string) bool {
	if _, err := s.images.Image(ref); err == nil {
		return true
	}
	_, err := s.images.Get(ref)
	return err == nil
}

// RenameRef moves the name to onto what from names on this node (see
// image.Store.RenameRef), then writes the blob store's record of to from
// this node's and drops from's, so that every node sharing the store
// adopts the new version. Renaming again once from is gone here answers
// errdefs.ErrNotFound. Snapshots are not renamed (their info is kept by
// name): errdefs.ErrInvalidArgument.
func (s *Service) RenameRef(ctx context.Context, from, to string) error {
	if strings.HasPrefix(from, snapshotPrefix) || strings.HasPrefix(to, snapshotPrefix) {
		return fmt.Errorf("rename ref %s to %s: a snapshot is not renamed: %w", from, to, errdefs.ErrInvalidArgument)
	}
	nfrom, err := image.ParseRef(from)
	if err != nil {
		return fmt.Errorf("rename ref: %w", err)
	}
	var digests []string
	if rec, err := s.localRecord(nfrom); err == nil {
		digests = rec.digests()
	}
	if err := s.images.RenameRef(from, to); err != nil {
		return err
	}
	if err := s.publishRef(ctx, to); err != nil {
		return fmt.Errorf("rename ref %s: %w", nfrom, err)
	}
	if err := s.dropRef(ctx, nfrom, digests); err != nil {
		return fmt.Errorf("rename ref %s: %w", nfrom, err)
	}
	return nil
}

package layers

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"strings"
	"time"

	"google.golang.org/protobuf/encoding/protojson"

	dsecv1 "dsec.dev/dsec/api/gen/dsec/v1"
	"dsec.dev/dsec/internal/edge/image"
	"dsec.dev/dsec/internal/errdefs"
)

// Snapshot layers. A snapshot is a layer of kind snapshot named snap:NAME,
// published like any layer (chunks, index, ref record), plus what it was
// taken from (its SnapshotInfo) at snapshots/NAME.json in the blob store, so
// that every node sharing the store lists it the same.

const snapshotPrefix = "snap:"

func snapshotKey(name string) string { return "snapshots/" + name + ".json" }

// maxSnapshotInfo bounds an info object read from the store.
const maxSnapshotInfo = 1 << 20

// HasRef reports whether ref names a layer on this node or in the blob
// store (another node's).
func (s *Service) HasRef(ref string) bool {
	nref, err := image.ParseRef(ref)
	if err != nil {
		return false
	}
	if s.knows(nref) {
		return true
	}
	_, err = s.readRef(context.Background(), nref)
	return err == nil
}

// StagePath is where a snapshot's layer file is built (snapshot.Pack's
// out) for AddSnapshot to move in by rename: a path in the image store's
// temporary directory, on its file system, which a restarted dsecd clears.
func (s *Service) StagePath(name string) string {
	return s.images.StagePath("snap-" + name + ".erofs")
}

// AddSnapshot stores the packed EROFS file, built at StagePath and sealed
// (its digest and size are info's), as layer ref (snap:NAME), kind
// snapshot, and publishes it: its chunks and index, its info, then its
// ref, in that order, so a node that finds the ref finds the whole layer.
// The file is consumed: moved into the image store, or removed. The mark
// of the layer's metadata chunks is made in the background (publish);
// a sandbox mounting the layer on this node waits for it.
func (s *Service) AddSnapshot(ctx context.Context, ref, file string, info *dsecv1.SnapshotInfo) error {
	defer os.Remove(file)
	start := time.Now()
	adopted := image.Adopted{Digest: info.GetDigest(), Kind: image.KindSnapshot, Size: info.GetSize(),
		Source: fmt.Sprintf("snapshot of %s on %s", info.GetSourceSandbox(), info.GetNode())}
	if err := s.images.Adopt(ctx, ref, []image.Adopted{adopted}, nil); err != nil {
		return fmt.Errorf("add snapshot layer %s: %w", ref, err)
	}
	if err := s.images.AddLayerFile(ctx, info.GetDigest(), file); err != nil {
		s.images.Remove(ref)
		return fmt.Errorf("add snapshot layer %s: %w", ref, err)
	}
	stored := time.Since(start)
	if err := s.publish(ctx, info.GetDigest(), true); err != nil {
		return fmt.Errorf("publish snapshot %s: %w", ref, err)
	}
	published := time.Since(start)
	data, err := protojson.Marshal(info)
	if err != nil {
		return fmt.Errorf("add snapshot layer %s: %w", ref, err)
	}
	if err := s.cfg.Blobs.Put(ctx, snapshotKey(strings.TrimPrefix(ref, snapshotPrefix)), bytes.NewReader(data), int64(len(data))); err != nil {
		return fmt.Errorf("publish snapshot %s: %w", ref, err)
	}
	s.warm(ctx, info.GetDigest())
	if err := s.publishRef(ctx, ref); err != nil {
		return err
	}
	s.log.Debug("published snapshot", "ref", ref, "digest", info.GetDigest(), "stored", stored,
		"chunks_published", published, "took", time.Since(start))
	return nil
}

// SnapshotsOf is every snapshot the layer l is, one per snap: ref whose
// info the blob store holds: snapshots of the same files share a layer.
func (s *Service) SnapshotsOf(ctx context.Context, l image.Layer) []*dsecv1.SnapshotInfo {
	var out []*dsecv1.SnapshotInfo
	for _, ref := range l.Refs {
		name, ok := strings.CutPrefix(ref, snapshotPrefix)
		if !ok {
			continue
		}
		info, err := s.readSnapshot(ctx, name)
		if err != nil {
			s.log.Debug("read snapshot info", "snapshot", name, "err", err)
			continue
		}
		out = append(out, info)
	}
	return out
}

func (s *Service) readSnapshot(ctx context.Context, name string) (*dsecv1.SnapshotInfo, error) {
	rc, err := s.cfg.Blobs.Get(ctx, snapshotKey(name))
	if err != nil {
		return nil, err
	}
	defer rc.Close()
	data, err := io.ReadAll(io.LimitReader(rc, maxSnapshotInfo+1))
	if err != nil {
		return nil, err
	}
	if len(data) > maxSnapshotInfo {
		return nil, fmt.Errorf("snapshot %s: info over %d bytes: %w", name, maxSnapshotInfo, errdefs.ErrInvalidArgument)
	}
	info := &dsecv1.SnapshotInfo{}
	if err := protojson.Unmarshal(data, info); err != nil {
		return nil, fmt.Errorf("snapshot %s: %v: %w", name, err, errdefs.ErrInvalidArgument)
	}
	if info.GetName() != name {
		return nil, fmt.Errorf("snapshot %s: its info names %q: %w", name, info.GetName(), errdefs.ErrInvalidArgument)
	}
	return info, nil
}

// dropSnapshot removes the info of a snapshot ref removed from the store.
func (s *Service) dropSnapshot(ctx context.Context, ref string) error {
	name, ok := strings.CutPrefix(ref, snapshotPrefix)
	if !ok {
		return nil
	}
	if err := s.cfg.Blobs.Delete(ctx, snapshotKey(name)); err != nil && !errors.Is(err, errdefs.ErrNotFound) {
		return fmt.Errorf("remove the info of snapshot %s: %w", name, err)
	}
	return nil
}

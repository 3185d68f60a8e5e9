package layers

import (
	"context"
	"errors"
	"fmt"
	"path/filepath"
	"strings"
	"sync"
	"time"

	"connectrpc.com/connect"

	dsecv1 "dsec.dev/dsec/api/gen/dsec/v1"
	"dsec.dev/dsec/api/gen/dsec/v1/dsecv1connect"
	"dsec.dev/dsec/internal/edge/image"
	"dsec.dev/dsec/internal/errdefs"
	"dsec.dev/dsec/internal/layerupload"
	"dsec.dev/dsec/internal/oci"
)

// Handler serves the public LayerService from a node's layer service. In
// the all-in-one dsecd the apiserver mounts it as it is.
type Handler struct {
	dsecv1connect.UnimplementedLayerServiceHandler
	svc *Service
	// inUse names a live sandbox that runs on the layer digest, "" for
	// none: a layer in use is not removed.
	inUse func(ctx context.Context, digest string) (string, error)
}

// NewHandler returns the LayerService of svc. inUse says which live
// sandbox, if any, runs on a layer.
func NewHandler(svc *Service, inUse func(ctx context.Context, digest string) (string, error)) *Handler {
	return &Handler{svc: svc, inUse: inUse}
}

var kinds = map[dsecv1.LayerKind]image.Kind{
	dsecv1.LayerKind_LAYER_KIND_BASE:      image.KindBase,
	dsecv1.LayerKind_LAYER_KIND_WORKSPACE: image.KindWorkspace,
	dsecv1.LayerKind_LAYER_KIND_TOOLKIT:   image.KindToolkit,
	dsecv1.LayerKind_LAYER_KIND_SNAPSHOT:  image.KindSnapshot,
}

func layerToProto(l image.Layer) *dsecv1.Layer {
	out := &dsecv1.Layer{Digest: l.Digest, Refs: l.Refs, Size: l.Size, CreatedUnixMs: l.Created.UnixMilli(), Source: l.Source,
		Warnings: l.Warnings, Images: l.Images}
	for k, v := range kinds {
		if v == l.Kind {
			out.Kind = k
		}
	}
	return out
}

func (ls *Handler) ImportLayer(ctx context.Context, req *connect.Request[dsecv1.ImportLayerRequest]) (*connect.Response[dsecv1.Layer], error) {
	m := req.Msg
	kind, ok := kinds[m.GetKind()]
	if !ok || kind == image.KindSnapshot {
		return nil, fmt.Errorf("layer kind must be base, workspace or toolkit (snapshot layers are made by Snapshot): %w", errdefs.ErrInvalidArgument)
	}
	if src := m.GetPath(); !filepath.IsAbs(src) {
		return nil, fmt.Errorf("import path %q must be absolute (a path on the daemon's host; UploadLayer sends a tree from the client's): %w", src, errdefs.ErrInvalidArgument)
	}
	l, err := ls.svc.Import(ctx, m.GetRef(), kind, m.GetPath(), image.ImportOptions{AllowSetuid: m.GetAllowSetuid()})
	if err != nil {
		return nil, err
	}
	return connect.NewResponse(layerToProto(l)), nil
}

func (ls *Handler) UploadLayer(ctx context.Context, stream *connect.ClientStream[dsecv1.UploadLayerRequest]) (*connect.Response[dsecv1.Layer], error) {
	l, err := ls.UploadLayerFrom(ctx, stream)
	if err != nil {
		return nil, err
	}
	return connect.NewResponse(l), nil
}

// UploadLayerFrom builds a layer from the archive an upload's stream
// carries, extracted as it arrives: at most the service's MaxUpload bytes
// of archive, unpacking to at most as many bytes of files.
func (ls *Handler) UploadLayerFrom(ctx context.Context, s layerupload.Stream) (*dsecv1.Layer, error) {
	_, h, err := layerupload.ReadHeader(s)
	if err != nil {
		return nil, err
	}
	kind, ok := kinds[h.GetKind()]
	if !ok || kind == image.KindSnapshot {
		return nil, fmt.Errorf("upload layer %s: layer kind must be base, workspace or toolkit (snapshot layers are made by Snapshot): %w", h.GetRef(), errdefs.ErrInvalidArgument)
	}
	limit := ls.svc.MaxUpload()
	if h.GetSize() > limit {
		return nil, fmt.Errorf("upload layer %s: an archive of %s is over the %s an upload may have (%s): %w",
			h.GetRef(), layerupload.Size(h.GetSize()), layerupload.Size(limit), MaxUploadFlag, errdefs.ErrResourceExhausted)
	}
	body := layerupload.NewBody(s, h.GetRef(), limit, MaxUploadFlag)
	l, err := ls.svc.ImportArchive(ctx, h.GetRef(), kind, body, image.ImportOptions{
		AllowSetuid: h.GetAllowSetuid(), MaxBytes: limit, LimitName: MaxUploadFlag,
	})
	if err != nil {
		return nil, err
	}
	return layerToProto(l), nil
}

// AdoptLayers records ref, which another node sharing the blob store
// imported, naming digests (see Service.Adopt).
func (ls *Handler) AdoptLayers(ctx context.Context, ref string, digests []string) error {
	return ls.svc.Adopt(ctx, ref, digests)
}

// RenameRef moves the name to onto what from names (see Service.RenameRef).
func (ls *Handler) RenameRef(ctx context.Context, from, to string) error {
	return ls.svc.RenameRef(ctx, from, to)
}

// BlobStore names the node's blob store alike on every node sharing it.
func (ls *Handler) BlobStore() string { return ls.svc.BlobStoreName() }

func (ls *Handler) ListLayers(ctx context.Context, req *connect.Request[dsecv1.ListLayersRequest]) (*connect.Response[dsecv1.ListLayersResponse], error) {
	all, err := ls.svc.List()
	if err != nil {
		return nil, err
	}
	out := &dsecv1.ListLayersResponse{}
	for _, l := range all {
		pl := layerToProto(l)
		if l.Kind == image.KindSnapshot {
			pl.Snapshots = ls.svc.SnapshotsOf(ctx, l)
			if len(pl.Snapshots) > 0 {
				pl.Snapshot = pl.Snapshots[0]
			}
		}
		out.Layers = append(out.Layers, pl)
	}
	return connect.NewResponse(out), nil
}

// RemoveLayer removes a layer's ref, an image, or a layer by digest; it
// refuses to take away a layer that a live sandbox runs on.
func (ls *Handler) RemoveLayer(ctx context.Context, req *connect.Request[dsecv1.RemoveLayerRequest]) (*connect.Response[dsecv1.RemoveLayerResponse], error) {
	if img, err := ls.svc.Image(req.Msg.GetRef()); err == nil {
		return ls.removeImage(ctx, img)
	}
	l, err := ls.svc.Get(req.Msg.GetRef())
	if errors.Is(err, errdefs.ErrNotFound) {
		// The blob store may have it still (the node that imported it
		// left): its record goes, so that no node adopts it again.
		if dropped, derr := ls.svc.DropRecord(ctx, req.Msg.GetRef()); derr != nil || !dropped {
			return nil, err
		}
		return connect.NewResponse(&dsecv1.RemoveLayerResponse{}), nil
	}
	if err != nil {
		return nil, err
	}
	lastRef := len(l.Refs) <= 1 || req.Msg.GetRef() == l.Digest
	if lastRef && ls.inUse != nil {
		id, err := ls.inUse(ctx, l.Digest)
		if err != nil {
			return nil, err
		}
		if id != "" {
			return nil, fmt.Errorf("layer %s is in use by sandbox %s: %w", req.Msg.GetRef(), id, errdefs.ErrFailedPrecondition)
		}
	}
	if err := ls.svc.Remove(ctx, req.Msg.GetRef()); err != nil {
		return nil, err
	}
	return connect.NewResponse(&dsecv1.RemoveLayerResponse{}), nil
}

// removeImage removes an image, refusing while a live sandbox runs on a
// layer that goes with it (one no other ref or image names). Before, an
// image's name was looked up as a layer's, not found, and only the blob
// store's record of it dropped: the image stayed on the node.
func (ls *Handler) removeImage(ctx context.Context, img image.ImageInfo) (*connect.Response[dsecv1.RemoveLayerResponse], error) {
	if ls.inUse != nil {
		for _, d := range img.Digests {
			l, err := ls.svc.Get(d)
			if err != nil || len(l.Refs) > 0 || len(l.Images) > 1 {
				continue // gone already, or kept by another name
			}
			id, err := ls.inUse(ctx, d)
			if err != nil {
				return nil, err
			}
			if id != "" {
				return nil, fmt.Errorf("image %s: its layer %s is in use by sandbox %s: %w", img.Ref, d, id, errdefs.ErrFailedPrecondition)
			}
		}
	}
	if err := ls.svc.Remove(ctx, img.Ref); err != nil {
		return nil, err
	}
	return connect.NewResponse(&dsecv1.RemoveLayerResponse{}), nil
}

func (ls *Handler) ListEnvironments(ctx context.Context, req *connect.Request[dsecv1.ListEnvironmentsRequest]) (*connect.Response[dsecv1.ListEnvironmentsResponse], error) {
	envs, err := ls.svc.Environments()
	if err != nil {
		return nil, err
	}
	out := &dsecv1.ListEnvironmentsResponse{}
	for _, e := range envs {
		out.Environments = append(out.Environments, &dsecv1.Environment{Name: e.Name, LayerDigests: e.Digests,
			Sandboxes: e.Sandboxes, LastUsedUnixMs: e.LastUsed.UnixMilli()})
	}
	return connect.NewResponse(out), nil
}

// ImportImage imports an OCI image as an environment, streaming progress.
func (ls *Handler) ImportImage(ctx context.Context, req *connect.Request[dsecv1.ImportImageRequest], out *connect.ServerStream[dsecv1.ImportImageProgress]) error {
	return ls.ImportImageTo(ctx, req.Msg, out.Send)
}

// ImportImageTo is ImportImage with progress sent through send, for a
// caller without a stream of its own to hand over (an apiserver importing on
// several edges at once).
func (ls *Handler) ImportImageTo(ctx context.Context, m *dsecv1.ImportImageRequest, sendMsg func(*dsecv1.ImportImageProgress) error) error {
	if m.GetRef() == "" || m.GetSource() == "" {
		return fmt.Errorf("import image: ref (name:tag) and source are required: %w", errdefs.ErrInvalidArgument)
	}
	src := m.GetSource()
	for _, p := range []string{"oci:", "docker-archive:"} {
		if rest, ok := strings.CutPrefix(src, p); ok && !filepath.IsAbs(rest) {
			return fmt.Errorf("import image: %s path %q must be absolute (a path on the daemon's host): %w", p, rest, errdefs.ErrInvalidArgument)
		}
	}
	// Progress is sent from the import's goroutine; a slow or gone client
	// must not stall it, so only the latest message waits to be sent.
	var mu sync.Mutex
	var sendErr error
	lastSent := time.Time{}
	send := func(p *dsecv1.ImportImageProgress, force bool) {
		mu.Lock()
		defer mu.Unlock()
		if sendErr != nil || (!force && time.Since(lastSent) < 100*time.Millisecond) {
			return
		}
		lastSent = time.Now()
		sendErr = sendMsg(p)
	}
	prevPhase := ""
	opts := oci.Options{
		Insecure: m.GetInsecure(), CollapseBelow: m.GetCollapseBelowBytes(),
		ImportOptions: image.ImportOptions{AllowSetuid: m.GetAllowSetuid()},
		Progress: func(p oci.Progress) {
			key := fmt.Sprintf("%s/%d", p.Phase, p.Layer)
			send(&dsecv1.ImportImageProgress{Phase: p.Phase, Layer: int32(p.Layer), Layers: int32(p.Layers),
				Bytes: p.Bytes, TotalBytes: p.TotalBytes, Rate: p.Rate}, key != prevPhase)
			prevPhase = key
		},
	}
	res, err := ls.svc.ImportImage(ctx, m.GetRef(), src, opts)
	if err != nil {
		return err
	}
	send(&dsecv1.ImportImageProgress{Phase: "done", Done: true, LayerDigests: res.Digests, OciLayers: int32(res.Collapsed), Warnings: res.Warnings}, true)
	mu.Lock()
	defer mu.Unlock()
	return sendErr
}

// LayerStats reports per layer and environment what sandboxes read.
func (ls *Handler) LayerStats(ctx context.Context, req *connect.Request[dsecv1.LayerStatsRequest]) (*connect.Response[dsecv1.LayerStatsResponse], error) {
	st, err := ls.svc.Stats(ctx)
	if err != nil {
		return nil, err
	}
	out := &dsecv1.LayerStatsResponse{Mode: string(st.Mode), BlobStore: st.BlobStore}
	for _, l := range st.Layers {
		out.Layers = append(out.Layers, &dsecv1.LayerUsage{
			Digest: l.Digest, Refs: l.Refs, Size: l.Size, BytesRead: l.BytesRead, BytesFetched: l.BytesFetched,
			ChunksTotal: l.ChunksTotal, ChunksFetched: l.ChunksFetched, CacheHits: l.CacheHits,
			CacheMisses: l.CacheMisses, FetchErrors: l.FetchErrors, Sandboxes: l.Sandboxes,
			BytesFetchedPlain: l.BytesFetchedPlain, MemoryHits: l.MemoryHits, DiskHits: l.DiskHits,
			BytesWrittenDisk: l.BytesWrittenDisk, BytesPushed: l.BytesPushed,
		})
	}
	for _, e := range st.Environments {
		out.Environments = append(out.Environments, &dsecv1.EnvironmentUsage{
			Name: e.Name, LayerDigests: e.Digests, Size: e.Size, BytesRead: e.BytesRead, Sandboxes: e.Sandboxes,
		})
	}
	return connect.NewResponse(out), nil
}

package apiserver

import (
	"context"
	"fmt"
	"path/filepath"
	"slices"

	"connectrpc.com/connect"

	dsecv1 "dsec.dev/dsec/api/gen/dsec/v1"
	"dsec.dev/dsec/internal/edge/image"
	"dsec.dev/dsec/internal/errdefs"
)

// Layers is the node's layer store. *image.Store implements it.
type Layers interface {
	Import(ctx context.Context, ref string, kind image.Kind, src string, opts image.ImportOptions) (image.Layer, error)
	List() ([]image.Layer, error)
	Get(refOrDigest string) (image.Layer, error)
	Remove(refOrDigest string) error
	Environments() ([]image.Environment, error)
}

type layerServer struct{ s *Server }

var kinds = map[dsecv1.LayerKind]image.Kind{
	dsecv1.LayerKind_LAYER_KIND_BASE:      image.KindBase,
	dsecv1.LayerKind_LAYER_KIND_WORKSPACE: image.KindWorkspace,
	dsecv1.LayerKind_LAYER_KIND_TOOLKIT:   image.KindToolkit,
}

func layerToProto(l image.Layer) *dsecv1.Layer {
	out := &dsecv1.Layer{Digest: l.Digest, Refs: l.Refs, Size: l.Size, CreatedUnixMs: l.Created.UnixMilli(), Source: l.Source}
	for k, v := range kinds {
		if v == l.Kind {
			out.Kind = k
		}
	}
	return out
}

func (ls *layerServer) ImportLayer(ctx context.Context, req *connect.Request[dsecv1.ImportLayerRequest]) (*connect.Response[dsecv1.Layer], error) {
	m := req.Msg
	kind, ok := kinds[m.GetKind()]
	if !ok {
		return nil, fmt.Errorf("layer kind must be base, workspace or toolkit: %w", errdefs.ErrInvalidArgument)
	}
	if !filepath.IsAbs(m.GetPath()) {
		return nil, fmt.Errorf("import path %q must be absolute (a path on the daemon's host): %w", m.GetPath(), errdefs.ErrInvalidArgument)
	}
	l, err := ls.s.layers.Import(ctx, m.GetRef(), kind, m.GetPath(), image.ImportOptions{AllowSetuid: m.GetAllowSetuid()})
	if err != nil {
		return nil, err
	}
	return connect.NewResponse(layerToProto(l)), nil
}

func (ls *layerServer) ListLayers(ctx context.Context, req *connect.Request[dsecv1.ListLayersRequest]) (*connect.Response[dsecv1.ListLayersResponse], error) {
	all, err := ls.s.layers.List()
	if err != nil {
		return nil, err
	}
	out := &dsecv1.ListLayersResponse{}
	for _, l := range all {
		out.Layers = append(out.Layers, layerToProto(l))
	}
	return connect.NewResponse(out), nil
}

// RemoveLayer refuses to remove a layer that a live sandbox runs on.
func (ls *layerServer) RemoveLayer(ctx context.Context, req *connect.Request[dsecv1.RemoveLayerRequest]) (*connect.Response[dsecv1.RemoveLayerResponse], error) {
	l, err := ls.s.layers.Get(req.Msg.GetRef())
	if err != nil {
		return nil, err
	}
	lastRef := len(l.Refs) <= 1 || req.Msg.GetRef() == l.Digest
	if lastRef {
		for _, n := range ls.s.order {
			live, err := ls.s.edges[n].List(ctx, nil, []dsecv1.State{dsecv1.State_STATE_CREATING, dsecv1.State_STATE_RUNNING})
			if err != nil {
				return nil, err
			}
			for _, sb := range live {
				if slices.Contains(sb.GetLayerDigests(), l.Digest) {
					return nil, fmt.Errorf("layer %s is in use by sandbox %s: %w", req.Msg.GetRef(), sb.GetId(), errdefs.ErrFailedPrecondition)
				}
			}
		}
	}
	if err := ls.s.layers.Remove(req.Msg.GetRef()); err != nil {
		return nil, err
	}
	return connect.NewResponse(&dsecv1.RemoveLayerResponse{}), nil
}

func (ls *layerServer) ListEnvironments(ctx context.Context, req *connect.Request[dsecv1.ListEnvironmentsRequest]) (*connect.Response[dsecv1.ListEnvironmentsResponse], error) {
	envs, err := ls.s.layers.Environments()
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

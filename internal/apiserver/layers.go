package apiserver

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"sync"

	"connectrpc.com/connect"

	dsecv1 "dsec.dev/dsec/api/gen/dsec/v1"
	"dsec.dev/dsec/api/gen/dsec/v1/dsecv1connect"
	"dsec.dev/dsec/internal/errdefs"
	"dsec.dev/dsec/internal/watcher"
)

// layerService serves the public LayerService over every routable edge:
// an import is handed to each (the same source builds the same layer, so
// its digest is one, and a blob store the nodes share keeps its chunks
// once), and listings are merged. With one node, as in the all-in-one
// dsecd, it is that node's layer service.
type layerService struct {
	dsecv1connect.UnimplementedLayerServiceHandler
	s *Server
}

// imageImporter is what an Edge offers beyond EdgeService for image
// imports: progress through a function, so that one import may run on
// several edges at once. edgesvc.Service and edgeclient.Remote have it.
type imageImporter interface {
	ImportImageTo(ctx context.Context, m *dsecv1.ImportImageRequest, send func(*dsecv1.ImportImageProgress) error) error
}

func (ls *layerService) nodes() ([]watcher.Node, error) {
	nodes := ls.s.routable()
	if len(nodes) == 0 {
		return nil, fmt.Errorf("no edge is routable: %w", errdefs.ErrUnavailable)
	}
	return nodes, nil
}

// onEach runs call on every routable edge at once and returns the answers
// in node order, or the first error (naming its node).
func onEach[Res any](ls *layerService, call func(e watcher.Edge) (*connect.Response[Res], error)) ([]*Res, error) {
	nodes, err := ls.nodes()
	if err != nil {
		return nil, err
	}
	out := make([]*Res, len(nodes))
	errs := make([]error, len(nodes))
	var wg sync.WaitGroup
	for i, n := range nodes {
		wg.Add(1)
		go func() {
			defer wg.Done()
			resp, err := call(n.Edge)
			if err != nil {
				errs[i] = fmt.Errorf("node %s: %w", n.Name, err)
				return
			}
			out[i] = resp.Msg
		}()
	}
	wg.Wait()
	if len(nodes) == 1 && errs[0] != nil {
		return nil, errors.Unwrap(errs[0]) // one node: its own words
	}
	return out, errors.Join(errs...)
}

// maxArchive bounds an import's archive sent in its request.
const maxArchive = 1 << 30

func (ls *layerService) ImportLayer(ctx context.Context, req *connect.Request[dsecv1.ImportLayerRequest]) (*connect.Response[dsecv1.Layer], error) {
	if n := len(req.Msg.GetArchive()); n > maxArchive {
		return nil, fmt.Errorf("import layer %s: an archive of %d MiB is over the %d MiB a request carries; name a path on the nodes or import an OCI image: %w",
			req.Msg.GetRef(), n>>20, maxArchive>>20, errdefs.ErrInvalidArgument)
	}
	all, err := onEach(ls, func(e watcher.Edge) (*connect.Response[dsecv1.Layer], error) { return e.ImportLayer(ctx, req) })
	if err != nil {
		return nil, err
	}
	out := all[0]
	for _, l := range all[1:] {
		if l.GetDigest() != out.GetDigest() {
			return nil, fmt.Errorf("import layer %s: the nodes built different layers (%s and %s) from one source; is the path the same on every node? (--upload sends the tree to each): %w",
				req.Msg.GetRef(), out.GetDigest(), l.GetDigest(), errdefs.ErrFailedPrecondition)
		}
		out.Warnings = mergeStrings(out.Warnings, l.GetWarnings())
	}
	return connect.NewResponse(out), nil
}

func (ls *layerService) ListLayers(ctx context.Context, req *connect.Request[dsecv1.ListLayersRequest]) (*connect.Response[dsecv1.ListLayersResponse], error) {
	all, err := onEach(ls, func(e watcher.Edge) (*connect.Response[dsecv1.ListLayersResponse], error) {
		return e.ListLayers(ctx, req)
	})
	if err != nil {
		return nil, err
	}
	out := &dsecv1.ListLayersResponse{}
	byDigest := map[string]*dsecv1.Layer{}
	for _, resp := range all {
		for _, l := range resp.GetLayers() {
			if have := byDigest[l.GetDigest()]; have != nil {
				have.Refs = mergeStrings(have.Refs, l.GetRefs())
				continue
			}
			byDigest[l.GetDigest()] = l
			out.Layers = append(out.Layers, l)
		}
	}
	return connect.NewResponse(out), nil
}

// RemoveLayer removes the layer from every node that has it; a node where
// a live sandbox runs on it refuses, and the layer stays there.
func (ls *layerService) RemoveLayer(ctx context.Context, req *connect.Request[dsecv1.RemoveLayerRequest]) (*connect.Response[dsecv1.RemoveLayerResponse], error) {
	nodes, err := ls.nodes()
	if err != nil {
		return nil, err
	}
	if len(nodes) == 1 {
		return nodes[0].Edge.RemoveLayer(ctx, req) // its own words
	}
	removed := false
	var errs []error
	for _, n := range nodes {
		_, err := n.Edge.RemoveLayer(ctx, req)
		switch {
		case err == nil:
			removed = true
		case !errors.Is(err, errdefs.ErrNotFound):
			errs = append(errs, fmt.Errorf("node %s: %w", n.Name, err))
		}
	}
	if err := errors.Join(errs...); err != nil {
		return nil, err
	}
	if !removed {
		return nil, fmt.Errorf("layer %s: no node has it: %w", req.Msg.GetRef(), errdefs.ErrNotFound)
	}
	return connect.NewResponse(&dsecv1.RemoveLayerResponse{}), nil
}

func (ls *layerService) ListEnvironments(ctx context.Context, req *connect.Request[dsecv1.ListEnvironmentsRequest]) (*connect.Response[dsecv1.ListEnvironmentsResponse], error) {
	all, err := onEach(ls, func(e watcher.Edge) (*connect.Response[dsecv1.ListEnvironmentsResponse], error) {
		return e.ListEnvironments(ctx, req)
	})
	if err != nil {
		return nil, err
	}
	out := &dsecv1.ListEnvironmentsResponse{}
	byName := map[string]*dsecv1.Environment{}
	for _, resp := range all {
		for _, e := range resp.GetEnvironments() {
			if have := byName[e.GetName()]; have != nil {
				have.Sandboxes += e.GetSandboxes()
				have.LastUsedUnixMs = max(have.LastUsedUnixMs, e.GetLastUsedUnixMs())
				continue
			}
			byName[e.GetName()] = e
			out.Environments = append(out.Environments, e)
		}
	}
	return connect.NewResponse(out), nil
}

// ImportImage imports on every node at once; the caller sees the first
// node's progress, and the end once every node is done.
func (ls *layerService) ImportImage(ctx context.Context, req *connect.Request[dsecv1.ImportImageRequest], out *connect.ServerStream[dsecv1.ImportImageProgress]) error {
	nodes, err := ls.nodes()
	if err != nil {
		return err
	}
	if len(nodes) == 1 {
		return nodes[0].Edge.ImportImage(ctx, req, out)
	}
	var mu sync.Mutex
	var last *dsecv1.ImportImageProgress
	errs := make([]error, len(nodes))
	var wg sync.WaitGroup
	for i, n := range nodes {
		im, ok := n.Edge.(imageImporter)
		if !ok {
			errs[i] = fmt.Errorf("node %s cannot import images for a cluster: %w", n.Name, errdefs.ErrNotSupported)
			continue
		}
		wg.Add(1)
		go func() {
			defer wg.Done()
			err := im.ImportImageTo(ctx, req.Msg, func(p *dsecv1.ImportImageProgress) error {
				if i != 0 {
					return nil
				}
				if p.GetDone() {
					mu.Lock()
					last = p
					mu.Unlock()
					return nil
				}
				mu.Lock()
				defer mu.Unlock()
				return out.Send(p)
			})
			if err != nil {
				errs[i] = fmt.Errorf("node %s: %w", n.Name, err)
			}
		}()
	}
	wg.Wait()
	if err := errors.Join(errs...); err != nil {
		return err
	}
	if last == nil {
		return fmt.Errorf("import image %s: node %s ended without a result: %w", req.Msg.GetRef(), nodes[0].Name, errdefs.ErrInternal)
	}
	return out.Send(last)
}

// LayerStats adds up every node's accounting per layer and environment.
func (ls *layerService) LayerStats(ctx context.Context, req *connect.Request[dsecv1.LayerStatsRequest]) (*connect.Response[dsecv1.LayerStatsResponse], error) {
	all, err := onEach(ls, func(e watcher.Edge) (*connect.Response[dsecv1.LayerStatsResponse], error) {
		return e.LayerStats(ctx, req)
	})
	if err != nil {
		return nil, err
	}
	out := all[0]
	layers := map[string]*dsecv1.LayerUsage{}
	for _, l := range out.Layers {
		layers[l.GetDigest()] = l
	}
	envs := map[string]*dsecv1.EnvironmentUsage{}
	for _, e := range out.Environments {
		envs[e.GetName()] = e
	}
	for _, st := range all[1:] {
		for _, l := range st.GetLayers() {
			have := layers[l.GetDigest()]
			if have == nil {
				layers[l.GetDigest()] = l
				out.Layers = append(out.Layers, l)
				continue
			}
			have.BytesRead += l.GetBytesRead()
			have.BytesFetched += l.GetBytesFetched()
			have.ChunksFetched += l.GetChunksFetched()
			have.CacheHits += l.GetCacheHits()
			have.CacheMisses += l.GetCacheMisses()
			have.FetchErrors += l.GetFetchErrors()
			have.Sandboxes += l.GetSandboxes()
		}
		for _, e := range st.GetEnvironments() {
			have := envs[e.GetName()]
			if have == nil {
				envs[e.GetName()] = e
				out.Environments = append(out.Environments, e)
				continue
			}
			have.BytesRead += e.GetBytesRead()
			have.Sandboxes += e.GetSandboxes()
		}
	}
	return connect.NewResponse(out), nil
}

// mergeStrings appends to a the strings of b it lacks.
func mergeStrings(a, b []string) []string {
	for _, s := range b {
		if !slices.Contains(a, s) {
			a = append(a, s)
		}
	}
	return a
}

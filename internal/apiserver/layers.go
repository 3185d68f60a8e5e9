package apiserver

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"
	"sync"

	"connectrpc.com/connect"

	edgev1 "dsec.dev/dsec/api/gen/dsec/edge/v1"
	dsecv1 "dsec.dev/dsec/api/gen/dsec/v1"
	"dsec.dev/dsec/api/gen/dsec/v1/dsecv1connect"
	"dsec.dev/dsec/internal/errdefs"
	"dsec.dev/dsec/internal/iam"
	"dsec.dev/dsec/internal/layerupload"
	"dsec.dev/dsec/internal/store"
	"dsec.dev/dsec/internal/watcher"
)

// layerService serves the public LayerService over every routable edge.
// An import runs on one edge per blob store and the others adopt what it
// made (imports.go); listings are merged. With one node, as in the
// all-in-one dsecd, it is that node's layer service.
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

// layerUploader is what an Edge offers beyond EdgeService for uploads: a
// stream that is not a Connect handler's, such as the caller's with its
// header put back, or one of several copies. edgesvc.Service and
// edgeclient.Remote have it.
type layerUploader interface {
	UploadLayerFrom(ctx context.Context, in layerupload.Stream) (*dsecv1.Layer, error)
}

// maxUploadMessage bounds one message of any LayerService call: an
// upload's pieces are the only large ones, so no message of an archive
// stays in memory beyond this.
const maxUploadMessage = 8 << 20

func (ls *layerService) nodes() ([]watcher.Node, error) {
	nodes := ls.s.routable()
	if len(nodes) == 0 {
		return nil, fmt.Errorf("no edge is routable: %w", errdefs.ErrUnavailable)
	}
	return nodes, nil
}

// onEach runs call on every node at once and returns the answers in node
// order, or the errors (each naming its node).
func onEach[Res any](nodes []watcher.Node, call func(e watcher.Edge) (*connect.Response[Res], error)) ([]*Res, error) {
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
	return out, errors.Join(errs...)
}

// onRoutable is onEach over every routable node; with one, an error is in
// the node's own words.
func onRoutable[Res any](ls *layerService, call func(e watcher.Edge) (*connect.Response[Res], error)) ([]*Res, error) {
	nodes, err := ls.nodes()
	if err != nil {
		return nil, err
	}
	if len(nodes) == 1 {
		resp, err := call(nodes[0].Edge)
		if err != nil {
			return nil, err // one node: its own words
		}
		return []*Res{resp.Msg}, nil
	}
	return onEach(nodes, call)
}

// ImportLayer imports a path on one node per blob store; the others adopt
// the layer. The layer goes to the request's project (or the token's),
// whose quota is charged its bytes.
func (ls *layerService) ImportLayer(ctx context.Context, req *connect.Request[dsecv1.ImportLayerRequest]) (*connect.Response[dsecv1.Layer], error) {
	c, project, err := ls.claimLayer(ctx, "/dsec.v1.LayerService/ImportLayer", req.Msg.GetRef(), req.Msg.GetProject())
	if err != nil {
		return nil, err
	}
	req.Msg.Ref = c.stage(req.Msg.GetRef())
	resp, err := ls.importLayer(ctx, req)
	if err != nil {
		c.fail(ctx)
		return nil, err
	}
	return ls.madeLayer(ctx, c, project, resp.Msg)
}

// claimLayer decides where a layer called ref goes (the project named, or
// the token's: the caller must hold builder there) and claims its name.
func (ls *layerService) claimLayer(ctx context.Context, op iam.Op, ref, named string) (*claim, string, error) {
	project, err := targetProject(ctx, op, named)
	if err != nil {
		return nil, "", err
	}
	name := objectName(ref)
	if name == "" && project != "" {
		return nil, "", fmt.Errorf("a layer of project %s needs a ref (name:tag): a layer without a name is the root's: %w", iam.Display(project), errdefs.ErrInvalidArgument)
	}
	c, err := ls.s.claimObject(ctx, store.ObjectLayer, name, project)
	if err != nil {
		return nil, "", err
	}
	return c, project, nil
}

// madeLayer records the bytes of a layer just made and charges them; past
// the quota the layer is removed again (the ref it was made under) and the
// refusal returned.
func (ls *layerService) madeLayer(ctx context.Context, c *claim, project string, l *dsecv1.Layer) (*connect.Response[dsecv1.Layer], error) {
	undo := func(ctx context.Context) error {
		_, err := ls.removeLayer(ctx, connect.NewRequest(&dsecv1.RemoveLayerRequest{Ref: c.made()}))
		return err
	}
	if err := c.done(ctx, []store.Blob{{Digest: l.GetDigest(), Bytes: l.GetSize()}}, undo); err != nil {
		return nil, err
	}
	if c.staged != "" {
		l.Refs = slices.DeleteFunc(l.Refs, func(r string) bool { return objectName(r) == c.staged || objectName(r) == c.o.Name })
		l.Refs = append(l.Refs, c.o.Name)
	}
	l.Project = project
	return connect.NewResponse(l), nil
}

// renameRef moves the name to onto what from names on every node that has
// it (EdgeService.RenameRef), so that to names its old version until it
// names the new one; a node that lacks from (it was not routable when the
// object was made) keeps what it has. With one node, an error is in the
// node's own words.
func (ls *layerService) renameRef(ctx context.Context, from, to string) error {
	req := connect.NewRequest(&edgev1.RenameRefRequest{From: from, To: to})
	nodes, err := ls.nodes()
	if err != nil {
		return err
	}
	if len(nodes) == 1 {
		_, err := nodes[0].Edge.RenameRef(ctx, req)
		return err
	}
	renamed := false
	var errs []error
	for _, n := range nodes {
		_, err := n.Edge.RenameRef(ctx, req)
		switch {
		case err == nil:
			renamed = true
		case !errors.Is(err, errdefs.ErrNotFound):
			errs = append(errs, fmt.Errorf("node %s: %w", n.Name, err))
		}
	}
	if err := errors.Join(errs...); err != nil {
		return err
	}
	if !renamed {
		return fmt.Errorf("rename %s to %s: no node has it: %w", from, to, errdefs.ErrNotFound)
	}
	return nil
}

func (ls *layerService) importLayer(ctx context.Context, req *connect.Request[dsecv1.ImportLayerRequest]) (*connect.Response[dsecv1.Layer], error) {
	nodes, err := ls.nodes()
	if err != nil {
		return nil, err
	}
	if len(nodes) == 1 {
		return nodes[0].Edge.ImportLayer(ctx, req)
	}
	ref := req.Msg.GetRef()
	if ref == "" {
		return nil, fmt.Errorf("import layer: a ref (name:tag) is required in a cluster (the other nodes adopt the layer by it): %w", errdefs.ErrInvalidArgument)
	}
	groups := importGroups(nodes)
	all, err := onEach(leads(groups), func(e watcher.Edge) (*connect.Response[dsecv1.Layer], error) { return e.ImportLayer(ctx, req) })
	if err != nil {
		return nil, err
	}
	out, err := sameLayer(ref, all)
	if err != nil {
		return nil, err
	}
	redo := func(n watcher.Node, want []string) error {
		resp, err := n.Edge.ImportLayer(ctx, req)
		if err != nil {
			return err
		}
		return differentLayers(ref, want[0], resp.Msg.GetDigest())
	}
	if err := adoptAll(ctx, groups, ref, layerDigests(all), redo); err != nil {
		return nil, err
	}
	return connect.NewResponse(out), nil
}

// UploadLayer relays the caller's upload to one node per blob store, as it
// comes; the others adopt the layer.
func (ls *layerService) UploadLayer(ctx context.Context, stream *connect.ClientStream[dsecv1.UploadLayerRequest]) (*connect.Response[dsecv1.Layer], error) {
	first, h, err := layerupload.ReadHeader(stream)
	if err != nil {
		return nil, err
	}
	c, project, err := ls.claimLayer(ctx, "/dsec.v1.LayerService/UploadLayer", h.GetRef(), h.GetProject())
	if err != nil {
		return nil, err
	}
	h.Ref = c.stage(h.GetRef())
	l, err := ls.uploadLayer(ctx, h, layerupload.Replay(first, stream))
	if err != nil {
		c.fail(ctx)
		return nil, err
	}
	return ls.madeLayer(ctx, c, project, l)
}

func (ls *layerService) uploadLayer(ctx context.Context, h *dsecv1.UploadLayerHeader, in layerupload.Stream) (*dsecv1.Layer, error) {
	nodes, err := ls.nodes()
	if err != nil {
		return nil, err
	}
	if len(nodes) == 1 {
		up, ok := nodes[0].Edge.(layerUploader)
		if !ok {
			return nil, fmt.Errorf("upload layer %s: node %s takes no uploads: %w", h.GetRef(), nodes[0].Name, errdefs.ErrNotSupported)
		}
		return up.UploadLayerFrom(ctx, in)
	}
	groups := importGroups(nodes)
	all, err := uploadTo(ctx, leads(groups), in)
	if err != nil {
		return nil, err
	}
	out, err := sameLayer(h.GetRef(), all)
	if err != nil {
		return nil, err
	}
	if err := adoptAll(ctx, groups, h.GetRef(), layerDigests(all), nil); err != nil {
		return nil, err
	}
	return out, nil
}

// sameLayer checks that the nodes built one layer from one source and
// returns it, with every node's warnings.
func sameLayer(ref string, all []*dsecv1.Layer) (*dsecv1.Layer, error) {
	out := all[0]
	for _, l := range all[1:] {
		if err := differentLayers(ref, out.GetDigest(), l.GetDigest()); err != nil {
			return nil, err
		}
		out.Warnings = mergeStrings(out.Warnings, l.GetWarnings())
	}
	return out, nil
}

// differentLayers says that two nodes built layers a and b from one
// source, if they differ.
func differentLayers(ref, a, b string) error {
	if a == b {
		return nil
	}
	return fmt.Errorf("import layer %s: the nodes built different layers (%s and %s) from one source; is the path the same on every node? (an upload sends the tree from the client): %w",
		ref, a, b, errdefs.ErrFailedPrecondition)
}

func layerDigests(all []*dsecv1.Layer) [][]string {
	out := make([][]string, len(all))
	for i, l := range all {
		out[i] = []string{l.GetDigest()}
	}
	return out
}

// ListLayers lists the layers the caller sees, each with the names it sees
// (docs/iam.md).
func (ls *layerService) ListLayers(ctx context.Context, req *connect.Request[dsecv1.ListLayersRequest]) (*connect.Response[dsecv1.ListLayersResponse], error) {
	layers, err := ls.visibleLayers(ctx)
	if err != nil {
		return nil, err
	}
	return connect.NewResponse(&dsecv1.ListLayersResponse{Layers: layers}), nil
}

// visibleLayers is every node's layers as the caller sees them. It
// removes the staging refs of calls that died (sweepStaging), which no one
// sees.
func (ls *layerService) visibleLayers(ctx context.Context) ([]*dsecv1.Layer, error) {
	layers, err := ls.allLayers(ctx)
	if err != nil {
		return nil, err
	}
	ix, err := ls.s.objectIndex(ctx)
	if err != nil {
		return nil, err
	}
	if ix != nil {
		ls.s.sweepStaging(ctx, ix, layers)
	}
	a, check := caller(ctx, iam.Viewer)
	return filterLayers(a, check, ix, layers), nil
}

// allLayers is every node's layers, merged by digest.
func (ls *layerService) allLayers(ctx context.Context) ([]*dsecv1.Layer, error) {
	req := connect.NewRequest(&dsecv1.ListLayersRequest{})
	all, err := onRoutable(ls, func(e watcher.Edge) (*connect.Response[dsecv1.ListLayersResponse], error) {
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
				have.Images = mergeStrings(have.Images, l.GetImages())
				have.Snapshots = mergeSnapshots(have.Snapshots, l.GetSnapshots())
				continue
			}
			byDigest[l.GetDigest()] = l
			out.Layers = append(out.Layers, l)
		}
	}
	return out.Layers, nil
}

// mergeSnapshots adds to have the snapshots of more it lacks, by name.
func mergeSnapshots(have, more []*dsecv1.SnapshotInfo) []*dsecv1.SnapshotInfo {
	for _, sn := range more {
		if !slices.ContainsFunc(have, func(h *dsecv1.SnapshotInfo) bool { return h.GetName() == sn.GetName() }) {
			have = append(have, sn)
		}
	}
	return have
}

// RemoveLayer removes the layer from every node that has it; a node where
// a live sandbox runs on it refuses, and the layer stays there. Only a
// builder of the layer's project removes it (of every project its names
// belong to, for a digest); its bytes go back to the project's quota.
func (ls *layerService) RemoveLayer(ctx context.Context, req *connect.Request[dsecv1.RemoveLayerRequest]) (*connect.Response[dsecv1.RemoveLayerResponse], error) {
	names, err := ls.removable(ctx, req.Msg.GetRef())
	if err != nil {
		return nil, err
	}
	resp, err := ls.removeLayer(ctx, req)
	if errors.Is(err, errdefs.ErrNotFound) && !strings.HasPrefix(objectName(req.Msg.GetRef()), "sha256:") {
		// No node holds the name (its node was replaced, or it was
		// removed there): only its record is left, which would keep its
		// charge and its project in use for ever.
		if _, found, oerr := ls.s.object(ctx, objectName(req.Msg.GetRef())); oerr == nil && found {
			ls.s.log.Info("no node holds the name: its record goes", "name", objectName(req.Msg.GetRef()))
			resp, err = connect.NewResponse(&dsecv1.RemoveLayerResponse{}), nil
		}
	}
	if err != nil {
		return nil, err
	}
	for _, n := range names {
		ls.s.forget(ctx, n)
	}
	return resp, nil
}

// removable decides whether the caller may remove ref and returns the
// names its removal takes away: ref, or every name of a digest's layer.
func (ls *layerService) removable(ctx context.Context, ref string) ([]string, error) {
	name := objectName(ref)
	if !strings.HasPrefix(name, "sha256:") {
		_, _, err := ls.s.manage(ctx, kindOf(name, store.ObjectLayer), name)
		return []string{name}, err
	}
	all, err := ls.allLayers(ctx)
	if err != nil {
		return nil, err
	}
	var names []string
	for _, l := range all {
		if l.GetDigest() == name {
			names = layerNames(l)
		}
	}
	a, check := caller(ctx, iam.Builder)
	if len(names) == 0 && check {
		if a.On("") < iam.Viewer {
			return nil, hiddenObject(store.ObjectLayer, name)
		}
		return nil, fmt.Errorf("layer %s has no name and so is the root's: removing it needs builder on the root: %w", name, errdefs.ErrPermissionDenied)
	}
	for _, n := range names {
		if _, _, err := ls.s.manage(ctx, kindOf(n, store.ObjectLayer), n); err != nil {
			if errors.Is(err, errdefs.ErrNotFound) {
				return nil, hiddenObject(store.ObjectLayer, name)
			}
			return nil, err
		}
	}
	return names, nil
}

func (ls *layerService) removeLayer(ctx context.Context, req *connect.Request[dsecv1.RemoveLayerRequest]) (*connect.Response[dsecv1.RemoveLayerResponse], error) {
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
	all, err := onRoutable(ls, func(e watcher.Edge) (*connect.Response[dsecv1.ListEnvironmentsResponse], error) {
		return e.ListEnvironments(ctx, req)
	})
	if err != nil {
		return nil, err
	}
	seen, err := ls.envFilter(ctx)
	if err != nil {
		return nil, err
	}
	out := &dsecv1.ListEnvironmentsResponse{}
	byName := map[string]*dsecv1.Environment{}
	for _, resp := range all {
		for _, e := range resp.GetEnvironments() {
			if !seen(e.GetName()) {
				continue
			}
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

// envFilter is whether the caller sees an environment: every part of its
// name.
func (ls *layerService) envFilter(ctx context.Context) (func(env string) bool, error) {
	a, check := caller(ctx, iam.Viewer)
	if !check {
		return func(string) bool { return true }, nil
	}
	ix, err := ls.s.objectIndex(ctx)
	if err != nil {
		return nil, err
	}
	return func(env string) bool { return visibleEnv(a, ix, env) }, nil
}

// ImportImage imports the image into the request's project (or the
// token's), whose quota is charged the bytes of its layers.
func (ls *layerService) ImportImage(ctx context.Context, req *connect.Request[dsecv1.ImportImageRequest], out *connect.ServerStream[dsecv1.ImportImageProgress]) error {
	project, err := targetProject(ctx, "/dsec.v1.LayerService/ImportImage", req.Msg.GetProject())
	if err != nil {
		return err
	}
	name := objectName(req.Msg.GetRef())
	c, err := ls.s.claimObject(ctx, store.ObjectImage, name, project)
	if err != nil {
		return err
	}
	req.Msg.Ref = c.stage(req.Msg.GetRef())
	if err := ls.importImage(ctx, req, out); err != nil {
		c.fail(ctx)
		return err
	}
	made := c.made()
	undo := func(ctx context.Context) error {
		_, err := ls.removeLayer(ctx, connect.NewRequest(&dsecv1.RemoveLayerRequest{Ref: made}))
		return err
	}
	var blobs []store.Blob
	if name != "" && ls.s.cfg.Objects != nil {
		all, err := ls.allLayers(context.WithoutCancel(ctx))
		if err != nil {
			// Not charged, so not kept: what the import made goes (a new
			// name's image, an overwrite's staging ref), and with it a
			// new name's record; an overwrite keeps the version before.
			if uerr := undo(context.WithoutCancel(ctx)); uerr != nil {
				ls.s.log.Warn("remove an image whose bytes were not counted", "name", name, "ref", made, "err", uerr)
			}
			c.fail(ctx)
			return fmt.Errorf("import image %s: count its bytes: %w (the import is removed)", name, err)
		}
		for _, l := range all {
			if slices.ContainsFunc(l.GetImages(), func(i string) bool { return objectName(i) == made }) {
				blobs = append(blobs, store.Blob{Digest: l.GetDigest(), Bytes: l.GetSize()})
			}
		}
	}
	return c.done(ctx, blobs, undo)
}

// importImage imports on one node per blob store at once, the caller
// seeing the first one's progress; then the other nodes adopt the image
// ("adopt"), and the first one's result ends the stream.
func (ls *layerService) importImage(ctx context.Context, req *connect.Request[dsecv1.ImportImageRequest], out *connect.ServerStream[dsecv1.ImportImageProgress]) error {
	nodes, err := ls.nodes()
	if err != nil {
		return err
	}
	if len(nodes) == 1 {
		return nodes[0].Edge.ImportImage(ctx, req, out)
	}
	var mu sync.Mutex
	send := func(p *dsecv1.ImportImageProgress) error {
		mu.Lock()
		defer mu.Unlock()
		return out.Send(p)
	}
	groups := importGroups(nodes)
	results, err := importImageOn(ctx, leads(groups), req.Msg, send)
	if err != nil {
		return err
	}
	res := results[0]
	digests := make([][]string, len(results))
	for i, r := range results {
		digests[i] = r.GetLayerDigests()
		res.Warnings = mergeStrings(res.Warnings, r.GetWarnings())
	}
	if len(nodes) > len(groups) {
		if err := send(&dsecv1.ImportImageProgress{Phase: "adopt", Layers: int32(len(res.GetLayerDigests()))}); err != nil {
			return err
		}
	}
	redo := func(n watcher.Node, want []string) error {
		got, err := importImageOn(ctx, []watcher.Node{n}, req.Msg, nil)
		if err != nil {
			return err
		}
		if !slices.Equal(got[0].GetLayerDigests(), want) {
			return fmt.Errorf("import image %s: the node built layers %v, another %v, from one source (did the tag move?): %w",
				req.Msg.GetRef(), got[0].GetLayerDigests(), want, errdefs.ErrFailedPrecondition)
		}
		return nil
	}
	if err := adoptAll(ctx, groups, req.Msg.GetRef(), digests, redo); err != nil {
		return err
	}
	return send(res)
}

// importImageOn imports on every node of to at once and returns each one's
// result (its last message). The first node's progress goes to send, if
// not nil.
func importImageOn(ctx context.Context, to []watcher.Node, m *dsecv1.ImportImageRequest, send func(*dsecv1.ImportImageProgress) error) ([]*dsecv1.ImportImageProgress, error) {
	results := make([]*dsecv1.ImportImageProgress, len(to))
	errs := make([]error, len(to))
	var wg sync.WaitGroup
	for i, n := range to {
		im, ok := n.Edge.(imageImporter)
		if !ok {
			errs[i] = fmt.Errorf("node %s cannot import images for a cluster: %w", n.Name, errdefs.ErrNotSupported)
			continue
		}
		wg.Add(1)
		go func() {
			defer wg.Done()
			err := im.ImportImageTo(ctx, m, func(p *dsecv1.ImportImageProgress) error {
				if p.GetDone() {
					results[i] = p
					return nil
				}
				if i != 0 || send == nil {
					return nil
				}
				return send(p)
			})
			switch {
			case err != nil:
				errs[i] = fmt.Errorf("node %s: %w", n.Name, err)
			case results[i] == nil:
				errs[i] = fmt.Errorf("import image %s: node %s ended without a result: %w", m.GetRef(), n.Name, errdefs.ErrInternal)
			}
		}()
	}
	wg.Wait()
	if err := errors.Join(errs...); err != nil {
		return nil, err
	}
	return results, nil
}

// LayerStats adds up every node's accounting per layer and environment.
func (ls *layerService) LayerStats(ctx context.Context, req *connect.Request[dsecv1.LayerStatsRequest]) (*connect.Response[dsecv1.LayerStatsResponse], error) {
	all, err := onRoutable(ls, func(e watcher.Edge) (*connect.Response[dsecv1.LayerStatsResponse], error) {
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
			have.BytesFetchedPlain += l.GetBytesFetchedPlain()
			have.MemoryHits += l.GetMemoryHits()
			have.DiskHits += l.GetDiskHits()
			have.BytesWrittenDisk += l.GetBytesWrittenDisk()
			have.BytesPushed += l.GetBytesPushed()
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
	if err := ls.statsSeen(ctx, out); err != nil {
		return nil, err
	}
	return connect.NewResponse(out), nil
}

// statsSeen keeps of st the layers and environments the caller sees.
func (ls *layerService) statsSeen(ctx context.Context, st *dsecv1.LayerStatsResponse) error {
	if _, check := caller(ctx, iam.Viewer); !check {
		return nil
	}
	layers, err := ls.visibleLayers(ctx)
	if err != nil {
		return err
	}
	digests := map[string]bool{}
	for _, l := range layers {
		digests[l.GetDigest()] = true
	}
	st.Layers = slices.DeleteFunc(st.Layers, func(l *dsecv1.LayerUsage) bool { return !digests[l.GetDigest()] })
	seen, err := ls.envFilter(ctx)
	if err != nil {
		return err
	}
	st.Environments = slices.DeleteFunc(st.Environments, func(e *dsecv1.EnvironmentUsage) bool { return !seen(e.GetName()) })
	return nil
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

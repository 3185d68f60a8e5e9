package apiserver

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"slices"
	"sync"

	"connectrpc.com/connect"

	edgev1 "dsec.dev/dsec/api/gen/dsec/edge/v1"
	dsecv1 "dsec.dev/dsec/api/gen/dsec/v1"
	"dsec.dev/dsec/internal/errdefs"
	"dsec.dev/dsec/internal/layerupload"
	"dsec.dev/dsec/internal/watcher"
)

// Imports in a cluster run once per blob store. The routable nodes are
// grouped by the blob store each reports (NodeStatus.blob_store, a name
// equal on nodes that share one); in each group the least busy node
// imports, publishing the layers and the ref to the store, and every other
// node of the group adopts them (EdgeService.AdoptLayers: it reads the
// ref's record and the layers' indexes, nothing else). An OCI image is thus
// fetched once, an upload sent to one edge. A node whose store turns out
// not to hold what its group's importer put there (a name that matched, a
// store that did not) imports for itself where the source can be read again
// (an image, a path); an upload cannot, and fails there saying so. A node
// reporting no blob store is a group of its own.

// importGroup is a lead, which imports, and the nodes that adopt from it.
type importGroup struct {
	lead   watcher.Node
	others []watcher.Node
}

// importGroups groups nodes by blob store, each led by its least busy node.
func importGroups(nodes []watcher.Node) []importGroup {
	sorted := slices.Clone(nodes)
	slices.SortStableFunc(sorted, func(a, b watcher.Node) int { return cmp.Compare(busy(a), busy(b)) })
	var groups []importGroup
	byStore := map[string]int{}
	for _, n := range sorted {
		name := n.Status.GetBlobStore()
		if i, ok := byStore[name]; ok && name != "" {
			groups[i].others = append(groups[i].others, n)
			continue
		}
		byStore[name] = len(groups)
		groups = append(groups, importGroup{lead: n})
	}
	return groups
}

// busy is what a node does now, by its last report.
func busy(n watcher.Node) int32 { return n.Status.GetLive() + n.Status.GetCreating() }

func leads(groups []importGroup) []watcher.Node {
	out := make([]watcher.Node, len(groups))
	for i, g := range groups {
		out[i] = g.lead
	}
	return out
}

// adoptAll has every node but the leads adopt ref, naming digests[i] (what
// group i's lead made), all at once. A node that answers NotFound (its
// store lacks them) is handed to redo, which imports there; with no redo,
// it fails.
func adoptAll(ctx context.Context, groups []importGroup, ref string, digests [][]string, redo func(n watcher.Node, digests []string) error) error {
	var mu sync.Mutex
	var errs []error
	var wg sync.WaitGroup
	for i, g := range groups {
		for _, n := range g.others {
			wg.Add(1)
			go func() {
				defer wg.Done()
				_, err := n.Edge.AdoptLayers(ctx, connect.NewRequest(&edgev1.AdoptLayersRequest{Ref: ref, LayerDigests: digests[i]}))
				switch {
				case err == nil:
					return
				case errors.Is(err, errdefs.ErrNotFound) && redo != nil:
					err = redo(n, digests[i])
				case errors.Is(err, errdefs.ErrNotFound):
					err = fmt.Errorf("its blob store (%s) lacks what node %s put in the store of that name, so the two do not share one; give the nodes one store, or import there by OCI image or path: %w",
						n.Status.GetBlobStore(), g.lead.Name, err)
				}
				if err != nil {
					mu.Lock()
					errs = append(errs, fmt.Errorf("node %s: %w", n.Name, err))
					mu.Unlock()
				}
			}()
		}
	}
	wg.Wait()
	return errors.Join(errs...)
}

// uploadTo relays one upload to every node of to at once, message by
// message: each gets every message as it comes, the slowest setting the
// pace, and none is kept. The first node to fail ends the upload for all.
func uploadTo(ctx context.Context, to []watcher.Node, in layerupload.Stream) ([]*dsecv1.Layer, error) {
	ups := make([]layerUploader, len(to))
	for i, n := range to {
		up, ok := n.Edge.(layerUploader)
		if !ok {
			return nil, fmt.Errorf("node %s takes no uploads: %w", n.Name, errdefs.ErrNotSupported)
		}
		ups[i] = up
	}
	ctx, cancel := context.WithCancelCause(ctx)
	defer cancel(nil)
	out := make([]*dsecv1.Layer, len(to))
	feeds := make([]*feed, len(to))
	var wg sync.WaitGroup
	for i, n := range to {
		feeds[i] = &feed{ch: make(chan *dsecv1.UploadLayerRequest), done: make(chan struct{})}
		wg.Add(1)
		go func() {
			defer wg.Done()
			defer close(feeds[i].done)
			l, err := ups[i].UploadLayerFrom(ctx, feeds[i])
			if err != nil {
				cancel(fmt.Errorf("node %s: %w", n.Name, err))
				return
			}
			out[i] = l
		}()
	}
	end := pump(ctx, in, feeds)
	for _, f := range feeds {
		f.end(end)
	}
	wg.Wait()
	if err := context.Cause(ctx); err != nil {
		return nil, err
	}
	if end != nil {
		return nil, end
	}
	return out, nil
}

// pump copies in's messages to every feed until in ends or ctx does, and
// returns how it ended: nil for in's clean end.
func pump(ctx context.Context, in layerupload.Stream, feeds []*feed) error {
	for in.Receive() {
		m := in.Msg()
		for _, f := range feeds {
			select {
			case f.ch <- m:
			case <-f.done: // ended already; its answer says why
			case <-ctx.Done():
				return context.Cause(ctx)
			}
		}
	}
	return in.Err()
}

// feed is one node's copy of an upload's stream.
type feed struct {
	ch   chan *dsecv1.UploadLayerRequest
	done chan struct{} // closed when the node's upload has ended
	msg  *dsecv1.UploadLayerRequest
	err  error // set before ch is closed
}

func (f *feed) Receive() bool {
	m, ok := <-f.ch
	f.msg = m
	return ok
}

func (f *feed) Msg() *dsecv1.UploadLayerRequest { return f.msg }
func (f *feed) Err() error                      { return f.err }

// end ends the feed: cleanly with nil, broken with err.
func (f *feed) end(err error) {
	f.err = err
	close(f.ch)
}

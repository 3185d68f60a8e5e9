package apiserver

import (
	"context"
	"fmt"
	"strings"
	"sync"
	"time"

	"connectrpc.com/connect"
	"google.golang.org/protobuf/proto"

	dsecv1 "dsec.dev/dsec/api/gen/dsec/v1"
	"dsec.dev/dsec/internal/errdefs"
)

// maxForkChildren bounds one fork.
const maxForkChildren = 16

// Snapshots are layers (snap:NAME, kind snapshot) that carry what they were
// taken from: the sandbox's node takes one, the blob store keeps it, and
// every node can start sandboxes on it.

func (s *Server) Snapshot(ctx context.Context, req *connect.Request[dsecv1.SnapshotRequest]) (*connect.Response[dsecv1.SnapshotInfo], error) {
	if req.Msg.GetSandboxId() == "" || req.Msg.GetName() == "" {
		return nil, fmt.Errorf("snapshot: sandbox_id and name are required: %w", errdefs.ErrInvalidArgument)
	}
	return forward(ctx, s, req.Msg.GetSandboxId(), req, func(e Edge) func(context.Context, *connect.Request[dsecv1.SnapshotRequest]) (*connect.Response[dsecv1.SnapshotInfo], error) {
		return e.Snapshot
	})
}

// ListSnapshots lists the snapshots of every routable node's layers, once
// each.
func (s *Server) ListSnapshots(ctx context.Context, req *connect.Request[dsecv1.ListSnapshotsRequest]) (*connect.Response[dsecv1.ListSnapshotsResponse], error) {
	ls := &layerService{s: s}
	layers, err := ls.ListLayers(ctx, connect.NewRequest(&dsecv1.ListLayersRequest{}))
	if err != nil {
		return nil, err
	}
	out := &dsecv1.ListSnapshotsResponse{}
	seen := map[string]bool{}
	for _, l := range layers.Msg.GetLayers() {
		// Snapshots of the same files share a layer: each is listed.
		sns := l.GetSnapshots()
		if len(sns) == 0 && l.GetSnapshot() != nil {
			sns = []*dsecv1.SnapshotInfo{l.GetSnapshot()} // an edge older than Layer.snapshots
		}
		for _, sn := range sns {
			if !seen[sn.GetName()] {
				seen[sn.GetName()] = true
				out.Snapshots = append(out.Snapshots, sn)
			}
		}
	}
	return connect.NewResponse(out), nil
}

// DeleteSnapshot removes the snapshot's layer from every node. Sandboxes
// running on it keep it until they go.
func (s *Server) DeleteSnapshot(ctx context.Context, req *connect.Request[dsecv1.DeleteSnapshotRequest]) (*connect.Response[dsecv1.DeleteSnapshotResponse], error) {
	name := req.Msg.GetName()
	if name == "" || strings.ContainsAny(name, ":+/") {
		return nil, fmt.Errorf("delete snapshot: name %q: want the snapshot's name, not its layer: %w", name, errdefs.ErrInvalidArgument)
	}
	ls := &layerService{s: s}
	if _, err := ls.RemoveLayer(ctx, connect.NewRequest(&dsecv1.RemoveLayerRequest{Ref: "snap:" + name})); err != nil {
		return nil, fmt.Errorf("delete snapshot %s: %w", name, err)
	}
	return connect.NewResponse(&dsecv1.DeleteSnapshotResponse{}), nil
}

// Fork takes one snapshot of the sandbox and makes count sandboxes from it
// with the source's spec, each placed on its own: one result per child.
func (s *Server) Fork(ctx context.Context, req *connect.Request[dsecv1.ForkRequest]) (*connect.Response[dsecv1.ForkResponse], error) {
	m := req.Msg
	if m.GetSandboxId() == "" {
		return nil, fmt.Errorf("fork: sandbox_id is required: %w", errdefs.ErrInvalidArgument)
	}
	n := int(m.GetCount())
	if n < 1 || n > maxForkChildren {
		return nil, fmt.Errorf("fork: count %d: want 1 to %d children: %w", n, maxForkChildren, errdefs.ErrInvalidArgument)
	}
	src, err := s.getSandbox(ctx, m.GetSandboxId())
	if err != nil {
		return nil, err
	}
	name := m.GetName()
	if name == "" {
		name = fmt.Sprintf("fork-%s-%d", m.GetSandboxId(), time.Now().UnixMilli())
	}
	snap, err := s.Snapshot(ctx, connect.NewRequest(&dsecv1.SnapshotRequest{SandboxId: m.GetSandboxId(), Name: name, Exclude: m.GetExclude()}))
	if err != nil {
		return nil, fmt.Errorf("fork %s: %w", m.GetSandboxId(), err)
	}
	spec := proto.Clone(src.GetSpec()).(*dsecv1.SandboxSpec)
	spec.Environment = snap.Msg.GetEnvironment()
	out := &dsecv1.ForkResponse{Snapshot: snap.Msg, Children: make([]*dsecv1.ForkChild, n)}
	var wg sync.WaitGroup
	for i := range n {
		wg.Add(1)
		go func() {
			defer wg.Done()
			sbs, err := s.createBatch(ctx, spec, 1)
			if err != nil {
				out.Children[i] = &dsecv1.ForkChild{Error: err.Error()}
				return
			}
			out.Children[i] = &dsecv1.ForkChild{Sandbox: sbs[0]}
		}()
	}
	wg.Wait()
	return connect.NewResponse(out), nil
}

package apiserver

import (
	"context"
	"fmt"
	"strings"
	"sync"
	"time"

	"connectrpc.com/connect"
	"google.golang.org/protobuf/proto"

	edgev1 "dsec.dev/dsec/api/gen/dsec/edge/v1"
	dsecv1 "dsec.dev/dsec/api/gen/dsec/v1"
	"dsec.dev/dsec/internal/errdefs"
	"dsec.dev/dsec/internal/store"
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

// Fork makes count sandboxes from the sandbox with its spec: one result
// per child. A microVM's children are copies of its memory, made on its
// node (forkMemory); other sandboxes' are made from one snapshot of their
// writable layer, each placed on its own.
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
	if src.GetSpec().GetIsolation() == dsecv1.Isolation_ISOLATION_MICROVM {
		return s.forkMemory(ctx, src, n, m)
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

// forkMemory forks microVM src into n children on its node: the edge saves
// src's memory, devices and writable disk once (src stands still for it,
// then runs on) and starts each child from that save with its own disk,
// identity and network (edgev1 Fork). The children's creates carry tokens
// of a batch of their own, as createBatch's. The response's snapshot
// describes the save, which is no layer and is gone once the children run:
// its layer is empty, its environment the children's (src's), frozen_us
// how long src stood still and capture_method "memory".
func (s *Server) forkMemory(ctx context.Context, src *dsecv1.Sandbox, n int, m *dsecv1.ForkRequest) (*connect.Response[dsecv1.ForkResponse], error) {
	id, node := src.GetId(), src.GetNode()
	if len(m.GetExclude()) > 0 {
		return nil, fmt.Errorf("fork %s: exclude leaves paths out of a layer snapshot; a microVM's fork copies its whole memory and disk: %w", id, errdefs.ErrInvalidArgument)
	}
	name := m.GetName()
	if name == "" {
		name = fmt.Sprintf("fork-%s-%d", id, time.Now().UnixMilli())
	}
	e, err := s.edgeFor(id)
	if err != nil {
		return nil, err
	}
	batch := newBatch()
	tokens := make([]string, n)
	for i := range tokens {
		tokens[i] = nodeToken(createToken(batch, i), node)
	}
	start := time.Now()
	resp, err := e.Fork(ctx, connect.NewRequest(&edgev1.ForkRequest{SandboxId: id, CreateTokens: tokens}))
	if err == nil && len(resp.Msg.GetResults()) != n {
		err = fmt.Errorf("node %s answered %d results to a fork of %d: %w", node, len(resp.Msg.GetResults()), n, errdefs.ErrInternal)
	}
	if err != nil {
		if outcomeUnknown(err) {
			ds := make([]store.Doubt, n)
			for i, t := range tokens {
				ds[i] = store.Doubt{Node: node, Token: t}
			}
			s.doubt(context.WithoutCancel(ctx), err, ds...)
		}
		return nil, fmt.Errorf("fork %s: %w", id, err)
	}
	out := &dsecv1.ForkResponse{
		Snapshot: &dsecv1.SnapshotInfo{
			Name: name, Environment: src.GetSpec().GetEnvironment(), SourceSandbox: id, Node: node,
			CreatedUnixMs: start.UnixMilli(), FrozenUs: resp.Msg.GetFrozenUs(), CaptureMethod: "memory",
		},
		Children: make([]*dsecv1.ForkChild, n),
	}
	for i, r := range resp.Msg.GetResults() {
		switch {
		case r.GetErrorCode() != 0:
			out.Children[i] = &dsecv1.ForkChild{Error: r.GetErrorMessage()}
		case r.GetSandbox() == nil:
			out.Children[i] = &dsecv1.ForkChild{Error: fmt.Sprintf("node %s answered child %d with neither a sandbox nor an error", node, i)}
		default:
			out.Children[i] = &dsecv1.ForkChild{Sandbox: r.GetSandbox()}
		}
	}
	return connect.NewResponse(out), nil
}

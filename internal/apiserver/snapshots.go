package apiserver

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"slices"
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
	if req.Msg.GetLayInto() != "" || len(req.Msg.GetLayFiles()) > 0 {
		return nil, fmt.Errorf("snapshot: lay_into and lay_files are a grade's own (Grade lays its capture and tests into its clean room): %w", errdefs.ErrInvalidArgument)
	}
	project, err := targetProject(ctx, "/dsec.v1.SandboxService/Snapshot", req.Msg.GetProject())
	if err != nil {
		return nil, err
	}
	return s.snapshot(ctx, req, project)
}

// snapshot takes a snapshot into project, which is charged its bytes
// (snapshot_bytes); past the quota it is deleted again.
func (s *Server) snapshot(ctx context.Context, req *connect.Request[dsecv1.SnapshotRequest], project string) (*connect.Response[dsecv1.SnapshotInfo], error) {
	name := "snap:" + req.Msg.GetName()
	c, err := s.claimObject(ctx, store.ObjectSnapshot, name, project)
	if err != nil {
		return nil, err
	}
	resp, err := forward(ctx, s, req.Msg.GetSandboxId(), req, func(e Edge) func(context.Context, *connect.Request[dsecv1.SnapshotRequest]) (*connect.Response[dsecv1.SnapshotInfo], error) {
		return e.Snapshot
	})
	if err != nil {
		c.fail(ctx)
		return nil, err
	}
	ls := &layerService{s: s}
	undo := func(ctx context.Context) error {
		_, err := ls.removeLayer(ctx, connect.NewRequest(&dsecv1.RemoveLayerRequest{Ref: name}))
		return err
	}
	if err := c.done(ctx, []store.Blob{snapshotBlob(resp.Msg)}, undo); err != nil {
		return nil, err
	}
	resp.Msg.Project = project
	return resp, nil
}

// snapshotTaken refuses a snapshot whose name its project's record holds
// already, before any node is asked, so that nothing is touched: a
// snapshot is not taken again under its name (SnapshotRequest.name), and
// a refused charge removes what the call made under the name with the
// name's record. The name is refused while a node holds it; a record
// another call is taking (its claim live) is refused before (see
// claimObject and nameBusy). Only a record whose snapshot no node holds (its
// node was replaced, or the call taking it died before it was done and
// its claim lapsed) is taken over.
func (s *Server) snapshotTaken(ctx context.Context, o store.Object) error {
	name := strings.TrimPrefix(o.Name, "snap:")
	held, err := s.nameExists(ctx, o.Name)
	switch {
	case err != nil:
		return fmt.Errorf("snapshot %s: look for it on the nodes: %w", name, err)
	case held:
		return fmt.Errorf("snapshot %s exists: a snapshot is not taken again under its name (delete it first, or name another): %w", name, errdefs.ErrAlreadyExists)
	}
	return nil
}

// snapshotBlob is the blob a snapshot holds: its layer, by digest (by its
// name when the node says none).
func snapshotBlob(sn *dsecv1.SnapshotInfo) store.Blob {
	d := sn.GetDigest()
	if d == "" {
		d = "snap:" + sn.GetName()
	}
	return store.Blob{Digest: d, Bytes: sn.GetSize()}
}

// ListSnapshots lists the snapshots of every routable node's layers, once
// each: those the caller sees.
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
		if errors.Is(err, errdefs.ErrNotFound) {
			return nil, fmt.Errorf("delete snapshot %s: %w", name, hiddenObject(store.ObjectSnapshot, name))
		}
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
	if m.GetIdempotencyKey() != "" {
		return nil, fmt.Errorf("fork %s: idempotency_key applies to a microVM's fork; a file-system fork (a snapshot and creates) takes none: %w", m.GetSandboxId(), errdefs.ErrInvalidArgument)
	}
	name := m.GetName()
	if name == "" {
		name = fmt.Sprintf("fork-%s-%d", m.GetSandboxId(), time.Now().UnixMilli())
	}
	// The fork's snapshot belongs to the source's project.
	snap, err := s.snapshot(ctx, connect.NewRequest(&dsecv1.SnapshotRequest{SandboxId: m.GetSandboxId(), Name: name, Exclude: m.GetExclude()}), projectOf(src))
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
	if key := m.GetIdempotencyKey(); key != "" {
		return s.forkKeyed(ctx, src, n, m, name, e)
	}
	// The children are charged now, each held until the node answers for
	// it (the node makes them all in one call).
	batch := newBatch()
	holds, err := s.chargeFork(ctx, src.GetSpec(), batch, n)
	if err != nil {
		return nil, fmt.Errorf("fork %s: %w", id, err)
	}
	resp, start, tokens, err := forkOn(ctx, e, id, node, batch, n)
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
		s.settleFork(ctx, holds, nil, err)
		return nil, fmt.Errorf("fork %s: %w", id, err)
	}
	out := forkResponse(src, name, start, resp.Msg)
	s.settleFork(ctx, holds, out, nil)
	return connect.NewResponse(out), nil
}

// chargeFork charges the project of spec for n children of a fork, each
// held under its own ID (fork:batch#i), or nothing when no limit applies.
func (s *Server) chargeFork(ctx context.Context, spec *dsecv1.SandboxSpec, batch string, n int) (held, error) {
	c, ok, err := s.quotaCharge(ctx, spec, n)
	if err != nil || !ok {
		return nil, err
	}
	one, _, _ := s.quotaCharge(ctx, spec, 1)
	h := make(held, n)
	holds := make([]store.Hold, n)
	for i := range holds {
		h[i] = "fork:" + createToken(batch, i)
		holds[i] = store.Hold{ID: h[i], Amounts: one.Held, Expires: c.Expires}
	}
	if err := s.charges.charge(ctx, s.cfg.Quotas, c.Project, c.Amounts, holds); err != nil {
		return nil, err
	}
	return h, nil
}

// settleFork settles the holds of a fork's children: a child made keeps
// its charge, one refused gives it back. A fork that failed (err) gives
// all back, but one whose outcome is unknown keeps them: children may
// live until the doubts are settled, and the sweep counts what is left.
func (s *Server) settleFork(ctx context.Context, holds held, out *dsecv1.ForkResponse, err error) {
	if len(holds) == 0 {
		return
	}
	if err != nil {
		s.settleHolds(ctx, holds, outcomeUnknown(err))
		return
	}
	var made, failed held
	for i, c := range out.GetChildren() {
		if i >= len(holds) {
			break
		}
		if c.GetSandbox() != nil {
			made = append(made, holds[i])
		} else {
			failed = append(failed, holds[i])
		}
	}
	s.settleHolds(ctx, made, true)
	s.settleHolds(ctx, failed, false)
}

// forkOn asks node's edge e to fork sandbox id into n children, with the
// create tokens of batch.
func forkOn(ctx context.Context, e Edge, id, node, batch string, n int) (*connect.Response[edgev1.ForkResponse], time.Time, []string, error) {
	tokens := make([]string, n)
	for i := range tokens {
		tokens[i] = nodeToken(createToken(batch, i), node)
	}
	start := time.Now()
	resp, err := e.Fork(ctx, connect.NewRequest(&edgev1.ForkRequest{SandboxId: id, CreateTokens: tokens}))
	return resp, start, tokens, err
}

// forkResponse is the API's answer to a microVM's fork the edge answered
// with resp.
func forkResponse(src *dsecv1.Sandbox, name string, start time.Time, resp *edgev1.ForkResponse) *dsecv1.ForkResponse {
	id, node := src.GetId(), src.GetNode()
	out := &dsecv1.ForkResponse{
		Snapshot: &dsecv1.SnapshotInfo{
			Name: name, Environment: src.GetSpec().GetEnvironment(), SourceSandbox: id, Node: node,
			CreatedUnixMs: start.UnixMilli(), FrozenUs: resp.GetFrozenUs(), CaptureMethod: "memory",
		},
		Children: make([]*dsecv1.ForkChild, len(resp.GetResults())),
	}
	for i, r := range resp.GetResults() {
		switch {
		case r.GetErrorCode() != 0:
			out.Children[i] = &dsecv1.ForkChild{Error: r.GetErrorMessage()}
		case r.GetSandbox() == nil:
			out.Children[i] = &dsecv1.ForkChild{Error: fmt.Sprintf("node %s answered child %d with neither a sandbox nor an error", node, i)}
		default:
			out.Children[i] = &dsecv1.ForkChild{Sandbox: r.GetSandbox()}
		}
	}
	return out
}

// forkKeyed is forkMemory under an idempotency key, which Create's
// machinery keeps: the key (as fork:KEY, apart from creates' keys) is
// reserved in the metadata store with the children's placements (all on
// src's node), and the children's create tokens name the reservation. A
// repeat of a fork that is done gets the children it recorded (replay); a
// fork of the key under way elsewhere (another replica, or this one's
// before a crash) is followed with the same tokens, which the edge answers
// with the children those tokens made (it forks only the missing ones);
// the children are recorded under the key once made. A fork that made no
// child, or failed, gives the key back for a retry.
func (s *Server) forkKeyed(ctx context.Context, src *dsecv1.Sandbox, n int, m *dsecv1.ForkRequest, name string, e Edge) (*connect.Response[dsecv1.ForkResponse], error) {
	id, node := src.GetId(), src.GetNode()
	key, hash := "fork:"+m.GetIdempotencyKey(), forkHash(m)
	// The children are charged in the transaction that reserves the key,
	// and only if it does (a follower forks the owner's, charged already),
	// each held apart until the node answers for it.
	c, charged, err := s.quotaCharge(ctx, src.GetSpec(), n)
	if err != nil {
		return nil, fmt.Errorf("fork %s: %w", id, err)
	}
	r := store.CreateReservation{Key: key, RequestHash: hash, Owner: s.cfg.Name, Placements: slices.Repeat([]string{node}, n)}
	if charged {
		c.Parts = n
		r.Charge = &c
	}
	got, reserved, err := s.reserve(ctx, r)
	if err != nil {
		return nil, fmt.Errorf("fork %s: %w", id, err)
	}
	if !reserved && got.State == store.StateDone {
		return s.forkReplay(ctx, src, n, name, key, hash)
	}
	if !reserved && len(got.Placements) != n {
		return nil, fmt.Errorf("fork %s: idempotency key %q: its reservation plans %d children, not %d: %w", id, m.GetIdempotencyKey(), len(got.Placements), n, errdefs.ErrInternal)
	}
	var holds held
	if reserved && charged {
		for i := range n {
			holds = append(holds, store.ReservationPart(key, got.Nonce, i))
		}
	}
	lctx, lost := context.WithCancelCause(ctx)
	defer lost(nil)
	stop := s.holdLease(lctx, key, got.Nonce, lost)
	resp, start, tokens, err := forkOn(lctx, e, id, node, batchOf(got), n)
	stop()
	wctx := context.WithoutCancel(ctx)
	if err == nil && len(resp.Msg.GetResults()) != n {
		err = fmt.Errorf("node %s answered %d results to a fork of %d: %w", node, len(resp.Msg.GetResults()), n, errdefs.ErrInternal)
	}
	giveBack := func() {
		if !reserved {
			return
		}
		if rerr := s.idem.ReleaseCreate(wctx, key); rerr != nil {
			s.log.Warn("release the reservation of a failed fork", "key", key, "err", rerr)
		}
	}
	if err != nil {
		if cause := context.Cause(lctx); errors.Is(cause, errdefs.ErrUnavailable) {
			err = cause // the lease was lost, not the caller
		}
		if outcomeUnknown(err) {
			ds := make([]store.Doubt, n)
			for i, t := range tokens {
				ds[i] = store.Doubt{Node: node, Token: t, Key: key}
			}
			s.doubt(wctx, err, ds...)
		}
		giveBack()
		s.settleFork(ctx, holds, nil, err)
		return nil, fmt.Errorf("fork %s: %w", id, err)
	}
	out := forkResponse(src, name, start, resp.Msg)
	s.settleFork(ctx, holds, out, nil)
	var rows []store.SandboxRow
	for _, c := range out.Children {
		if c.GetSandbox() != nil {
			rows = append(rows, store.SandboxRow{ID: c.GetSandbox().GetId(), Node: node, Key: key, Created: time.Now()})
		}
	}
	if len(rows) == 0 {
		giveBack()
		return connect.NewResponse(out), nil
	}
	err = s.idem.CompleteCreate(wctx, key, got.Nonce, rows)
	switch {
	case err == nil:
		return connect.NewResponse(out), nil
	case errors.Is(err, errdefs.ErrAlreadyExists):
		// Another replica recorded the key's children first: theirs stand.
		return s.forkReplay(ctx, src, n, name, key, hash)
	case errors.Is(err, errdefs.ErrNotFound):
		return nil, fmt.Errorf("fork %s with idempotency key %q: its reservation ended while the fork ran (released, or abandoned after %s untouched); try again: %w",
			id, m.GetIdempotencyKey(), s.cfg.AbandonAfter, errdefs.ErrUnavailable)
	}
	return nil, fmt.Errorf("fork %s: record its children: %w", id, err)
}

// forkReplay answers a repeated keyed fork from its record: the children
// the first call made, as they are now (one since deleted says so), and
// an error for each it could not make.
func (s *Server) forkReplay(ctx context.Context, src *dsecv1.Sandbox, n int, name, key, hash string) (*connect.Response[dsecv1.ForkResponse], error) {
	sbs, err := s.replay(ctx, key, hash)
	if err != nil {
		return nil, fmt.Errorf("fork %s: %w", src.GetId(), err)
	}
	out := &dsecv1.ForkResponse{
		Snapshot: &dsecv1.SnapshotInfo{Name: name, Environment: src.GetSpec().GetEnvironment(), SourceSandbox: src.GetId(),
			Node: src.GetNode(), CaptureMethod: "memory"},
		Children: make([]*dsecv1.ForkChild, n),
	}
	for i := range out.Children {
		if i < len(sbs) {
			out.Children[i] = &dsecv1.ForkChild{Sandbox: sbs[i]}
			continue
		}
		out.Children[i] = &dsecv1.ForkChild{Error: "not made by the first fork with this idempotency key"}
	}
	return connect.NewResponse(out), nil
}

// forkHash is what a repeated keyed fork must match: the request without
// its key.
func forkHash(m *dsecv1.ForkRequest) string {
	c := proto.Clone(m).(*dsecv1.ForkRequest)
	c.IdempotencyKey = ""
	b, _ := proto.MarshalOptions{Deterministic: true}.Marshal(c)
	sum := sha256.Sum256(b)
	return hex.EncodeToString(sum[:])
}

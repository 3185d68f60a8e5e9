package apiserver

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"strings"
	"sync"
	"time"

	"connectrpc.com/connect"
	"google.golang.org/protobuf/proto"

	edgev1 "dsec.dev/dsec/api/gen/dsec/edge/v1"
	dsecv1 "dsec.dev/dsec/api/gen/dsec/v1"
	"dsec.dev/dsec/internal/errdefs"
	"dsec.dev/dsec/internal/placement"
	"dsec.dev/dsec/internal/store"
)

// Create makes spec.count sandboxes (one when zero), all or none. With an
// idempotency key, a repeat of the same request returns the first answer.
func (s *Server) Create(ctx context.Context, req *connect.Request[dsecv1.CreateRequest]) (*connect.Response[dsecv1.CreateResponse], error) {
	msg := req.Msg
	count := int(msg.GetCount())
	if count == 0 {
		count = 1
	}
	if count < 0 || count > s.cfg.MaxBatch {
		return nil, fmt.Errorf("count %d is outside 1..%d: %w", msg.GetCount(), s.cfg.MaxBatch, errdefs.ErrInvalidArgument)
	}
	if msg.GetSpec().GetEnvironment() == "" {
		return nil, fmt.Errorf("spec.environment is required (BASE[+LAYER...]): %w", errdefs.ErrInvalidArgument)
	}
	wait := time.Duration(msg.GetWaitSeconds()) * time.Second
	if wait <= 0 {
		wait = 60 * time.Second
	}
	ctx, cancel := context.WithTimeout(ctx, wait)
	defer cancel()

	key := msg.GetIdempotencyKey()
	if key == "" {
		sbs, err := s.createBatch(ctx, msg.GetSpec(), count)
		if err != nil {
			return nil, err
		}
		return connect.NewResponse(&dsecv1.CreateResponse{Sandboxes: sbs}), nil
	}
	hash := requestHash(msg)
	for {
		if sbs, err := s.replay(ctx, key, hash); err == nil {
			return connect.NewResponse(&dsecv1.CreateResponse{Sandboxes: sbs}), nil
		} else if !errors.Is(err, errdefs.ErrNotFound) {
			return nil, err
		}
		// Only one create per key runs; the others wait for its record.
		s.inflightMu.Lock()
		ch, busy := s.inflight[key]
		if !busy {
			ch = make(chan struct{})
			s.inflight[key] = ch
		}
		s.inflightMu.Unlock()
		if busy {
			select {
			case <-ch:
				continue
			case <-ctx.Done():
				return nil, fmt.Errorf("wait for the create with idempotency key %q: %w", key, errdefs.ErrDeadlineExceeded)
			}
		}
		// The create that held the key may have finished between the
		// replay above and taking the key: look again before creating.
		sbs, err := s.replay(ctx, key, hash)
		if errors.Is(err, errdefs.ErrNotFound) {
			sbs, err = s.createAndRecord(ctx, msg.GetSpec(), count, key, hash)
		}
		s.inflightMu.Lock()
		delete(s.inflight, key)
		close(ch)
		s.inflightMu.Unlock()
		if err != nil {
			return nil, err
		}
		return connect.NewResponse(&dsecv1.CreateResponse{Sandboxes: sbs}), nil
	}
}

// createAndRecord makes the batch under its idempotency key, across
// replicas: the key and the batch's placements are reserved in the
// metadata store first, so a replica retrying the same request (after this
// one crashed, say) follows the same plan; each sandbox's create carries a
// token of the key, so an edge hands both the same sandbox. The key's
// record and the sandboxes' rows are written in one transaction; a batch
// that cannot be recorded is deleted again.
func (s *Server) createAndRecord(ctx context.Context, spec *dsecv1.SandboxSpec, count int, key, hash string) ([]*dsecv1.Sandbox, error) {
	nodes, err := s.place(placeRequest(spec, count), nil)
	if err != nil {
		return nil, err
	}
	got, reserved, err := s.idem.ReserveCreate(ctx, store.CreateReservation{Key: key, RequestHash: hash, Owner: s.cfg.Name, Placements: nodes})
	if err != nil {
		s.unplace(nodes)
		return nil, err
	}
	if !reserved {
		s.unplace(nodes)
		if got.State == store.StateDone {
			return s.replay(ctx, key, hash)
		}
		// Another replica holds the key: follow its plan, with the same
		// tokens, so that both get the same sandboxes.
		if len(got.Placements) != count {
			return nil, fmt.Errorf("idempotency key %q: its reservation plans %d sandboxes, not %d: %w", key, len(got.Placements), count, errdefs.ErrInternal)
		}
		nodes = got.Placements
		s.log.Debug("following another replica's create", "key", key, "owner", got.Owner)
	}
	sbs, err := s.createPlaced(ctx, spec, nodes, key)
	if err != nil {
		if reserved {
			if rerr := s.idem.ReleaseCreate(context.WithoutCancel(ctx), key); rerr != nil {
				s.log.Warn("release the reservation of a failed create", "key", key, "err", rerr)
			}
		}
		return nil, err
	}
	rows := make([]store.SandboxRow, len(sbs))
	for i, sb := range sbs {
		rows[i] = store.SandboxRow{ID: sb.GetId(), Node: sb.GetNode(), Key: key, Created: time.Now()}
	}
	if err := s.idem.CompleteCreate(context.WithoutCancel(ctx), key, got.Nonce, rows); err != nil {
		if errors.Is(err, errdefs.ErrAlreadyExists) {
			// Another replica recorded other sandboxes for the key first
			// (a create that went elsewhere after a refusal): theirs stand.
			s.deleteAll(context.WithoutCancel(ctx), sbs)
			return s.replay(ctx, key, hash)
		}
		s.deleteAll(context.WithoutCancel(ctx), sbs)
		return nil, err
	}
	return sbs, nil
}

// unplace gives back placements that will not be used.
func (s *Server) unplace(nodes []string) {
	for _, n := range nodes {
		s.placer.Done(n, 1, false)
	}
}

// replay answers a repeated create from its idempotency record.
func (s *Server) replay(ctx context.Context, key, hash string) ([]*dsecv1.Sandbox, error) {
	rec, err := s.idem.GetIdempotency(ctx, key)
	if err != nil {
		return nil, err
	}
	if rec.RequestHash != hash {
		return nil, fmt.Errorf("idempotency key %q was used for a different request: %w", key, errdefs.ErrInvalidArgument)
	}
	out := make([]*dsecv1.Sandbox, 0, len(rec.IDs))
	for _, id := range rec.IDs {
		sb, err := s.getSandbox(ctx, id)
		if errors.Is(err, errdefs.ErrNotFound) {
			sb = &dsecv1.Sandbox{Id: id, State: dsecv1.State_STATE_STOPPED, Reason: dsecv1.Reason_REASON_DELETED,
				Message: "made by an earlier call with this idempotency key, and since removed"}
		} else if err != nil {
			return nil, err
		}
		out = append(out, sb)
	}
	return out, nil
}

func requestHash(msg *dsecv1.CreateRequest) string {
	c := proto.Clone(msg).(*dsecv1.CreateRequest)
	c.IdempotencyKey = ""
	c.WaitSeconds = 0
	b, _ := proto.MarshalOptions{Deterministic: true}.Marshal(c)
	sum := sha256.Sum256(b)
	return hex.EncodeToString(sum[:])
}

// createBatch places n sandboxes in one decision round and makes them.
func (s *Server) createBatch(ctx context.Context, spec *dsecv1.SandboxSpec, n int) ([]*dsecv1.Sandbox, error) {
	nodes, err := s.place(placeRequest(spec, n), nil)
	if err != nil {
		return nil, err
	}
	return s.createPlaced(ctx, spec, nodes, "")
}

// createPlaced starts one sandbox on each of nodes (placed and reserved
// already) with bounded concurrency. A node's refusal (ResourceExhausted:
// it is full) or failure sends that sandbox elsewhere, at most maxHops
// tries in all. If any sandbox cannot be made, the others are removed and
// its error returned. With a key, each sandbox's create carries a token
// derived from it, so a retried create gets the sandboxes the first made.
func (s *Server) createPlaced(ctx context.Context, spec *dsecv1.SandboxSpec, nodes []string, key string) ([]*dsecv1.Sandbox, error) {
	n := len(nodes)
	out := make([]*dsecv1.Sandbox, n)
	errs := make([]error, n)
	sem := make(chan struct{}, s.cfg.CreateConcurrency)
	var wg sync.WaitGroup
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	for i := range n {
		wg.Add(1)
		go func() {
			defer wg.Done()
			select {
			case sem <- struct{}{}:
			case <-ctx.Done():
				s.placer.Done(nodes[i], 1, false)
				errs[i] = ctx.Err()
				return
			}
			defer func() { <-sem }()
			out[i], errs[i] = s.createOne(ctx, spec, nodes[i], createToken(key, i))
			if errs[i] != nil {
				cancel()
			}
		}()
	}
	wg.Wait()
	var first error
	for _, err := range errs {
		if err != nil && (first == nil || errors.Is(first, context.Canceled)) {
			first = err
		}
	}
	if first != nil {
		s.deleteAll(context.WithoutCancel(ctx), out)
		if n > 1 {
			return nil, fmt.Errorf("create %d sandboxes (none kept): %w", n, first)
		}
		return nil, first
	}
	return out, nil
}

// placeRequest is what placement is asked for n sandboxes of spec.
func placeRequest(spec *dsecv1.SandboxSpec, n int) placement.Request {
	return placement.Request{Backend: backendName(spec.GetBackend()), Count: n}
}

// place asks placement for nodes. When nothing has room, the error says
// why in the nodes' own words too: each full node's admission reason from
// its last report (which names the flag that raises its limit).
func (s *Server) place(req placement.Request, exclude map[string]bool) ([]string, error) {
	nodes, err := s.placer.Place(s.placementView(), req, exclude)
	var ex *placement.ExhaustedError
	if err == nil || !errors.As(err, &ex) {
		return nodes, err
	}
	var why []string
	for _, n := range s.fleet.Nodes() {
		if r := n.Status.GetRefusing(); n.Healthy && r != "" && len(why) < 3 {
			why = append(why, strings.TrimSuffix(r, ": "+errdefs.ErrResourceExhausted.Error()))
		}
	}
	if len(why) == 0 {
		// The reports predate this apiserver's own placements, which
		// filled the nodes: say which flag raises a node's limit.
		return nil, fmt.Errorf("%w (dsecd --max-sandboxes raises an edge's limit)", err)
	}
	return nil, fmt.Errorf("%w: %s", err, strings.Join(why, "; "))
}

// maxHops bounds the nodes one sandbox's create tries.
const maxHops = 3

// createOne makes one sandbox on node (placed and reserved already),
// placing it again elsewhere when the node refuses or fails.
func (s *Server) createOne(ctx context.Context, spec *dsecv1.SandboxSpec, node, token string) (*dsecv1.Sandbox, error) {
	var retry placement.Retry
	for hop := 1; ; hop++ {
		sb, err := s.createOn(ctx, spec, node, token)
		s.placer.Done(node, 1, err == nil)
		if err == nil {
			return sb, nil
		}
		if !retry.Again(node, err) {
			return nil, err
		}
		if hop == maxHops {
			return nil, fmt.Errorf("create a sandbox: %d nodes tried (%d refused, %d failed); the last: %w",
				hop, retry.Refusals, retry.Failures, err)
		}
		s.log.Debug("create goes elsewhere", "node", node, "err", err)
		picked, perr := s.place(placeRequest(spec, 1), retry.Exclude)
		if perr != nil {
			return nil, fmt.Errorf("create a sandbox after %s said %v: %w", node, err, perr)
		}
		node = picked[0]
	}
}

func (s *Server) createOn(ctx context.Context, spec *dsecv1.SandboxSpec, node, token string) (*dsecv1.Sandbox, error) {
	e, err := s.fleet.Edge(node)
	if err != nil {
		return nil, err
	}
	if token != "" {
		token += "@" + node // a token names one create on one node
	}
	resp, err := e.Create(ctx, connect.NewRequest(&edgev1.CreateRequest{Spec: spec, CreateToken: token}))
	if err != nil {
		return nil, err
	}
	return resp.Msg, nil
}

func createToken(key string, i int) string {
	if key == "" {
		return ""
	}
	return fmt.Sprintf("%s#%d", key, i)
}

func (s *Server) deleteAll(ctx context.Context, sbs []*dsecv1.Sandbox) {
	for _, sb := range sbs {
		if sb == nil {
			continue
		}
		e, err := s.edgeFor(sb.GetId())
		if err != nil {
			continue
		}
		if _, err := e.Delete(ctx, connect.NewRequest(&dsecv1.DeleteRequest{Id: sb.GetId()})); err != nil {
			s.log.Warn("remove sandbox of a failed batch", "id", sb.GetId(), "err", err)
		}
	}
}

func (s *Server) getSandbox(ctx context.Context, id string) (*dsecv1.Sandbox, error) {
	if id == "" {
		return nil, fmt.Errorf("id is required: %w", errdefs.ErrInvalidArgument)
	}
	e, err := s.edgeFor(id)
	if err != nil {
		return nil, err
	}
	resp, err := e.Get(ctx, connect.NewRequest(&dsecv1.GetRequest{Id: id}))
	if err != nil {
		return nil, err
	}
	return resp.Msg, nil
}

func (s *Server) Get(ctx context.Context, req *connect.Request[dsecv1.GetRequest]) (*connect.Response[dsecv1.Sandbox], error) {
	sb, err := s.getSandbox(ctx, req.Msg.GetId())
	if err != nil {
		return nil, err
	}
	return connect.NewResponse(sb), nil
}

// liveStates are the states of a sandbox that still holds resources: what
// List returns unless asked for others.
func liveStates() []dsecv1.State {
	return []dsecv1.State{dsecv1.State_STATE_CREATING, dsecv1.State_STATE_RUNNING, dsecv1.State_STATE_STOPPING,
		dsecv1.State_STATE_PAUSING, dsecv1.State_STATE_PAUSED, dsecv1.State_STATE_RESUMING}
}

func (s *Server) List(ctx context.Context, req *connect.Request[dsecv1.ListRequest]) (*connect.Response[dsecv1.ListResponse], error) {
	states := req.Msg.GetStates()
	switch {
	case len(states) > 0 && req.Msg.GetAll():
		return nil, fmt.Errorf("list: states and all both given; name one: %w", errdefs.ErrInvalidArgument)
	case len(states) == 0 && !req.Msg.GetAll():
		states = liveStates()
	}
	for _, st := range states {
		if _, ok := dsecv1.State_name[int32(st)]; !ok || st == dsecv1.State_STATE_UNSPECIFIED {
			return nil, fmt.Errorf("list: state %d is not a sandbox state: %w", st, errdefs.ErrInvalidArgument)
		}
	}
	out := &dsecv1.ListResponse{}
	// An unreachable node's sandboxes cannot be listed; its calls fail
	// with Unavailable naming it.
	for _, n := range s.routable() {
		resp, err := n.Edge.List(ctx, connect.NewRequest(&dsecv1.ListRequest{Labels: req.Msg.GetLabels(), States: states}))
		if err != nil {
			return nil, fmt.Errorf("list sandboxes of node %s: %w", n.Name, err)
		}
		out.Sandboxes = append(out.Sandboxes, resp.Msg.GetSandboxes()...)
	}
	return connect.NewResponse(out), nil
}

func (s *Server) Delete(ctx context.Context, req *connect.Request[dsecv1.DeleteRequest]) (*connect.Response[dsecv1.DeleteResponse], error) {
	id := req.Msg.GetId()
	if id == "" {
		return nil, fmt.Errorf("id is required: %w", errdefs.ErrInvalidArgument)
	}
	e, err := s.edgeFor(id)
	if err != nil {
		return nil, err
	}
	return e.Delete(ctx, connect.NewRequest(&dsecv1.DeleteRequest{Id: id}))
}

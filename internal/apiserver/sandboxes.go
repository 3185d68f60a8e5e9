package apiserver

import (
	"context"
	"crypto/rand"
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
	"dsec.dev/dsec/internal/iam"
	"dsec.dev/dsec/internal/placement"
	"dsec.dev/dsec/internal/sandboxpage"
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
	if _, ok := dsecv1.Isolation_name[int32(msg.GetSpec().GetIsolation())]; !ok {
		return nil, fmt.Errorf("spec.isolation %d is not known (container, gvisor, microvm): %w", msg.GetSpec().GetIsolation(), errdefs.ErrInvalidArgument)
	}
	// A retry is known by the request its client sent, hashed before
	// the spec is spelt out below (its class, its project), so that the
	// hash does not change with what this apiserver fills in.
	hash := requestHash(msg)
	if err := normalizeQoS(msg.GetSpec()); err != nil {
		return nil, err
	}
	if msg.GetSpec().GetBackend() == dsecv1.Backend_BACKEND_FNCALL {
		return nil, fmt.Errorf("backend fncall serves FnCallService's calls (RunCode) from pools the nodes keep; it makes no sandboxes to order: %w", errdefs.ErrInvalidArgument)
	}
	if err := placeInProject(ctx, msg.GetSpec()); err != nil {
		return nil, err
	}
	if err := s.usable(ctx, msg.GetSpec().GetEnvironment()); err != nil {
		return nil, err
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
	for {
		// Only one create per key runs here; the others wait for its
		// record. A key done already (a retry) is found by its
		// reservation, which answers with the record: looking it up first
		// would cost every new key a query.
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
		sbs, err := s.createAndRecord(ctx, msg.GetSpec(), count, key, hash)
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
// token of the reservation, so an edge hands both the same sandbox. While
// the batch is made its creates hold the reservation's lease (holdLease),
// so no apiserver abandons it. The key's record and the sandboxes' rows are
// written in one transaction; a batch that cannot be recorded is deleted
// again.
func (s *Server) createAndRecord(ctx context.Context, spec *dsecv1.SandboxSpec, count int, key, hash string) ([]*dsecv1.Sandbox, error) {
	nodes, err := s.place(ctx, placeRequest(spec, count), nil)
	if err != nil {
		// A retry of a create that is done gets its answer even when
		// no node could take the batch now.
		if sbs, rerr := s.replay(ctx, key, hash); !errors.Is(rerr, errdefs.ErrNotFound) {
			return sbs, rerr
		}
		return nil, err
	}
	// The quota is charged in the transaction that reserves the key, and
	// only if it does: a follower makes the owner's sandboxes, charged
	// already.
	c, charged, err := s.quotaCharge(ctx, spec, count)
	if err != nil {
		s.unplace(nodes)
		return nil, err
	}
	r := store.CreateReservation{Key: key, RequestHash: hash, Owner: s.cfg.Name, Placements: nodes}
	if charged {
		r.Charge = &c
	}
	got, reserved, err := s.reserve(ctx, r)
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
	var h held
	if reserved && charged {
		h = held{store.ReservationHold(key, got.Nonce)}
	}
	release := func() { s.settleHolds(ctx, h, false) }
	lctx, lost := context.WithCancelCause(ctx)
	defer lost(nil)
	stop := s.holdLease(lctx, key, got.Nonce, lost)
	batch := batchOf(got)
	sbs, err := s.createPlaced(lctx, spec, nodes, batch, key)
	stop()
	wctx := context.WithoutCancel(ctx)
	if err != nil {
		if cause := context.Cause(lctx); errors.Is(cause, errdefs.ErrUnavailable) {
			err = cause // the lease was lost, not the caller
		}
		s.discard(wctx, sbs, batch, key, reserved)
		release()
		return nil, err
	}
	rows := make([]store.SandboxRow, len(sbs))
	for i, sb := range sbs {
		rows[i] = store.SandboxRow{ID: sb.GetId(), Node: sb.GetNode(), Key: key, Created: time.Now()}
	}
	err = s.idem.CompleteCreate(wctx, key, got.Nonce, rows)
	switch {
	case err == nil:
		s.settleHolds(ctx, h, true)
		return sbs, nil
	case errors.Is(err, errdefs.ErrAlreadyExists):
		// Another replica recorded other sandboxes for the key first (a
		// create that went elsewhere after a refusal): theirs stand, and
		// ours that are not among them go.
		rec, gerr := s.idem.GetIdempotency(wctx, key)
		if gerr != nil {
			s.doubtAll(wctx, sbs, batch, key, gerr)
			return nil, gerr
		}
		for i, sb := range sbs {
			if slices.Contains(rec.IDs, sb.GetId()) {
				sbs[i] = nil
			}
		}
		s.deleteAll(wctx, sbs, batch, key)
		release()
		return s.replay(ctx, key, hash)
	case errors.Is(err, errdefs.ErrNotFound):
		// The reservation is gone for good (its nonce is never used
		// again): nobody can complete it with these sandboxes.
		s.deleteAll(wctx, sbs, batch, key)
		release()
		return nil, fmt.Errorf("create with idempotency key %q: its reservation ended while the create ran (released, or abandoned after %s untouched); nothing was kept, try again: %w",
			key, s.cfg.AbandonAfter, errdefs.ErrUnavailable)
	}
	// The completion may or may not have been stored: the charge stays,
	// and the reconciliation sets the quota's use from what remains.
	s.discard(wctx, sbs, batch, key, reserved)
	s.settleHolds(ctx, h, true)
	return nil, err
}

// discard gives up the sandboxes a keyed batch made. Another create may be
// following the same reservation with the same tokens, and so share some
// of them, and complete it: only the owner, once it has released the
// reservation, deletes them now. Otherwise (a follower, or a release that
// failed) they are left as doubts, which reconciliation settles once the
// key is done (sparing the sandboxes it recorded) or gone.
func (s *Server) discard(ctx context.Context, sbs []*dsecv1.Sandbox, batch, key string, owner bool) {
	if owner {
		err := s.idem.ReleaseCreate(ctx, key)
		if err == nil {
			s.deleteAll(ctx, sbs, batch, key)
			return
		}
		s.log.Warn("release the reservation of a failed create", "key", key, "err", err)
	}
	s.doubtAll(ctx, sbs, batch, key, errors.New("the batch failed"))
}

// reserve reserves r.Key, or returns the reservation that holds it. A
// pending one another create holds is touched before it is followed, so
// that no apiserver abandons it under this create; one that ended in
// between is looked up again.
func (s *Server) reserve(ctx context.Context, r store.CreateReservation) (store.CreateReservation, bool, error) {
	if r.Charge != nil {
		// Charged with the project's other charges under way, in one
		// transaction; a key held already is read below.
		got, reserved, err := s.charges.reserve(ctx, s.cfg.Quotas, r)
		if err != nil || reserved {
			return got, reserved, err
		}
	}
	for attempt := 1; ; attempt++ {
		got, reserved, err := s.idem.ReserveCreate(ctx, r)
		if err != nil || reserved || got.State == store.StateDone {
			return got, reserved, err
		}
		err = s.idem.TouchCreate(ctx, r.Key, got.Nonce)
		if err == nil || !errors.Is(err, errdefs.ErrNotFound) || attempt == 3 {
			return got, false, err
		}
	}
}

// holdLease renews the lease of the reservation (key, nonce) while its
// create runs, every quarter of AbandonAfter, until stop is called. Should
// the reservation be gone (an apiserver abandoned it: this one could not
// renew it in time), it ends the create through lost, with Unavailable: the
// caller may try again. A store that cannot be reached is tried again at
// the next renewal.
func (s *Server) holdLease(ctx context.Context, key, nonce string, lost context.CancelCauseFunc) (stop func()) {
	done := make(chan struct{})
	var wg sync.WaitGroup
	wg.Add(1)
	go func() {
		defer wg.Done()
		t := time.NewTicker(s.cfg.AbandonAfter / 4)
		defer t.Stop()
		for {
			select {
			case <-done:
				return
			case <-ctx.Done():
				return
			case <-t.C:
			}
			err := s.idem.TouchCreate(ctx, key, nonce)
			if errors.Is(err, errdefs.ErrNotFound) {
				lost(fmt.Errorf("create with idempotency key %q: its reservation ended while the create ran (abandoned after %s untouched, or released): %w",
					key, s.cfg.AbandonAfter, errdefs.ErrUnavailable))
				return
			}
			if err != nil && ctx.Err() == nil {
				s.log.Warn("renew the lease of a reservation", "key", key, "err", err)
			}
		}
	}()
	return func() {
		close(done)
		wg.Wait()
	}
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
// Its charge is held under the batch's name until the batch is made or
// given up.
func (s *Server) createBatch(ctx context.Context, spec *dsecv1.SandboxSpec, n int) ([]*dsecv1.Sandbox, error) {
	batch := newBatch()
	h, err := s.charge(ctx, spec, n, "batch:"+batch)
	if err != nil {
		return nil, err
	}
	nodes, err := s.place(ctx, placeRequest(spec, n), nil)
	if err != nil {
		s.settleHolds(ctx, h, false)
		return nil, err
	}
	sbs, err := s.createPlaced(ctx, spec, nodes, batch, "")
	if err != nil {
		s.deleteAll(context.WithoutCancel(ctx), sbs, batch, "")
		s.settleHolds(ctx, h, false)
		return nil, err
	}
	s.settleHolds(ctx, h, true)
	return sbs, nil
}

// createPlaced starts one sandbox on each of nodes (placed and reserved
// already). The sandboxes bound for one node go in one call (CreateMany),
// the calls to different nodes at once, with bounded concurrency. A node's
// refusal (ResourceExhausted: it is full) or failure sends that sandbox
// elsewhere, at most maxHops tries in all. If any sandbox cannot be made,
// its error is returned with the sandboxes that were (nil where none was),
// for the caller to remove. Sandbox i's create on node N carries the token
// BATCH#i@N (createToken), so a retried create of a keyed batch (whose
// batch name is its reservation's) gets the sandboxes the first made, and
// reconciliation can find what a given-up create made; key is the batch's
// idempotency key, "" for none.
func (s *Server) createPlaced(ctx context.Context, spec *dsecv1.SandboxSpec, nodes []string, batch, key string) ([]*dsecv1.Sandbox, error) {
	n := len(nodes)
	out := make([]*dsecv1.Sandbox, n)
	errs := make([]error, n)
	if n == 1 {
		out[0], errs[0] = s.createOne(ctx, spec, nodes[0], createToken(batch, 0), key)
		return out, errs[0]
	}
	groups := byNode(nodes)
	sem := make(chan struct{}, s.cfg.CreateConcurrency)
	var wg sync.WaitGroup
	// A failure stops the calls not yet started; those under way finish
	// (a create cut off midway would leave its outcome unknown, its
	// sandbox to the reconciler), so the caller can remove all of them now.
	stop := make(chan struct{})
	var once sync.Once
	for _, g := range groups {
		wg.Add(1)
		go func() {
			defer wg.Done()
			giveUp := func(err error) {
				s.placer.Done(g.node, len(g.idx), false)
				for _, i := range g.idx {
					errs[i] = err
				}
			}
			select {
			case <-stop:
				giveUp(context.Canceled)
				return
			default:
			}
			select {
			case sem <- struct{}{}:
			case <-stop:
				giveUp(context.Canceled)
				return
			case <-ctx.Done():
				giveUp(ctx.Err())
				return
			}
			defer func() { <-sem }()
			s.createGroup(ctx, spec, g.node, g.idx, batch, key, out, errs)
			for _, i := range g.idx {
				if errs[i] != nil {
					once.Do(func() { close(stop) })
					break
				}
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
		return out, fmt.Errorf("create %d sandboxes (none kept): %w", n, first)
	}
	return out, nil
}

// nodeGroup is the sandboxes of a batch bound for one node, by index.
type nodeGroup struct {
	node string
	idx  []int
}

// byNode groups the indices of nodes by node, in the order the nodes first
// appear, at most maxCreateMany to a group.
func byNode(nodes []string) []nodeGroup {
	var groups []nodeGroup
	at := map[string]int{}
	for i, node := range nodes {
		g, ok := at[node]
		if !ok || len(groups[g].idx) == maxCreateMany {
			g = len(groups)
			at[node] = g
			groups = append(groups, nodeGroup{node: node})
		}
		groups[g].idx = append(groups[g].idx, i)
	}
	return groups
}

// maxCreateMany is the most sandboxes one CreateMany carries (the edge's
// own bound).
const maxCreateMany = 256

// createGroup makes sandboxes idx of a batch on node in one call and sends
// each the node refused or failed elsewhere, as createOne does, filling in
// out and errs at idx.
func (s *Server) createGroup(ctx context.Context, spec *dsecv1.SandboxSpec, node string, idx []int, batch, key string, out []*dsecv1.Sandbox, errs []error) {
	if len(idx) == 1 {
		i := idx[0]
		out[i], errs[i] = s.createOne(ctx, spec, node, createToken(batch, i), key)
		return
	}
	tokens := make([]string, len(idx))
	for j, i := range idx {
		tokens[j] = createToken(batch, i)
	}
	sbs, cerrs := s.createManyOn(ctx, spec, node, tokens, key)
	var wg sync.WaitGroup
	for j, i := range idx {
		s.placer.Done(node, 1, cerrs[j] == nil)
		if cerrs[j] == nil {
			out[i] = sbs[j]
			continue
		}
		wg.Add(1)
		go func() {
			defer wg.Done()
			out[i], errs[i] = s.createElsewhere(ctx, spec, node, tokens[j], key, cerrs[j])
		}()
	}
	wg.Wait()
}

// placeRequest is what placement is asked for n sandboxes of spec.
func placeRequest(spec *dsecv1.SandboxSpec, n int) placement.Request {
	return placement.Request{Backend: isolationName(spec.GetIsolation()), Count: n}
}

// place asks placement for nodes. When the nodes are full, the error says
// why in the nodes' own words too: each full node's admission reason from
// its last report (which names the flag that raises its limit). Other
// shortages (no healthy node, none with the backend, every node tried)
// say nothing of the limit: raising it would not help.
//
// Before refusing for want of room, it has the nodes polled (refreshFull)
// and asks again: their reports may predate room made since.
func (s *Server) place(ctx context.Context, req placement.Request, exclude map[string]bool) ([]string, error) {
	nodes, err := s.placer.Place(s.placementView(), req, exclude)
	if shortOfRoom(err) && s.refreshFull(ctx, req.Backend) {
		nodes, err = s.placer.Place(s.placementView(), req, exclude)
	}
	s.metrics.Placement(placementOutcome(err))
	var ex *placement.ExhaustedError
	if err != nil && errors.As(err, &ex) && ex.Shortage == placement.NoBackend {
		// No node offers the isolation: say what they lack for it.
		if why := s.missingOn(req.Backend); why != "" {
			return nil, fmt.Errorf("%w: %s", err, why)
		}
		return nil, err
	}
	if err == nil || !errors.As(err, &ex) || !ex.Full() {
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
func (s *Server) createOne(ctx context.Context, spec *dsecv1.SandboxSpec, node, token, key string) (*dsecv1.Sandbox, error) {
	sb, err := s.createOn(ctx, spec, node, token, key)
	s.placer.Done(node, 1, err == nil)
	if err == nil {
		return sb, nil
	}
	return s.createElsewhere(ctx, spec, node, token, key, err)
}

// createElsewhere goes on with the create of token that node answered
// with err: placed again without the nodes tried, while placement.Retry
// says so, at most maxHops nodes in all.
func (s *Server) createElsewhere(ctx context.Context, spec *dsecv1.SandboxSpec, node, token, key string, err error) (*dsecv1.Sandbox, error) {
	var retry placement.Retry
	for hop := 1; ; hop++ {
		if !retry.Again(node, err) {
			return nil, err
		}
		if hop == maxHops {
			return nil, fmt.Errorf("create a sandbox: %d nodes tried (%d refused, %d failed); the last: %w",
				hop, retry.Refusals, retry.Failures, err)
		}
		s.log.Debug("create goes elsewhere", "node", node, "err", err)
		picked, perr := s.place(ctx, placeRequest(spec, 1), retry.Exclude)
		if perr != nil {
			if retry.Refusals == 0 {
				// Every node tried failed (none was full), and no other
				// is left: the last failure, of its kind, says why.
				// "Every node was tried" would read as a full fleet,
				// which a caller retries as overload for ever.
				return nil, fmt.Errorf("create a sandbox (no other node to try after %s): %w", node, err)
			}
			return nil, fmt.Errorf("create a sandbox after %s said %v: %w", node, err, perr)
		}
		node = picked[0]
		var sb *dsecv1.Sandbox
		sb, err = s.createOn(ctx, spec, node, token, key)
		s.placer.Done(node, 1, err == nil)
		if err == nil {
			return sb, nil
		}
	}
}

// createOn sends one create to node, its token naming that node too. When
// the call ends without the node's verdict (it timed out, the connection
// dropped, the caller gave up) the node may yet make the sandbox: the
// create is recorded as a doubt for reconciliation to settle.
func (s *Server) createOn(ctx context.Context, spec *dsecv1.SandboxSpec, node, token, key string) (*dsecv1.Sandbox, error) {
	e, err := s.fleet.Edge(node)
	if err != nil {
		return nil, err // nothing was sent
	}
	token = nodeToken(token, node)
	resp, err := e.Create(ctx, connect.NewRequest(&edgev1.CreateRequest{Spec: spec, CreateToken: token}))
	if err != nil {
		if outcomeUnknown(err) {
			s.doubt(ctx, err, store.Doubt{Node: node, Token: token, Key: key})
		}
		return nil, err
	}
	return resp.Msg, nil
}

// createManyOn sends the creates of tokens to node in one call, each token
// naming that node too, and returns each one's sandbox or error. A create
// whose outcome the call did not bring is recorded as a doubt, as createOn
// does.
func (s *Server) createManyOn(ctx context.Context, spec *dsecv1.SandboxSpec, node string, tokens []string, key string) ([]*dsecv1.Sandbox, []error) {
	sbs := make([]*dsecv1.Sandbox, len(tokens))
	errs := make([]error, len(tokens))
	fail := func(err error) ([]*dsecv1.Sandbox, []error) {
		for j := range errs {
			errs[j] = err
		}
		return sbs, errs
	}
	e, err := s.fleet.Edge(node)
	if err != nil {
		return fail(err) // nothing was sent
	}
	sent := make([]string, len(tokens))
	for j, t := range tokens {
		sent[j] = nodeToken(t, node)
	}
	resp, err := e.CreateMany(ctx, connect.NewRequest(&edgev1.CreateManyRequest{Spec: spec, CreateTokens: sent}))
	if err == nil && len(resp.Msg.GetResults()) != len(sent) {
		err = fmt.Errorf("node %s answered %d results to %d creates: %w", node, len(resp.Msg.GetResults()), len(sent), errdefs.ErrInternal)
	}
	if err != nil {
		if outcomeUnknown(err) {
			ds := make([]store.Doubt, len(sent))
			for j, t := range sent {
				ds[j] = store.Doubt{Node: node, Token: t, Key: key}
			}
			s.doubt(ctx, err, ds...)
		}
		return fail(err)
	}
	for j, r := range resp.Msg.GetResults() {
		switch {
		case r.GetErrorCode() != 0:
			errs[j] = errdefs.FromConnect(connect.NewError(connect.Code(r.GetErrorCode()), errors.New(r.GetErrorMessage())))
			if outcomeUnknown(errs[j]) {
				s.doubt(ctx, errs[j], store.Doubt{Node: node, Token: sent[j], Key: key})
			}
		case r.GetSandbox() == nil:
			errs[j] = fmt.Errorf("node %s answered create %s with neither a sandbox nor an error: %w", node, sent[j], errdefs.ErrInternal)
			s.doubt(ctx, errs[j], store.Doubt{Node: node, Token: sent[j], Key: key})
		default:
			sbs[j] = r.GetSandbox()
		}
	}
	return sbs, errs
}

// createToken names sandbox i of a batch; nodeToken adds the node it is
// sent to (a token names one create on one node): BATCH#i@NODE.
func createToken(batch string, i int) string { return fmt.Sprintf("%s#%d", batch, i) }

func nodeToken(token, node string) string { return token + "@" + node }

// batchPrefix is what the tokens of every create of a batch start with.
func batchPrefix(batch string) string { return batch + "#" }

// newBatch names a batch without an idempotency key: 16 random hex digits.
func newBatch() string {
	b := make([]byte, 8)
	rand.Read(b) // never returns an error (crypto/rand)
	return hex.EncodeToString(b)
}

// batchOf names a keyed batch by its reservation's nonce, so no other
// reservation of the key (after this one was released or abandoned) sends
// the same tokens; reservations made before nonces existed use the key.
func batchOf(r store.CreateReservation) string {
	if r.Nonce == "" {
		return r.Key
	}
	return r.Nonce
}

// doubtAll records every sandbox of sbs made (index i of sbs is sandbox i;
// nil ones were not made) as a doubt, for reconciliation to settle.
func (s *Server) doubtAll(ctx context.Context, sbs []*dsecv1.Sandbox, batch, key string, why error) {
	var ds []store.Doubt
	for i, sb := range sbs {
		if sb != nil {
			ds = append(ds, store.Doubt{Node: sb.GetNode(), Token: nodeToken(createToken(batch, i), sb.GetNode()), Key: key})
		}
	}
	s.doubt(ctx, why, ds...)
}

// deleteAll removes the sandboxes of a batch that will not be kept (index
// i of sbs is sandbox i; nil ones were not made). A delete that fails
// leaves a doubt, so reconciliation removes the sandbox later.
func (s *Server) deleteAll(ctx context.Context, sbs []*dsecv1.Sandbox, batch, key string) {
	for i, sb := range sbs {
		if sb == nil {
			continue
		}
		e, err := s.edgeFor(sb.GetId())
		if err == nil {
			_, err = e.Delete(ctx, connect.NewRequest(&dsecv1.DeleteRequest{Id: sb.GetId()}))
		}
		if err != nil {
			s.log.Warn("remove sandbox of a failed batch", "id", sb.GetId(), "err", err)
			s.doubt(ctx, err, store.Doubt{Node: sb.GetNode(), Token: nodeToken(createToken(batch, i), sb.GetNode()), Key: key})
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
	if a, need, check := callerRole(ctx); check {
		s.projects.put(id, projectOf(resp.Msg))
		if err := admit(a, need, id, projectOf(resp.Msg)); err != nil {
			return nil, err
		}
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
	paged := req.Msg.GetPageSize() != 0 || req.Msg.GetPageToken() != ""
	size := int(req.Msg.GetPageSize())
	var after *dsecv1.Sandbox
	if paged {
		var err error
		if after, err = sandboxpage.Check(size, req.Msg.GetPageToken()); err != nil {
			return nil, fmt.Errorf("list: %w", err)
		}
		size = min(size, sandboxpage.MaxSize)
	}
	out := &dsecv1.ListResponse{}
	// An unreachable node's sandboxes cannot be listed (its calls fail
	// with Unavailable naming it): the answer names it, so that a list
	// short of them does not read as a list of everything.
	for _, n := range s.fleet.Nodes() {
		if !n.Healthy {
			out.UnreachableNodes = append(out.UnreachableNodes, n.Name)
		}
	}
	slices.Sort(out.UnreachableNodes)
	// Each node filters its own list by what the caller may see and, for
	// a page, answers only its first page_size+1 sandboxes after the
	// cursor (one more than a page, so a node's "more" shows) and its
	// count: a page reads nodes x page_size records, not every record.
	ereq := &edgev1.ListRequest{Labels: req.Msg.GetLabels(), States: states}
	// The fncall backend's pooled containers are the platform's, not the
	// caller's: listed only when asked for by their label.
	_, pooled := req.Msg.GetLabels()[FnCallPoolLabel]
	if !pooled {
		ereq.ExcludeLabels = []string{FnCallPoolLabel}
	}
	if a, _, check := callerRole(ctx); check {
		// visible's rule, as subtrees a node can test.
		projects, all := a.Reach(iam.Viewer)
		ereq.Scoped, ereq.Projects = !all, projects
	}
	if paged {
		ereq.PageSize = int32(size + 1)
		ereq.AfterCreatedUnixMs, ereq.AfterId = after.GetCreatedUnixMs(), after.GetId()
	}
	total := 0
	for _, n := range s.routable() {
		resp, err := n.Edge.List(ctx, connect.NewRequest(ereq))
		if err != nil {
			return nil, fmt.Errorf("list sandboxes of node %s: %w", n.Name, err)
		}
		// What a node answers is filtered again here, which costs a page
		// little: an edge from before the scope and page fields (a
		// cluster halfway through an upgrade) answers every match of the
		// labels and states, and is only slower.
		sbs := resp.Msg.GetSandboxes()
		if !pooled {
			sbs = slices.DeleteFunc(sbs, func(sb *dsecv1.Sandbox) bool {
				_, isPool := sb.GetSpec().GetLabels()[FnCallPoolLabel]
				return isPool
			})
		}
		sbs = visible(ctx, sbs)
		if resp.Msg.GetFiltered() {
			total += int(resp.Msg.GetTotal())
		} else {
			total += len(sbs) // every match, the cursor aside
		}
		out.Sandboxes = append(out.Sandboxes, sbs...)
	}
	if paged {
		sandboxpage.Sort(out.Sandboxes)
		out.Total = int32(total)
		var err error
		out.Sandboxes, out.NextPageToken, err = sandboxpage.Cut(out.Sandboxes, size, req.Msg.GetPageToken())
		if err != nil {
			return nil, fmt.Errorf("list: %w", err)
		}
	}
	return connect.NewResponse(out), nil
}

func (s *Server) Delete(ctx context.Context, req *connect.Request[dsecv1.DeleteRequest]) (*connect.Response[dsecv1.DeleteResponse], error) {
	id := req.Msg.GetId()
	if id == "" {
		return nil, fmt.Errorf("id is required: %w", errdefs.ErrInvalidArgument)
	}
	e, err := s.sandboxEdge(ctx, id)
	if err != nil {
		return nil, err
	}
	if s.cfg.Quotas == nil {
		return e.Delete(ctx, connect.NewRequest(&dsecv1.DeleteRequest{Id: id}))
	}
	// What a live sandbox held goes back when it is deleted, once however
	// many deletes race (ReleaseSandbox), held until then (holdRelease);
	// one that ended by itself is the reconciliation's to give back.
	sb, err := e.Get(ctx, connect.NewRequest(&dsecv1.GetRequest{Id: id}))
	if err != nil {
		return nil, err
	}
	if !live(sb.Msg.GetState()) {
		return e.Delete(ctx, connect.NewRequest(&dsecv1.DeleteRequest{Id: id}))
	}
	project, amounts := projectOf(sb.Msg), amountsOf(sb.Msg.GetSpec(), 1)
	h := s.holdRelease(ctx, project, id, amounts)
	resp, err := e.Delete(ctx, connect.NewRequest(&dsecv1.DeleteRequest{Id: id}))
	if err != nil {
		s.settleHolds(ctx, h, true) // nothing was released: the hold just goes
		return nil, err
	}
	s.releaseSandbox(ctx, project, id, amounts)
	return resp, nil
}

package apiserver

import (
	"context"
	"errors"
	"maps"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"connectrpc.com/connect"

	edgev1 "dsec.dev/dsec/api/gen/dsec/edge/v1"
	"dsec.dev/dsec/internal/errdefs"
	"dsec.dev/dsec/internal/store"
	"dsec.dev/dsec/internal/watcher"
)

// Reconciliation keeps the edges and the metadata store agreeing about
// which sandboxes exist, after faults:
//
//   - A create whose outcome an apiserver never learned (the call timed
//     out, the connection dropped, the caller gave up, a batch's delete
//     failed) may still make a sandbox, on a node frozen meanwhile say:
//     the create is recorded as a doubt (node, token, key) in the store,
//     where any apiserver finds it. Once the node answers, an apiserver asks
//     it to Reap the doubtful tokens, sparing the sandboxes a completed
//     keyed create recorded, and clears the doubts. A doubt of a key still
//     pending waits: the create holding it may yet complete with that
//     sandbox. A reaped token is dead on the edge, so a create of it still
//     queued there makes nothing.
//   - A pending reservation whose lease nobody renewed for AbandonAfter
//     (its owner died, and no retry follows its plan) is abandoned: in one
//     transaction it is removed and its batch's token prefix is recorded as
//     a doubt on every node, which the step above settles. The key is free
//     again at once. A create still working for the reservation renews the
//     lease (holdLease) every quarter of AbandonAfter, and a completion
//     needs the reservation still pending under its nonce, so abandonment
//     and acknowledgement exclude each other: a sandbox a retry is about to
//     acknowledge is never reaped, and one reaped is never acknowledged.
//   - The other way, the rows of sandboxes the (answering) node no longer
//     has (deleted, expired, its disk lost) are removed, so the store does
//     not grow and a replay says "since removed". A node reports how many
//     sandboxes stopped living on it since its edge started; while that
//     count and the start are what they were at this apiserver's last
//     check of the node, no row of it can have gone stale and the check is
//     skipped (reading a node's every row and asking after each, every
//     sweep, cost seconds of CPU at half a million rows), except once every
//     fullRowCheck, for a sandbox that ended before its row was written.
//
// The watcher runs NodeReturned for a node that answers again (or is seen
// first); RunReconciler then settles that node at once, and sweeps every
// routable node every ReconcileInterval, so that a doubt recorded while its
// node was healthy is settled too.

// DefaultAbandonAfter is how long a pending reservation may go without its
// lease renewed before any apiserver abandons it. The creates working for
// it renew it every quarter of that (30 s), so only a reservation whose
// every worker is dead, or cut off from the store for four renewals in a
// row, loses it; and a key whose owner died is free again within about
// AbandonAfter plus ReconcileInterval. It bounds nothing about how long a
// create may take: a live create holds its reservation as long as it runs.
const DefaultAbandonAfter = 2 * time.Minute

// reconcileTimeout bounds the settling of one node: reaping can mean
// stopping many real sandboxes.
const reconcileTimeout = 2 * time.Minute

// staleBatch is how many stale reservations one sweep abandons at most.
const staleBatch = 100

// goneBatch is how many sandbox IDs one Gone call carries.
const goneBatch = 1000

// fullRowCheck is how often a node's sandbox rows are checked even though
// none of its sandboxes ended since the last check.
const fullRowCheck = 10 * time.Minute

// rowMark is what a node reported when its rows were last checked.
type rowMark struct {
	started int64  // NodeStatus.started_unix_ms
	ended   uint64 // NodeStatus.ended
	at      time.Time
}

// ReconcileStats counts what reconciliation did since the apiserver
// started; /metrics serves them.
type ReconcileStats struct {
	DoubtsRecorded        int64 // creates recorded as doubts
	DoubtsSettled         int64 // doubts settled with their nodes and cleared
	SandboxesReaped       int64 // sandboxes nodes removed when asked to reap
	ReservationsAbandoned int64 // stale reservations abandoned
	RowsRemoved           int64 // sandbox rows of sandboxes gone from their nodes
	RowChecksSkipped      int64 // node row checks skipped: none of its sandboxes ended since the last
}

type reconciler struct {
	doubtsRecorded, doubtsSettled, reaped, abandoned, rowsRemoved, rowChecksSkipped atomic.Int64

	mu       sync.Mutex
	unsaved  []store.Doubt           // doubts the store could not take yet
	returned map[string]watcher.Node // nodes to settle at once
	kick     chan struct{}
	checked  map[string]rowMark // by node: its last row check
	swept    time.Time          // the last sweepObjects
}

func newReconciler() reconciler {
	return reconciler{returned: map[string]watcher.Node{}, kick: make(chan struct{}, 1), checked: map[string]rowMark{}}
}

// ReconcileStats returns the counters.
func (s *Server) ReconcileStats() ReconcileStats {
	r := &s.rec
	return ReconcileStats{DoubtsRecorded: r.doubtsRecorded.Load(), DoubtsSettled: r.doubtsSettled.Load(),
		SandboxesReaped: r.reaped.Load(), ReservationsAbandoned: r.abandoned.Load(), RowsRemoved: r.rowsRemoved.Load(),
		RowChecksSkipped: r.rowChecksSkipped.Load()}
}

// outcomeUnknown says whether a create that failed with err may yet have
// made a sandbox: every error but the node's own verdict that it made
// none.
func outcomeUnknown(err error) bool {
	for _, kind := range []error{
		errdefs.ErrResourceExhausted, errdefs.ErrInvalidArgument, errdefs.ErrNotFound, errdefs.ErrAlreadyExists,
		errdefs.ErrFailedPrecondition, errdefs.ErrNotSupported, errdefs.ErrPermissionDenied, errdefs.ErrUnauthenticated,
	} {
		if errors.Is(err, kind) {
			return false
		}
	}
	return true
}

// doubt records ds, creates that failed with why, for reconciliation, in
// one write. Doubts the store cannot take now are kept in memory and saved
// at the next sweep.
func (s *Server) doubt(ctx context.Context, why error, ds ...store.Doubt) {
	if len(ds) == 0 {
		return
	}
	s.rec.doubtsRecorded.Add(int64(len(ds)))
	now := time.Now()
	for i := range ds {
		ds[i].Created = now
		s.log.Debug("create outcome unknown; recorded for reconciliation", "node", ds[i].Node, "token", ds[i].Token, "key", ds[i].Key, "err", why)
	}
	if err := s.idem.AddDoubts(context.WithoutCancel(ctx), ds); err != nil {
		s.log.Warn("record creates' doubts; keeping them until the store answers", "doubts", len(ds), "node", ds[0].Node, "token", ds[0].Token, "err", err)
		s.rec.mu.Lock()
		s.rec.unsaved = append(s.rec.unsaved, ds...)
		s.rec.mu.Unlock()
	}
}

// NodeReturned asks RunReconciler to settle node n now, through n.Edge:
// the watcher calls it (Config.OnReturn) when a node answers again, or is
// seen for the first time, just before it makes the node routable. It does
// not block.
func (s *Server) NodeReturned(n watcher.Node) {
	s.rec.mu.Lock()
	s.rec.returned[n.Name] = n
	s.rec.mu.Unlock()
	select {
	case s.rec.kick <- struct{}{}:
	default:
	}
}

// RunReconciler reconciles until ctx ends: every node NodeReturned names,
// at once; everything, at start and every ReconcileInterval.
func (s *Server) RunReconciler(ctx context.Context) {
	t := time.NewTicker(s.cfg.ReconcileInterval)
	defer t.Stop()
	s.Reconcile(ctx)
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
			s.Reconcile(ctx)
		case <-s.rec.kick:
			s.rec.mu.Lock()
			nodes := slices.Collect(maps.Values(s.rec.returned))
			s.rec.returned = map[string]watcher.Node{}
			s.rec.mu.Unlock()
			s.reconcileNodes(ctx, nodes)
		}
	}
}

// Reconcile sweeps once: it saves the doubts the store could not take,
// abandons stale reservations, then settles the doubts of every routable
// node and checks its sandbox rows, corrects the quotas' use and, every
// objectSweepEvery, sweeps the records of calls that died (sweepObjects).
func (s *Server) Reconcile(ctx context.Context) {
	s.saveUnsaved(ctx)
	s.abandonStale(ctx)
	s.reconcileNodes(ctx, s.routable())
	s.reconcileQuotas(ctx)
	s.rec.mu.Lock()
	due := time.Since(s.rec.swept) >= objectSweepEvery
	if due {
		s.rec.swept = time.Now()
	}
	s.rec.mu.Unlock()
	if due {
		s.sweepObjects(ctx, time.Now())
	}
}

func (s *Server) saveUnsaved(ctx context.Context) {
	s.rec.mu.Lock()
	ds := s.rec.unsaved
	s.rec.unsaved = nil
	s.rec.mu.Unlock()
	if len(ds) == 0 {
		return
	}
	if err := s.idem.AddDoubts(ctx, ds); err != nil {
		s.log.Warn("record doubts kept in memory", "doubts", len(ds), "err", err)
		s.rec.mu.Lock()
		s.rec.unsaved = append(s.rec.unsaved, ds...)
		s.rec.mu.Unlock()
	}
}

// abandonStale abandons the pending reservations whose lease lapsed,
// leaving a doubt of the batch's token prefix on every node of the fleet
// (a create may have gone to any, after a refusal).
func (s *Server) abandonStale(ctx context.Context) {
	nodes := s.fleet.Nodes()
	if len(nodes) == 0 {
		return // no fleet seen yet: nowhere to leave the doubts
	}
	cutoff := time.Now().Add(-s.cfg.AbandonAfter)
	stale, err := s.idem.StaleCreates(ctx, cutoff, staleBatch)
	if err != nil {
		s.log.Warn("reconcile: list stale reservations", "err", err)
		return
	}
	for _, r := range stale {
		doubts := make([]store.Doubt, 0, len(nodes))
		for _, n := range nodes {
			doubts = append(doubts, store.Doubt{Node: n.Name, Token: batchPrefix(batchOf(r)), Prefix: true, Key: r.Key})
		}
		ok, err := s.idem.AbandonCreate(ctx, r.Key, r.Nonce, cutoff, doubts)
		if err != nil {
			s.log.Warn("reconcile: abandon a stale reservation", "key", r.Key, "err", err)
			continue
		}
		if ok {
			// Its charge goes with it: its sandboxes are reaped, and the
			// quota sweep counts them while they live.
			if s.cfg.Quotas != nil {
				s.settleHolds(ctx, reservationHolds(r), false)
			}
			s.rec.abandoned.Add(1)
			s.log.Info("reconcile: abandoned a reservation nobody renewed; its sandboxes will be reaped",
				"key", r.Key, "owner", r.Owner, "sandboxes", len(r.Placements), "untouched", time.Since(r.Updated).Round(time.Second), "nodes", len(nodes))
		}
	}
}

// reconcileNodes settles the doubts and checks the rows of nodes.
func (s *Server) reconcileNodes(ctx context.Context, nodes []watcher.Node) {
	doubts, err := s.idem.Doubts(ctx)
	if err != nil {
		s.log.Warn("reconcile: list doubts", "err", err)
	}
	byNode := map[string][]store.Doubt{}
	for _, d := range doubts {
		byNode[d.Node] = append(byNode[d.Node], d)
	}
	for _, n := range nodes {
		if ctx.Err() != nil {
			return
		}
		nctx, cancel := context.WithTimeout(ctx, reconcileTimeout)
		if err == nil {
			s.settle(nctx, n, byNode[n.Name])
		}
		s.checkRows(nctx, n)
		cancel()
	}
}

// settle has node n reap what its doubtful creates made, sparing what a
// completed create recorded, and clears the doubts. Doubts of a key whose
// reservation is still pending wait.
func (s *Server) settle(ctx context.Context, n watcher.Node, doubts []store.Doubt) {
	if len(doubts) == 0 {
		return
	}
	keys := map[string]verdict{}
	req := &edgev1.ReapRequest{}
	keep := map[string]bool{}
	var settled []store.Doubt
	for _, d := range doubts {
		if d.Key != "" {
			v, ok := keys[d.Key]
			if !ok {
				var err error
				if v, err = s.keyVerdict(ctx, d.Key, n.Name); err != nil {
					s.log.Warn("reconcile: read the create of a doubt", "node", n.Name, "key", d.Key, "err", err)
					v.wait = true
				}
				keys[d.Key] = v
			}
			if v.wait {
				continue
			}
			for _, id := range v.keep {
				keep[id] = true
			}
		}
		if d.Prefix {
			req.TokenPrefixes = append(req.TokenPrefixes, d.Token)
		} else {
			req.Tokens = append(req.Tokens, d.Token)
		}
		settled = append(settled, d)
	}
	if len(settled) == 0 {
		return
	}
	req.KeepIds = slices.Sorted(maps.Keys(keep))
	resp, err := n.Edge.Reap(ctx, connect.NewRequest(req))
	if err != nil {
		s.log.Warn("reconcile: reap on node", "node", n.Name, "doubts", len(settled), "err", err)
		return
	}
	if err := s.idem.ClearDoubts(ctx, settled); err != nil {
		s.log.Warn("reconcile: clear settled doubts", "node", n.Name, "doubts", len(settled), "err", err)
		return
	}
	removed := len(resp.Msg.GetRemovedIds())
	s.rec.doubtsSettled.Add(int64(len(settled)))
	s.rec.reaped.Add(int64(removed))
	s.log.Info("reconcile: settled doubtful creates", "node", n.Name, "doubts", len(settled), "reaped", removed,
		"kept", len(req.KeepIds), "waiting", len(doubts)-len(settled))
}

// verdict is what to do with the doubts of one key on one node.
type verdict struct {
	wait bool     // its reservation is pending: leave them
	keep []string // the sandboxes its completed create recorded there
}

// keyVerdict says what to do with node's doubts of key: wait while its
// reservation is pending; else spare the sandboxes its completed create
// recorded on node (none when the key is gone).
func (s *Server) keyVerdict(ctx context.Context, key, node string) (verdict, error) {
	var v verdict
	r, err := s.idem.Reservation(ctx, key)
	switch {
	case errors.Is(err, errdefs.ErrNotFound):
	case err != nil:
		return v, err
	case r.State == store.StatePending:
		v.wait = true
		return v, nil
	}
	// Rows outlive the key's record (ExpireIdempotency) for as long as
	// their sandboxes live, so they are what a completed create spares.
	rows, err := s.idem.SandboxRows(ctx, key)
	if err != nil {
		return v, err
	}
	for _, row := range rows {
		if row.Node == node {
			v.keep = append(v.keep, row.ID)
		}
	}
	return v, nil
}

// checkRows removes the rows of the sandboxes node n no longer has, unless
// none of them can have gone since the last check.
func (s *Server) checkRows(ctx context.Context, n watcher.Node) {
	// The mark is read before the rows: a sandbox that ends from now on
	// raises the count the next check compares.
	mark := rowMark{started: n.Status.GetStartedUnixMs(), ended: n.Status.GetEnded(), at: time.Now()}
	s.rec.mu.Lock()
	last, ok := s.rec.checked[n.Name]
	s.rec.mu.Unlock()
	if ok && mark.started != 0 && mark.started == last.started && mark.ended == last.ended && mark.at.Sub(last.at) < fullRowCheck {
		s.rec.rowChecksSkipped.Add(1)
		return
	}
	rows, err := s.idem.NodeSandboxRows(ctx, n.Name)
	if err != nil {
		s.log.Warn("reconcile: list sandbox rows", "node", n.Name, "err", err)
		return
	}
	removed := 0
	for chunk := range slices.Chunk(rows, goneBatch) {
		ids := make([]string, len(chunk))
		for i, r := range chunk {
			ids[i] = r.ID
		}
		resp, err := n.Edge.Gone(ctx, connect.NewRequest(&edgev1.GoneRequest{Ids: ids}))
		if err != nil {
			s.log.Warn("reconcile: ask which sandboxes are gone", "node", n.Name, "err", err)
			return
		}
		gone := resp.Msg.GetIds()
		if len(gone) == 0 {
			continue
		}
		if err := s.idem.DeleteSandboxRows(ctx, gone); err != nil {
			s.log.Warn("reconcile: remove rows of gone sandboxes", "node", n.Name, "err", err)
			return
		}
		removed += len(gone)
	}
	s.rec.mu.Lock()
	s.rec.checked[n.Name] = mark
	s.rec.mu.Unlock()
	if removed > 0 {
		s.rec.rowsRemoved.Add(int64(removed))
		s.log.Info("reconcile: removed the rows of sandboxes gone from their node", "node", n.Name, "rows", removed, "of", len(rows))
	}
}

// reservationHolds names the holds a reservation's charge may hold: one
// for a create, one per child for a fork (store.QuotaCharge.Parts).
func reservationHolds(r store.CreateReservation) held {
	h := held{store.ReservationHold(r.Key, r.Nonce)}
	for i := range r.Placements {
		h = append(h, store.ReservationPart(r.Key, r.Nonce, i))
	}
	return h
}

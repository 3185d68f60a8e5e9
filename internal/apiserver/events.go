package apiserver

import (
	"context"
	"errors"
	"fmt"
	"math"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"connectrpc.com/connect"

	edgev1 "dsec.dev/dsec/api/gen/dsec/edge/v1"
	dsecv1 "dsec.dev/dsec/api/gen/dsec/v1"
	"dsec.dev/dsec/api/gen/dsec/v1/dsecv1connect"
	"dsec.dev/dsec/internal/errdefs"
	"dsec.dev/dsec/internal/iam"
	"dsec.dev/dsec/internal/pullpack"
	"dsec.dev/dsec/internal/store"
)

// Lifecycle events (docs/events.md). Each edge keeps its sandboxes' events
// in order in memory (package eventlog), each named NODE/EPOCH/SEQ; one
// apiserver at a time, the holder of the node's lease in the store, pulls
// them (RunEvents) into the metadata store with the node's cursor in one
// write, so nothing is offered twice, and an apiserver taking over
// resumes where the last left off. Readers list or follow the store by its
// cursor, each seeing its token's project and the projects under it.

const (
	// DefaultEventRetention is how long events are kept when
	// Config.EventRetention is 0.
	DefaultEventRetention = 7 * 24 * time.Hour
	// eventPullEvery is how often RunEvents looks for new events; a node
	// whose last report names the sequence number this apiserver has
	// pulled to is not called.
	eventPullEvery = 250 * time.Millisecond
	// eventPullTimeout bounds one node's Events call, so a node that hangs
	// delays the others' events by at most that.
	eventPullTimeout = 2 * time.Second
	// eventPage is what one edge call and one store read return at most.
	eventPage = 1000
	// followPoll is how often a follower reads the store when this
	// apiserver stored nothing meanwhile (another may have).
	followPoll = time.Second
	// callFlushEvery is how often an apiserver writes its FnCall counters
	// when they changed (usage.go).
	callFlushEvery = 5 * time.Second
)

// EventStore is what the apiserver needs of the store for events.
type EventStore interface {
	store.EventPulls
	ListEvents(ctx context.Context, q store.EventQuery) ([]store.Event, error)
	ExpireEvents(ctx context.Context, olderThan time.Time) (int, error)
}

const (
	// eventLease is how long a claim holds a node's pull; claims renew it
	// every eventClaimEvery. Another apiserver takes a killed one's nodes
	// within eventLease.
	eventLease      = 5 * time.Second
	eventClaimEvery = time.Second
	// A node's pull is deleted from the store once the node has left the
	// fleet and no apiserver has held it for eventForgetAfter; each
	// apiserver looks every eventForgetEvery (forgetGoneNodes).
	eventForgetAfter = time.Hour
	eventForgetEvery = 10 * time.Minute
	// A create's doubt on a node gone from the fleet is deleted once it
	// is doubtForgetAfter old (forgetGoneNodes): a sandbox the create made
	// there has outlived the default --max-ttl by then, and its idle
	// timeout (nobody knew of it to use it) long before.
	doubtForgetAfter = 24 * time.Hour
)

// eventState is the apiserver's side of the event stream: its counters,
// and a channel closed (and replaced) each time it stores events, for its
// followers.
type eventState struct {
	stored  atomic.Int64 // events this apiserver stored
	lost    atomic.Int64 // events nodes no longer kept when it asked
	pulls   atomic.Int64 // Events calls this apiserver made to nodes
	held    atomic.Int64 // nodes whose pull this apiserver holds
	changed atomic.Pointer[chan struct{}]
	// stopping is closed when the apiserver begins to stop: followers
	// end then, rather than hold its shutdown to its grace period.
	stopping chan struct{}
	stopOnce sync.Once
}

func (e *eventState) init() {
	ch := make(chan struct{})
	e.changed.Store(&ch)
	e.stopping = make(chan struct{})
}

// EndFollowers ends every FollowEvents stream with Unavailable, which
// clients take as "follow again, elsewhere, after the last event": the
// daemon calls it as it begins to stop, so a stream with nothing to send
// does not hold the shutdown for its whole grace period.
func (s *Server) EndFollowers() {
	s.events.stopOnce.Do(func() { close(s.events.stopping) })
}

// wake tells the followers that events were stored.
func (e *eventState) wake() {
	ch := make(chan struct{})
	close(*e.changed.Swap(&ch))
}

// RunEvents pulls the nodes' events into the store until ctx ends (at
// once without Config.Events, or with Config.EventsOff). Every apiserver
// runs it, and each node is pulled by one at a time: the holder of the
// node's lease in the store (ClaimEventPulls, renewed every second for the
// routable nodes; each apiserver takes only its share of them and gives
// back the extra between two pulls), which stores each tick's pulls of all its nodes with
// their cursors in one write (PullEvents). Another apiserver takes the nodes of one that
// stopped (at once: it hands them back) or died (when the leases lapse),
// and resumes at their cursors.
func (s *Server) RunEvents(ctx context.Context) {
	// The ledger rides on the pull (usage.go): with events off it still runs for it.
	if s.cfg.Events == nil || s.cfg.EventsOff && s.cfg.Ledger == nil {
		return
	}
	owner := s.cfg.Name + "/" + randomHex(6)
	defer func() {
		if err := s.cfg.Events.ReleaseEventPulls(context.WithoutCancel(ctx), owner); err != nil {
			s.log.Warn("release event pulls", "err", err)
		}
	}()
	held := map[string]store.EventPull{}
	var claimed time.Time
	t := time.NewTicker(eventPullEvery)
	defer t.Stop()
	flushed, forgot := time.Now(), time.Now()
	for {
		if time.Since(forgot) >= eventForgetEvery {
			forgot = time.Now()
			s.forgetGoneNodes(ctx, forgot)
		}
		if time.Since(claimed) >= eventClaimEvery {
			claimed = time.Now()
			s.claimEventPulls(ctx, owner, held)
		}
		if !s.pullEvents(ctx, owner, held) {
			claimed = time.Time{} // a lease lost: claim again at the next tick
		}
		if time.Since(flushed) >= callFlushEvery {
			s.flushCalls(ctx)
			flushed = time.Now()
		}
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
	}
}

// forgetGoneNodes deletes from the store the pulls of the nodes gone from
// the fleet (removed from the registry, or from --edges) that no apiserver
// has held for eventForgetAfter before now, their creates' doubts recorded
// doubtForgetAfter before now, and this apiserver's ledger cursors of the
// nodes gone from the fleet: all would grow with every node that ever
// left. A node that is down or restarting stays in the fleet and keeps
// them. An empty fleet (the registry not read yet) forgets nothing.
func (s *Server) forgetGoneNodes(ctx context.Context, now time.Time) {
	var keep []string
	for _, n := range s.fleet.Nodes() {
		keep = append(keep, n.Name)
	}
	if len(keep) == 0 {
		return
	}
	s.usage.forget(keep)
	n, err := s.cfg.Events.ForgetEventPulls(ctx, keep, now.Add(-eventForgetAfter))
	if err != nil {
		if ctx.Err() == nil {
			s.log.Warn("forget the event pulls of nodes gone", "err", err)
		}
		return
	}
	if n > 0 {
		s.log.Info("forgot the event pulls of nodes gone from the fleet", "count", n, "gone for", eventForgetAfter)
	}
	n, err = s.idem.ForgetDoubts(ctx, keep, now.Add(-doubtForgetAfter))
	if err != nil {
		if ctx.Err() == nil {
			s.log.Warn("forget the doubts of nodes gone", "err", err)
		}
		return
	}
	if n > 0 {
		s.log.Info("forgot the doubtful creates of nodes gone from the fleet", "count", n, "older than", doubtForgetAfter)
	}
}

// claimEventPulls renews owner's leases of the routable nodes, takes the
// free ones, and sets held to them with their stored cursors (on an
// error, holding none: another apiserver may be taking them).
func (s *Server) claimEventPulls(ctx context.Context, owner string, held map[string]store.EventPull) {
	var nodes []string
	for _, n := range s.fleet.Nodes() {
		if n.Healthy && n.Edge != nil {
			nodes = append(nodes, n.Name)
		}
	}
	now := time.Now()
	ps, err := s.cfg.Events.ClaimEventPulls(ctx, owner, nodes, now, now.Add(eventLease))
	clear(held)
	if err != nil {
		if ctx.Err() == nil {
			s.log.Warn("claim event pulls", "err", err)
		}
		s.events.held.Store(0)
		return
	}
	for _, p := range ps {
		held[p.Node] = p
	}
	s.events.held.Store(int64(len(held)))
}

// pullEvents reads what each node held logged past its cursors, events
// and ledger records, and stores it all, with the nodes' new cursors, in
// one write (a round per page while some node has more). It returns false
// when owner lost a node's lease (nothing of that write stored): the
// leases are to be claimed again.
func (s *Server) pullEvents(ctx context.Context, owner string, held map[string]store.EventPull) bool {
	for len(held) > 0 {
		var to []store.EventPull
		var evs []store.Event
		var ledgers []string // the nodes whose ledgers this round pulls
		more := false
		for _, n := range s.fleet.Nodes() {
			c, ok := held[n.Name]
			if !ok || !n.Healthy || n.Edge == nil {
				continue
			}
			st := n.Status
			due := s.cfg.Ledger != nil && s.usage.due(n.Name, c.UsageEpoch, s.cfg.UsagePullEvery)
			eventsNew := !s.cfg.EventsOff && (c.Epoch == "" || st == nil || st.GetEventEpoch() != c.Epoch || st.GetEventSeq() > c.Seq)
			usageNew := due && (st == nil || st.GetUsageEpoch() != c.UsageEpoch || st.GetUsageSeq() > c.UsageSeq)
			if !eventsNew && !usageNew {
				continue
			}
			next, got, ok := s.readNode(ctx, n.Edge, c, due)
			if !ok {
				continue
			}
			if due || next.UsageEpoch != c.UsageEpoch {
				ledgers = append(ledgers, n.Name)
			}
			if len(got) == 0 && len(next.Usage) == 0 && next.Epoch == c.Epoch && next.Seq == c.Seq &&
				next.UsageEpoch == c.UsageEpoch && next.UsageSeq == c.UsageSeq {
				continue
			}
			to = append(to, next)
			if evs == nil {
				evs = got // most rounds hear from one node: its page, not a copy
			} else {
				evs = append(evs, got...)
			}
			more = more || len(got) == eventPage
		}
		if len(to) == 0 {
			s.usage.markPulled(ledgers)
			return true
		}
		added, err := s.cfg.Events.PullEvents(ctx, owner, to, evs...)
		if errors.Is(err, errdefs.ErrFailedPrecondition) {
			s.log.Info("an event pull was taken over by another apiserver; claiming again", "err", err)
			return false
		}
		if err != nil {
			s.log.Warn("store events", "nodes", len(to), "events", len(evs), "err", err)
			return true
		}
		s.usage.markPulled(ledgers)
		for _, c := range to {
			c.Usage = nil
			held[c.Node] = c
		}
		if added > 0 {
			s.events.stored.Add(int64(added))
			s.events.wake()
		}
		if !more {
			return true
		}
	}
	return true
}

// readNode reads a page of the node's events after c, and its ledger's
// records after c's when withUsage, and returns the cursors after them
// with the records (the events with events off: none, the cursor
// unmoved); false on an error (the next pull asks again).
func (s *Server) readNode(ctx context.Context, edge Edge, c store.EventPull, withUsage bool) (store.EventPull, []store.Event, bool) {
	cctx, cancel := context.WithTimeout(ctx, eventPullTimeout)
	defer cancel()
	s.events.pulls.Add(1)
	after := c.UsageSeq
	if !withUsage {
		// Its ledger is not due (Config.UsagePullEvery): the records
		// after the largest version of its epoch are none.
		after = math.MaxUint64
	}
	resp, err := edge.Events(cctx, connect.NewRequest(&edgev1.EventsRequest{Epoch: c.Epoch, After: c.Seq, Limit: eventPage,
		UsageEpoch: c.UsageEpoch, UsageAfter: after, Packed: true}))
	if err != nil {
		s.log.Debug("pull events", "node", c.Node, "err", err)
		return c, nil, false
	}
	m := resp.Msg
	next := c
	// The ledger's records ride on the pull (usage.go). A pull not due
	// whose node answers in another epoch (it restarted) carries the
	// node's whole ledger all the same (the version asked for is of the
	// old epoch): it is stored, and the cursor moves to the new epoch, so
	// the pulls until the next due one carry nothing.
	if withUsage || (s.cfg.Ledger != nil && m.GetUsageEpoch() != c.UsageEpoch) {
		rows, err := pulledUsage(m)
		if err != nil {
			s.log.Warn("pull usage: the node's answer is unreadable", "node", c.Node, "err", err)
			return c, nil, false
		}
		next.UsageEpoch, next.UsageSeq, next.Usage = m.GetUsageEpoch(), m.GetUsageNext(), rows
	}
	if s.cfg.EventsOff {
		return next, nil, true
	}
	if n := m.GetLost(); n > 0 {
		s.events.lost.Add(int64(n))
		s.log.Warn("events lost: the node no longer keeps them", "node", c.Node, "lost", n)
	}
	evs, err := pulledEvents(m)
	if err != nil {
		s.log.Warn("pull events: the node's answer is unreadable", "node", c.Node, "err", err)
		return c, nil, false
	}
	next.Epoch, next.Seq = m.GetEpoch(), m.GetNext()
	return next, evs, true
}

// pulledEvents reads the events of a pull's answer: packed, or (from an
// edge that predates packing) as messages.
func pulledEvents(m *edgev1.EventsResponse) ([]store.Event, error) {
	if len(m.GetPackedEvents()) == 0 {
		evs := make([]store.Event, 0, len(m.GetEvents()))
		for _, e := range m.GetEvents() {
			evs = append(evs, store.Event{Key: e.GetKey(), At: time.UnixMilli(e.GetAtUnixMs()), Project: e.GetProject(),
				SandboxID: e.GetSandboxId(), Kind: e.GetKind(), Node: e.GetNode(), Reason: e.GetReason(), Message: e.GetMessage()})
		}
		return evs, nil
	}
	var evs []store.Event
	var key []byte
	var prefix int
	err := pullpack.Read(m.GetPackedEvents(), func(node string, seq uint64, e pullpack.Event) {
		if evs == nil {
			evs = make([]store.Event, 0, eventPage)
			key = append(append(append(append(key, node...), '/'), m.GetEpoch()...), '/')
			prefix = len(key)
		}
		key = strconv.AppendUint(key[:prefix], seq, 10)
		evs = append(evs, store.Event{Key: string(key), At: time.UnixMilli(e.AtUnixMs), Project: e.Project, SandboxID: e.SandboxID,
			Kind: e.Kind, Node: node, Reason: e.Reason, Message: e.Message})
	})
	if err != nil {
		return nil, err
	}
	return evs, nil
}

// RunEventExpiry forgets the events older than the configured retention,
// about once an hour at random times, as RunAuditExpiry does the audit
// trail's, until ctx ends (at once without Config.Events or when events
// are kept forever).
func (s *Server) RunEventExpiry(ctx context.Context) {
	retention := s.cfg.EventRetention
	if retention == 0 {
		retention = DefaultEventRetention
	}
	if s.cfg.Events == nil || retention < 0 {
		return
	}
	expireEvery(ctx, "events", retention, auditExpiryEvery, s.log, s.cfg.Events.ExpireEvents)
}

// eventQuery reads a ListEventsRequest as a store query a may run: its
// project (the token's when unset) and everything under it.
func (s *Server) eventQuery(a iam.Authority, op iam.Op, m *dsecv1.ListEventsRequest) (store.EventQuery, error) {
	if s.cfg.Events == nil {
		return store.EventQuery{}, fmt.Errorf("events: this server keeps no metadata store: %w", errdefs.ErrNotSupported)
	}
	path, err := projectOr(a, m.Project)
	if err != nil {
		return store.EventQuery{}, err
	}
	if err := allow(a, op, path); err != nil {
		return store.EventQuery{}, err
	}
	if err := checkEventKinds(m.GetKinds()); err != nil {
		return store.EventQuery{}, err
	}
	if m.GetLimit() < 0 || m.GetAfter() < 0 || m.GetBefore() < 0 {
		return store.EventQuery{}, fmt.Errorf("limit %d, after %d, before %d: want 0 or more: %w", m.GetLimit(), m.GetAfter(), m.GetBefore(), errdefs.ErrInvalidArgument)
	}
	return store.EventQuery{Projects: []string{path}, After: m.GetAfter(), Since: timeOf(m.GetSinceUnixMs()),
		SandboxID: m.GetSandboxId(), Kinds: m.GetKinds(), Limit: min(int(m.GetLimit()), eventPage),
		Before: m.GetBefore(), NewestFirst: m.GetNewestFirst()}, nil
}

func eventMsg(e store.Event) *dsecv1.Event {
	return &dsecv1.Event{Id: e.ID, Key: e.Key, AtUnixMs: e.At.UnixMilli(), Project: e.Project, SandboxId: e.SandboxID,
		Kind: e.Kind, Node: e.Node, Reason: e.Reason, Message: e.Message}
}

// ListEvents returns a page of the events the request selects.
func (s *Server) ListEvents(ctx context.Context, req *connect.Request[dsecv1.ListEventsRequest]) (*connect.Response[dsecv1.ListEventsResponse], error) {
	q, err := s.eventQuery(actor(ctx), iam.Op(dsecv1connect.SandboxServiceListEventsProcedure), req.Msg)
	if err != nil {
		return nil, err
	}
	evs, err := s.cfg.Events.ListEvents(ctx, q)
	if err != nil {
		return nil, err
	}
	out := &dsecv1.ListEventsResponse{Next: q.After}
	for _, e := range evs {
		out.Events = append(out.Events, eventMsg(e))
		out.Next = max(out.Next, e.ID)
	}
	return connect.NewResponse(out), nil
}

// FollowEvents sends the events the request selects, then each new one as
// it is stored, until the caller hangs up. It reads the store again as
// soon as this apiserver stores events and at least every followPoll (for
// what other apiservers store). A limit ends the stream after that many.
func (s *Server) FollowEvents(ctx context.Context, req *connect.Request[dsecv1.ListEventsRequest], stream *connect.ServerStream[dsecv1.Event]) error {
	q, err := s.eventQuery(actor(ctx), iam.Op(dsecv1connect.SandboxServiceFollowEventsProcedure), req.Msg)
	if err != nil {
		return err
	}
	if req.Msg.GetNewestFirst() || req.Msg.GetBefore() > 0 {
		return fmt.Errorf("follow events: newest_first and before are ListEvents' only: %w", errdefs.ErrInvalidArgument)
	}
	left := int(req.Msg.GetLimit()) // 0: no end
	// The headers go at once, so a client knows it is following.
	if err := stream.Send(nil); err != nil {
		return err
	}
	for {
		changed := *s.events.changed.Load()
		q.Limit = eventPage
		evs, err := s.cfg.Events.ListEvents(ctx, q)
		if err != nil {
			return err
		}
		for _, e := range evs {
			if err := stream.Send(eventMsg(e)); err != nil {
				return err
			}
			q.After = e.ID
			if left > 0 {
				if left--; left == 0 {
					return nil
				}
			}
		}
		if len(evs) == eventPage {
			continue
		}
		t := time.NewTimer(followPoll)
		select {
		case <-ctx.Done():
			t.Stop()
			return nil
		case <-s.events.stopping:
			t.Stop()
			return fmt.Errorf("follow events: this apiserver is stopping; follow again after the last event: %w", errdefs.ErrUnavailable)
		case <-changed:
		case <-t.C:
		}
		t.Stop()
	}
}

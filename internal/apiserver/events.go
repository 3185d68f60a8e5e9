package apiserver

import (
	"context"
	"fmt"
	"math/rand/v2"
	"sync/atomic"
	"time"

	"connectrpc.com/connect"

	edgev1 "dsec.dev/dsec/api/gen/dsec/edge/v1"
	dsecv1 "dsec.dev/dsec/api/gen/dsec/v1"
	"dsec.dev/dsec/api/gen/dsec/v1/dsecv1connect"
	"dsec.dev/dsec/internal/errdefs"
	"dsec.dev/dsec/internal/iam"
	"dsec.dev/dsec/internal/store"
)

// Lifecycle events (docs/events.md). Each edge keeps its sandboxes' events
// in order in memory (package eventlog), each named NODE/EPOCH/SEQ; every
// apiserver pulls them from every routable node (RunEvents) into the
// metadata store, which stores each key once: two apiservers pulling one
// node, or one restarted pulling from the start of the node's log again,
// record nothing twice, and an apiserver that was down loses nothing the
// node still keeps. Readers list or follow the store by its cursor, each
// seeing its token's project and the projects under it.

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
)

// EventStore is what the apiserver needs of the store for events.
type EventStore interface {
	AppendEvents(ctx context.Context, evs ...store.Event) (int, error)
	ListEvents(ctx context.Context, q store.EventQuery) ([]store.Event, error)
	ExpireEvents(ctx context.Context, olderThan time.Time) (int, error)
}

// eventState is the apiserver's side of the event stream: where it has
// pulled each node to, and a channel closed (and replaced) each time it
// stores events, for its followers.
type eventState struct {
	stored  atomic.Int64 // events this apiserver stored (new keys)
	lost    atomic.Int64 // events nodes no longer kept when it asked
	changed atomic.Pointer[chan struct{}]
}

func (e *eventState) init() {
	ch := make(chan struct{})
	e.changed.Store(&ch)
}

// wake tells the followers that events were stored.
func (e *eventState) wake() {
	ch := make(chan struct{})
	close(*e.changed.Swap(&ch))
}

// eventCursor is how far a node's log has been pulled.
type eventCursor struct {
	epoch string
	seq   uint64
}

// RunEvents pulls the nodes' events into the store until ctx ends (at
// once without Config.Events). Every apiserver runs it.
func (s *Server) RunEvents(ctx context.Context) {
	if s.cfg.Events == nil {
		return
	}
	cursors := map[string]eventCursor{}
	t := time.NewTicker(eventPullEvery)
	defer t.Stop()
	for {
		s.pullEvents(ctx, cursors)
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
	}
}

// pullEvents stores what each routable node logged past its cursor.
func (s *Server) pullEvents(ctx context.Context, cursors map[string]eventCursor) {
	for _, n := range s.fleet.Nodes() {
		if !n.Healthy || n.Edge == nil {
			continue
		}
		c, seen := cursors[n.Name]
		if st := n.Status; seen && st != nil && st.GetEventEpoch() == c.epoch && st.GetEventSeq() <= c.seq {
			continue
		}
		cursors[n.Name] = s.pullNode(ctx, n.Name, n.Edge, c)
	}
}

// pullNode stores node's events after c and returns the cursor after the
// last stored: on an error, c, so the next pull asks again.
func (s *Server) pullNode(ctx context.Context, node string, edge Edge, c eventCursor) eventCursor {
	for {
		cctx, cancel := context.WithTimeout(ctx, eventPullTimeout)
		resp, err := edge.Events(cctx, connect.NewRequest(&edgev1.EventsRequest{Epoch: c.epoch, After: c.seq, Limit: eventPage}))
		cancel()
		if err != nil {
			s.log.Debug("pull events", "node", node, "err", err)
			return c
		}
		m := resp.Msg
		if n := m.GetLost(); n > 0 {
			s.events.lost.Add(int64(n))
			s.log.Warn("events lost: the node no longer keeps them", "node", node, "lost", n)
		}
		evs := make([]store.Event, 0, len(m.GetEvents()))
		for _, e := range m.GetEvents() {
			evs = append(evs, store.Event{Key: e.GetKey(), At: time.UnixMilli(e.GetAtUnixMs()), Project: e.GetProject(),
				SandboxID: e.GetSandboxId(), Kind: e.GetKind(), Node: e.GetNode(), Reason: e.GetReason(), Message: e.GetMessage()})
		}
		if len(evs) > 0 {
			added, err := s.cfg.Events.AppendEvents(ctx, evs...)
			if err != nil {
				s.log.Warn("store events", "node", node, "events", len(evs), "err", err)
				return c
			}
			if added > 0 {
				s.events.stored.Add(int64(added))
				s.events.wake()
			}
		}
		c = eventCursor{epoch: m.GetEpoch(), seq: m.GetNext()}
		if len(evs) < eventPage {
			return c
		}
	}
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
	every := auditExpiryEvery
	t := time.NewTimer(rand.N(every/4) + 1)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
		if n, err := s.cfg.Events.ExpireEvents(ctx, time.Now().Add(-retention)); err != nil {
			s.log.Warn("expire events", "err", err)
		} else if n > 0 {
			s.log.Info("expired events", "count", n, "retention", retention)
		}
		t.Reset(every/2 + rand.N(every))
	}
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
	if m.GetLimit() < 0 || m.GetAfter() < 0 {
		return store.EventQuery{}, fmt.Errorf("limit %d, after %d: want 0 or more: %w", m.GetLimit(), m.GetAfter(), errdefs.ErrInvalidArgument)
	}
	return store.EventQuery{Projects: []string{path}, After: m.GetAfter(), Since: timeOf(m.GetSinceUnixMs()),
		SandboxID: m.GetSandboxId(), Kinds: m.GetKinds(), Limit: min(int(m.GetLimit()), eventPage)}, nil
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
		out.Next = e.ID
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
		case <-changed:
		case <-t.C:
		}
		t.Stop()
	}
}

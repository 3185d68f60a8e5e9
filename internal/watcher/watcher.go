// Package watcher is an apiserver's view of the fleet. It learns the nodes
// from the cluster's registry, polls every edge's Status about once a
// second for health, capacity and load, and answers the apiserver's two
// questions: which edge holds this sandbox (routing, by the node, slot and
// generation its ID names) and which nodes may take new ones (placement).
// A node that misses MissLimit polls in a row is unroutable: calls for its
// sandboxes fail at once with Unavailable naming it, and placement skips
// it; when it answers again, OnReturn reconciles what changed meanwhile.
// A poll that fails while the node answers this apiserver's other calls is
// no miss: under a burst a starved node's Status may wait longer than a
// poll's timeout, and the node is busy, not gone.
// Every apiserver runs its own watcher; they share nothing but the registry.
package watcher

import (
	"context"
	"fmt"
	"log/slog"
	"sort"
	"sync"
	"sync/atomic"
	"time"

	"connectrpc.com/connect"

	edgev1 "dsec.dev/dsec/api/gen/dsec/edge/v1"
	"dsec.dev/dsec/api/gen/dsec/edge/v1/edgev1connect"
	"dsec.dev/dsec/internal/errdefs"
	"dsec.dev/dsec/internal/sandboxid"
)

// Edge is one node's EdgeService, as the apiserver calls it.
type Edge = edgev1connect.EdgeServiceHandler

// Member is a node as the registry has it.
type Member struct {
	Name       string
	Addr       string // where its EdgeService listens (https://HOST:PORT)
	Slot       uint16
	Generation uint32
}

// Node is a node as the watcher last saw it.
type Node struct {
	Member
	Edge    Edge
	Healthy bool
	// Status is the node's last report (nil before the first answer).
	Status *edgev1.NodeStatus
	// LastSeen is when it last answered; Misses counts the polls it has
	// missed since.
	LastSeen time.Time
	Misses   int
	LastErr  string

	// answered is when (Unix ns) the edge last answered another call.
	answered *atomic.Int64
	// asked is when the poll whose report Status holds was sent: a
	// slower poll sent before it does not replace it.
	asked time.Time
}

// Config tunes a Watcher. Members and Dial are required.
type Config struct {
	// Members lists the registered nodes.
	Members func(ctx context.Context) ([]Member, error)
	// Dial returns the EdgeService client of a member; it is called once
	// per member (and again when its address changes). The client calls
	// answered whenever the edge answers one of its calls (edgeclient.New
	// takes it).
	Dial func(m Member, answered func()) (Edge, error)
	// Interval between polls; default 750 ms. Timeout bounds one poll;
	// default 60 % of Interval. MissLimit polls missed in a row make a
	// node unroutable; default 3. With the defaults a node that stops
	// answering is unroutable within 3.5 s: the first poll after it stopped
	// starts within an interval and is forgiven if the node answered
	// another call in the interval before it, and the third miss ends a
	// timeout after the fourth poll starts.
	Interval  time.Duration
	Timeout   time.Duration
	MissLimit int
	// OnReport, if set, gets every report (placement drops the placements
	// a report already counts); OnReturn, if set, runs when a node is about
	// to become routable, at first sight or after it was unroutable, to
	// reconcile what happened while this apiserver could not see it; the
	// node stays unroutable until it succeeds.
	OnReport func(node string, st *edgev1.NodeStatus)
	OnReturn func(ctx context.Context, n Node) error
	Log      *slog.Logger
}

// Watcher keeps the fleet's view. It is safe for concurrent use.
type Watcher struct {
	cfg Config

	mu    sync.RWMutex
	nodes map[string]*Node
}

// New returns a Watcher; call Run to keep it current, or Poll for one round.
func New(cfg Config) *Watcher {
	if cfg.Interval == 0 {
		cfg.Interval = 750 * time.Millisecond
	}
	if cfg.Timeout == 0 {
		cfg.Timeout = cfg.Interval * 6 / 10
	}
	if cfg.MissLimit == 0 {
		cfg.MissLimit = 3
	}
	if cfg.Log == nil {
		cfg.Log = slog.New(slog.DiscardHandler)
	}
	return &Watcher{cfg: cfg, nodes: map[string]*Node{}}
}

// Run polls until ctx ends.
func (w *Watcher) Run(ctx context.Context) {
	t := time.NewTicker(w.cfg.Interval)
	defer t.Stop()
	for {
		w.Poll(ctx)
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
	}
}

// Poll refreshes the members from the registry and polls every node once,
// all at once.
func (w *Watcher) Poll(ctx context.Context) {
	members, err := w.cfg.Members(ctx)
	if err != nil {
		// The registry is away (PostgreSQL restarting): keep the last
		// members and poll them.
		w.cfg.Log.Warn("read the node registry", "err", err)
	} else {
		w.setMembers(members)
	}
	w.mu.RLock()
	nodes := make([]*Node, 0, len(w.nodes))
	for _, n := range w.nodes {
		nodes = append(nodes, n)
	}
	w.mu.RUnlock()
	w.pollAll(ctx, nodes, true)
}

// Refresh polls the named routable nodes now, outside the rounds, and
// returns when their reports are in or their polls have failed. Placement
// asks it before it refuses a create because the reports say every node
// is full: a node may have made room since its last report (a delete, a
// warm pool shrinking), and a refusal should not outlive that by a round.
// A failed refresh is no miss: only the rounds judge health.
func (w *Watcher) Refresh(ctx context.Context, names []string) {
	w.mu.RLock()
	nodes := make([]*Node, 0, len(names))
	for _, name := range names {
		if n := w.nodes[name]; n != nil && n.Healthy {
			nodes = append(nodes, n)
		}
	}
	w.mu.RUnlock()
	w.pollAll(ctx, nodes, false)
}

// pollAll polls the nodes all at once and returns when every poll has
// ended; round is pollOne's.
func (w *Watcher) pollAll(ctx context.Context, nodes []*Node, round bool) {
	var wg sync.WaitGroup
	for _, n := range nodes {
		wg.Go(func() { w.pollOne(ctx, n, round) })
	}
	wg.Wait()
}

// setMembers adds new members, redials moved ones and drops removed ones.
func (w *Watcher) setMembers(members []Member) {
	w.mu.Lock()
	defer w.mu.Unlock()
	seen := map[string]bool{}
	for _, m := range members {
		seen[m.Name] = true
		n := w.nodes[m.Name]
		if n != nil && n.Member == m {
			continue
		}
		answered := new(atomic.Int64)
		e, err := w.cfg.Dial(m, func() { answered.Store(time.Now().UnixNano()) })
		if err != nil {
			w.cfg.Log.Warn("dial edge", "node", m.Name, "addr", m.Addr, "err", err)
			continue
		}
		if n == nil {
			// A new node is routable once it has answered a poll.
			w.nodes[m.Name] = &Node{Member: m, Edge: e, Misses: w.cfg.MissLimit, answered: answered}
			continue
		}
		n.Member, n.Edge, n.answered = m, e, answered
	}
	for name := range w.nodes {
		if !seen[name] {
			delete(w.nodes, name)
		}
	}
}

// pollOne asks n for its Status. A round's poll (round) counts a failure
// as a miss; a refresh's does not.
func (w *Watcher) pollOne(ctx context.Context, n *Node, round bool) {
	pctx, cancel := context.WithTimeout(ctx, w.cfg.Timeout)
	defer cancel()
	w.mu.RLock()
	edge, name, answered, healthy := n.Edge, n.Name, n.answered, n.Healthy
	w.mu.RUnlock()
	start := time.Now()
	resp, err := edge.Status(pctx, connect.NewRequest(&edgev1.StatusRequest{}))
	if err == nil && resp.Msg.GetNode() != name {
		err = fmt.Errorf("the edge at %s says it is node %q, not %q", n.Addr, resp.Msg.GetNode(), name)
	} else if err != nil && healthy && answered.Load() >= start.Add(-w.cfg.Interval).UnixNano() {
		// The edge answered another call since the last round: it is
		// too busy to answer this poll in time, not gone. Its last
		// report stands.
		w.cfg.Log.Debug("busy node missed a poll", "node", name, "err", err)
		return
	}
	if err != nil && !round {
		w.cfg.Log.Debug("refresh poll failed", "node", name, "err", err)
		return
	}
	w.mu.Lock()
	if err != nil {
		n.Misses++
		n.LastErr = err.Error()
		if n.Healthy && n.Misses >= w.cfg.MissLimit {
			n.Healthy = false
			w.cfg.Log.Warn("node unroutable", "node", name, "missed", n.Misses, "err", err)
		}
		w.mu.Unlock()
		return
	}
	returning := !n.Healthy
	if returning && !round {
		// Went unroutable since the refresh began: a round brings it back.
		w.mu.Unlock()
		return
	}
	snapshot := *n
	snapshot.Status = resp.Msg
	w.mu.Unlock()
	if returning && w.cfg.OnReturn != nil {
		if err := w.cfg.OnReturn(ctx, snapshot); err != nil {
			w.cfg.Log.Warn("reconcile returning node", "node", name, "err", err)
			return // stays unroutable; the next poll tries again
		}
	}
	w.mu.Lock()
	if start.Before(n.asked) {
		// A refresh sent after this poll has reported already.
		w.mu.Unlock()
		return
	}
	n.Status, n.LastSeen, n.Misses, n.LastErr, n.asked = resp.Msg, time.Now(), 0, "", start
	if returning {
		n.Healthy = true
		w.cfg.Log.Info("node routable", "node", name)
	}
	w.mu.Unlock()
	if w.cfg.OnReport != nil {
		w.cfg.OnReport(name, resp.Msg)
	}
}

// Route returns the edge holding the sandbox id names: its node must be a
// member on the same slot and generation, and routable.
func (w *Watcher) Route(id string) (Edge, error) {
	p, err := parseID(id)
	if err != nil {
		return nil, err
	}
	w.mu.RLock()
	defer w.mu.RUnlock()
	n := w.nodes[p.Node]
	if !n.minted(p) {
		return nil, fmt.Errorf("no sandbox %s (its node %q, slot %d, generation %d, is not part of this cluster any more): %w",
			id, p.Node, p.Slot, p.Generation, errdefs.ErrNotFound)
	}
	if !n.Healthy {
		return nil, unroutable(n)
	}
	return n.Edge, nil
}

// parseID reads a sandbox ID a caller named. One that does not parse
// (mistyped, cut short) names no sandbox: NotFound, as an ID of the right
// form that no node has, not a lesson in the form of IDs.
func parseID(id string) (sandboxid.ID, error) {
	p, err := sandboxid.Parse(id)
	if err != nil {
		return p, fmt.Errorf("no sandbox %s: %w", id, errdefs.ErrNotFound)
	}
	return p, nil
}

// minted says whether n (nil: no such member) is the node that made an ID:
// the same name and, when the ID carries one, the same slot and generation.
func (n *Node) minted(p sandboxid.ID) bool {
	return n != nil && (p.Slot == 0 || (n.Slot == p.Slot && n.Generation == p.Generation))
}

func unroutable(n *Node) error {
	seen := "never answered"
	if !n.LastSeen.IsZero() {
		seen = "last answered " + time.Since(n.LastSeen).Round(100*time.Millisecond).String() + " ago"
	}
	return fmt.Errorf("node %s is unreachable (%s: %s): %w", n.Name, seen, n.LastErr, errdefs.ErrUnavailable)
}

// Edge returns the edge of node name if it is routable.
func (w *Watcher) Edge(name string) (Edge, error) {
	w.mu.RLock()
	defer w.mu.RUnlock()
	n := w.nodes[name]
	if n == nil {
		return nil, fmt.Errorf("node %q is not part of this cluster: %w", name, errdefs.ErrNotFound)
	}
	if !n.Healthy {
		return nil, unroutable(n)
	}
	return n.Edge, nil
}

// Nodes returns every member as last seen, by name.
func (w *Watcher) Nodes() []Node {
	w.mu.RLock()
	out := make([]Node, 0, len(w.nodes))
	for _, n := range w.nodes {
		out = append(out, *n)
	}
	w.mu.RUnlock()
	sort.Slice(out, func(i, j int) bool { return out[i].Name < out[j].Name })
	return out
}

// Fixed is a fleet that never changes and is always routable: the
// all-in-one dsecd's one node, or a test's. Its nodes carry no Status.
type Fixed struct {
	nodes map[string]*Node
}

// NewFixed returns the fleet of the given nodes (Name and Edge set; Slot
// and Generation as their IDs carry them, 0 without a registry).
func NewFixed(nodes ...Node) *Fixed {
	f := &Fixed{nodes: map[string]*Node{}}
	for _, n := range nodes {
		n.Healthy = true
		f.nodes[n.Name] = &n
	}
	return f
}

// Route returns the edge of the node a sandbox ID names.
func (f *Fixed) Route(id string) (Edge, error) {
	p, err := parseID(id)
	if err != nil {
		return nil, err
	}
	n := f.nodes[p.Node]
	if !n.minted(p) {
		return nil, fmt.Errorf("no sandbox %s (its node %q is not this one): %w", id, p.Node, errdefs.ErrNotFound)
	}
	return n.Edge, nil
}

// Edge returns the edge of node name.
func (f *Fixed) Edge(name string) (Edge, error) {
	n := f.nodes[name]
	if n == nil {
		return nil, fmt.Errorf("node %q is not part of this cluster: %w", name, errdefs.ErrNotFound)
	}
	return n.Edge, nil
}

// Nodes returns the fleet's nodes, by name.
func (f *Fixed) Nodes() []Node {
	out := make([]Node, 0, len(f.nodes))
	for _, n := range f.nodes {
		out = append(out, *n)
	}
	sort.Slice(out, func(i, j int) bool { return out[i].Name < out[j].Name })
	return out
}

// Package hollow is an edge that starts nothing: it registers, admits,
// names sandboxes, reports its load, ends them at their TTL (RunExpiry)
// and answers the control calls like a real edge, from records in memory, so the control plane (apiservers,
// placement, the watcher, PostgreSQL) can be measured alone at the scale of
// a whole fleet on one machine, as kubemark's hollow kubelets do for
// Kubernetes. Calls that run inside a sandbox are refused: there is none.
// `dsecd edge --runtime fake` serves one; a scale test runs many in one
// process.
package hollow

import (
	"container/heap"
	"context"
	"fmt"
	"maps"
	"slices"
	"sort"
	"sync"
	"time"

	"google.golang.org/protobuf/proto"

	dsecv1 "dsec.dev/dsec/api/gen/dsec/v1"
	"dsec.dev/dsec/internal/agent/agentclient"
	"dsec.dev/dsec/internal/edge/eventlog"
	"dsec.dev/dsec/internal/edge/ledger"
	"dsec.dev/dsec/internal/edge/netpolicy"
	"dsec.dev/dsec/internal/edge/sandbox"
	"dsec.dev/dsec/internal/edge/snapshot"
	"dsec.dev/dsec/internal/errdefs"
	"dsec.dev/dsec/internal/iam"
	"dsec.dev/dsec/internal/metrics"
	"dsec.dev/dsec/internal/qos"
	"dsec.dev/dsec/internal/sandboxid"
	"dsec.dev/dsec/internal/sandboxpage"
)

// Config shapes a hollow edge.
type Config struct {
	Node         string
	Slot         uint16 // the node's registry slot and generation, in its IDs
	Generation   uint32
	MaxSandboxes int           // admission's cap; 0 = 200
	StartDelay   time.Duration // how long a create "starts" for; 0 = none
	// MaxStarting bounds creates starting at once, as a real node's start
	// concurrency does; 0 = no bound.
	MaxStarting int
	// Retention is how long a deleted sandbox's record stays; 0 = 10 min.
	Retention time.Duration
	// Events receives the lifecycle events of its sandboxes (created,
	// paused, resumed, deleted), as a real edge's; nil records none.
	Events *eventlog.Log
	// Ledger receives its sandboxes' synthetic use (Usage), as a real
	// edge's ledger does their cgroups': a record at create, a sample of
	// each sandbox when its checkpoint is due (RunLedger) and a last one
	// at delete, so the apiservers' pulls and store writes run as in a
	// real cluster; nil keeps none. A real edge samples each sandbox
	// every interval, but a hollow sandbox's use grows evenly, so the
	// samples in between would change nothing the pulls bring; LiveUsage
	// reads a hollow sandbox's use as of its last checkpoint.
	Ledger *ledger.Ledger
	// LedgerInterval is how often RunLedger looks for checkpoints due; 0
	// = ledger.DefaultInterval.
	LedgerInterval time.Duration
	// ExpiryInterval is how often RunExpiry ends the sandboxes whose TTL
	// ran out; 0 = a second, as a real edge's sweep.
	ExpiryInterval time.Duration
	// Metrics records its creates, deletes, pauses and resumes as a real
	// edge's do (backend and isolation container), so that recording
	// costs in a hollow cluster what it does in a real one; nil records
	// nothing.
	Metrics *metrics.Edge
}

// Edge is a hollow edge. It is safe for concurrent use.
type Edge struct {
	cfg Config

	mu  sync.Mutex
	sbs map[string]*dsecv1.Sandbox
	// tmu guards the tokens alone (taken under mu to change them, alone
	// to read them): the edge service asks SandboxOf under its own lock
	// at each keyed create, which then waited behind every create's
	// section under mu, a convoy of all the node's creates.
	tmu      sync.Mutex
	tokens   map[string]string // create token -> the live sandbox it made
	tokenOf  map[string]string // and back
	gone     map[string]time.Time
	goneSeq  []string // deleted IDs, oldest first
	starting int
	pools    []*dsecv1.WarmPool
	ended    uint64    // sandboxes deleted since started
	started  time.Time // when the edge began counting ended
	// due is when each sandbox with a ledger record is next sampled,
	// soonest first (sampleLedger).
	due []dueCheck
	// expiries is when each sandbox with a TTL runs out of it (a heap,
	// soonest first): an entry whose sandbox's expiry moved since (a
	// SetTimeout, a resume: each pushes one of its own) or that ended
	// is dropped when it comes up (expire).
	expiries expiries
}

// dueSample is when sandbox id's expiry is due.
type dueSample struct {
	id string
	at time.Time
}

// dueCheck is when sandbox sb's next sample is due. It holds the sandbox,
// not its ID: a round of samples reads each entry's state to drop those
// that ended, and looking each up in sbs was most of what the ledger's
// rounds cost on a busy hollow edge.
type dueCheck struct {
	sb *dsecv1.Sandbox
	at time.Time
}

// expiries is a heap of sandboxes' expiries, soonest first.
type expiries []dueSample

func (h expiries) Len() int           { return len(h) }
func (h expiries) Less(i, j int) bool { return h[i].at.Before(h[j].at) }
func (h expiries) Swap(i, j int)      { h[i], h[j] = h[j], h[i] }
func (h *expiries) Push(x any)        { *h = append(*h, x.(dueSample)) }
func (h *expiries) Pop() any {
	old := *h
	x := old[len(old)-1]
	*h = old[:len(old)-1]
	return x
}

// New returns a hollow edge for node cfg.Node.
func New(cfg Config) *Edge {
	if cfg.MaxSandboxes == 0 {
		cfg.MaxSandboxes = 200
	}
	if cfg.Retention == 0 {
		cfg.Retention = 10 * time.Minute
	}
	return &Edge{cfg: cfg, sbs: map[string]*dsecv1.Sandbox{}, tokens: map[string]string{}, tokenOf: map[string]string{}, gone: map[string]time.Time{},
		started: time.Now()}
}

func (e *Edge) Node() string { return e.cfg.Node }

// live counts sandboxes not stopped; the caller holds e.mu.
func (e *Edge) live() int { return len(e.sbs) - len(e.gone) }

func (e *Edge) Status() sandbox.Status {
	e.mu.Lock()
	defer e.mu.Unlock()
	st := sandbox.Status{Node: e.cfg.Node, MaxSandboxes: e.cfg.MaxSandboxes, Live: e.live(), Creating: e.starting, At: time.Now(),
		Ended: e.ended, Started: e.started, CoreSched: qos.CoreSched{Reason: "a hollow node runs no sandbox"}}
	if st.Live >= e.cfg.MaxSandboxes {
		st.Refusing = e.fullError().Error()
	}
	return st
}

func (e *Edge) fullError() error {
	return fmt.Errorf("node %s holds its maximum of %d sandboxes (dsecd --max-sandboxes raises it): %w", e.cfg.Node, e.cfg.MaxSandboxes, errdefs.ErrResourceExhausted)
}

// Create admits and records a sandbox for the create token names ("" for
// none), after StartDelay.
func (e *Edge) Create(ctx context.Context, spec *dsecv1.SandboxSpec, token string) (*dsecv1.Sandbox, error) {
	began := time.Now()
	sb, err := e.create(ctx, spec, token)
	e.cfg.Metrics.Create("container", "container", err, time.Since(began))
	return sb, err
}

func (e *Edge) create(ctx context.Context, spec *dsecv1.SandboxSpec, token string) (*dsecv1.Sandbox, error) {
	if spec.GetEnvironment() == "" {
		return nil, fmt.Errorf("environment is required (BASE[+LAYER...]): %w", errdefs.ErrInvalidArgument)
	}
	e.mu.Lock()
	e.forget(time.Now())
	if e.live() >= e.cfg.MaxSandboxes {
		e.mu.Unlock()
		return nil, e.fullError()
	}
	if e.cfg.MaxStarting > 0 && e.starting >= e.cfg.MaxStarting {
		e.mu.Unlock()
		return nil, fmt.Errorf("node %s is starting %d sandboxes, its most at once: %w", e.cfg.Node, e.starting, errdefs.ErrResourceExhausted)
	}
	now := time.Now()
	sb := &dsecv1.Sandbox{Id: sandboxid.New(e.cfg.Node, e.cfg.Slot, e.cfg.Generation), Node: e.cfg.Node, Spec: proto.Clone(spec).(*dsecv1.SandboxSpec),
		State: dsecv1.State_STATE_CREATING, CreatedUnixMs: now.UnixMilli()}
	e.sbs[sb.Id] = sb
	if token != "" {
		e.tmu.Lock()
		e.tokens[token], e.tokenOf[sb.Id] = sb.Id, token
		e.tmu.Unlock()
	}
	e.starting++
	e.mu.Unlock()
	if e.cfg.StartDelay > 0 {
		t := time.NewTimer(e.cfg.StartDelay)
		select {
		case <-t.C:
		case <-ctx.Done():
			t.Stop()
		}
	}
	e.mu.Lock()
	defer e.mu.Unlock()
	e.starting--
	if err := ctx.Err(); err != nil {
		delete(e.sbs, sb.Id)
		e.dropToken(sb.Id)
		return nil, fmt.Errorf("start sandbox %s: %w", sb.Id, errdefs.ErrDeadlineExceeded)
	}
	// Deleted while it started: it stays stopped.
	if err := sandbox.Transition(sb, dsecv1.State_STATE_RUNNING); err != nil {
		return nil, sandbox.GoneError(sb)
	}
	e.cfg.Events.Add(eventlog.Created, sb.Id, spec.GetLabels()[iam.ProjectLabel], "", "")
	started := time.Now()
	if e.cfg.Ledger != nil {
		e.cfg.Ledger.Start(sb.Id, spec.GetLabels()[iam.ProjectLabel], spec.GetLabels(), started, true)
		e.due = append(e.due, dueCheck{sb, started.Add(e.cfg.Ledger.Checkpoint())})
	}
	sb.StartedUnixMs, sb.LastActiveUnixMs = started.UnixMilli(), started.UnixMilli()
	if ttl := spec.GetTtlSeconds(); ttl > 0 {
		sb.ExpiresUnixMs = started.Add(time.Duration(ttl) * time.Second).UnixMilli()
		e.watchExpiry(sb)
	}
	return proto.Clone(sb).(*dsecv1.Sandbox), nil
}

// forget drops records deleted longer ago than Retention, oldest first;
// the caller holds e.mu.
func (e *Edge) forget(now time.Time) {
	n := 0
	for ; n < len(e.goneSeq); n++ {
		id := e.goneSeq[n]
		if now.Sub(e.gone[id]) <= e.cfg.Retention {
			break
		}
		delete(e.gone, id)
		delete(e.sbs, id)
	}
	e.goneSeq = e.goneSeq[n:]
}

// dropToken forgets the token of sandbox id, which is no longer live; the
// caller holds e.mu.
func (e *Edge) dropToken(id string) {
	e.tmu.Lock()
	defer e.tmu.Unlock()
	if tok, ok := e.tokenOf[id]; ok {
		delete(e.tokenOf, id)
		delete(e.tokens, tok)
	}
}

// SandboxOf returns the live sandbox a create token made.
func (e *Edge) SandboxOf(token string) (string, bool) {
	e.tmu.Lock()
	defer e.tmu.Unlock()
	id, ok := e.tokens[token]
	return id, ok
}

// Tokens returns the create token of every live sandbox that has one.
func (e *Edge) Tokens() map[string]string {
	e.tmu.Lock()
	defer e.tmu.Unlock()
	return maps.Clone(e.tokens)
}

func (e *Edge) Get(ctx context.Context, id string) (*dsecv1.Sandbox, error) {
	e.mu.Lock()
	defer e.mu.Unlock()
	sb, ok := e.sbs[id]
	if !ok {
		return nil, fmt.Errorf("sandbox %s: %w", id, errdefs.ErrNotFound)
	}
	return proto.Clone(sb).(*dsecv1.Sandbox), nil
}

// Gone returns those of ids that name no live sandbox, under one lock.
func (e *Edge) Gone(ids []string) []string {
	e.mu.Lock()
	defer e.mu.Unlock()
	var out []string
	for _, id := range ids {
		if sb, ok := e.sbs[id]; !ok || !sandbox.Live(sb.GetState()) {
			out = append(out, id)
		}
	}
	return out
}

func (e *Edge) List(ctx context.Context, labels map[string]string, states []dsecv1.State) ([]*dsecv1.Sandbox, error) {
	out, _, err := e.Query(ctx, sandboxpage.Query{Labels: labels, States: states})
	sort.Slice(out, func(i, j int) bool { return out[i].GetId() < out[j].GetId() })
	return out, err
}

// Query answers an edge's List as sandbox.Manager's does.
func (e *Edge) Query(ctx context.Context, q sandboxpage.Query) ([]*dsecv1.Sandbox, int, error) {
	e.mu.Lock()
	defer e.mu.Unlock()
	page, total := sandboxpage.PickRecords(q, e.sbs)
	return page, total, nil
}

func (e *Edge) Delete(ctx context.Context, id string) error {
	began := time.Now()
	e.mu.Lock()
	sb, ok := e.sbs[id]
	if !ok || !sandbox.Live(sb.GetState()) {
		e.mu.Unlock()
		return nil
	}
	end, err := e.stop(sb, dsecv1.Reason_REASON_DELETED, "deleted by request", began)
	e.mu.Unlock()
	if err == nil {
		e.record(end)
	}
	e.cfg.Metrics.Delete("container", "container", err, time.Since(began))
	return err
}

// ending is what a stop leaves to record once e.mu is released: the
// sandbox's end event, and its ledger's last sample and end. The event
// log and the ledger have locks of their own; taken under e.mu, a sweep's
// chunk of ends held the node's creates behind it (BenchmarkClusterOps
// with a TTL, the lock contention profile: four times the wait with the
// events and the ledger on).
type ending struct {
	id, project, kind, why, message string
	labels                          map[string]string
	last                            ledger.Sample
	sampled                         bool // started: the ledger has a record to end
}

// record records the ends stop left.
func (e *Edge) record(ends ...ending) {
	for _, d := range ends {
		e.cfg.Events.Add(d.kind, d.id, d.project, d.why, d.message)
		if e.cfg.Ledger != nil && d.sampled {
			// The last sample, as a real edge takes before the cgroup
			// goes, and the end, under one lock of the ledger's.
			e.cfg.Ledger.Finish(d.id, d.project, d.labels, d.last)
		}
	}
}

// stop ends live sandbox sb at now for reason, as a real edge's stop does,
// and returns its end event and its last sample and end in the ledger,
// for the caller to record once it released e.mu, which it holds.
// Nothing is there to stop: stopping and stopped at once.
func (e *Edge) stop(sb *dsecv1.Sandbox, reason dsecv1.Reason, message string, now time.Time) (ending, error) {
	for _, st := range []dsecv1.State{dsecv1.State_STATE_STOPPING, dsecv1.State_STATE_STOPPED} {
		if err := sandbox.Transition(sb, st); err != nil {
			return ending{}, err
		}
	}
	id, labels := sb.GetId(), sb.GetSpec().GetLabels()
	sb.Reason, sb.Message = reason, message
	kind, why := sandbox.EndEvent(dsecv1.State_STATE_STOPPED, reason)
	end := ending{id: id, project: labels[iam.ProjectLabel], kind: kind, why: why, message: message, labels: labels,
		last: Usage(sb, now), sampled: sb.GetStartedUnixMs() > 0}
	e.dropToken(id)
	e.gone[id] = now
	e.goneSeq = append(e.goneSeq, id)
	e.ended++
	return end, nil
}

// watchExpiry has expire end sb once its expiry, if it has one, is past;
// the caller holds e.mu.
func (e *Edge) watchExpiry(sb *dsecv1.Sandbox) {
	if exp := sb.GetExpiresUnixMs(); exp > 0 {
		heap.Push(&e.expiries, dueSample{sb.GetId(), time.UnixMilli(exp)})
	}
}

// RunExpiry ends each running sandbox whose TTL ran out, each
// ExpiryInterval until ctx ends, as a real edge's sweep does (reason TTL,
// an expired event).
func (e *Edge) RunExpiry(ctx context.Context) {
	every := e.cfg.ExpiryInterval
	if every <= 0 {
		every = time.Second
	}
	tick(ctx, every, func(now time.Time) { e.expire(now) })
}

// tick runs fn each every until ctx ends.
func tick(ctx context.Context, every time.Duration, fn func(now time.Time)) {
	t := time.NewTicker(every)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case now := <-t.C:
			fn(now)
		}
	}
}

// expire ends the running sandboxes whose expiry is at or before now (or
// pauses those whose spec says so), at most expireChunk of them under one
// lock of e.mu, and returns how many. A paused one waits: its clocks
// stand still, and its resume moves its expiry (and watches it again).
func (e *Edge) expire(now time.Time) int {
	n := 0
	var ends []ending
	e.mu.Lock()
	for len(e.expiries) > 0 && !e.expiries[0].at.After(now) {
		d := heap.Pop(&e.expiries).(dueSample)
		sb, ok := e.sbs[d.id]
		if !ok || sb.GetState() != dsecv1.State_STATE_RUNNING || sb.GetExpiresUnixMs() != d.at.UnixMilli() {
			continue // ended, paused, or its expiry moved: watched anew if it matters
		}
		if sb.GetSpec().GetOnTimeout() == dsecv1.OnTimeout_ON_TIMEOUT_PAUSE {
			// Paused instead, as a real edge does for such a sandbox.
			if err := e.move(sb, dsecv1.State_STATE_PAUSED, now); err != nil {
				continue
			}
		} else {
			end, err := e.stop(sb, dsecv1.Reason_REASON_TTL, fmt.Sprintf("its TTL of %ds ran out", sb.GetSpec().GetTtlSeconds()), now)
			if err != nil {
				continue
			}
			ends = append(ends, end)
		}
		n++
		if n%expireChunk == 0 {
			// Let the creates and calls waiting for e.mu in between,
			// and record the chunk's ends meanwhile.
			e.mu.Unlock()
			e.record(ends...)
			ends = ends[:0]
			e.mu.Lock()
		}
	}
	e.mu.Unlock()
	e.record(ends...)
	return n
}

// expireChunk is how many sandboxes expire ends under one lock of e.mu.
const expireChunk = 1024

// EndPhase refuses: a hollow sandbox has no phases (a hollow edge keeps
// no clocks); an unknown one is NotFound.
func (e *Edge) EndPhase(ctx context.Context, id string, phase dsecv1.Phase) (*dsecv1.Sandbox, error) {
	if _, err := e.Get(ctx, id); err != nil {
		return nil, err
	}
	return nil, fmt.Errorf("sandbox %s is on hollow node %s, which keeps no phases: %w", id, e.cfg.Node, errdefs.ErrNotSupported)
}

// Phase is unspecified: a hollow sandbox has no phases.
func (e *Edge) Phase(id string) dsecv1.Phase { return dsecv1.Phase_PHASE_UNSPECIFIED }

// Isolation says a hollow sandbox is a container.
func (e *Edge) Isolation(id string) string { return "container" }

// SetTimeout moves a live sandbox's expiry; a hollow edge enforces none.
func (e *Edge) SetTimeout(ctx context.Context, id string, timeout time.Duration, extendOnly bool) (*dsecv1.Sandbox, error) {
	e.mu.Lock()
	defer e.mu.Unlock()
	sb, ok := e.sbs[id]
	if !ok {
		return nil, fmt.Errorf("sandbox %s: %w", id, errdefs.ErrNotFound)
	}
	exp := time.Now().Add(timeout).UnixMilli()
	if !extendOnly || exp > sb.GetExpiresUnixMs() {
		sb.ExpiresUnixMs = exp
		e.watchExpiry(sb)
	}
	return proto.Clone(sb).(*dsecv1.Sandbox), nil
}

// Metrics says a hollow sandbox uses nothing; it keeps no samples.
func (e *Edge) Metrics(ctx context.Context, id string, since time.Time) (*dsecv1.SandboxMetrics, error) {
	if _, err := e.Get(ctx, id); err != nil {
		return nil, err
	}
	return &dsecv1.SandboxMetrics{TimeUnixMs: time.Now().UnixMilli()}, nil
}

// Pause marks a running sandbox paused; there is nothing to freeze.
func (e *Edge) Pause(ctx context.Context, id string, keepMemory bool) (*dsecv1.Sandbox, bool, error) {
	began := time.Now()
	sb, already, err := e.flip(id, dsecv1.State_STATE_RUNNING, dsecv1.State_STATE_PAUSED)
	if !already {
		e.cfg.Metrics.Pause("pause", err, time.Since(began))
	}
	return sb, already, err
}

// Resume marks a paused sandbox running.
func (e *Edge) Resume(ctx context.Context, id string, skipPrefetch bool) (*dsecv1.Sandbox, bool, time.Duration, error) {
	began := time.Now()
	sb, already, err := e.flip(id, dsecv1.State_STATE_PAUSED, dsecv1.State_STATE_RUNNING)
	if !already {
		e.cfg.Metrics.Pause("resume", err, time.Since(began))
	}
	return sb, already, 0, err
}

// flip moves a sandbox from state from to state to; already when it is in
// to.
func (e *Edge) flip(id string, from, to dsecv1.State) (*dsecv1.Sandbox, bool, error) {
	e.mu.Lock()
	defer e.mu.Unlock()
	sb, ok := e.sbs[id]
	if !ok {
		return nil, false, fmt.Errorf("sandbox %s: %w", id, errdefs.ErrNotFound)
	}
	switch sb.GetState() {
	case to:
		return proto.Clone(sb).(*dsecv1.Sandbox), true, nil
	case from:
		if err := e.move(sb, to, time.Now()); err != nil {
			return nil, false, err
		}
		return proto.Clone(sb).(*dsecv1.Sandbox), false, nil
	}
	return nil, false, sandbox.GoneError(sb)
}

// move pauses running sandbox sb, or resumes paused sb, at now, with its
// event; the caller holds e.mu. A resume sets the clocks as a real edge's
// does (sandbox.Resumed: the TTL's end moves by the time paused), and
// watches the moved expiry.
func (e *Edge) move(sb *dsecv1.Sandbox, to dsecv1.State, now time.Time) error {
	if err := sandbox.Transition(sb, to); err != nil {
		return err
	}
	kind := eventlog.Resumed
	if to == dsecv1.State_STATE_PAUSED {
		sb.PausedUnixMs = now.UnixMilli()
		kind = eventlog.Paused
	} else {
		sandbox.Resumed(sb, now)
		e.watchExpiry(sb)
	}
	e.cfg.Events.Add(kind, sb.GetId(), sb.GetSpec().GetLabels()[iam.ProjectLabel], "", "")
	return nil
}

// Lay refuses: a hollow sandbox has no file system.
func (e *Edge) Lay(ctx context.Context, id, room, name string, sel snapshot.Select) (*dsecv1.SnapshotInfo, error) {
	if _, err := e.Get(ctx, id); err != nil {
		return nil, err
	}
	return nil, fmt.Errorf("lay a capture of hollow sandbox %s: %w", id, errdefs.ErrNotSupported)
}

// Snapshot refuses: a hollow sandbox has no file system.
func (e *Edge) Snapshot(ctx context.Context, id, name string, sel snapshot.Select) (*dsecv1.SnapshotInfo, error) {
	if _, err := e.Get(ctx, id); err != nil {
		return nil, err
	}
	return nil, fmt.Errorf("sandbox %s is on hollow node %s, which keeps no files: %w", id, e.cfg.Node, errdefs.ErrNotSupported)
}

// AgentStarting refuses as Agent does.
func (e *Edge) AgentStarting(ctx context.Context, id string) (agentclient.Client, func(), func(), error) {
	c, release, err := e.Agent(ctx, id)
	return c, release, release, err
}

// Agent refuses: a hollow sandbox has no agent. A sandbox that ended
// says so, as a real edge's does (FailedPrecondition).
func (e *Edge) Agent(ctx context.Context, id string) (agentclient.Client, func(), error) {
	sb, err := e.Get(ctx, id)
	if err != nil {
		return nil, nil, err
	}
	if !sandbox.Live(sb.GetState()) {
		return nil, nil, sandbox.GoneError(sb)
	}
	return nil, nil, fmt.Errorf("sandbox %s is on hollow node %s, which runs no commands: %w", id, e.cfg.Node, errdefs.ErrNotSupported)
}

func (e *Edge) SetNetworkRules(ctx context.Context, id string, rules map[string]bool, cut bool) ([]string, error) {
	e.mu.Lock()
	defer e.mu.Unlock()
	sb, ok := e.sbs[id]
	if !ok {
		return nil, fmt.Errorf("sandbox %s: %w", id, errdefs.ErrNotFound)
	}
	sb.Spec.NetworkRules = maps.Clone(rules)
	return nil, nil
}

func (e *Edge) NetworkLog(ctx context.Context, id string, since time.Time, limit int) ([]netpolicy.Event, error) {
	if _, err := e.Get(ctx, id); err != nil {
		return nil, err
	}
	return nil, nil
}

// Provenance of a hollow sandbox: nothing runs, so nothing is seen but
// its paths.
func (e *Edge) Provenance(ctx context.Context, id string, flagsOnly bool) (*dsecv1.SandboxProvenance, error) {
	sb, err := e.Get(ctx, id)
	if err != nil {
		return nil, err
	}
	if !sandbox.Live(sb.GetState()) {
		return nil, sandbox.GoneError(sb)
	}
	return &dsecv1.SandboxProvenance{SandboxId: id, Isolation: "hollow", TakenUnixMs: time.Now().UnixMilli(),
		Flags: &dsecv1.ProvenanceFlags{}, Paths: sb.GetSpec().GetProvenance(),
		Unseen: []string{"everything: a hollow sandbox runs nothing"}}, nil
}

func (e *Edge) SetProvenancePaths(ctx context.Context, id string, paths *dsecv1.ProvenancePaths) ([]string, error) {
	if err := sandbox.CheckProvenancePaths(paths); err != nil {
		return nil, err
	}
	e.mu.Lock()
	defer e.mu.Unlock()
	sb, ok := e.sbs[id]
	if !ok {
		return nil, fmt.Errorf("sandbox %s: %w", id, errdefs.ErrNotFound)
	}
	sb.Spec.Provenance = proto.Clone(paths).(*dsecv1.ProvenancePaths)
	return nil, nil
}

func (e *Edge) SetWarmPool(ctx context.Context, spec *dsecv1.SandboxSpec, size int) (*dsecv1.WarmPool, error) {
	e.mu.Lock()
	defer e.mu.Unlock()
	p := &dsecv1.WarmPool{Node: e.cfg.Node, Spec: proto.Clone(spec).(*dsecv1.SandboxSpec), Size: int32(size), Ready: int32(size)}
	e.pools = slices.DeleteFunc(e.pools, func(q *dsecv1.WarmPool) bool { return proto.Equal(q.GetSpec(), spec) })
	if size > 0 {
		e.pools = append(e.pools, p)
	}
	return proto.Clone(p).(*dsecv1.WarmPool), nil
}

func (e *Edge) WarmPools(ctx context.Context) ([]*dsecv1.WarmPool, error) {
	e.mu.Lock()
	defer e.mu.Unlock()
	var out []*dsecv1.WarmPool
	for _, p := range e.pools {
		out = append(out, proto.Clone(p).(*dsecv1.WarmPool))
	}
	return out, nil
}

// Usage is a hollow sandbox's synthetic use at now, from its start: what
// a typical sandbox of its shape reads in a real cgroup (most use little
// of their CPU request): 5 % of its CPUs (one when it asks for none),
// an eighth of its memory (64 MiB when it asks for none), a writable
// layer of 16 MiB and 1 KiB/s of egress.
func Usage(sb *dsecv1.Sandbox, now time.Time) ledger.Sample {
	up := max(now.Sub(time.UnixMilli(sb.GetStartedUnixMs())), 0)
	cpus := sb.GetSpec().GetCpus()
	if cpus <= 0 {
		cpus = 1
	}
	mem := sb.GetSpec().GetMemoryMb() << 20 / 8
	if mem <= 0 {
		mem = 64 << 20
	}
	return ledger.Sample{At: now, CPUUsec: int64(up.Seconds() * cpus * 0.05 * 1e6), MemoryBytes: mem,
		DiskBytes: 16 << 20, EgressBytes: int64(up.Seconds() * 1024)}
}

// sampled says whether sb's use is sampled: it runs or is paused, and
// started.
func sampled(sb *dsecv1.Sandbox) bool {
	st := sb.GetState()
	return (st == dsecv1.State_STATE_RUNNING || st == dsecv1.State_STATE_PAUSED) && sb.GetStartedUnixMs() != 0
}

// sampleChunk is how many sandboxes one lock of a round of samples takes.
const sampleChunk = 1024

// RunLedger samples the synthetic use of the running or paused sandboxes
// whose checkpoint is due into the ledger each LedgerInterval until ctx
// ends (at once without one).
func (e *Edge) RunLedger(ctx context.Context) {
	if e.cfg.Ledger == nil {
		return
	}
	every := e.cfg.LedgerInterval
	if every <= 0 {
		every = ledger.DefaultInterval
	}
	tick(ctx, every, e.sampleLedger)
}

// sampleLedger takes one round of samples: of each running or paused
// sandbox whose checkpoint is due, its next then a checkpoint on (due
// stays soonest first; a create between two chunks may put a sandbox due
// a few milliseconds later before them, sampled a round later). It takes
// sampleChunk sandboxes at a time under e.mu (a create or delete waits for
// a chunk's samples, not the round's), each chunk observed by the ledger
// under one lock of its own. A sample names no project or labels: the
// record has them from its Start, and a hollow sandbox's labels do not
// change. Sampling every sandbox each round, as a real edge does, was a
// tenth of a hollow edge's CPU in bench cluster (100,000 sandboxes a node
// and more, where a real node holds hundreds), and changed nothing the
// pulls bring: they carry a record at its checkpoints and its end.
func (e *Edge) sampleLedger(now time.Time) {
	every := e.cfg.Ledger.Checkpoint()
	obs := make([]ledger.Observation, 0, sampleChunk)
	e.mu.Lock()
	for len(e.due) > 0 && !e.due[0].at.After(now) {
		sb := e.due[0].sb
		e.due = e.due[1:]
		if !sampled(sb) {
			continue // ended: its last sample came at its delete
		}
		obs = append(obs, ledger.Observation{ID: sb.GetId(), Sample: Usage(sb, now)})
		e.due = append(e.due, dueCheck{sb, now.Add(every)})
		if len(obs) == sampleChunk {
			// Under e.mu still: a delete's last sample and end come
			// before or after these, never between.
			e.cfg.Ledger.ObserveAll(obs)
			obs = obs[:0]
			e.mu.Unlock()
			e.mu.Lock()
		}
	}
	e.cfg.Ledger.ObserveAll(obs)
	// Drop the entries of the sandboxes that ended: most end before their
	// first checkpoint (minutes away), and their entries would otherwise
	// wait that long, the array growing with every create for the garbage
	// collector to go through (some 250,000 on a busy edge by the end of
	// an eight-round BenchmarkClusterOps).
	kept := e.due[:0]
	for _, d := range e.due {
		if sampled(d.sb) {
			kept = append(kept, d)
		}
	}
	clear(e.due[len(kept):])
	e.due = kept
	e.mu.Unlock()
	// Kept in memory only: Save drops the records ended past ledger.Keep.
	e.cfg.Ledger.Save(now)
}

package fncall

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"slices"
	"sync"
	"time"

	agentv1 "dsec.dev/dsec/api/gen/dsec/agent/v1"
	dsecv1 "dsec.dev/dsec/api/gen/dsec/v1"
	"dsec.dev/dsec/internal/errdefs"
)

// Sandboxes is what the pools need of the edge. *sandbox.Manager, through
// a small adapter in the daemon, implements it.
type Sandboxes interface {
	// Create makes a fncall container and returns its ID once its agent
	// answers.
	Create(ctx context.Context, spec *dsecv1.SandboxSpec) (string, error)
	Delete(ctx context.Context, id string) error
	// Call hands one call to the container's agent.
	Call(ctx context.Context, id string, req *agentv1.CallRequest) (*agentv1.CallResponse, error)
}

// denyAll is the rule set of a networked container between calls.
const denyAll = "0.0.0.0/0"

// PoolLabel marks a pooled container with its pool's key.
const PoolLabel = "dsec.fncall/pool"

// poolKey names one pool: containers of one environment and memory class,
// with or without a network.
type poolKey struct {
	env      string
	memoryMB int64 // the containers' memory limit: the class a call's limit rounds up to
	network  bool
}

func (k poolKey) String() string {
	net := ""
	if k.network {
		net = "+net"
	}
	return fmt.Sprintf("%s/%dM%s", k.env, k.memoryMB, net)
}

// member is one pooled container.
type member struct {
	id    string
	calls int
	idle  time.Time // when it was last given back
}

// waiter is a call waiting for a member of its pool.
type waiter struct {
	ch     chan *member // buffered: its member, or nil when none is coming
	since  time.Time
	needMB int64 // the call's memory limit
}

// pool holds the warm containers of one key. Idle members are kept in a
// stack (the most recently used first: its caches are the warmest);
// waiters are served in arrival order. The first `starting` waiters are
// the ones the containers decided on will serve at the latest.
type pool struct {
	key      poolKey
	idle     []*member
	busy     map[*member]time.Time // members running a call, since when
	starting int                   // containers decided on, waiting for a start slot or being created
	creating int                   // of those, the ones being created
	regrow   *time.Timer           // a second look at waiters held back
	waiters  []*waiter
	held     string // why waiters are held back, for a refusal's message
	lastErr  error  // the last failed create, given to waiters it leaves with none
}

func (p *pool) size() int { return len(p.idle) + len(p.busy) + p.starting }

// heldByLong says whether the pool's containers are held by long calls:
// at least half of its running calls have run for age or more (calls that
// loop, sleep or wait, alone or among short ones). Its waiters then wait
// for calls that end late, which no queue drains in time. Running calls
// younger than that are short ones, or a storm of them slowed down by busy
// CPUs: their waiters wait for the CPUs, which more containers would only
// share out.
func (p *pool) heldByLong(now time.Time, age time.Duration) bool {
	old := 0
	for _, since := range p.busy {
		if now.Sub(since) >= age {
			old++
		}
	}
	return len(p.busy) > 0 && 2*old >= len(p.busy)
}

// meanAge is the mean age of the pool's running calls.
func (p *pool) meanAge(now time.Time) time.Duration {
	if len(p.busy) == 0 {
		return 0
	}
	var sum time.Duration
	for _, since := range p.busy {
		sum += now.Sub(since)
	}
	return sum / time.Duration(len(p.busy))
}

// pools is the node's set of pools and their sizing policy.
type pools struct {
	sb  Sandboxes
	cfg PoolConfig
	log *slog.Logger

	// slots bounds the containers being created at once on the node: a
	// start is tens of ms of CPU (runc, the agent, the warm interpreter),
	// so many at once only share the CPUs, each taking longer, and leave
	// the calls running less of them. The starts decided on wait for one
	// in turn, and one no longer needed by then is dropped.
	slots chan struct{}

	mu      sync.Mutex
	mem     *memAvailable // read under mu
	byKey   map[poolKey]*pool
	waiting int // calls queued for a member, over every pool
	closed  bool
	wg      sync.WaitGroup // creates and deletes under way
}

// PoolConfig sizes the pools.
type PoolConfig struct {
	// MinIdle is the floor: idle containers each pool keeps once used.
	MinIdle int
	// MaxPerPool is the ceiling of one pool on this node; 0 = the node's,
	// MaxContainers.
	MaxPerPool int
	// SoftMaxPerPool is how many of a pool's containers run calls at once
	// while its calls are short: enough to keep the node's CPUs busy, not
	// so many that they only share them out. Past it a call waits for one
	// of those containers, and gets one of its own only when it waited a
	// quarter of MaxStartDelay while long calls hold them, as far as the
	// node's memory holds more.
	SoftMaxPerPool int
	// MaxStartDelay bounds how long a call waits for a container when none
	// is being started for it: past it the call is refused with
	// ResourceExhausted, to be tried elsewhere or later, rather than queue
	// past its caller's patience.
	MaxStartDelay time.Duration
	// LookEvery is how often a pool whose waiters are held back looks at
	// them again.
	LookEvery time.Duration
	// MaxContainers bounds the fncall containers of the node, every pool.
	MaxContainers int
	// MaxCreating bounds the containers being created at once on the
	// node, every pool.
	MaxCreating int
	// MaxQueue bounds the calls waiting for a container on this node; a
	// call over it is refused at once with ResourceExhausted.
	MaxQueue int
	// IdleRetire is how long a container above the floor may stay idle.
	IdleRetire time.Duration
	// MaxCalls retires a container after this many calls (0 = never).
	MaxCalls int
	// Spec is the template of a pooled container (its environment and
	// memory are the pool's).
	CPUs   float64
	DiskMB int64
	// QoS is the pooled containers' CPU class (package qos): "" or
	// latency by default, since a call's time limits are wall-clock and a
	// best_effort call starved by latency sandboxes would time out, its
	// reward wrong; best_effort where the node's latency work must come
	// first (dsecd --fncall-qos, docs/qos.md).
	QoS string
}

func newPools(sb Sandboxes, cfg PoolConfig, log *slog.Logger) *pools {
	return &pools{sb: sb, cfg: cfg, log: log, byKey: map[poolKey]*pool{}, mem: newMemAvailable(),
		slots: make(chan struct{}, cfg.MaxCreating)}
}

// acquire returns an idle member of key's pool for a call whose memory
// limit is needMB, or one started for it, or one given back by another
// call within MaxStartDelay; it refuses the call with ResourceExhausted
// when none is coming by then.
func (ps *pools) acquire(ctx context.Context, key poolKey, needMB int64) (*member, error) {
	ps.mu.Lock()
	if ps.closed {
		ps.mu.Unlock()
		return nil, fmt.Errorf("run code: the node is shutting down: %w", errdefs.ErrUnavailable)
	}
	p := ps.byKey[key]
	if p == nil {
		p = &pool{key: key, busy: map[*member]time.Time{}}
		ps.byKey[key] = p
	}
	now := time.Now()
	if len(p.waiters) == 0 && len(p.idle) > 0 && len(p.busy) < ps.cfg.SoftMaxPerPool {
		m := ps.takeIdleLocked(p, now)
		ps.mu.Unlock()
		return m, nil
	}
	if ps.waiting >= ps.cfg.MaxQueue {
		ps.mu.Unlock()
		return nil, fmt.Errorf("run code: %d calls are already waiting for a container on this node (the queue's bound): %w", ps.cfg.MaxQueue, errdefs.ErrResourceExhausted)
	}
	w := &waiter{ch: make(chan *member, 1), since: now, needMB: needMB}
	p.waiters = append(p.waiters, w)
	ps.waiting++
	ps.dispatchLocked(p, now)
	ps.mu.Unlock()
	return ps.wait(ctx, p, w)
}

// wait waits for w's member. At MaxStartDelay a waiter that no starting
// container will serve leaves the queue refused; one that a container
// starting will serve waits for it (its time counts against its call's
// timeouts: Service.RunCode).
func (ps *pools) wait(ctx context.Context, p *pool, w *waiter) (*member, error) {
	bound := time.NewTimer(ps.cfg.MaxStartDelay)
	defer bound.Stop()
	for {
		select {
		case m := <-w.ch:
			return ps.handed(p, m)
		case <-bound.C:
			ps.mu.Lock()
			i := slices.Index(p.waiters, w)
			if i < 0 || i < p.starting {
				// Handed its member just now, or one is starting for it.
				ps.mu.Unlock()
				continue
			}
			p.waiters = slices.Delete(p.waiters, i, i+1)
			ps.waiting--
			why := p.held
			ps.mu.Unlock()
			if why == "" {
				why = "every container is busy"
			}
			return nil, fmt.Errorf("run code: no container of pool %s could take the call within %s (%s): %w",
				p.key, ps.cfg.MaxStartDelay, why, errdefs.ErrResourceExhausted)
		case <-ctx.Done():
			ps.mu.Lock()
			if i := slices.Index(p.waiters, w); i >= 0 {
				p.waiters = slices.Delete(p.waiters, i, i+1)
				ps.waiting--
				ps.mu.Unlock()
			} else {
				// A member handed over meanwhile goes back.
				ps.mu.Unlock()
				if m := <-w.ch; m != nil {
					ps.release(p.key, m, false)
				}
			}
			return nil, fmt.Errorf("run code: waited for a container of pool %s until %w", p.key, ctx.Err())
		}
	}
}

// handed is a waiter's answer: its member, or the error of the create
// that was to give it one.
func (ps *pools) handed(p *pool, m *member) (*member, error) {
	if m != nil {
		return m, nil
	}
	ps.mu.Lock()
	err := p.lastErr
	ps.mu.Unlock()
	return nil, fmt.Errorf("run code: no container of pool %s could start: %w", p.key, err)
}

func (ps *pools) takeIdleLocked(p *pool, now time.Time) *member {
	n := len(p.idle)
	m := p.idle[n-1]
	p.idle = p.idle[:n-1]
	p.busy[m] = now
	return m
}

// patience is how long a call past its pool's soft ceiling waits for a
// running container before it may get one of its own: a quarter of the
// start bound, so that one started for it comes well within the bound.
func (ps *pools) patience() time.Duration { return ps.cfg.MaxStartDelay / 4 }

// ownLocked is how many of p's waiters, from the first, need a container
// of their own past the soft ceiling: those that waited patience() while
// long calls hold the pool's containers (heldByLong). Short calls past
// the soft ceiling wait for one of the soft ceiling's containers instead:
// spread over more containers they would only share the CPUs out, and
// run slower on colder caches (print(1) at 64 in flight on a 2-core node
// ran 362 calls/s on 64 containers and 551 on 8); so the containers a
// burst of long calls grew stay idle, warm for the next burst.
func (ps *pools) ownLocked(p *pool, now time.Time) int {
	patience := ps.patience()
	n := 0
	for n < len(p.waiters) && now.Sub(p.waiters[n].since) >= patience {
		n++
	}
	if n == 0 || !p.heldByLong(now, patience) {
		return 0
	}
	return n
}

// dispatchLocked hands p's idle members to its waiters in arrival order,
// while fewer than the soft ceiling run, or to those that need one of
// their own (ownLocked); then it starts containers for the waiters left.
func (ps *pools) dispatchLocked(p *pool, now time.Time) {
	for len(p.waiters) > 0 && len(p.idle) > 0 && len(p.busy) < ps.cfg.SoftMaxPerPool {
		ps.handLocked(p, now)
	}
	if len(p.waiters) > 0 && len(p.idle) > 0 {
		// Decided once: every call handed a member is young.
		for own := ps.ownLocked(p, now); own > 0 && len(p.idle) > 0; own-- {
			ps.handLocked(p, now)
		}
	}
	ps.growLocked(p, now)
}

// handLocked gives p's first waiter an idle member.
func (ps *pools) handLocked(p *pool, now time.Time) {
	w := p.waiters[0]
	p.waiters = p.waiters[1:]
	ps.waiting--
	w.ch <- ps.takeIdleLocked(p, now)
}

// growLocked decides on a container for each waiter that no container
// decided on will serve, while the ceilings and the node's memory allow:
// up to SoftMaxPerPool for any waiter, past it for those that need one of
// their own (ownLocked). Admission is by memory, not by cores: a start
// needs the node's available memory, less the containers already
// starting, to hold the call's memory limit and the container's own
// overhead; a CPU-bound call only runs slower beside others, while one
// that does not start in time fails its caller. The start slots pace the
// creates. What holds waiters back is looked at again after LookEvery.
func (ps *pools) growLocked(p *pool, now time.Time) {
	if ps.closed {
		return
	}
	p.held = ""
	added, own := 0, -1 // own: waiters that need a container of their own; -1 = not yet asked
	for p.starting < len(p.waiters) {
		if len(p.idle) > 0 {
			// Idle members the waiters may not take yet (dispatchLocked).
			p.held = fmt.Sprintf("its %d running calls are short ones and the others wait for them", len(p.busy))
			break
		}
		if p.size() >= ps.cfg.MaxPerPool {
			p.held = fmt.Sprintf("the pool holds its most containers, %d", ps.cfg.MaxPerPool)
			break
		}
		if n := ps.totalLocked(); n >= ps.cfg.MaxContainers {
			p.held = fmt.Sprintf("the node holds its most fncall containers, %d", n)
			break
		}
		if p.size() >= ps.cfg.SoftMaxPerPool {
			if own < 0 {
				own = ps.ownLocked(p, now)
			}
			if p.starting >= own {
				p.held = fmt.Sprintf("its %d running calls are short ones and the others wait for them", len(p.busy))
				break
			}
		}
		w := p.waiters[p.starting]
		if avail, ok := ps.memoryFreeLocked(now); ok && avail < w.needMB+agentOverheadMB {
			p.held = fmt.Sprintf("the node's available memory, %d MiB less the containers starting, does not hold another container for a call of %d MiB", avail, w.needMB)
			break
		}
		added++
		p.starting++
		ps.wg.Add(1)
		go ps.start(p)
	}
	if added > 0 && p.size() > ps.cfg.SoftMaxPerPool {
		ps.log.Info("fncall pool grows past its soft ceiling: long calls hold its containers", "pool", p.key.String(),
			"size", p.size(), "busy", len(p.busy), "starting", p.starting, "waiting", len(p.waiters), "mean_call_age", p.meanAge(now), "added", added)
	}
	if p.starting < len(p.waiters) {
		ps.lookAgainLocked(p)
	}
}

// neededLocked says whether a start decided on for p is still needed as
// it gets its slot: a waiter is left that the containers being created
// (and the idle ones) will not serve. One whose waiter was served by a
// call's end meanwhile, or left, creates nothing.
func (ps *pools) neededLocked(p *pool) bool {
	return len(p.waiters) > p.creating+len(p.idle)
}

// memoryFreeLocked is the node's available memory less what the
// containers already starting will take and it does not show yet; false
// when it cannot be read (growth is then not held back on a guess).
func (ps *pools) memoryFreeLocked(now time.Time) (int64, bool) {
	avail, ok := ps.mem.availableMB(now)
	if !ok {
		return 0, false
	}
	starting := 0
	for _, p := range ps.byKey {
		starting += p.starting
	}
	return avail - int64(starting)*agentOverheadMB, true
}

// lookAgainLocked has dispatchLocked look at p again after LookEvery.
func (ps *pools) lookAgainLocked(p *pool) {
	if p.regrow != nil || ps.closed {
		return
	}
	p.regrow = time.AfterFunc(ps.cfg.LookEvery, func() {
		ps.mu.Lock()
		defer ps.mu.Unlock()
		p.regrow = nil
		ps.dispatchLocked(p, time.Now())
	})
}

func (ps *pools) totalLocked() int {
	n := 0
	for _, p := range ps.byKey {
		n += p.size()
	}
	return n
}

// start creates a container for p once a start slot is free, unless p no
// longer needs it by then (neededLocked).
func (ps *pools) start(p *pool) {
	defer ps.wg.Done()
	ps.slots <- struct{}{}
	defer func() { <-ps.slots }()
	ps.mu.Lock()
	if ps.closed || !ps.neededLocked(p) {
		p.starting--
		ps.mu.Unlock()
		return
	}
	p.creating++
	ps.mu.Unlock()
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	spec := &dsecv1.SandboxSpec{
		Environment: p.key.env,
		Backend:     dsecv1.Backend_BACKEND_FNCALL,
		MemoryMb:    p.key.memoryMB,
		Cpus:        ps.cfg.CPUs,
		DiskMb:      ps.cfg.DiskMB,
		Pids:        4096,
		// The pool decides when a container goes, not the idle timer.
		IdleTimeoutSeconds: -1,
		Labels:             map[string]string{PoolLabel: p.key.String()},
		Qos:                ps.cfg.QoS,
	}
	if p.key.network {
		// A network namespace whose rules allow nothing until a call's
		// own rules are set (Service.run).
		spec.NetworkRules = map[string]bool{denyAll: false}
	}
	t0 := time.Now()
	id, err := ps.sb.Create(ctx, spec)
	ps.mu.Lock()
	p.starting--
	p.creating--
	if err != nil {
		p.lastErr = err
		ps.log.Warn("fncall container did not start", "pool", p.key.String(), "err", err)
		// Waiters beyond what is still starting get the error rather
		// than wait for a container that is not coming.
		for len(p.waiters) > p.starting {
			w := p.waiters[0]
			p.waiters = p.waiters[1:]
			ps.waiting--
			w.ch <- nil
		}
		ps.mu.Unlock()
		return
	}
	ps.log.Debug("fncall container started", "pool", p.key.String(), "id", id, "took", time.Since(t0))
	m := &member{id: id}
	if ps.closed {
		ps.mu.Unlock()
		ps.remove(m)
		return
	}
	// Idle and handed out under the same lock that ended its start: in
	// between, the waiter it serves would count as served by nothing, and
	// another start (neededLocked, growLocked) be decided for it.
	now := time.Now()
	m.idle = now
	p.idle = append(p.idle, m)
	ps.dispatchLocked(p, now)
	ps.mu.Unlock()
}

// release gives m back to key's pool, or retires it.
func (ps *pools) release(key poolKey, m *member, retire bool) {
	ps.mu.Lock()
	p := ps.byKey[key]
	now := time.Now()
	delete(p.busy, m)
	if ps.closed || retire || (ps.cfg.MaxCalls > 0 && m.calls >= ps.cfg.MaxCalls) {
		// A retired member's place can be taken by a new container.
		ps.dispatchLocked(p, now)
		ps.mu.Unlock()
		ps.remove(m)
		return
	}
	m.idle = now
	p.idle = append(p.idle, m)
	ps.dispatchLocked(p, now)
	ps.mu.Unlock()
}

func (ps *pools) remove(m *member) {
	ps.wg.Add(1)
	go func() {
		defer ps.wg.Done()
		ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
		defer cancel()
		if err := ps.sb.Delete(ctx, m.id); err != nil {
			ps.log.Warn("remove fncall container", "id", m.id, "err", err)
		}
	}()
}

// trim retires idle members above each pool's floor that have been idle
// longer than IdleRetire, oldest first.
func (ps *pools) trim(now time.Time) {
	var retire []*member
	ps.mu.Lock()
	for _, p := range ps.byKey {
		for len(p.idle) > ps.cfg.MinIdle && now.Sub(p.idle[0].idle) >= ps.cfg.IdleRetire {
			retire = append(retire, p.idle[0])
			p.idle = p.idle[1:]
		}
	}
	ps.mu.Unlock()
	for _, m := range retire {
		ps.remove(m)
	}
}

// close removes every idle container, retires busy ones as their calls
// end, and waits for that.
func (ps *pools) close() {
	ps.mu.Lock()
	ps.closed = true
	var idle []*member
	for _, p := range ps.byKey {
		if p.regrow != nil {
			p.regrow.Stop()
			p.regrow = nil
		}
		idle = append(idle, p.idle...)
		p.idle = nil
		for _, w := range p.waiters {
			w.ch <- nil
		}
		ps.waiting -= len(p.waiters)
		p.waiters = nil
		p.lastErr = errors.New("the node is shutting down")
	}
	ps.mu.Unlock()
	for _, m := range idle {
		ps.remove(m)
	}
	ps.wg.Wait()
}

// PoolStatus is one pool's state, for NodeStatus and inspection.
type PoolStatus struct {
	Key                         string
	Idle, Busy, Starting, Queue int
}

func (ps *pools) status() []PoolStatus {
	ps.mu.Lock()
	defer ps.mu.Unlock()
	var out []PoolStatus
	for _, p := range ps.byKey {
		out = append(out, PoolStatus{Key: p.key.String(), Idle: len(p.idle), Busy: len(p.busy), Starting: p.starting, Queue: len(p.waiters)})
	}
	return out
}

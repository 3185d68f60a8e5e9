package fncall

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
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

// minIdleToGrow is the share of the node's CPU time that must have gone
// unused lately for a pool to grow past its soft ceiling.
const minIdleToGrow = 0.15

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

// pool holds the warm containers of one key. Idle members are kept in a
// stack (the most recently used first: its caches are the warmest);
// waiters are served in arrival order.
type pool struct {
	key      poolKey
	idle     []*member
	busy     map[*member]time.Time // members running a call, since when
	starting int                   // containers being created
	regrow   *time.Timer           // a held-back growth's second look
	grewAt   time.Time             // the last growth past the soft ceiling
	waiters  []chan *member
	lastErr  error // the last failed create, given to waiters it leaves with none
	failedAt time.Time
}

func (p *pool) size() int { return len(p.idle) + len(p.busy) + p.starting }

// stalled says whether the pool's running calls are long ones (their mean
// age at least age): waiters then wait for calls that sleep or grind, and
// another container helps. Calls that end quickly mean the waiters wait
// for the CPU, which another container only divides further.
func (p *pool) stalled(now time.Time, age time.Duration) bool {
	if len(p.busy) == 0 {
		// Containers still starting will take the waiters first.
		return p.starting == 0
	}
	return p.meanAge(now) >= age
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

	cpu *cpuIdle

	mu      sync.Mutex
	byKey   map[poolKey]*pool
	waiting int // calls queued for a member, over every pool
	closed  bool
	wg      sync.WaitGroup // creates and deletes under way
}

// PoolConfig sizes the pools.
type PoolConfig struct {
	// MinIdle is the floor: idle containers each pool keeps once used.
	MinIdle int
	// MaxPerPool is the ceiling: containers of one pool on this node.
	MaxPerPool int
	// SoftMaxPerPool is where a pool stops growing while its calls are
	// short (their mean age under StallAge): enough containers to keep the
	// node's CPUs busy, not so many that they only share them out.
	SoftMaxPerPool int
	StallAge       time.Duration
	// MaxContainers bounds the fncall containers of the node, every pool.
	MaxContainers int
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
}

func newPools(sb Sandboxes, cfg PoolConfig, log *slog.Logger) *pools {
	return &pools{sb: sb, cfg: cfg, log: log, byKey: map[poolKey]*pool{}, cpu: newCPUIdle()}
}

// acquire returns an idle member of key's pool, starting a container when
// the pool may grow, or waits for one until ctx ends.
func (ps *pools) acquire(ctx context.Context, key poolKey) (*member, error) {
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
	if n := len(p.idle); n > 0 {
		m := p.idle[n-1]
		p.idle = p.idle[:n-1]
		p.busy[m] = time.Now()
		ps.mu.Unlock()
		return m, nil
	}
	if ps.waiting >= ps.cfg.MaxQueue {
		ps.mu.Unlock()
		return nil, fmt.Errorf("run code: %d calls are already waiting for a container on this node (the queue's bound): %w", ps.cfg.MaxQueue, errdefs.ErrResourceExhausted)
	}
	ch := make(chan *member, 1)
	p.waiters = append(p.waiters, ch)
	ps.waiting++
	ps.growLocked(p)
	ps.mu.Unlock()

	select {
	case m := <-ch:
		if m == nil {
			ps.mu.Lock()
			err := p.lastErr
			ps.mu.Unlock()
			return nil, fmt.Errorf("run code: no container of pool %s could start: %w", key, err)
		}
		return m, nil
	case <-ctx.Done():
		ps.mu.Lock()
		for i, w := range p.waiters {
			if w == ch {
				p.waiters = append(p.waiters[:i], p.waiters[i+1:]...)
				ps.waiting--
				break
			}
		}
		ps.mu.Unlock()
		// A member handed over meanwhile goes back.
		select {
		case m := <-ch:
			if m != nil {
				ps.release(key, m, false)
			}
		default:
		}
		return nil, fmt.Errorf("run code: waited for a container of pool %s until %w", key, ctx.Err())
	}
}

// growLocked starts containers while waiters outnumber those starting and
// the ceilings allow. Up to SoftMaxPerPool a pool grows for every waiter;
// past it only while its calls are long ones (stalled) and the node's CPUs
// have time to spare, by a quarter (at least one) per StallAge, looking
// again after StallAge. Once its calls are short again it shrinks back, a
// container per call that ends (overgrownLocked).
func (ps *pools) growLocked(p *pool) {
	if ps.closed {
		return
	}
	budget := -1 // containers it may start past the soft ceiling; -1 = not yet decided
	for len(p.waiters) > p.starting && p.size() < ps.cfg.MaxPerPool && ps.totalLocked() < ps.cfg.MaxContainers {
		if p.size() >= ps.cfg.SoftMaxPerPool {
			if budget < 0 {
				budget = 0
				now := time.Now()
				// One step per StallAge, and only with CPUs to spare.
				if now.Sub(p.grewAt) >= ps.cfg.StallAge && p.stalled(now, ps.cfg.StallAge) && ps.cpu.fraction(now) >= minIdleToGrow {
					p.grewAt = now
					budget = max(1, p.size()/4)
					ps.log.Info("fncall pool grows past its soft ceiling: its calls are long ones", "pool", p.key.String(),
						"size", p.size(), "busy", len(p.busy), "starting", p.starting, "waiting", len(p.waiters), "mean_call_age", p.meanAge(time.Now()), "adding", budget)
				}
			}
			if budget == 0 {
				ps.lookAgainLocked(p)
				break
			}
			budget--
		}
		p.starting++
		ps.wg.Add(1)
		go ps.start(p)
	}
	// A pool that can start nothing now (node ceiling) gets a container
	// when another pool's retires.
}

// lookAgainLocked has growLocked look at p again after StallAge.
func (ps *pools) lookAgainLocked(p *pool) {
	if p.regrow != nil || ps.closed {
		return
	}
	p.regrow = time.AfterFunc(ps.cfg.StallAge, func() {
		ps.mu.Lock()
		defer ps.mu.Unlock()
		p.regrow = nil
		ps.growLocked(p)
	})
}

func (ps *pools) totalLocked() int {
	n := 0
	for _, p := range ps.byKey {
		n += p.size()
	}
	return n
}

func (ps *pools) start(p *pool) {
	defer ps.wg.Done()
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
	if err != nil {
		p.lastErr, p.failedAt = err, time.Now()
		ps.log.Warn("fncall container did not start", "pool", p.key.String(), "err", err)
		// Waiters beyond what is still starting get the error rather
		// than wait for a container that is not coming.
		for len(p.waiters) > p.starting {
			w := p.waiters[0]
			p.waiters = p.waiters[1:]
			ps.waiting--
			w <- nil
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
	p.busy[m] = time.Now()
	ps.mu.Unlock()
	ps.release(p.key, m, false)
}

// release gives m back to key's pool after a call, or retires it.
func (ps *pools) release(key poolKey, m *member, retire bool) {
	ps.mu.Lock()
	p := ps.byKey[key]
	delete(p.busy, m)
	if ps.closed || retire || (ps.cfg.MaxCalls > 0 && m.calls >= ps.cfg.MaxCalls) {
		// A retired member's place can be taken by a new container.
		ps.growLocked(p)
		ps.mu.Unlock()
		ps.remove(m)
		return
	}
	if len(p.waiters) > 0 {
		if ps.overgrownLocked(p, time.Now()) {
			// Calls queue for the CPU, not for containers: one container
			// fewer serves them as fast, and the rest stay warmer.
			ps.mu.Unlock()
			ps.remove(m)
			return
		}
		w := p.waiters[0]
		p.waiters = p.waiters[1:]
		ps.waiting--
		p.busy[m] = time.Now()
		ps.mu.Unlock()
		w <- m
		return
	}
	m.idle = time.Now()
	p.idle = append(p.idle, m)
	ps.mu.Unlock()
}

// shrinkAfter is how many StallAges after its last growth past the soft
// ceiling a pool may shrink back to it.
const shrinkAfter = 10

// overgrownLocked says whether a member just given back (no longer among
// p's busy ones) should retire rather than serve a waiter: the pool grew
// past its soft ceiling for long calls, and its calls are short ones again.
// Left alone, such a pool would keep every container it grew for as long
// as calls queue (none is ever idle long enough to retire), and short
// calls spread over more containers than the CPUs need run slower: more
// agents and interpreters contend for the same cores and caches.
func (ps *pools) overgrownLocked(p *pool, now time.Time) bool {
	return p.size()+1 > ps.cfg.SoftMaxPerPool &&
		now.Sub(p.grewAt) >= shrinkAfter*ps.cfg.StallAge &&
		len(p.busy) > 0 && !p.stalled(now, ps.cfg.StallAge)
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
			w <- nil
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

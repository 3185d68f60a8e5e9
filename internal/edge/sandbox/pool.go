package sandbox

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"slices"
	"strings"
	"time"

	"google.golang.org/protobuf/proto"

	dsecv1 "dsec.dev/dsec/api/gen/dsec/v1"
	"dsec.dev/dsec/internal/errdefs"
	"dsec.dev/dsec/internal/iam"
	"dsec.dev/dsec/internal/qos"
)

// Warm pools keep sandboxes of one shape started and idle, so that a create
// of that shape takes one instead of starting a container: starting one
// costs tens of milliseconds of runc, taking one a record write. A member
// has run one exec (warmUp) before it counts as ready. A member
// is an ordinary sandbox of the manager (pinged, persisted, torn down like
// any other) that Get, List and Delete do not see until it is taken. Its
// record carries poolLabel, so an edge that restarts removes the members
// it finds instead of adopting them: the pools are configuration of the
// running edge, set again by whoever asked for them.

// poolLabel marks the record of a sandbox waiting in a warm pool; its value
// is the pool's key.
const poolLabel = "dsec.dev/warm-pool"

type pool struct {
	key      string
	shape    *dsecv1.SandboxSpec // defaults filled in; no labels, TTL or idle timeout
	size     int
	ready    []*sandbox // oldest first
	starting int
	taken    int64
	missed   int64
	lastErr  string
	failures int
	retryAt  time.Time // no refill before this after failures
}

// status is the pool's state now. Starting counts what the refill will
// start as well as what it is starting (a few start at once, the rest wait
// their turn), so a pool just set reads "0 ready, N starting" rather than
// nothing at all; while refills back off after a failure, only those under
// way count, and LastError says why.
func (p *pool) status(node string, now time.Time) *dsecv1.WarmPool {
	starting := p.starting
	if lack := p.size - len(p.ready); lack > starting && !now.Before(p.retryAt) {
		starting = lack
	}
	return &dsecv1.WarmPool{
		Key: p.key, Spec: cloneSpec(p.shape), Size: int32(p.size),
		Ready: int32(len(p.ready)), Starting: int32(starting),
		Taken: p.taken, Missed: p.missed, LastError: p.lastErr, Node: node,
	}
}

// shapeOf is what a create must match to take a pooled sandbox: the spec
// with defaults applied, minus what is set at take time. The project
// label stays: a pool belongs to a project and serves its creates only.
func shapeOf(spec *dsecv1.SandboxSpec) *dsecv1.SandboxSpec {
	s := cloneSpec(spec)
	project, ok := s.Labels[iam.ProjectLabel]
	s.Labels = nil
	if ok {
		s.Labels = map[string]string{iam.ProjectLabel: project}
	}
	s.TtlSeconds = 0
	s.IdleTimeoutSeconds = 0
	s.Phases = nil // a lifetime, set at take time as the TTL is
	if s.Qos == "" {
		s.Qos = string(qos.Latency) // the default, so both spellings share a pool
	}
	s.Provenance = nil
	return s
}

func shapeKey(shape *dsecv1.SandboxSpec) string {
	b, err := proto.MarshalOptions{Deterministic: true}.Marshal(shape)
	if err != nil {
		panic(fmt.Sprintf("marshal sandbox spec: %v", err)) // a valid message always marshals
	}
	sum := sha256.Sum256(b)
	return hex.EncodeToString(sum[:8])
}

// alive reports whether a pooled sandbox can still be handed out: the
// table allows a claim.
func (sb *sandbox) alive() bool {
	sb.mu.Lock()
	defer sb.mu.Unlock()
	return decide(sb.phaseOf(), callClaim) == allow
}

// SetWarmPool keeps size sandboxes of spec's shape ready on this node and
// returns the pool's state. Size 0 removes the pool; its idle sandboxes are
// deleted.
func (m *Manager) SetWarmPool(ctx context.Context, spec *dsecv1.SandboxSpec, size int) (*dsecv1.WarmPool, error) {
	if size < 0 {
		return nil, fmt.Errorf("warm pool size %d is negative: %w", size, errdefs.ErrInvalidArgument)
	}
	spec, err := m.applyDefaults(spec)
	if err != nil {
		return nil, err
	}
	if len(spec.GetNetworkRules()) > 0 {
		return nil, fmt.Errorf("warm pools hold sandboxes without network rules: %w", errdefs.ErrInvalidArgument)
	}
	if size > 0 {
		if _, err := m.images.ResolveEnvironment(ctx, spec.GetEnvironment()); err != nil {
			return nil, fmt.Errorf("resolve environment %q: %w", spec.GetEnvironment(), err)
		}
	}
	shape := shapeOf(spec)
	key := shapeKey(shape)

	m.poolMu.Lock()
	others := 0
	for k, p := range m.pools {
		if k != key {
			others += p.size
		}
	}
	if others+size > m.cfg.MaxWarm {
		m.poolMu.Unlock()
		return nil, fmt.Errorf("warm pools of node %s may hold %d sandboxes in all; %d are taken by other pools: %w",
			m.cfg.Node, m.cfg.MaxWarm, others, errdefs.ErrResourceExhausted)
	}
	p := m.pools[key]
	if p == nil {
		p = &pool{key: key, shape: shape}
		if size > 0 {
			m.pools[key] = p
		}
	}
	p.size = size
	p.failures, p.retryAt = 0, time.Time{}
	st := p.status(m.cfg.Node, time.Now())
	m.poolMu.Unlock()
	m.log.Info("warm pool set", "key", key, "env", shape.GetEnvironment(), "size", size)
	m.kickPools()
	return st, nil
}

// WarmPools returns the state of every warm pool of this node.
func (m *Manager) WarmPools(ctx context.Context) ([]*dsecv1.WarmPool, error) {
	m.poolMu.Lock()
	defer m.poolMu.Unlock()
	out := make([]*dsecv1.WarmPool, 0, len(m.pools))
	for _, p := range m.pools {
		out = append(out, p.status(m.cfg.Node, time.Now()))
	}
	slices.SortFunc(out, func(a, b *dsecv1.WarmPool) int {
		if c := strings.Compare(a.GetSpec().GetEnvironment(), b.GetSpec().GetEnvironment()); c != 0 {
			return c
		}
		return strings.Compare(a.GetKey(), b.GetKey())
	})
	return out, nil
}

func (m *Manager) kickPools() {
	select {
	case m.poolKick <- struct{}{}:
	default:
	}
}

// takeWarm hands a pooled sandbox of spec's shape to the caller (the create
// token names), or returns nil when the pool is empty or missing (the
// caller then starts one).
func (m *Manager) takeWarm(ctx context.Context, spec *dsecv1.SandboxSpec, token string) *dsecv1.Sandbox {
	if len(spec.GetNetworkRules()) > 0 {
		return nil
	}
	key := shapeKey(shapeOf(spec))
	m.poolMu.Lock()
	p := m.pools[key]
	if p == nil || p.size == 0 {
		m.poolMu.Unlock()
		return nil
	}
	var sb *sandbox
	for sb == nil && len(p.ready) > 0 {
		c := p.ready[0]
		p.ready = p.ready[1:]
		if c.alive() {
			sb = c
		}
	}
	if sb == nil {
		p.missed++
	} else {
		p.taken++
		m.lastTake = time.Now()
	}
	m.poolMu.Unlock()
	m.kickPools()
	if sb == nil {
		return nil
	}
	rec, err := m.claim(ctx, sb, spec, token)
	if err == nil {
		return rec
	}
	if errors.Is(err, errStale) {
		m.log.Info("warm pool holds an older version of its environment; emptying it", "key", key, "env", spec.GetEnvironment())
		m.flushPool(ctx, key)
	} else {
		m.log.Warn("take sandbox from warm pool", "key", key, "err", err)
	}
	go m.drop(context.WithoutCancel(ctx), sb, "dropped from its warm pool")
	m.poolMu.Lock()
	p.taken--
	p.missed++
	m.poolMu.Unlock()
	return nil
}

var errStale = errors.New("the pooled sandbox runs other layers than its environment now names")

// claim turns a pooled sandbox into the caller's: its record takes the
// caller's spec (labels, TTL and idle timeout included) and the create's
// token, and starts its lifetime now. It is a transition (pooled running
// → running) under the sandbox's op lock, so it and a stop of the same
// sandbox (its agent died, its pool let it go) happen one after the
// other: a sandbox stopping or stopped is refused (the caller starts one),
// and a drop after the claim leaves the caller's sandbox alone.
func (m *Manager) claim(ctx context.Context, sb *sandbox, spec *dsecv1.SandboxSpec, token string) (*dsecv1.Sandbox, error) {
	layers, err := m.images.ResolveEnvironment(ctx, spec.GetEnvironment())
	if err != nil {
		return nil, err
	}
	digests := make([]string, len(layers))
	for i, l := range layers {
		digests[i] = l.Digest
	}
	now := time.Now()
	sb.op.Lock()
	defer sb.op.Unlock()
	// The pooled mark changes: under the Manager's mu too (see transition).
	m.mu.Lock()
	sb.mu.Lock()
	prev, key := sb.rec, sb.pool
	if v := decide(sb.phaseOf(), callClaim); v != allow {
		err := refusal(prev, v, callClaim)
		sb.mu.Unlock()
		m.mu.Unlock()
		return nil, fmt.Errorf("claim pooled sandbox: %w", err)
	}
	if !slices.Equal(digests, prev.GetLayerDigests()) {
		sb.mu.Unlock()
		m.mu.Unlock()
		return nil, errStale
	}
	rec := cloneRec(prev)
	rec.Spec = cloneSpec(spec)
	rec.CreatedUnixMs = now.UnixMilli()
	rec.StartedUnixMs = now.UnixMilli()
	rec.ExpiresUnixMs = now.Add(time.Duration(spec.GetTtlSeconds()) * time.Second).UnixMilli()
	if spec.GetPhases() != nil {
		enterPhase(rec, dsecv1.Phase_PHASE_SETUP, now)
	}
	rec.LastActiveUnixMs = now.UnixMilli()
	rec.FromWarmPool = true
	if token != "" {
		err = m.states.SaveToken(rec.GetId(), token)
	}
	if err == nil {
		sb.rec = rec
		if err = m.transition(sb, running); err != nil {
			// Not saved: it stays in its pool, as it was, for the caller's drop.
			sb.rec, sb.pool = prev, key
		}
	}
	if err == nil {
		sb.lastActive = now
		sb.token = token
	}
	out := cloneRec(sb.rec)
	sb.mu.Unlock()
	m.mu.Unlock()
	if err != nil {
		return nil, err
	}
	// The ledger counts it from its claim: its counters now are the base,
	// read before the caller runs anything in it.
	m.observe(ctx, out, sb.rt)
	// Use accounting rewrites the layer index: not on the caller's clock.
	go func() {
		if err := m.images.RecordEnvironment(spec.GetEnvironment(), digests); err != nil {
			m.log.Warn("record environment use", "env", spec.GetEnvironment(), "err", err)
		}
	}()
	m.log.Debug("sandbox taken from warm pool", "id", out.GetId(), "env", spec.GetEnvironment(), "took", time.Since(now))
	return out, nil
}

// flushPool deletes the idle sandboxes of one pool; the refill starts new ones.
func (m *Manager) flushPool(ctx context.Context, key string) {
	m.poolMu.Lock()
	var drop []*sandbox
	if p := m.pools[key]; p != nil {
		drop, p.ready = p.ready, nil
	}
	m.poolMu.Unlock()
	for _, sb := range drop {
		go m.drop(context.WithoutCancel(ctx), sb, "dropped from its warm pool")
	}
	m.kickPools()
}

// poolLoop refills the warm pools until Shutdown.
func (m *Manager) poolLoop() {
	defer m.wg.Done()
	tick := time.NewTicker(time.Second)
	defer tick.Stop()
	for {
		select {
		case <-m.stop:
			return
		case <-m.poolKick:
		case <-tick.C:
		}
		m.refill()
	}
}

// refillDelay is how long after a take refills wait.
const refillDelay = 100 * time.Millisecond

// refill drops dead and surplus members and starts what the pools lack,
// at most cfg.WarmStarts at a time, none while a caller's create is
// starting a container (the caller waits on that one, nobody on a refill),
// and none within refillDelay of a take.
func (m *Manager) refill() {
	var drop []*sandbox
	now := time.Now()
	m.poolMu.Lock()
	// Whoever just took a sandbox runs its first command now: let it have
	// the CPU a refill's runc would take.
	if wait := refillDelay - now.Sub(m.lastTake); wait > 0 {
		m.poolMu.Unlock()
		time.AfterFunc(wait, m.kickPools)
		return
	}
	total, starting := 0, 0
	for _, p := range m.pools {
		p.ready = slices.DeleteFunc(p.ready, func(sb *sandbox) bool { return !sb.alive() })
		for len(p.ready) > p.size {
			drop = append(drop, p.ready[len(p.ready)-1])
			p.ready = p.ready[:len(p.ready)-1]
		}
		total += len(p.ready) + p.starting
		starting += p.starting
	}
	keys := make([]string, 0, len(m.pools))
	for k := range m.pools {
		keys = append(keys, k)
	}
	slices.Sort(keys)
	for _, k := range keys {
		p := m.pools[k]
		if p.size == 0 && p.starting == 0 && len(p.ready) == 0 {
			delete(m.pools, k)
			continue
		}
		for p.size > len(p.ready)+p.starting && starting < m.cfg.WarmStarts && total < m.cfg.MaxWarm &&
			m.cold.Load() == 0 && !now.Before(p.retryAt) && m.admit(true) == nil {
			p.starting++
			starting++
			total++
			m.wg.Add(1)
			go m.refillOne(p)
		}
	}
	m.poolMu.Unlock()
	for _, sb := range drop {
		m.drop(context.Background(), sb, "its warm pool shrank")
	}
}

// warmUpTimeout bounds a pool member's warm-up exec.
const warmUpTimeout = 30 * time.Second

// warmUp runs `true` once in a new pool member before it counts as
// ready, by the path a client's exec takes (the agent's framed exec), so
// the first exec of whoever takes it is not the sandbox's first: in a
// microVM that one pays for the command's pages read from the layers and,
// under TCG, the exec path's code translated, ~100 ms where a later exec
// takes ~10. Best effort: a failure (an image without `true`) is logged
// and the member kept, as the exec reached the agent all the same.
func (m *Manager) warmUp(sb *sandbox) {
	sb.mu.Lock()
	a, id := sb.agent, sb.rec.GetId()
	sb.mu.Unlock()
	if a == nil {
		return
	}
	ctx, cancel := context.WithTimeout(context.Background(), warmUpTimeout)
	defer cancel()
	t := time.Now()
	s, err := a.ExecEvents(ctx, &dsecv1.ExecRequest{Argv: []string{"true"}})
	if err == nil {
		for s.Receive() {
		}
		err = s.Err()
		s.Close()
	}
	if err != nil {
		m.log.Debug("warm up pool member", "id", id, "err", err)
		return
	}
	m.log.Debug("pool member warmed up", "id", id, "took", time.Since(t))
}

func (m *Manager) refillOne(p *pool) {
	defer m.wg.Done()
	spec := cloneSpec(p.shape)
	spec.Labels = map[string]string{poolLabel: p.key}
	sb, err := m.start(context.Background(), m.NewID(), spec, p.key, "", nil)
	if err == nil {
		m.warmUp(sb)
	}
	m.poolMu.Lock()
	p.starting--
	keep := err == nil && m.pools[p.key] == p && len(p.ready) < p.size
	if err != nil {
		p.failures++
		p.lastErr = err.Error()
		p.retryAt = time.Now().Add(min(time.Second<<min(p.failures, 6), time.Minute))
	} else {
		p.failures, p.lastErr = 0, ""
	}
	if keep {
		p.ready = append(p.ready, sb)
	}
	m.poolMu.Unlock()
	if err != nil {
		m.log.Warn("refill warm pool", "key", p.key, "env", p.shape.GetEnvironment(), "err", err)
		return
	}
	if !keep {
		m.drop(context.Background(), sb, "its warm pool shrank")
	}
	m.kickPools()
}

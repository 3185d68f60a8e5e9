package sandbox

import (
	"context"
	"errors"
	"fmt"
	"time"

	dsecv1 "dsec.dev/dsec/api/gen/dsec/v1"
	"dsec.dev/dsec/internal/edge/backend"
	"dsec.dev/dsec/internal/errdefs"
)

// Pause freezes sandbox id and, unless keepMemory, pushes its memory out of
// RAM (page cache dropped, anonymous memory to swap where the node has
// it). It returns the paused record, or already true and the record as it
// is when the sandbox was paused before. The sandbox stays paused across a
// restart of the edge.
func (m *Manager) Pause(ctx context.Context, id string, keepMemory bool) (rec *dsecv1.Sandbox, already bool, err error) {
	sb, err := m.lookup(id)
	if err != nil {
		return nil, false, err
	}
	begin := time.Now()
	rec, already, err = m.pause(ctx, sb, keepMemory)
	if !already {
		m.cfg.Metrics.Pause("pause", err, time.Since(begin))
	}
	return rec, already, err
}

func (m *Manager) pause(ctx context.Context, sb *sandbox, keepMemory bool) (*dsecv1.Sandbox, bool, error) {
	ctx = context.WithoutCancel(ctx) // a pause half done helps nobody
	if err := refuseNow(sb, callPause); err != nil {
		return nil, false, err
	}
	pz, err := m.pauser(sb)
	if err != nil {
		return nil, false, fmt.Errorf("pause sandbox %s: %w", sb.rec.GetId(), err)
	}
	sb.op.Lock()
	defer sb.op.Unlock()
	sb.mu.Lock()
	switch v := decide(sb.phaseOf(), callPause); v {
	case allow:
	case noop:
		defer sb.mu.Unlock()
		return cloneRec(sb.rec), true, nil
	default:
		defer sb.mu.Unlock()
		return nil, false, refusal(sb.rec, v, callPause)
	}
	id := sb.rec.GetId()
	if err := m.transitionLogged(sb, pausing); err != nil {
		sb.mu.Unlock()
		return nil, false, fmt.Errorf("pause sandbox %s: %w", id, err)
	}
	sb.mu.Unlock()
	// New calls wait for the pause; those under way end first.
	drain := drainBound(sb.rec.GetSpec(), keepMemory)
	if n := drainCalls(sb, drain); n > 0 {
		m.log.Warn("pausing with unary calls under way", "id", id, "calls", n, "waited", drain)
	}

	st, err := pz.Pause(ctx, id, !keepMemory)
	sb.mu.Lock()
	defer sb.mu.Unlock()
	if err != nil {
		if frozen, ferr := pz.Frozen(ctx, id); ferr != nil || !frozen {
			if terr := m.transitionLogged(sb, running); terr != nil {
				err = errors.Join(err, terr)
			}
			return nil, false, fmt.Errorf("pause sandbox %s: %w", id, err)
		}
		// Frozen, but its memory could not be pushed out: it is paused
		// all the same, and the stats say what stayed and why.
		m.log.Warn("paused sandbox keeps its memory in RAM", "id", id, "err", err)
		why := "pushing its memory out failed: " + err.Error()
		if st.KeptReason != "" {
			why = st.KeptReason + "; " + why
		}
		st.KeptReason = why
	}
	now := time.Now()
	sb.rec.PausedUnixMs = now.UnixMilli()
	sb.rec.LastPause = pauseStats(st)
	if err := m.transitionLogged(sb, paused); err != nil {
		return nil, false, fmt.Errorf("pause sandbox %s: %w", id, err)
	}
	m.log.Info("sandbox paused", "id", id, "frozen", st.Frozen, "reclaim", st.Reclaim,
		"resident_mb", st.Resident>>20, "released_mb", st.Released>>20, "swapped_mb", st.Swapped>>20,
		"kept_mb", st.Kept.Total()>>20, "kept_reason", st.KeptReason)
	return cloneRec(sb.rec), false, nil
}

// callDrain bounds how long a pause waits for the calls under way that
// have not started (AgentStarting): milliseconds each, but a write to a
// full stdin pipe may block. A frozen sandbox's calls only stall: they
// carry on after the resume.
const callDrain = 2 * time.Second

// channelDrain is callDrain for a pause that ends the agent channel (a
// microVM's to disk), which fails the calls it cuts: a command not yet
// started, a file half written. A best-effort guest under TCG (its QEMU
// under SCHED_IDLE beside busier work on the node) can take seconds to
// start a command, and a demo run lost a systems task to the 2 s bound.
const channelDrain = 20 * time.Second

// drainBound is how long a pause of a sandbox of spec waits for the calls
// under way that have not started.
func drainBound(spec *dsecv1.SandboxSpec, keepMemory bool) time.Duration {
	if !keepMemory && KindOf(spec).Isolation == dsecv1.Isolation_ISOLATION_MICROVM {
		return channelDrain
	}
	return callDrain
}

// drainCalls waits until sandbox sb has no unary call under way, or for
// at most wait, and returns how many are left.
func drainCalls(sb *sandbox, wait time.Duration) int {
	deadline := time.Now().Add(wait)
	for {
		sb.mu.Lock()
		n := sb.calls
		sb.mu.Unlock()
		if n == 0 || time.Now().After(deadline) {
			return n
		}
		time.Sleep(2 * time.Millisecond)
	}
}

func pauseStats(st backend.PauseStats) *dsecv1.PauseStats {
	return &dsecv1.PauseStats{
		FrozenUs: st.Frozen.Microseconds(), ReclaimMs: st.Reclaim.Milliseconds(),
		ResidentBytes: st.Resident, ReleasedBytes: st.Released, SwappedBytes: st.Swapped,
		KeptBytes: st.Kept.Total(), KeptAnonBytes: st.Kept.Anon, KeptShmemBytes: st.Kept.Shmem,
		KeptCacheBytes: st.Kept.Cache, KeptKernelBytes: st.Kept.Kernel, KeptReason: st.KeptReason,
	}
}

// Resume brings a paused sandbox's memory back and thaws it. It returns the
// running record, or already true when it was running, and how long the
// prefetch of its memory took.
// With skipPrefetch the thaw comes at once and the first touches fault the
// memory back in.
func (m *Manager) Resume(ctx context.Context, id string, skipPrefetch bool) (rec *dsecv1.Sandbox, already bool, prefetch time.Duration, err error) {
	sb, err := m.lookup(id)
	if err != nil {
		return nil, false, 0, err
	}
	begin := time.Now()
	rec, already, prefetch, err = m.resume(ctx, sb, !skipPrefetch)
	if !already {
		m.cfg.Metrics.Pause("resume", err, time.Since(begin))
	}
	return rec, already, prefetch, err
}

func (m *Manager) resume(ctx context.Context, sb *sandbox, prefetch bool) (*dsecv1.Sandbox, bool, time.Duration, error) {
	ctx = context.WithoutCancel(ctx)
	if err := refuseNow(sb, callResume); err != nil {
		return nil, false, 0, err
	}
	pz, err := m.pauser(sb)
	if err != nil {
		return nil, false, 0, fmt.Errorf("resume sandbox %s: %w", sb.rec.GetId(), err)
	}
	sb.op.Lock()
	defer sb.op.Unlock()
	sb.mu.Lock()
	switch v := decide(sb.phaseOf(), callResume); v {
	case allow:
	case noop:
		defer sb.mu.Unlock()
		return cloneRec(sb.rec), true, 0, nil
	default:
		defer sb.mu.Unlock()
		return nil, false, 0, refusal(sb.rec, v, callResume)
	}
	id := sb.rec.GetId()
	if err := m.transitionLogged(sb, resuming); err != nil {
		sb.mu.Unlock()
		return nil, false, 0, fmt.Errorf("resume sandbox %s: %w", id, err)
	}
	sb.mu.Unlock()

	st, err := pz.Resume(ctx, id, prefetch)
	sb.mu.Lock()
	defer sb.mu.Unlock()
	if err != nil {
		if frozen, ferr := pz.Frozen(ctx, id); ferr != nil || frozen {
			if terr := m.transitionLogged(sb, paused); terr != nil {
				err = errors.Join(err, terr)
			}
			return nil, false, 0, fmt.Errorf("resume sandbox %s: %w", id, err)
		}
	}
	now := time.Now()
	Resumed(sb.rec, now)
	sb.lastActive = now
	sb.pingFails = 0
	if err := m.transitionLogged(sb, running); err != nil {
		return nil, false, 0, fmt.Errorf("resume sandbox %s: %w", id, err)
	}
	m.log.Info("sandbox resumed", "id", id, "prefetch", st.Prefetch, "thaw", st.Thaw,
		"advised_mb", st.Advised>>20, "advised_tmpfs_mb", st.AdvisedTmpfs>>20)
	return cloneRec(sb.rec), false, st.Prefetch, nil
}

// refuseNow answers a call the table refuses in the sandbox's state at
// once, without waiting for the op lock (which a create holds throughout).
func refuseNow(sb *sandbox, c call) error {
	sb.mu.Lock()
	defer sb.mu.Unlock()
	if v := decide(sb.phaseOf(), c); v == refuseNew || v == refuseGone {
		return refusal(sb.rec, v, c)
	}
	return nil
}

// Resumed sets the clocks of a record that was paused for its running
// again at now (the transition to running is the caller's: a Manager's,
// or a hollow edge's). Its clocks stood still while paused: the TTL's end
// moves by the time paused (a TTL that ran out and paused it starts
// afresh), and the idle clock starts now.
func Resumed(rec *dsecv1.Sandbox, now time.Time) {
	if p, exp := rec.GetPausedUnixMs(), rec.GetExpiresUnixMs(); p > 0 && exp > 0 {
		left := exp - p
		if left <= 0 {
			left = rec.GetSpec().GetTtlSeconds() * 1000
		}
		rec.ExpiresUnixMs = now.UnixMilli() + left
	}
	if p, ends := rec.GetPausedUnixMs(), rec.GetPhaseEndsUnixMs(); p > 0 && ends > 0 {
		rec.PhaseEndsUnixMs = now.UnixMilli() + max(0, ends-p) // a phase's clock stands still too
	}
	rec.LastActiveUnixMs = now.UnixMilli()
}

// save writes a record, logging a failure: the record on disk is what a
// restarted edge goes by, and Recover checks it against the runtime.
func (m *Manager) save(rec *dsecv1.Sandbox) {
	if err := m.states.Save(rec); err != nil {
		m.log.Warn("save sandbox record", "id", rec.GetId(), "state", rec.GetState().String(), "err", err)
	}
}

// use finds a sandbox for a call that runs in it and calls f with the
// sandbox running and its mu held: a paused sandbox is resumed first
// (refused instead when its spec says auto_resume false), a transition
// under way is waited for.
func (m *Manager) use(ctx context.Context, id string, f func(sb *sandbox) error) error {
	sb, err := m.lookup(id)
	if err != nil {
		return err
	}
	for {
		sb.mu.Lock()
		v := decide(sb.phaseOf(), callUse)
		switch v {
		case allow:
			defer sb.mu.Unlock()
			return f(sb)
		case resumeFirst:
			auto := sb.rec.GetSpec().AutoResume == nil || sb.rec.GetSpec().GetAutoResume()
			sb.mu.Unlock()
			if !auto {
				return fmt.Errorf("sandbox %s is paused and its spec says auto_resume false: resume it first: %w", id, errdefs.ErrFailedPrecondition)
			}
			if _, _, _, err := m.resume(ctx, sb, true); err != nil {
				return err
			}
		case waitFor:
			sb.mu.Unlock()
			sb.op.Lock() // held by the transition under way
			sb.op.Unlock()
		default:
			defer sb.mu.Unlock()
			return refusal(sb.rec, v, callUse)
		}
		if err := ctx.Err(); err != nil {
			return err
		}
	}
}

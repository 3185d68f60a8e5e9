package sandbox

import (
	"context"
	"fmt"
	"runtime"
	"time"

	dsecv1 "dsec.dev/dsec/api/gen/dsec/v1"
	"dsec.dev/dsec/internal/edge/backend"
	"dsec.dev/dsec/internal/errdefs"
)

// SetTimeout moves a live sandbox's expiry to timeout from now; with
// extendOnly an expiry already further away stays. A paused sandbox's
// clocks stand still: it gets timeout of running time once resumed. It
// returns the record with the new expiry.
func (m *Manager) SetTimeout(ctx context.Context, id string, timeout time.Duration, extendOnly bool) (*dsecv1.Sandbox, error) {
	if timeout < 0 {
		return nil, fmt.Errorf("set timeout of sandbox %s: %s is negative: %w", id, timeout, errdefs.ErrInvalidArgument)
	}
	if max := m.cfg.Limits.MaxTTL; max > 0 && timeout > max {
		return nil, fmt.Errorf("set timeout of sandbox %s: %s is over the node's limit of %s: %w", id, timeout, max, errdefs.ErrInvalidArgument)
	}
	sb, err := m.lookup(id)
	if err != nil {
		return nil, err
	}
	if err := refuseNow(sb, callUse); err != nil {
		return nil, err
	}
	// A pause or resume under way moves the expiry too (resumed): wait
	// for it.
	sb.op.Lock()
	defer sb.op.Unlock()
	sb.mu.Lock()
	defer sb.mu.Unlock()
	rec := sb.rec
	from := time.Now()
	switch rec.GetState() {
	case dsecv1.State_STATE_RUNNING:
	case dsecv1.State_STATE_PAUSED:
		// resumed keeps expiry - paused of running time.
		from = time.UnixMilli(rec.GetPausedUnixMs())
	default:
		if !sb.gone.IsZero() || !Live(rec.GetState()) {
			return nil, GoneError(rec)
		}
		return nil, fmt.Errorf("set timeout of sandbox %s while %s: %w", id, stateWord(rec.GetState()), errdefs.ErrFailedPrecondition)
	}
	exp := from.Add(timeout).UnixMilli()
	if exp == 0 {
		exp = 1 // 0 means no expiry
	}
	if extendOnly && rec.GetExpiresUnixMs() >= exp {
		return cloneRec(rec), nil
	}
	rec.ExpiresUnixMs = exp
	m.save(rec)
	m.log.Debug("sandbox timeout set", "id", id, "timeout", timeout, "expires", time.UnixMilli(exp))
	return cloneRec(rec), nil
}

// cpuSample is a sandbox's CPU time at one moment.
type cpuSample struct {
	usec int64
	at   time.Time
}

// The window a CPU percentage is measured over: the time since the
// previous reading when that lies between these, else a fresh window of
// the shorter.
const (
	cpuWindowMin = 100 * time.Millisecond
	cpuWindowMax = time.Minute
)

// Metrics reads a sandbox's resource use now: CPU (in percent of its cores,
// over the time since the previous reading, or 100 ms measured now),
// memory from its cgroup and its writable layer's disk use, each with its
// limit (the node's when the sandbox has none of its own); with since
// not zero, also the samples of its history taken after since.
func (m *Manager) Metrics(ctx context.Context, id string, since time.Time) (*dsecv1.SandboxMetrics, error) {
	sb, err := m.lookup(id)
	if err != nil {
		return nil, err
	}
	sb.mu.Lock()
	rec := sb.rec
	state, rt, spec, prev := rec.GetState(), sb.rt, rec.GetSpec(), sb.cpuAt
	gone := !sb.gone.IsZero()
	sb.mu.Unlock()
	if gone || !Live(state) {
		return nil, GoneError(rec)
	}
	if state == dsecv1.State_STATE_CREATING {
		return nil, fmt.Errorf("sandbox %s is still being created: %w", id, errdefs.ErrFailedPrecondition)
	}
	meter, ok := rt.(backend.Meter)
	if !ok {
		return nil, fmt.Errorf("metrics of sandbox %s: %w", id, m.lacks(KindOf(spec), "measure its sandboxes"))
	}
	u, err := meter.Usage(ctx, id)
	if err != nil {
		return nil, err
	}
	now := time.Now()
	if d := now.Sub(prev.at); prev.at.IsZero() || d < cpuWindowMin || d > cpuWindowMax || u.CPUUsec < prev.usec {
		// No usable reading before: measure a window now.
		prev = cpuSample{usec: u.CPUUsec, at: now}
		select {
		case <-ctx.Done():
			return nil, ctx.Err()
		case <-time.After(cpuWindowMin):
		}
		if u, err = meter.Usage(ctx, id); err != nil {
			return nil, err
		}
		now = time.Now()
	}
	sb.mu.Lock()
	sb.cpuAt = cpuSample{usec: u.CPUUsec, at: now}
	sb.mu.Unlock()

	cores := spec.GetCpus()
	if cores <= 0 {
		cores = float64(runtime.NumCPU())
	}
	out := &dsecv1.SandboxMetrics{
		TimeUnixMs:       now.UnixMilli(),
		CpuCount:         cores,
		CpuUsedUsec:      u.CPUUsec,
		MemoryUsedBytes:  u.MemoryBytes,
		MemoryLimitBytes: u.MemoryLimit,
		MemoryCacheBytes: u.CacheBytes,
		DiskUsedBytes:    u.DiskBytes,
		DiskLimitBytes:   u.DiskLimit,
	}
	if wall := now.Sub(prev.at).Microseconds(); wall > 0 {
		pct := float64(u.CPUUsec-prev.usec) / (float64(wall) * cores) * 100
		out.CpuUsedPct = min(max(pct, 0), 100)
	}
	if out.MemoryLimitBytes == 0 {
		if mb, err := MemTotalMB(); err == nil {
			out.MemoryLimitBytes = mb << 20
		}
	}
	if out.DiskLimitBytes == 0 {
		out.DiskLimitBytes = u.DiskSize
	}
	if !since.IsZero() {
		out.Samples = sb.history(since)
	}
	return out, nil
}

package sandbox

import (
	"context"
	"time"

	"google.golang.org/protobuf/proto"

	dsecv1 "dsec.dev/dsec/api/gen/dsec/v1"
	"dsec.dev/dsec/internal/edge/backend"
	"dsec.dev/dsec/internal/edge/ledger"
	"dsec.dev/dsec/internal/iam"
)

// EgressMeter is what a Network that counts its sandboxes' egress
// implements (package netctl's Controller: the host veth's receive
// counter).
type EgressMeter interface {
	EgressBytes(id string) (int64, error)
}

// ledgerLoop samples every live sandbox's use into the cost ledger every
// interval and saves the ledger, until the manager stops.
func (m *Manager) ledgerLoop(every time.Duration) {
	defer m.wg.Done()
	t := time.NewTicker(every)
	defer t.Stop()
	for {
		select {
		case <-m.stop:
			if err := m.cfg.Ledger.Save(time.Now()); err != nil {
				m.log.Warn("save the cost ledger", "err", err)
			}
			return
		case <-t.C:
		}
		m.mu.Lock()
		live := make([]*sandbox, 0, len(m.sandboxes))
		for _, sb := range m.sandboxes {
			if sb.gone.IsZero() && sb.pool == "" && sb.rt != nil {
				live = append(live, sb)
			}
		}
		m.mu.Unlock()
		ctx, cancel := context.WithTimeout(context.Background(), every)
		for _, sb := range live {
			sb.mu.Lock()
			rec, rt := sb.rec, sb.rt
			state := rec.GetState()
			sb.mu.Unlock()
			if state == dsecv1.State_STATE_CREATING || !Live(state) {
				continue
			}
			m.observe(ctx, rec, rt)
		}
		cancel()
		if err := m.cfg.Ledger.Save(time.Now()); err != nil {
			m.log.Warn("save the cost ledger", "err", err)
		}
	}
}

// observe samples sandbox rec's use (its cgroup's CPU time and memory,
// its writable layer, its veth's egress) into the ledger. A sandbox its
// runtime cannot meter now (a microVM paused to disk has no QEMU) is
// skipped: the next sample integrates over the gap.
func (m *Manager) observe(ctx context.Context, rec *dsecv1.Sandbox, rt backend.Runtime) {
	meter, ok := rt.(backend.Meter)
	if m.cfg.Ledger == nil || !ok {
		return
	}
	id := rec.GetId()
	u, err := meter.Usage(ctx, id)
	if err != nil {
		m.log.Debug("sample sandbox usage", "id", id, "err", err)
		return
	}
	s := ledger.Sample{At: time.Now(), CPUUsec: u.CPUUsec, MemoryBytes: u.MemoryBytes, DiskBytes: u.DiskBytes}
	if em, ok := m.net.(EgressMeter); ok && m.net != nil && len(rec.GetSpec().GetNetworkRules()) > 0 {
		if n, err := em.EgressBytes(id); err == nil {
			s.EgressBytes = n
		}
	}
	labels := rec.GetSpec().GetLabels()
	m.cfg.Ledger.Observe(id, labels[iam.ProjectLabel], labels, s)
	m.keepSample(rec, u, s)
}

// What a sandbox's history holds: the samples of the last historyWindow,
// at most historyMax of them (a short --ledger-interval keeps less time).
const (
	historyWindow = 10 * time.Minute
	historyMax    = 120
)

// keepSample adds sample s (u as read) to the history of sandbox rec,
// which Metrics answers with, dropping what is older than historyWindow.
func (m *Manager) keepSample(rec *dsecv1.Sandbox, u backend.Usage, s ledger.Sample) {
	m.mu.Lock()
	sb := m.sandboxes[rec.GetId()]
	m.mu.Unlock()
	if sb == nil {
		return
	}
	ms := &dsecv1.MetricsSample{TimeUnixMs: s.At.UnixMilli(), CpuUsedUsec: u.CPUUsec, MemoryUsedBytes: u.MemoryBytes,
		MemoryLimitBytes: u.MemoryLimit, DiskUsedBytes: u.DiskBytes, NetEgressBytes: s.EgressBytes}
	if ms.MemoryLimitBytes == 0 {
		if mb, err := MemTotalMB(); err == nil {
			ms.MemoryLimitBytes = mb << 20
		}
	}
	sb.mu.Lock()
	defer sb.mu.Unlock()
	// CPU over the time since the sample before; the first over the time
	// since the sandbox started (or was claimed: its counter may hold
	// the time it waited in its pool, so it reads high once).
	prevUsec, prevAt := int64(0), time.UnixMilli(rec.GetCreatedUnixMs())
	if n := len(sb.samples); n > 0 {
		prevUsec, prevAt = sb.samples[n-1].GetCpuUsedUsec(), time.UnixMilli(sb.samples[n-1].GetTimeUnixMs())
	}
	if wall := s.At.Sub(prevAt).Microseconds(); wall > 0 && u.CPUUsec >= prevUsec {
		ms.CpuUsedCores = float64(u.CPUUsec-prevUsec) / float64(wall)
	}
	drop := 0
	for drop < len(sb.samples) && (len(sb.samples)-drop >= historyMax || s.At.Sub(time.UnixMilli(sb.samples[drop].GetTimeUnixMs())) > historyWindow) {
		drop++
	}
	sb.samples = append(sb.samples[drop:], ms)
}

// history returns the samples of sb taken after since, oldest first.
func (sb *sandbox) history(since time.Time) []*dsecv1.MetricsSample {
	sb.mu.Lock()
	defer sb.mu.Unlock()
	var out []*dsecv1.MetricsSample
	for _, ms := range sb.samples {
		if ms.GetTimeUnixMs() > since.UnixMilli() {
			out = append(out, proto.Clone(ms).(*dsecv1.MetricsSample))
		}
	}
	return out
}

// finalUsage takes sandbox id's last sample before its runtime removes
// it (its cgroup and veth go with it) and ends its ledger record.
func (m *Manager) finalUsage(ctx context.Context, id string, rt backend.Runtime) {
	if m.cfg.Ledger == nil {
		return
	}
	m.mu.Lock()
	sb := m.sandboxes[id]
	m.mu.Unlock()
	if sb == nil {
		return
	}
	if _, known := m.cfg.Ledger.Get(id); !known {
		return // never started for a caller: a pooled one, or a create that failed
	}
	sb.mu.Lock()
	rec := sb.rec
	sb.mu.Unlock()
	m.observe(ctx, rec, rt)
	m.cfg.Ledger.End(id, time.Now())
}

// ledgerEvent starts a sandbox's ledger record when it is made for a
// caller or claimed from its pool, and ends it when it ends (its last
// sample, taken before its runtime removes it, may come after).
func (m *Manager) ledgerEvent(rec *dsecv1.Sandbox, from, to phase) {
	if m.cfg.Ledger == nil {
		return
	}
	labels := rec.GetSpec().GetLabels()
	switch {
	case to.state == dsecv1.State_STATE_RUNNING && (from.state == dsecv1.State_STATE_CREATING || from.pooled):
		at := time.Now()
		if c := rec.GetCreatedUnixMs(); c > 0 && !from.pooled {
			at = time.UnixMilli(c)
		}
		m.cfg.Ledger.Start(rec.GetId(), labels[iam.ProjectLabel], labels, at, !from.pooled)
	case to.state == dsecv1.State_STATE_STOPPED || to.state == dsecv1.State_STATE_FAILED:
		m.cfg.Ledger.End(rec.GetId(), time.Now())
	}
}

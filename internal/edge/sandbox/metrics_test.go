package sandbox

import (
	"context"
	"errors"
	"testing"
	"time"

	dsecv1 "dsec.dev/dsec/api/gen/dsec/v1"
	"dsec.dev/dsec/internal/edge/backend"
	"dsec.dev/dsec/internal/edge/ledger"
	"dsec.dev/dsec/internal/errdefs"
)

func TestSetTimeout(t *testing.T) {
	rt := newFake(t)
	m := newTestManagerWith(t, t.TempDir(), rt, &fakeImages{}, func(c *Config) { c.Limits.MaxTTL = 2 * time.Hour })
	ctx := context.Background()
	sb, err := m.Create(ctx, &dsecv1.SandboxSpec{Environment: "base:1", TtlSeconds: 3600, IdleTimeoutSeconds: -1}, "")
	if err != nil {
		t.Fatal(err)
	}
	id := sb.GetId()
	expiresIn := func(rec *dsecv1.Sandbox) time.Duration {
		return time.Until(time.UnixMilli(rec.GetExpiresUnixMs())).Round(time.Minute)
	}

	// Sooner, then extend-only leaves a later expiry and takes a later one.
	rec, err := m.SetTimeout(ctx, id, 10*time.Minute, false)
	if err != nil || expiresIn(rec) != 10*time.Minute {
		t.Fatalf("SetTimeout 10m = %v, %v", rec.GetExpiresUnixMs(), err)
	}
	if rec, _ := m.SetTimeout(ctx, id, 5*time.Minute, true); expiresIn(rec) != 10*time.Minute {
		t.Errorf("extend-only to 5m moved the expiry to %s from now", expiresIn(rec))
	}
	if rec, _ := m.SetTimeout(ctx, id, 20*time.Minute, true); expiresIn(rec) != 20*time.Minute {
		t.Errorf("extend-only to 20m: expires in %s", expiresIn(rec))
	}
	if _, err := m.SetTimeout(ctx, id, 3*time.Hour, false); !errors.Is(err, errdefs.ErrInvalidArgument) {
		t.Errorf("over the node's longest TTL: %v", err)
	}
	if _, err := m.SetTimeout(ctx, "sb-n1-nothing", time.Minute, false); !errors.Is(err, errdefs.ErrNotFound) {
		t.Errorf("unknown sandbox: %v", err)
	}

	// Paused, its clock stands still: the timeout counts from the resume.
	if _, _, err := m.Pause(ctx, id, false); err != nil {
		t.Fatal(err)
	}
	if _, err := m.SetTimeout(ctx, id, 30*time.Minute, false); err != nil {
		t.Fatal(err)
	}
	time.Sleep(50 * time.Millisecond)
	rec, _, _, err = m.Resume(ctx, id, false)
	if err != nil || expiresIn(rec) != 30*time.Minute {
		t.Fatalf("resumed after SetTimeout 30m while paused: expires in %s, %v", expiresIn(rec), err)
	}

	// Timeout 0 ends it at once.
	if _, err := m.SetTimeout(ctx, id, 0, false); err != nil {
		t.Fatal(err)
	}
	waitState(t, m, id, dsecv1.State_STATE_STOPPED, dsecv1.Reason_REASON_TTL)
	if _, err := m.SetTimeout(ctx, id, time.Minute, false); !errors.Is(err, errdefs.ErrFailedPrecondition) {
		t.Errorf("SetTimeout of a stopped sandbox: %v", err)
	}
}

func TestMetricsRefusedWithoutMeter(t *testing.T) {
	rt := newFake(t)
	m := newTestManager(t, t.TempDir(), rt)
	ctx := context.Background()
	sb, err := m.Create(ctx, &dsecv1.SandboxSpec{Environment: "base:1", IdleTimeoutSeconds: -1}, "")
	if err != nil {
		t.Fatal(err)
	}
	if _, err := m.Metrics(ctx, sb.GetId(), time.Time{}); !errors.Is(err, errdefs.ErrNotSupported) {
		t.Errorf("metrics from a runtime that cannot measure: %v", err)
	}
}

// TestMetricsHistory feeds a sandbox's history samples as the ledger's
// loop reads them: each sample's CPU is in cores over the time since the
// one before, the history answers what came after since, and it keeps
// historyWindow of samples, at most historyMax.
func TestMetricsHistory(t *testing.T) {
	rt := newFake(t)
	m := newTestManager(t, t.TempDir(), rt)
	ctx := context.Background()
	rec, err := m.Create(ctx, &dsecv1.SandboxSpec{Environment: "base:1", IdleTimeoutSeconds: -1}, "")
	if err != nil {
		t.Fatal(err)
	}
	sb, err := m.lookup(rec.GetId())
	if err != nil {
		t.Fatal(err)
	}
	start := time.UnixMilli(rec.GetCreatedUnixMs())
	add := func(after time.Duration, cpu time.Duration, mem int64) {
		at := start.Add(after)
		m.keepSample(rec, backend.Usage{CPUUsec: cpu.Microseconds(), MemoryBytes: mem, MemoryLimit: 1 << 30, DiskBytes: 4096},
			ledger.Sample{At: at, CPUUsec: cpu.Microseconds(), MemoryBytes: mem, EgressBytes: 100})
	}
	add(10*time.Second, time.Second, 10<<20)     // 0.1 cores since the start
	add(20*time.Second, 16*time.Second, 200<<20) // 1.5 cores
	add(30*time.Second, 16*time.Second, 200<<20) // idle
	h := sb.history(start.Add(15 * time.Second))
	if len(h) != 2 {
		t.Fatalf("history after 15 s: %d samples, want 2", len(h))
	}
	if got := h[0].GetCpuUsedCores(); got < 1.49 || got > 1.51 {
		t.Errorf("the busy sample: %v cores, want 1.5", got)
	}
	if h[0].GetMemoryUsedBytes() != 200<<20 || h[0].GetMemoryLimitBytes() != 1<<30 || h[0].GetNetEgressBytes() != 100 {
		t.Errorf("the busy sample: %v", h[0])
	}
	if got := h[1].GetCpuUsedCores(); got != 0 {
		t.Errorf("the idle sample: %v cores, want 0", got)
	}
	if got := sb.history(time.Time{})[0].GetCpuUsedCores(); got < 0.099 || got > 0.101 {
		t.Errorf("the first sample: %v cores over the time since the start, want 0.1", got)
	}
	// Later samples push out those older than the window, and at most
	// historyMax stay.
	for i := range 2 * historyMax {
		add(historyWindow+time.Duration(i)*time.Second, 16*time.Second, 1)
	}
	h = sb.history(time.Time{})
	if len(h) != historyMax {
		t.Fatalf("history: %d samples, want %d", len(h), historyMax)
	}
	if first := time.UnixMilli(h[0].GetTimeUnixMs()); first.Before(start.Add(historyWindow)) {
		t.Errorf("the oldest sample kept is from %v after the start, older than the window", first.Sub(start))
	}
}

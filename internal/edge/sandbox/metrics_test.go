package sandbox

import (
	"context"
	"errors"
	"testing"
	"time"

	dsecv1 "dsec.dev/dsec/api/gen/dsec/v1"
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
	if _, err := m.Metrics(ctx, sb.GetId()); !errors.Is(err, errdefs.ErrNotSupported) {
		t.Errorf("metrics from a runtime that cannot measure: %v", err)
	}
}

package sandbox

import (
	"context"
	"testing"
	"time"

	dsecv1 "dsec.dev/dsec/api/gen/dsec/v1"
	"dsec.dev/dsec/internal/edge/backend/fake"
	"dsec.dev/dsec/internal/testutil"
)

// noPings makes a Manager that would ping an agent only once an hour.
func noPings(c *Config) { c.PingInterval = time.Hour }

// An idle sandbox costs no round trip: the sweep pings no agent that holds
// a watch connection, however often it runs.
func TestIdleSandboxesAreNotPinged(t *testing.T) {
	rt := newFake(t)
	m := newTestManagerWith(t, t.TempDir(), rt, &fakeImages{}, func(c *Config) { c.PingInterval = time.Millisecond })
	ctx := context.Background()
	for range 3 {
		if _, err := m.Create(ctx, &dsecv1.SandboxSpec{Environment: "base:1", IdleTimeoutSeconds: -1}, ""); err != nil {
			t.Fatal(err)
		}
	}
	before := rt.Pings()
	for range 3 {
		m.sweep(time.Now(), true)
	}
	if n := rt.Pings() - before; n != 0 {
		t.Fatalf("three sweeps pinged idle agents %d times, want none", n)
	}
}

// A dead agent fails its sandbox at once, from its watch connection's end,
// with no ping due: agent_lost, or oom when it was OOM-killed; and so for a
// sandbox a restarted edge re-adopted.
func TestDeadAgentFailsWithoutPings(t *testing.T) {
	rt := newFake(t)
	dir := t.TempDir()
	m := newTestManagerWith(t, dir, rt, &fakeImages{}, noPings)
	ctx := context.Background()
	spec := &dsecv1.SandboxSpec{Environment: "base:1", IdleTimeoutSeconds: -1}
	var ids []string
	for range 3 {
		sb, err := m.Create(ctx, spec, "")
		if err != nil {
			t.Fatal(err)
		}
		ids = append(ids, sb.GetId())
	}
	// Past the edge's first sweep, which pinged every agent when pings
	// were how a dead one was found.
	time.Sleep(1200 * time.Millisecond)
	rt.Kill(ids[0], false)
	rt.Kill(ids[1], true)
	waitState(t, m, ids[0], dsecv1.State_STATE_FAILED, dsecv1.Reason_REASON_AGENT_LOST)
	waitState(t, m, ids[1], dsecv1.State_STATE_FAILED, dsecv1.Reason_REASON_OOM)
	if got, _ := m.Get(ctx, ids[2]); got.GetState() != dsecv1.State_STATE_RUNNING {
		t.Fatalf("a live agent's sandbox: %v", got)
	}

	m.Shutdown()
	m2 := newTestManagerWith(t, dir, rt, &fakeImages{}, noPings)
	rt.Kill(ids[2], false)
	waitState(t, m2, ids[2], dsecv1.State_STATE_FAILED, dsecv1.Reason_REASON_AGENT_LOST)
}

// A paused sandbox's watch waits: a restarted edge re-adopts it without a
// word to its frozen agent, and once resumed its agent's death still fails
// it.
func TestPausedSandboxIsWatchedAcrossRestart(t *testing.T) {
	rt := newFake(t)
	dir := t.TempDir()
	m := newTestManagerWith(t, dir, rt, &fakeImages{}, noPings)
	ctx := context.Background()
	sb, err := m.Create(ctx, &dsecv1.SandboxSpec{Environment: "base:1", IdleTimeoutSeconds: -1}, "")
	if err != nil {
		t.Fatal(err)
	}
	if _, _, err := m.Pause(ctx, sb.GetId(), false); err != nil {
		t.Fatal(err)
	}
	m.Shutdown()
	m2 := newTestManagerWith(t, dir, rt, &fakeImages{}, noPings)
	before := rt.Pings()
	m2.sweep(time.Now(), true)
	if got, _ := m2.Get(ctx, sb.GetId()); got.GetState() != dsecv1.State_STATE_PAUSED || rt.Pings() != before {
		t.Fatalf("paused sandbox after a restart and a sweep: %v, %d pings", got, rt.Pings()-before)
	}
	if _, _, _, err := m2.Resume(ctx, sb.GetId(), false); err != nil {
		t.Fatal(err)
	}
	rt.Kill(sb.GetId(), false)
	waitState(t, m2, sb.GetId(), dsecv1.State_STATE_FAILED, dsecv1.Reason_REASON_AGENT_LOST)
}

// An agent older than watch connections is pinged every PingInterval, and
// its death found so.
func TestAgentWithoutWatchIsPinged(t *testing.T) {
	rt := newFake(t, fake.WithoutWatch())
	m := newTestManagerWith(t, t.TempDir(), rt, &fakeImages{}, noPings)
	ctx := context.Background()
	sb, err := m.Create(ctx, &dsecv1.SandboxSpec{Environment: "base:1", IdleTimeoutSeconds: -1}, "")
	if err != nil {
		t.Fatal(err)
	}
	s, _ := m.lookup(sb.GetId())
	testutil.WaitFor(t, 5*time.Second, "the edge to find the agent holds no watch connection", func() bool {
		s.mu.Lock()
		defer s.mu.Unlock()
		return s.polled
	})
	before := rt.Pings()
	m.sweep(time.Now(), true)
	if rt.Pings() != before+1 {
		t.Fatalf("a sweep pinged the agent without a watch %d times, want once", rt.Pings()-before)
	}
	rt.Kill(sb.GetId(), false)
	m.sweep(time.Now(), true)
	waitState(t, m, sb.GetId(), dsecv1.State_STATE_FAILED, dsecv1.Reason_REASON_AGENT_LOST)
}

package sandbox

import (
	"context"
	"testing"
	"time"

	dsecv1 "dsec.dev/dsec/api/gen/dsec/v1"
)

// TestPauseWaitsForCalls: a pause waits for a call under way that has not
// started (AgentStarting) before its backend pauses the sandbox, where a
// stream (Agent) or a started call does not hold it up: a microVM paused
// to disk ends its channel, which a started command's stream outlives and
// a unary call would not.
func TestPauseWaitsForCalls(t *testing.T) {
	rt := newFake(t)
	m := newTestManager(t, t.TempDir(), rt)
	ctx := context.Background()
	sb, err := m.Create(ctx, &dsecv1.SandboxSpec{Environment: "base:1", IdleTimeoutSeconds: -1}, "")
	if err != nil {
		t.Fatal(err)
	}
	id := sb.GetId()

	_, releaseStream, err := m.Agent(ctx, id)
	if err != nil {
		t.Fatal(err)
	}
	defer releaseStream()
	if _, _, err := m.Pause(ctx, id, false); err != nil {
		t.Fatalf("Pause with a stream under way: %v", err)
	}
	if _, _, _, err := m.Resume(ctx, id, true); err != nil {
		t.Fatal(err)
	}

	_, started, releaseStarted, err := m.AgentStarting(ctx, id)
	if err != nil {
		t.Fatal(err)
	}
	defer releaseStarted()
	started()
	if _, _, err := m.Pause(ctx, id, false); err != nil {
		t.Fatalf("Pause with a started call under way: %v", err)
	}
	if _, _, _, err := m.Resume(ctx, id, true); err != nil {
		t.Fatal(err)
	}

	_, _, releaseCall, err := m.AgentStarting(ctx, id)
	if err != nil {
		t.Fatal(err)
	}
	paused := make(chan error, 1)
	go func() {
		_, _, err := m.Pause(ctx, id, false)
		paused <- err
	}()
	for {
		rec, err := m.Get(ctx, id)
		if err != nil {
			t.Fatal(err)
		}
		if rec.GetState() == dsecv1.State_STATE_PAUSED {
			t.Fatal("the sandbox paused while a unary call was under way")
		}
		if rec.GetState() == dsecv1.State_STATE_PAUSING {
			break
		}
		time.Sleep(time.Millisecond)
	}
	if frozen, err := rt.Frozen(ctx, id); err != nil || frozen {
		t.Errorf("the backend paused the sandbox (frozen %v, %v) while a unary call was under way", frozen, err)
	}
	releaseCall()
	if err := <-paused; err != nil {
		t.Fatalf("Pause once the call ended: %v", err)
	}
	if frozen, err := rt.Frozen(ctx, id); err != nil || !frozen {
		t.Errorf("after the pause: frozen %v, %v", frozen, err)
	}
}

// TestDrainBound: a pause that ends the agent channel (a microVM's to
// disk) waits longer for the calls under way than one that only freezes
// the sandbox, whose calls carry on after the resume.
func TestDrainBound(t *testing.T) {
	vm := &dsecv1.SandboxSpec{Isolation: dsecv1.Isolation_ISOLATION_MICROVM}
	for _, c := range []struct {
		spec       *dsecv1.SandboxSpec
		keepMemory bool
		want       time.Duration
	}{
		{vm, false, channelDrain},
		{vm, true, callDrain},
		{&dsecv1.SandboxSpec{}, false, callDrain},
		{&dsecv1.SandboxSpec{Isolation: dsecv1.Isolation_ISOLATION_GVISOR}, false, callDrain},
	} {
		if got := drainBound(c.spec, c.keepMemory); got != c.want {
			t.Errorf("drainBound(%v, keepMemory %v) = %v, want %v", c.spec.GetIsolation(), c.keepMemory, got, c.want)
		}
	}
}

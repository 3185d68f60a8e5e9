package sandbox

import (
	"context"
	"errors"
	"testing"
	"time"

	dsecv1 "dsec.dev/dsec/api/gen/dsec/v1"
	"dsec.dev/dsec/internal/agent/agentclient"
	"dsec.dev/dsec/internal/edge/backend"
	"dsec.dev/dsec/internal/edge/backend/fake"
	"dsec.dev/dsec/internal/errdefs"
	"dsec.dev/dsec/internal/sandboxid"
)

// inject puts a sandbox in state st into m, as its own transitions would
// leave it: a create, pause or resume under way holds the op lock, and
// finish ends it (creating → running, pausing → paused, resuming →
// running).
func inject(t *testing.T, m *Manager, rt *fake.Runtime, st dsecv1.State) (id string, finish func()) {
	t.Helper()
	id = sandboxid.New("n1", 0, 0)
	rec := &dsecv1.Sandbox{Id: id, Node: "n1", State: st, Spec: &dsecv1.SandboxSpec{Environment: "base:1", TtlSeconds: 3600}}
	sb := &sandbox{rec: rec, lastActive: time.Now(), td: m.teardownOf(id, rt)}
	if st != dsecv1.State_STATE_STOPPED && st != dsecv1.State_STATE_FAILED {
		dial, err := rt.Start(context.Background(), backend.Spec{ID: id, Layers: []backend.Layer{{Digest: "sha256:x", FSType: backend.FSTypeDir, Dir: "/layers/x"}}, LogPath: "/dev/null"})
		if err != nil {
			t.Fatal(err)
		}
		rt.SetFrozen(id, st == dsecv1.State_STATE_PAUSED || st == dsecv1.State_STATE_PAUSING || st == dsecv1.State_STATE_RESUMING)
		sb.rt, sb.agent = rt, agentclient.New(dial)
	} else {
		sb.gone = time.Now()
		rec.Reason = dsecv1.Reason_REASON_DELETED
	}
	if err := m.states.Save(rec); err != nil {
		t.Fatal(err)
	}
	finish = func() {}
	if next, ok := afterTransition[st]; ok {
		sb.op.Lock()
		finish = func() {
			sb.mu.Lock()
			sb.rec.State = next
			sb.mu.Unlock()
			rt.SetFrozen(id, next == dsecv1.State_STATE_PAUSED)
			sb.op.Unlock()
		}
	}
	if st == dsecv1.State_STATE_STOPPING {
		// A stop whose teardown failed midway: the container is gone, the
		// rest is left for the next call.
		sb.td = teardown{}
		m.hold(&sb.td, resRecord, id, rt)
	}
	m.mu.Lock()
	m.sandboxes[id] = sb
	m.mu.Unlock()
	return id, finish
}

// afterTransition is where a transition under way ends.
var afterTransition = map[dsecv1.State]dsecv1.State{
	dsecv1.State_STATE_CREATING: dsecv1.State_STATE_RUNNING,
	dsecv1.State_STATE_PAUSING:  dsecv1.State_STATE_PAUSED,
	dsecv1.State_STATE_RESUMING: dsecv1.State_STATE_RUNNING,
}

// do makes call c on sandbox id the way the edge's callers do.
func do(m *Manager, c call, id string) (already bool, err error) {
	ctx := context.Background()
	switch c {
	case callUse:
		_, release, err := m.Agent(ctx, id)
		if err == nil {
			release()
		}
		return false, err
	case callPause:
		_, already, err := m.Pause(ctx, id, false)
		return already, err
	case callResume:
		_, already, _, err := m.Resume(ctx, id, false)
		return already, err
	case callDelete:
		return false, m.Delete(ctx, id)
	}
	panic("unknown call")
}

// TestTransitionTable makes every call in every state and checks that the
// edge does what the table says: go ahead, do nothing and say so, resume
// first, wait for the transition under way, or refuse.
func TestTransitionTable(t *testing.T) {
	for st := range transitions {
		for c := range numCalls {
			v := decide(st, c)
			t.Run(stateWord(st)+"/"+c.String(), func(t *testing.T) {
				rt := newFake(t)
				m := newTestManager(t, t.TempDir(), rt)
				id, finish := inject(t, m, rt, st)
				defer func() { finish() }() // ends a transition the test did not end itself

				type result struct {
					already bool
					err     error
				}
				done := make(chan result, 1)
				go func() {
					a, err := do(m, c, id)
					done <- result{a, err}
				}()
				var r result
				switch v {
				case waitFor:
					select {
					case r := <-done:
						t.Fatalf("returned %+v while the transition was under way", r)
					case <-time.After(50 * time.Millisecond):
					}
					f := finish
					finish = func() {}
					f()
					r = <-done
					// The call goes on as the table says of the state the
					// transition ended in.
					st = afterTransition[st]
					v = decide(st, c)
				case allow:
					if st == dsecv1.State_STATE_CREATING {
						// A delete of a sandbox being made waits for the create.
						f := finish
						finish = func() {}
						f()
					}
					r = <-done
				default:
					select {
					case r = <-done:
					case <-time.After(2 * time.Second):
						t.Fatalf("verdict %s, yet the call waits", v)
					}
				}
				got, _ := m.Get(context.Background(), id)
				switch v {
				case allow, resumeFirst, waitFor:
					if r.err != nil || r.already {
						t.Fatalf("verdict %s: %+v", v, r)
					}
				case noop:
					if r.err != nil || (c != callDelete && !r.already) {
						t.Fatalf("verdict noop: %+v, want already", r)
					}
					if c != callDelete && got.GetState() != st {
						t.Fatalf("a noop changed the state to %s", got.GetState())
					}
				case refuseNew, refuseGone:
					if !errors.Is(r.err, errdefs.ErrFailedPrecondition) {
						t.Fatalf("verdict %s: %v, want FailedPrecondition", v, r.err)
					}
					return
				}
				// Where an allowed call leads.
				want := map[call]dsecv1.State{callUse: dsecv1.State_STATE_RUNNING, callPause: dsecv1.State_STATE_PAUSED,
					callResume: dsecv1.State_STATE_RUNNING, callDelete: dsecv1.State_STATE_STOPPED}[c]
				if v == noop && c == callDelete {
					want = st
					if st == dsecv1.State_STATE_STOPPING {
						want = dsecv1.State_STATE_STOPPED // the retry finished the teardown
					}
				}
				if v == noop && c != callDelete {
					want = st
				}
				if got.GetState() != want {
					t.Fatalf("after %s in %s (%s): %s, want %s", c, stateWord(st), v, got.GetState(), want)
				}
			})
		}
	}
}

func TestPauseSurvivesRestartAndResumesOnUse(t *testing.T) {
	rt := newFake(t)
	dir := t.TempDir()
	m := newTestManager(t, dir, rt)
	ctx := context.Background()
	sb, err := m.Create(ctx, &dsecv1.SandboxSpec{Environment: "base:1", IdleTimeoutSeconds: -1}, "")
	if err != nil {
		t.Fatal(err)
	}
	paused, already, err := m.Pause(ctx, sb.GetId(), false)
	if err != nil || already || paused.GetState() != dsecv1.State_STATE_PAUSED || paused.GetLastPause().GetReleasedBytes() == 0 {
		t.Fatalf("Pause = %v, %v, %v", paused, already, err)
	}
	if _, already, _ := m.Pause(ctx, sb.GetId(), false); !already {
		t.Fatal("a second pause did not say it was paused already")
	}
	m.Shutdown()

	// The health checks of a restarted edge do not fail a frozen agent.
	m2 := newTestManager(t, dir, rt)
	time.Sleep(300 * time.Millisecond) // a few ping intervals
	got, err := m2.Get(ctx, sb.GetId())
	if err != nil || got.GetState() != dsecv1.State_STATE_PAUSED {
		t.Fatalf("after a restart: %v, %v; want paused", got, err)
	}
	_, release, err := m2.Agent(ctx, sb.GetId())
	if err != nil {
		t.Fatalf("a call to a paused sandbox: %v; want it resumed", err)
	}
	release()
	if got, _ := m2.Get(ctx, sb.GetId()); got.GetState() != dsecv1.State_STATE_RUNNING {
		t.Fatalf("after a call: %s, want running", got.GetState())
	}
	if frozen, _ := rt.Frozen(ctx, sb.GetId()); frozen {
		t.Fatal("the container is still frozen")
	}
}

func TestRecoverFindsInterruptedPause(t *testing.T) {
	rt := newFake(t)
	dir := t.TempDir()
	m := newTestManager(t, dir, rt)
	ctx := context.Background()
	frozen, _ := m.Create(ctx, &dsecv1.SandboxSpec{Environment: "base:1"}, "")
	thawed, _ := m.Create(ctx, &dsecv1.SandboxSpec{Environment: "base:1"}, "")
	m.Shutdown()
	// The edge died midway: one pause had frozen its sandbox, one resume
	// had thawed its sandbox, and neither record says how it ended.
	for id, st := range map[string]dsecv1.State{frozen.GetId(): dsecv1.State_STATE_PAUSING, thawed.GetId(): dsecv1.State_STATE_RESUMING} {
		rec, err := m.states.Load(id)
		if err != nil {
			t.Fatal(err)
		}
		rec.State = st
		if err := m.states.Save(rec); err != nil {
			t.Fatal(err)
		}
	}
	rt.SetFrozen(frozen.GetId(), true)
	m2 := newTestManager(t, dir, rt)
	if got, _ := m2.Get(ctx, frozen.GetId()); got.GetState() != dsecv1.State_STATE_PAUSED {
		t.Errorf("frozen mid-pause: %s after recovery, want paused", got.GetState())
	}
	if got, _ := m2.Get(ctx, thawed.GetId()); got.GetState() != dsecv1.State_STATE_RUNNING {
		t.Errorf("thawed mid-resume: %s after recovery, want running", got.GetState())
	}
}

func TestOnTimeoutPause(t *testing.T) {
	rt := newFake(t)
	m := newTestManager(t, t.TempDir(), rt)
	ctx := context.Background()
	sb, err := m.Create(ctx, &dsecv1.SandboxSpec{Environment: "base:1", TtlSeconds: 1, IdleTimeoutSeconds: -1,
		OnTimeout: dsecv1.OnTimeout_ON_TIMEOUT_PAUSE}, "")
	if err != nil {
		t.Fatal(err)
	}
	waitState(t, m, sb.GetId(), dsecv1.State_STATE_PAUSED, dsecv1.Reason_REASON_UNSPECIFIED)
	time.Sleep(1500 * time.Millisecond) // a paused sandbox's TTL stands still
	rec, already, _, err := m.Resume(ctx, sb.GetId(), false)
	if err != nil || already {
		t.Fatalf("Resume: %v %v", already, err)
	}
	// The TTL that ran out starts afresh, from the resume.
	if left := time.Until(time.UnixMilli(rec.GetExpiresUnixMs())); left < 500*time.Millisecond || left > 1100*time.Millisecond {
		t.Fatalf("after resume the TTL ends in %s, want about 1s", left)
	}
	waitState(t, m, sb.GetId(), dsecv1.State_STATE_PAUSED, dsecv1.Reason_REASON_UNSPECIFIED)
}

func TestAutoResumeFalseRefuses(t *testing.T) {
	rt := newFake(t)
	m := newTestManager(t, t.TempDir(), rt)
	ctx := context.Background()
	no := false
	sb, err := m.Create(ctx, &dsecv1.SandboxSpec{Environment: "base:1", AutoResume: &no}, "")
	if err != nil {
		t.Fatal(err)
	}
	if _, _, err := m.Pause(ctx, sb.GetId(), true); err != nil {
		t.Fatal(err)
	}
	if _, _, err := m.Agent(ctx, sb.GetId()); !errors.Is(err, errdefs.ErrFailedPrecondition) {
		t.Fatalf("a call to a paused sandbox with auto_resume false: %v, want FailedPrecondition", err)
	}
	if got, _ := m.Get(ctx, sb.GetId()); got.GetState() != dsecv1.State_STATE_PAUSED {
		t.Fatalf("refused call changed the state to %s", got.GetState())
	}
	if _, _, _, err := m.Resume(ctx, sb.GetId(), false); err != nil {
		t.Fatal(err)
	}
	if _, release, err := m.Agent(ctx, sb.GetId()); err != nil {
		t.Fatalf("after resume: %v", err)
	} else {
		release()
	}
}

func TestPausedRetention(t *testing.T) {
	rt := newFake(t)
	m := newTestManagerWith(t, t.TempDir(), rt, &fakeImages{}, func(c *Config) { c.PausedRetention = time.Second })
	ctx := context.Background()
	sb, err := m.Create(ctx, &dsecv1.SandboxSpec{Environment: "base:1"}, "")
	if err != nil {
		t.Fatal(err)
	}
	if _, _, err := m.Pause(ctx, sb.GetId(), false); err != nil {
		t.Fatal(err)
	}
	waitState(t, m, sb.GetId(), dsecv1.State_STATE_STOPPED, dsecv1.Reason_REASON_PAUSED_TOO_LONG)
	if ids, _ := rt.List(ctx); len(ids) != 0 {
		t.Fatalf("a sandbox stopped after its paused retention left containers: %v", ids)
	}
}

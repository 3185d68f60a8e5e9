package sandbox

import (
	"context"
	"errors"
	"slices"
	"testing"
	"time"

	dsecv1 "dsec.dev/dsec/api/gen/dsec/v1"
	"dsec.dev/dsec/internal/agent/agentclient"
	"dsec.dev/dsec/internal/edge/backend"
	"dsec.dev/dsec/internal/edge/backend/fake"
	"dsec.dev/dsec/internal/errdefs"
	"dsec.dev/dsec/internal/sandboxid"
)

// inject puts a sandbox in phase p into m, as its own transitions would
// leave it: a create, pause or resume under way holds the op lock, and
// finish ends it (creating → running, pausing → paused, resuming →
// running).
func inject(t *testing.T, m *Manager, rt *fake.Runtime, p phase) (id string, finish func()) {
	t.Helper()
	st := p.state
	id = sandboxid.New("n1", 0, 0)
	rec := &dsecv1.Sandbox{Id: id, Node: "n1", State: st, Spec: &dsecv1.SandboxSpec{Environment: "base:1", TtlSeconds: 3600},
		LayerDigests: []string{"sha256:aa"}}
	sb := &sandbox{rec: rec, lastActive: time.Now(), td: m.teardownOf(id, rt)}
	if p.pooled {
		sb.pool = "test-pool"
	}
	if !ended(st) {
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
	if next, ok := afterTransition[p]; ok {
		sb.op.Lock()
		finish = func() {
			sb.mu.Lock()
			sb.rec.State = next.state
			sb.mu.Unlock()
			rt.SetFrozen(id, next.state == dsecv1.State_STATE_PAUSED)
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
var afterTransition = map[phase]phase{
	creating:     running,
	pausing:      paused,
	resuming:     running,
	poolCreating: poolRunning,
}

// do makes call c on sandbox id the way the edge's callers do: a delete of
// a pooled sandbox is the edge's own stop (callers do not see it).
func do(m *Manager, c call, id string) (already bool, err error) {
	ctx := context.Background()
	m.mu.Lock()
	sb := m.sandboxes[id]
	m.mu.Unlock()
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
		if peek(m, id).pooled {
			return false, m.stopSandbox(ctx, sb, dsecv1.State_STATE_STOPPED, dsecv1.Reason_REASON_DELETED, "test")
		}
		return false, m.Delete(ctx, id)
	case callClaim:
		_, err := m.claim(ctx, sb, &dsecv1.SandboxSpec{Environment: "base:1", TtlSeconds: 60}, "")
		return false, err
	case callDrop:
		return false, m.stopAs(ctx, sb, callDrop, dsecv1.State_STATE_STOPPED, dsecv1.Reason_REASON_DELETED, "test")
	}
	panic("unknown call")
}

// peek is the phase of sandbox id, pooled or not.
func peek(m *Manager, id string) phase {
	m.mu.Lock()
	sb := m.sandboxes[id]
	m.mu.Unlock()
	sb.mu.Lock()
	defer sb.mu.Unlock()
	return sb.phaseOf()
}

// TestTransitionTable makes every call in every phase and checks that the
// edge does what the table says: go ahead, do nothing and say so, resume
// first, wait for the transition under way, or refuse.
func TestTransitionTable(t *testing.T) {
	for p := range transitions {
		for c := range numCalls {
			v := decide(p, c)
			t.Run(p.String()+"/"+c.String(), func(t *testing.T) {
				rt := newFake(t)
				m := newTestManager(t, t.TempDir(), rt)
				id, finish := inject(t, m, rt, p)
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
					// The call goes on as the table says of the phase the
					// transition ended in.
					p = afterTransition[p]
					v = decide(p, c)
				case allow:
					if p.state == dsecv1.State_STATE_CREATING {
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
				got := peek(m, id)
				switch v {
				case allow, resumeFirst:
					if r.err != nil || r.already {
						t.Fatalf("verdict %s: %+v", v, r)
					}
				case noop:
					if r.err != nil || (c != callDelete && c != callDrop && !r.already) {
						t.Fatalf("verdict noop: %+v, want already", r)
					}
				case refuseNew, refuseGone, hidden, illegal:
					want := map[verdict]error{refuseNew: errdefs.ErrFailedPrecondition, refuseGone: errdefs.ErrFailedPrecondition,
						hidden: errdefs.ErrNotFound, illegal: errdefs.ErrInternal}[v]
					if !errors.Is(r.err, want) {
						t.Fatalf("verdict %s: %v, want %v", v, r.err, want)
					}
					if got != p {
						t.Fatalf("a refused %s moved it from %s to %s", c, p, got)
					}
					return
				}
				// Where an allowed call leads.
				want := map[call]phase{callUse: running, callPause: paused, callResume: running,
					callDelete: {dsecv1.State_STATE_STOPPED, p.pooled}, callClaim: running, callDrop: poolStopped}[c]
				if v == noop {
					want = p
					if p.state == dsecv1.State_STATE_STOPPING && (c == callDelete || p.pooled) {
						want.state = dsecv1.State_STATE_STOPPED // the retry finished the teardown
					}
				}
				if got != want {
					t.Fatalf("after %s in %s (%s): %s, want %s", c, p, v, got, want)
				}
			})
		}
	}
}

// TestTransitionsRefuseIllegal: transition makes every change next lists
// and refuses every other, with Internal, the phase and the record on disk
// unchanged.
func TestTransitionsRefuseIllegal(t *testing.T) {
	rt := newFake(t)
	m := newTestManager(t, t.TempDir(), rt)
	legal, refused := 0, 0
	for from := range transitions {
		for to := range transitions {
			id := sandboxid.New("n1", 0, 0)
			rec := &dsecv1.Sandbox{Id: id, Node: "n1", State: from.state}
			sb := &sandbox{rec: rec}
			if from.pooled {
				sb.pool = "test-pool"
			}
			if err := m.states.Save(rec); err != nil {
				t.Fatal(err)
			}
			m.mu.Lock()
			sb.mu.Lock()
			err := m.transition(sb, to)
			got := sb.phaseOf()
			sb.mu.Unlock()
			m.mu.Unlock()
			onDisk, lerr := m.states.Load(id)
			if lerr != nil {
				t.Fatal(lerr)
			}
			if slices.Contains(next[from], to) {
				legal++
				if err != nil || got != to {
					t.Errorf("%s → %s: %v, now %s", from, to, err, got)
				}
				if !ended(to.state) && onDisk.GetState() != to.state {
					t.Errorf("%s → %s: the record on disk says %s", from, to, onDisk.GetState())
				}
				continue
			}
			refused++
			if !errors.Is(err, errdefs.ErrInternal) || got != from || onDisk.GetState() != from.state {
				t.Errorf("%s → %s: %v, now %s (on disk %s); want refused with Internal", from, to, err, got, onDisk.GetState())
			}
		}
	}
	if legal == 0 || refused == 0 {
		t.Fatalf("%d legal and %d refused transitions tried", legal, refused)
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

// TestTransitionOfRecords: Transition, for records an edge keeps without a
// Manager, follows the same table: legal changes apply, an illegal one is
// Internal and leaves the record as it was.
func TestTransitionOfRecords(t *testing.T) {
	for _, tc := range []struct {
		from, to dsecv1.State
		ok       bool
	}{
		{dsecv1.State_STATE_CREATING, dsecv1.State_STATE_RUNNING, true},
		{dsecv1.State_STATE_RUNNING, dsecv1.State_STATE_PAUSED, true},
		{dsecv1.State_STATE_PAUSED, dsecv1.State_STATE_RUNNING, true},
		{dsecv1.State_STATE_RUNNING, dsecv1.State_STATE_STOPPING, true},
		{dsecv1.State_STATE_STOPPING, dsecv1.State_STATE_STOPPED, true},
		{dsecv1.State_STATE_RUNNING, dsecv1.State_STATE_STOPPED, false},
		{dsecv1.State_STATE_STOPPED, dsecv1.State_STATE_RUNNING, false},
		{dsecv1.State_STATE_CREATING, dsecv1.State_STATE_PAUSED, false},
	} {
		rec := &dsecv1.Sandbox{Id: "sb-1", State: tc.from}
		err := Transition(rec, tc.to)
		switch {
		case tc.ok && (err != nil || rec.GetState() != tc.to):
			t.Errorf("%s -> %s: %v, state %s", tc.from, tc.to, err, rec.GetState())
		case !tc.ok && (!errors.Is(err, errdefs.ErrInternal) || rec.GetState() != tc.from):
			t.Errorf("%s -> %s: %v, state %s; want Internal and the record unchanged", tc.from, tc.to, err, rec.GetState())
		}
	}
}

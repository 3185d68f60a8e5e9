package sandbox

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"sync"
	"testing"
	"time"

	dsecv1 "dsec.dev/dsec/api/gen/dsec/v1"
	"dsec.dev/dsec/internal/edge/backend/fake"
	"dsec.dev/dsec/internal/errdefs"
)

// waitPool waits until the only warm pool has ready sandboxes ready and
// none starting, and the runtime holds containers containers.
func waitPool(t *testing.T, m *Manager, rt *fake.Runtime, ready, containers int) *dsecv1.WarmPool {
	t.Helper()
	var pool *dsecv1.WarmPool
	waitPools(t, m, rt, fmt.Sprintf("%d ready with %d containers", ready, containers), func(ids []string, ps []*dsecv1.WarmPool) bool {
		if len(ps) == 1 && ps[0].GetReady() == int32(ready) && ps[0].GetStarting() == 0 && len(ids) == containers {
			pool = ps[0]
			return true
		}
		return false
	})
	return pool
}

func TestWarmPoolServesAndRefills(t *testing.T) {
	rt := newFake(t)
	m := newTestManager(t, t.TempDir(), rt)
	ctx := context.Background()
	shape := &dsecv1.SandboxSpec{Environment: "base:1", Cpus: 0.5, MemoryMb: 64}

	p, err := m.SetWarmPool(ctx, shape, 2)
	if err != nil {
		t.Fatal(err)
	}
	if p.GetSize() != 2 || p.GetSpec().GetTtlSeconds() != 0 || p.GetSpec().GetCpus() != 0.5 {
		t.Errorf("pool %v: want size 2 and the shape without a TTL", p)
	}
	// A pool just set says what it is filling: not 0 ready and 0 starting.
	if p.GetReady()+p.GetStarting() != 2 {
		t.Errorf("pool set: %d ready, %d starting; want 2 together", p.GetReady(), p.GetStarting())
	}
	if ps, _ := m.WarmPools(ctx); len(ps) != 1 || ps[0].GetReady()+ps[0].GetStarting() != 2 {
		t.Errorf("pools right after pool set: %v; want 2 ready or starting", ps)
	}
	waitPool(t, m, rt, 2, 2)
	members, _ := rt.List(ctx)
	for _, id := range members {
		// Each ran one exec (refused by the fake) before it was ready.
		if n := rt.Execs(id); n != 1 {
			t.Errorf("pooled %s had %d warm-up execs, want 1", id, n)
		}
	}
	if sbs, _ := m.List(ctx, nil, nil); len(sbs) != 0 {
		t.Fatalf("List shows pooled sandboxes: %v", sbs)
	}
	for _, id := range members {
		if _, err := m.Get(ctx, id); !errors.Is(err, errdefs.ErrNotFound) {
			t.Errorf("Get of pooled %s: %v, want not found", id, err)
		}
		if _, _, err := m.Agent(ctx, id); !errors.Is(err, errdefs.ErrNotFound) {
			t.Errorf("Agent of pooled %s: %v, want not found", id, err)
		}
		if err := m.Delete(ctx, id); err != nil {
			t.Errorf("Delete of pooled %s: %v", id, err)
		}
	}
	waitPool(t, m, rt, 2, 2) // Delete of an unknown ID removed nothing

	// Same shape, other labels, TTL and idle timeout: taken from the pool.
	ask := &dsecv1.SandboxSpec{Environment: "base:1", Cpus: 0.5, MemoryMb: 64, TtlSeconds: 60,
		IdleTimeoutSeconds: -1, Labels: map[string]string{"job": "a"}}
	before := time.Now()
	got, err := m.Create(ctx, ask, "")
	if err != nil {
		t.Fatal(err)
	}
	if !got.GetFromWarmPool() || !slices.Contains(members, got.GetId()) {
		t.Fatalf("create got %s (from pool %v); pool held %v", got.GetId(), got.GetFromWarmPool(), members)
	}
	if got.GetSpec().GetLabels()["job"] != "a" || got.GetSpec().GetLabels()[poolLabel] != "" {
		t.Errorf("labels %v, want the caller's only", got.GetSpec().GetLabels())
	}
	if exp := time.UnixMilli(got.GetExpiresUnixMs()); exp.Before(before.Add(59*time.Second)) || exp.After(time.Now().Add(61*time.Second)) {
		t.Errorf("expires %v, want about a minute after the take", exp)
	}
	if g, err := m.Get(ctx, got.GetId()); err != nil || g.GetState() != dsecv1.State_STATE_RUNNING {
		t.Fatalf("Get of taken sandbox: %v %v", g, err)
	}
	if rec, err := m.states.Load(got.GetId()); err != nil || rec.GetSpec().GetLabels()[poolLabel] != "" || !rec.GetFromWarmPool() {
		t.Fatalf("saved record of taken sandbox: %v %v", rec, err)
	}
	st := waitPool(t, m, rt, 2, 3) // refilled
	if st.GetTaken() != 1 || st.GetMissed() != 0 {
		t.Errorf("taken %d missed %d, want 1 and 0", st.GetTaken(), st.GetMissed())
	}

	// Another shape starts its own sandbox.
	other, err := m.Create(ctx, &dsecv1.SandboxSpec{Environment: "base:1", Cpus: 1}, "")
	if err != nil || other.GetFromWarmPool() {
		t.Fatalf("other shape: %v from pool %v", err, other.GetFromWarmPool())
	}

	// A dead member is replaced.
	var victim string
	for _, id := range mustList(t, rt) {
		if id != got.GetId() && id != other.GetId() {
			victim = id
			break
		}
	}
	rt.Kill(victim, false)
	waitPools(t, m, rt, "dead member "+victim+" replaced", func(ids []string, ps []*dsecv1.WarmPool) bool {
		return !slices.Contains(ids, victim) && len(ps) == 1 && ps[0].GetReady() == 2
	})

	// Size 0 removes the pool and its members; taken sandboxes stay.
	if _, err := m.SetWarmPool(ctx, shape, 0); err != nil {
		t.Fatal(err)
	}
	waitPools(t, m, rt, "pool removed", func(ids []string, ps []*dsecv1.WarmPool) bool {
		return len(ps) == 0 && len(ids) == 2
	})
	if miss, err := m.Create(ctx, ask, ""); err != nil || miss.GetFromWarmPool() {
		t.Fatalf("create after the pool was removed: %v, from pool %v", err, miss.GetFromWarmPool())
	}
}

// waitPools waits until ok holds for the runtime's containers and the
// manager's pools.
func waitPools(t *testing.T, m *Manager, rt *fake.Runtime, what string, ok func(ids []string, ps []*dsecv1.WarmPool) bool) {
	t.Helper()
	deadline := time.Now().Add(5 * time.Second)
	for {
		ids := mustList(t, rt)
		ps, _ := m.WarmPools(context.Background())
		if ok(ids, ps) {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("not %s: containers %v, pools %v", what, ids, ps)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

func mustList(t *testing.T, rt *fake.Runtime) []string {
	t.Helper()
	ids, err := rt.List(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	return ids
}

func TestWarmPoolRefusesBadShapes(t *testing.T) {
	rt := newFake(t)
	m := newTestManager(t, t.TempDir(), rt)
	ctx := context.Background()
	for _, tc := range []struct {
		name string
		spec *dsecv1.SandboxSpec
		size int
		want error
	}{
		{"unknown environment", &dsecv1.SandboxSpec{Environment: "nope:1"}, 1, errdefs.ErrNotFound},
		{"negative size", &dsecv1.SandboxSpec{Environment: "base:1"}, -1, errdefs.ErrInvalidArgument},
		{"network rules", &dsecv1.SandboxSpec{Environment: "base:1", NetworkRules: map[string]bool{"pypi": true}}, 1, errdefs.ErrFailedPrecondition},
		{"over the node's cap", &dsecv1.SandboxSpec{Environment: "base:1"}, 257, errdefs.ErrResourceExhausted},
		{"reserved label", &dsecv1.SandboxSpec{Environment: "base:1", Labels: map[string]string{poolLabel: "x"}}, 1, errdefs.ErrInvalidArgument},
	} {
		if _, err := m.SetWarmPool(ctx, tc.spec, tc.size); !errors.Is(err, tc.want) {
			t.Errorf("%s: %v, want %v", tc.name, err, tc.want)
		}
	}
	if _, err := m.Create(ctx, &dsecv1.SandboxSpec{Environment: "base:1", Labels: map[string]string{poolLabel: "x"}}, ""); !errors.Is(err, errdefs.ErrInvalidArgument) {
		t.Errorf("create with the pool label: %v, want invalid argument", err)
	}
	if ps, _ := m.WarmPools(ctx); len(ps) != 0 {
		t.Errorf("refused pools were kept: %v", ps)
	}
}

func TestWarmPoolDropsStaleEnvironment(t *testing.T) {
	rt := newFake(t)
	images := &fakeImages{}
	m := newTestManagerWith(t, t.TempDir(), rt, images, nil)
	ctx := context.Background()
	shape := &dsecv1.SandboxSpec{Environment: "base:1"}
	if _, err := m.SetWarmPool(ctx, shape, 2); err != nil {
		t.Fatal(err)
	}
	waitPool(t, m, rt, 2, 2)
	old := mustList(t, rt)

	images.retag("sha256:bb") // base:1 now names another layer
	sb, err := m.Create(ctx, shape, "")
	if err != nil {
		t.Fatal(err)
	}
	if sb.GetFromWarmPool() || slices.Contains(old, sb.GetId()) || sb.GetLayerDigests()[0] != "sha256:bb" {
		t.Fatalf("create after retag got %s on %v (from pool %v); stale members were %v", sb.GetId(), sb.GetLayerDigests(), sb.GetFromWarmPool(), old)
	}
	waitPool(t, m, rt, 2, 3)
	for _, id := range old {
		if slices.Contains(mustList(t, rt), id) {
			t.Errorf("stale member %s still runs", id)
		}
	}
	again, err := m.Create(ctx, shape, "")
	if err != nil || !again.GetFromWarmPool() || again.GetLayerDigests()[0] != "sha256:bb" {
		t.Fatalf("create from the refilled pool: %v %v", again, err)
	}
}

func TestRecoverRemovesPooledSandboxes(t *testing.T) {
	rt := newFake(t)
	dir := t.TempDir()
	m := newTestManager(t, dir, rt)
	ctx := context.Background()
	shape := &dsecv1.SandboxSpec{Environment: "base:1"}
	if _, err := m.SetWarmPool(ctx, shape, 2); err != nil {
		t.Fatal(err)
	}
	waitPool(t, m, rt, 2, 2)
	taken, err := m.Create(ctx, shape, "")
	if err != nil || !taken.GetFromWarmPool() {
		t.Fatalf("take: %v %v", taken, err)
	}
	waitPool(t, m, rt, 2, 3)
	m.Shutdown()

	m2 := newTestManager(t, dir, rt)
	if ids := mustList(t, rt); len(ids) != 1 || ids[0] != taken.GetId() {
		t.Fatalf("after recover the runtime holds %v, want only the taken %s", ids, taken.GetId())
	}
	if got, err := m2.Get(ctx, taken.GetId()); err != nil || got.GetState() != dsecv1.State_STATE_RUNNING {
		t.Fatalf("taken sandbox after recover: %v %v", got, err)
	}
	if ps, _ := m2.WarmPools(ctx); len(ps) != 0 {
		t.Fatalf("pools survived a restart: %v", ps)
	}
	if err := m2.Teardown(ctx); err != nil {
		t.Fatal(err)
	}
}

// Concurrent creates never get the same pooled sandbox, and the pool's
// counts add up.
func TestWarmPoolConcurrentTakes(t *testing.T) {
	rt := newFake(t)
	m := newTestManager(t, t.TempDir(), rt)
	ctx := context.Background()
	shape := &dsecv1.SandboxSpec{Environment: "base:1"}
	if _, err := m.SetWarmPool(ctx, shape, 5); err != nil {
		t.Fatal(err)
	}
	waitPool(t, m, rt, 5, 5)
	const n = 20
	ids := make([]string, n)
	warm := make([]bool, n)
	var wg sync.WaitGroup
	for i := range n {
		wg.Go(func() {
			sb, err := m.Create(ctx, shape, "")
			if err != nil {
				t.Error(err)
				return
			}
			ids[i], warm[i] = sb.GetId(), sb.GetFromWarmPool()
		})
	}
	wg.Wait()
	seen := map[string]bool{}
	fromPool := 0
	for i, id := range ids {
		if seen[id] {
			t.Fatalf("sandbox %s handed out twice", id)
		}
		seen[id] = true
		if warm[i] {
			fromPool++
		}
	}
	if fromPool == 0 {
		t.Error("no create was served by a full pool of 5")
	}
	ps, _ := m.WarmPools(ctx)
	if len(ps) != 1 || ps[0].GetTaken() != int64(fromPool) || ps[0].GetTaken()+ps[0].GetMissed() != n {
		t.Errorf("pool counts %v; want taken %d and taken+missed %d", ps, fromPool, n)
	}
}

// TestClaimRacesStop runs a create that takes the only pooled sandbox and
// a stop of that sandbox at once, many times: its pool letting it go (a
// drop) in even rounds, the edge failing it (its agent died) in odd ones.
// Every outcome is one of: claimed first, the create gets it running and a
// drop leaves it alone, while a failure ends it where its caller sees it
// failed; stopped first, the create starts another (or takes the refill,
// when that was ready first) and the pooled one ends
// unseen. Whatever happened, the runtime and the record store hold exactly
// the sandboxes still alive.
func TestClaimRacesStop(t *testing.T) {
	rt := newFake(t)
	m := newTestManager(t, t.TempDir(), rt)
	ctx := context.Background()
	shape := &dsecv1.SandboxSpec{Environment: "base:1"}
	if _, err := m.SetWarmPool(ctx, shape, 1); err != nil {
		t.Fatal(err)
	}
	outcomes := map[string]int{}
	for round := range 150 {
		m.kickPools()
		waitPool(t, m, rt, 1, 1)
		m.poolMu.Lock()
		var member *sandbox
		for _, p := range m.pools {
			member = p.ready[0]
		}
		m.poolMu.Unlock()
		memberID := member.rec.GetId()
		dropping := round%2 == 0

		start := make(chan struct{})
		var created *dsecv1.Sandbox
		var createErr error
		var wg sync.WaitGroup
		wg.Go(func() {
			<-start
			created, createErr = m.Create(ctx, shape, "")
		})
		wg.Go(func() {
			<-start
			if dropping {
				m.drop(ctx, member, "test")
				return
			}
			if err := m.stopSandbox(ctx, member, dsecv1.State_STATE_FAILED, dsecv1.Reason_REASON_AGENT_LOST, "test"); err != nil {
				t.Error(err)
			}
		})
		close(start)
		wg.Wait()
		if createErr != nil {
			t.Fatalf("round %d: create: %v", round, createErr)
		}
		m.mu.Lock()
		member.mu.Lock()
		got := member.phaseOf()
		member.mu.Unlock()
		m.mu.Unlock()
		// The create took the member (claimed first), or a sandbox of its
		// own: a new one, or, when the stop came first and the refill was
		// ready before the create looked (a loaded machine), the refill.
		claimed := created.GetId() == memberID
		if claimed && !created.GetFromWarmPool() {
			t.Fatalf("round %d: create got the pooled %s but says it was not from the pool", round, memberID)
		}
		var want phase
		switch {
		case claimed && dropping:
			want = running
		case claimed:
			want = failed
		case dropping:
			want = poolStopped
		default:
			want = poolFailed
		}
		if got != want {
			t.Fatalf("round %d: claimed %v, dropping %v: the pooled sandbox is %s, want %s", round, claimed, dropping, got, want)
		}
		outcomes[fmt.Sprintf("claimed %v, dropping %v, from the pool %v", claimed, dropping, created.GetFromWarmPool())]++

		// Nothing leaks: once refills are done, the runtime and the record
		// store hold what is alive, no more.
		alive := 1 // the refilled pool's member
		if created.GetId() != memberID || want == running {
			alive++
		}
		m.kickPools() // the drops end after the take's kick: do not wait for the next tick
		waitPool(t, m, rt, 1, alive)
		var live []string
		m.mu.Lock()
		for id, sb := range m.sandboxes {
			if sb.gone.IsZero() {
				live = append(live, id)
			}
		}
		m.mu.Unlock()
		slices.Sort(live)
		containers := mustList(t, rt)
		slices.Sort(containers)
		records, err := m.states.IDs()
		if err != nil {
			t.Fatal(err)
		}
		slices.Sort(records)
		if !slices.Equal(live, containers) || !slices.Equal(live, records) {
			t.Fatalf("round %d: alive %v, containers %v, records %v", round, live, containers, records)
		}
		if created.GetId() != memberID || want == running {
			if err := m.Delete(ctx, created.GetId()); err != nil {
				t.Fatal(err)
			}
		}
	}
	t.Logf("outcomes: %v", outcomes)
}

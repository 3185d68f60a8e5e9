package sandbox

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"maps"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"connectrpc.com/connect"

	agentv1 "dsec.dev/dsec/api/gen/dsec/agent/v1"
	dsecv1 "dsec.dev/dsec/api/gen/dsec/v1"
	"dsec.dev/dsec/internal/agent/agentclient"
	"dsec.dev/dsec/internal/edge/image"
	"dsec.dev/dsec/internal/edge/runtime"
	"dsec.dev/dsec/internal/errdefs"
	"dsec.dev/dsec/internal/sandboxid"
)

// fakeRuntime keeps containers as a set; a test can make one die. A
// frozen container's agent does not answer. hold, when set, is waited on
// by every Pause and Resume (a test holds a transition midway).
type fakeRuntime struct {
	mu       sync.Mutex
	running  map[string]bool
	frozen   map[string]bool
	failNext error
	hold     chan struct{}
}

func (f *fakeRuntime) Pause(ctx context.Context, id string, reclaim bool) (runtime.PauseStats, error) {
	f.wait()
	f.mu.Lock()
	defer f.mu.Unlock()
	if !f.running[id] {
		return runtime.PauseStats{}, fmt.Errorf("freeze %s: %w", id, errdefs.ErrNotFound)
	}
	if f.frozen == nil {
		f.frozen = map[string]bool{}
	}
	f.frozen[id] = true
	return runtime.PauseStats{Frozen: time.Millisecond, Resident: 100 << 20, Released: 95 << 20}, nil
}

func (f *fakeRuntime) Resume(ctx context.Context, id string, prefetch bool) (runtime.ResumeStats, error) {
	f.wait()
	f.mu.Lock()
	defer f.mu.Unlock()
	delete(f.frozen, id)
	return runtime.ResumeStats{}, nil
}

func (f *fakeRuntime) Frozen(ctx context.Context, id string) (bool, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.frozen[id], nil
}

func (f *fakeRuntime) Freeze(ctx context.Context, id string) error { return nil }
func (f *fakeRuntime) Thaw(ctx context.Context, id string) error   { return nil }
func (f *fakeRuntime) Upper(id string) (string, error)             { return "/upper/" + id, nil }
func (f *fakeRuntime) CaptureDir() string                          { return "/captures" }

func (f *fakeRuntime) wait() {
	f.mu.Lock()
	h := f.hold
	f.mu.Unlock()
	if h != nil {
		<-h
	}
}

func (f *fakeRuntime) Start(ctx context.Context, s runtime.Spec) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	if err := f.failNext; err != nil {
		f.failNext = nil
		return err
	}
	f.running[s.ID] = true
	return nil
}

func (f *fakeRuntime) Status(ctx context.Context, id string) (runtime.Status, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	r, ok := f.running[id]
	if !ok {
		return runtime.Status{}, fmt.Errorf("container %s: %w", id, errdefs.ErrNotFound)
	}
	return runtime.Status{Running: r}, nil
}

func (f *fakeRuntime) Delete(ctx context.Context, id string) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	delete(f.running, id)
	delete(f.frozen, id)
	return nil
}

func (f *fakeRuntime) List(ctx context.Context) ([]string, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	var ids []string
	for id := range f.running {
		ids = append(ids, id)
	}
	return ids, nil
}

func (f *fakeRuntime) kill(id string) {
	f.mu.Lock()
	f.running[id] = false
	f.mu.Unlock()
}

// fakeImages knows one environment, base:1, whose layer a test may change.
type fakeImages struct {
	mu     sync.Mutex
	digest string // "" = sha256:aa
}

func (f *fakeImages) ResolveEnvironment(ctx context.Context, env string) ([]image.Layer, error) {
	if env != "base:1" {
		return nil, fmt.Errorf("environment %q: %w", env, errdefs.ErrNotFound)
	}
	f.mu.Lock()
	defer f.mu.Unlock()
	d := f.digest
	if d == "" {
		d = "sha256:aa"
	}
	return []image.Layer{{Digest: d, Kind: image.KindBase}}, nil
}

func (f *fakeImages) retag(digest string) {
	f.mu.Lock()
	f.digest = digest
	f.mu.Unlock()
}

func (*fakeImages) Release(ctx context.Context, id string) {}

func (*fakeImages) Mount(ctx context.Context, id, digest string) (string, error) {
	return "/layers/" + digest, nil
}
func (*fakeImages) RecordEnvironment(env string, digests []string) error { return nil }

// fakeAgent answers Ping from the runtime's view of its container.
type fakeAgent struct {
	agentclient.Client
	rt      *fakeRuntime
	id      string
	running *int32
}

// Close has no connections to drop.
func (a *fakeAgent) Close() {}

func (a *fakeAgent) Ping(ctx context.Context, req *connect.Request[agentv1.PingRequest]) (*connect.Response[agentv1.PingResponse], error) {
	st, err := a.rt.Status(ctx, a.id)
	if err != nil || !st.Running {
		return nil, connect.NewError(connect.CodeUnavailable, errors.New("connection refused"))
	}
	if frozen, _ := a.rt.Frozen(ctx, a.id); frozen {
		return nil, connect.NewError(connect.CodeDeadlineExceeded, errors.New("frozen agent: no answer"))
	}
	a.rt.mu.Lock()
	n := *a.running
	a.rt.mu.Unlock()
	return connect.NewResponse(&agentv1.PingResponse{RunningProcesses: n}), nil
}

func newTestManager(t *testing.T, dir string, rt *fakeRuntime, busy *int32) *Manager {
	t.Helper()
	return newTestManagerWith(t, dir, rt, busy, &fakeImages{}, nil)
}

// newTestManagerWith makes a Manager on images; edit, if set, changes its
// configuration first.
func newTestManagerWith(t *testing.T, dir string, rt *fakeRuntime, busy *int32, images *fakeImages, edit func(*Config)) *Manager {
	t.Helper()
	dial := func(sock string) agentclient.Client {
		// The socket path is <dir>/<id>/agent.sock.
		id := sock[len(dir)+1 : len(sock)-len("/agent.sock")]
		return &fakeAgent{rt: rt, id: id, running: busy}
	}
	cfg := Config{Node: "n1", StateDir: dir, PingInterval: 100 * time.Millisecond, Defaults: Defaults{TTL: time.Hour}}
	if edit != nil {
		edit(&cfg)
	}
	m, err := New(cfg, rt, images, nil, dial, slog.New(slog.DiscardHandler))
	if err != nil {
		t.Fatal(err)
	}
	if err := m.Recover(context.Background()); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(m.Shutdown)
	return m
}

func waitState(t *testing.T, m *Manager, id string, want dsecv1.State, reason dsecv1.Reason) {
	t.Helper()
	deadline := time.Now().Add(5 * time.Second)
	for time.Now().Before(deadline) {
		sb, err := m.Get(context.Background(), id)
		if err == nil && sb.GetState() == want {
			if sb.GetReason() != reason {
				t.Fatalf("%s is %s for %s, want %s", id, want, sb.GetReason(), reason)
			}
			return
		}
		time.Sleep(20 * time.Millisecond)
	}
	sb, _ := m.Get(context.Background(), id)
	t.Fatalf("%s did not reach %s (%s): %v", id, want, reason, sb)
}

func TestCreateAndLifetimes(t *testing.T) {
	rt := &fakeRuntime{running: map[string]bool{}}
	var busy int32
	m := newTestManager(t, t.TempDir(), rt, &busy)
	ctx := context.Background()

	sb, err := m.Create(ctx, &dsecv1.SandboxSpec{Environment: "base:1", TtlSeconds: 1, IdleTimeoutSeconds: -1}, "")
	if err != nil {
		t.Fatal(err)
	}
	if sb.GetState() != dsecv1.State_STATE_RUNNING || sb.GetSpec().GetMemoryMb() != 0 {
		t.Fatalf("created %v", sb)
	}
	waitState(t, m, sb.GetId(), dsecv1.State_STATE_STOPPED, dsecv1.Reason_REASON_TTL)
	if _, _, err := m.Agent(ctx, sb.GetId()); !errors.Is(err, errdefs.ErrFailedPrecondition) {
		t.Fatalf("agent of a stopped sandbox: %v", err)
	}

	// Idle: reaped only while nothing runs inside.
	rt.mu.Lock()
	busy = 1
	rt.mu.Unlock()
	idle, err := m.Create(ctx, &dsecv1.SandboxSpec{Environment: "base:1", IdleTimeoutSeconds: 1}, "")
	if err != nil {
		t.Fatal(err)
	}
	time.Sleep(2500 * time.Millisecond)
	if got, _ := m.Get(ctx, idle.GetId()); got.GetState() != dsecv1.State_STATE_RUNNING {
		t.Fatalf("reaped as idle while a command runs: %v", got)
	}
	rt.mu.Lock()
	busy = 0
	rt.mu.Unlock()
	waitState(t, m, idle.GetId(), dsecv1.State_STATE_STOPPED, dsecv1.Reason_REASON_IDLE)

	// A container that dies is failed with agent_lost and cleaned up.
	dead, err := m.Create(ctx, &dsecv1.SandboxSpec{Environment: "base:1", IdleTimeoutSeconds: -1}, "")
	if err != nil {
		t.Fatal(err)
	}
	rt.kill(dead.GetId())
	waitState(t, m, dead.GetId(), dsecv1.State_STATE_FAILED, dsecv1.Reason_REASON_AGENT_LOST)
	if _, err := rt.Status(ctx, dead.GetId()); !errors.Is(err, errdefs.ErrNotFound) {
		t.Fatalf("failed sandbox's container still there: %v", err)
	}
}

func TestCreateFailureRollsBack(t *testing.T) {
	rt := &fakeRuntime{running: map[string]bool{}, failNext: errors.New("runc exploded")}
	var busy int32
	dir := t.TempDir()
	m := newTestManager(t, dir, rt, &busy)
	if _, err := m.Create(context.Background(), &dsecv1.SandboxSpec{Environment: "base:1"}, ""); err == nil {
		t.Fatal("create succeeded")
	}
	if sbs, _ := m.List(context.Background(), nil, nil); len(sbs) != 0 {
		t.Fatalf("a failed create is still known: %v", sbs)
	}
	if ids, _ := rt.List(context.Background()); len(ids) != 0 {
		t.Fatalf("a failed create left containers: %v", ids)
	}
	if ids, _ := m.states.IDs(); len(ids) != 0 {
		t.Fatalf("a failed create left records: %v", ids)
	}
	if _, err := m.Create(context.Background(), &dsecv1.SandboxSpec{Environment: "nope:1"}, ""); !errors.Is(err, errdefs.ErrNotFound) {
		t.Fatalf("unknown environment: %v", err)
	}
}

func TestRecoverAdoptsAndReaps(t *testing.T) {
	rt := &fakeRuntime{running: map[string]bool{}}
	var busy int32
	dir := t.TempDir()
	m := newTestManager(t, dir, rt, &busy)
	ctx := context.Background()
	alive, _ := m.Create(ctx, &dsecv1.SandboxSpec{Environment: "base:1"}, "")
	died, _ := m.Create(ctx, &dsecv1.SandboxSpec{Environment: "base:1"}, "")
	m.Shutdown()
	rt.kill(died.GetId())
	orphan := sandboxid.New("n1", 0, 0)
	rt.running[orphan] = true // a container whose create never saved a record

	m2 := newTestManager(t, dir, rt, &busy)
	if got, err := m2.Get(ctx, alive.GetId()); err != nil || got.GetState() != dsecv1.State_STATE_RUNNING {
		t.Fatalf("alive after recover: %v %v", got, err)
	}
	if got, err := m2.Get(ctx, died.GetId()); err != nil || got.GetState() != dsecv1.State_STATE_FAILED {
		t.Fatalf("died after recover: %v %v", got, err)
	}
	if _, err := rt.Status(ctx, orphan); !errors.Is(err, errdefs.ErrNotFound) {
		t.Fatalf("orphan container not removed: %v", err)
	}
	if err := m2.Teardown(ctx); err != nil {
		t.Fatal(err)
	}
	if ids, _ := rt.List(ctx); len(ids) != 0 {
		t.Fatalf("teardown left containers: %v", ids)
	}
}

func TestCreateRefusesOverNodeLimits(t *testing.T) {
	rt := &fakeRuntime{running: map[string]bool{}}
	var busy int32
	m := newTestManagerWith(t, t.TempDir(), rt, &busy, &fakeImages{}, func(c *Config) {
		c.Limits = Limits{MaxCPUs: 2, MaxMemoryMB: 4096, MaxDiskMB: 8192, MaxTTL: time.Hour}
	})
	for _, tc := range []struct {
		name string
		spec *dsecv1.SandboxSpec
		msg  string // "" = admitted
	}{
		{"at every limit", &dsecv1.SandboxSpec{Cpus: 2, MemoryMb: 4096, DiskMb: 8192, TtlSeconds: 3600}, ""},
		{"memory_mb 10^9", &dsecv1.SandboxSpec{MemoryMb: 1_000_000_000},
			"memory_mb 1000000000 is over the node's limit of 4096 (dsecd --max-memory-mb)"},
		{"memory one over", &dsecv1.SandboxSpec{MemoryMb: 4097}, "memory_mb 4097 is over the node's limit of 4096"},
		{"cpus", &dsecv1.SandboxSpec{Cpus: 3}, "cpus 3.00 is over the node's limit of 2.00 (dsecd --max-cpus)"},
		{"disk", &dsecv1.SandboxSpec{DiskMb: 8193}, "disk_mb 8193 is over the node's limit of 8192"},
		{"ttl", &dsecv1.SandboxSpec{TtlSeconds: 3601}, "ttl 3601s is over the node's limit of 1h0m0s"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			tc.spec.Environment = "base:1"
			sb, err := m.Create(context.Background(), tc.spec, "")
			if tc.msg == "" {
				if err != nil {
					t.Fatalf("Create: %v", err)
				}
				if err := m.Delete(context.Background(), sb.GetId()); err != nil {
					t.Fatal(err)
				}
				return
			}
			if !errors.Is(err, errdefs.ErrInvalidArgument) || !strings.Contains(err.Error(), tc.msg) {
				t.Fatalf("Create = %v; want invalid argument containing %q", err, tc.msg)
			}
		})
	}
	if ids, _ := rt.List(context.Background()); len(ids) != 0 {
		t.Errorf("refused creates left containers: %v", ids)
	}
}

// A full node refuses a caller's create and names the flag that raises
// its maximum; warm pool members are not counted against a caller.
func TestCreateRefusedOnFullNode(t *testing.T) {
	rt := &fakeRuntime{running: map[string]bool{}}
	var busy int32
	m := newTestManagerWith(t, t.TempDir(), rt, &busy, &fakeImages{}, func(c *Config) {
		c.Limits.MaxSandboxes = 2
	})
	ctx := context.Background()
	shape := &dsecv1.SandboxSpec{Environment: "base:1", MemoryMb: 64}
	if _, err := m.SetWarmPool(ctx, shape, 1); err != nil {
		t.Fatal(err)
	}
	waitPool(t, m, rt, 1, 1)
	for range 2 {
		if _, err := m.Create(ctx, &dsecv1.SandboxSpec{Environment: "base:1"}, ""); err != nil {
			t.Fatalf("create on a node holding fewer than its maximum: %v", err)
		}
	}
	_, err := m.Create(ctx, &dsecv1.SandboxSpec{Environment: "base:1"}, "")
	const want = "node n1 holds its maximum of 2 sandboxes (dsecd --max-sandboxes raises it)"
	if !errors.Is(err, errdefs.ErrResourceExhausted) || !strings.Contains(err.Error(), want) {
		t.Fatalf("create on a full node: %v; want resource exhausted containing %q", err, want)
	}
	// The pool's member still serves its shape.
	if sb, err := m.Create(ctx, shape, ""); err != nil || !sb.GetFromWarmPool() {
		t.Fatalf("create of the pool's shape on a full node: %v, %v; want the pooled sandbox", sb, err)
	}
}

func TestParseMeminfo(t *testing.T) {
	const meminfo = "MemTotal:       24683872 kB\nMemFree:        22304292 kB\nMemAvailable:   24188140 kB\n"
	for _, tc := range []struct {
		text, key string
		want      int64
		err       error
	}{
		{meminfo, "MemTotal", 24105, nil},
		{meminfo, "MemAvailable", 23621, nil},
		{meminfo, "Mem", 0, errdefs.ErrNotSupported}, // a prefix of a key is not the key
		{"MemTotal: lots kB\n", "MemTotal", 0, strconv.ErrSyntax},
		{"", "MemTotal", 0, errdefs.ErrNotSupported},
	} {
		got, err := parseMeminfo(strings.NewReader(tc.text), tc.key)
		if got != tc.want || !errors.Is(err, tc.err) {
			t.Errorf("parseMeminfo(%q, %s) = %d, %v; want %d, %v", tc.text, tc.key, got, err, tc.want, tc.err)
		}
	}
}

// TestTokensSurviveRecover: a sandbox keeps the create token it was made
// (or taken from a warm pool) for, across a restart of the edge; a stopped
// one answers for its token no more.
func TestTokensSurviveRecover(t *testing.T) {
	rt := &fakeRuntime{running: map[string]bool{}}
	var busy int32
	dir := t.TempDir()
	m := newTestManager(t, dir, rt, &busy)
	ctx := context.Background()
	cold, err := m.Create(ctx, &dsecv1.SandboxSpec{Environment: "base:1", Cpus: 1}, "b1#0@n1")
	if err != nil {
		t.Fatal(err)
	}
	shape := &dsecv1.SandboxSpec{Environment: "base:1"}
	if _, err := m.SetWarmPool(ctx, shape, 1); err != nil {
		t.Fatal(err)
	}
	waitPool(t, m, rt, 1, 2)
	warm, err := m.Create(ctx, shape, "b1#1@n1")
	if err != nil || !warm.GetFromWarmPool() {
		t.Fatalf("take from the pool: %v %v", warm, err)
	}
	plain, err := m.Create(ctx, &dsecv1.SandboxSpec{Environment: "base:1", Cpus: 1}, "")
	if err != nil {
		t.Fatal(err)
	}
	stopped, err := m.Create(ctx, &dsecv1.SandboxSpec{Environment: "base:1", Cpus: 1}, "b2#0@n1")
	if err != nil {
		t.Fatal(err)
	}
	if err := m.Delete(ctx, stopped.GetId()); err != nil {
		t.Fatal(err)
	}
	want := map[string]string{"b1#0@n1": cold.GetId(), "b1#1@n1": warm.GetId()}
	if got := m.Tokens(); !maps.Equal(got, want) {
		t.Fatalf("tokens %v, want %v", got, want)
	}
	m.Shutdown()

	m2 := newTestManager(t, dir, rt, &busy)
	if got := m2.Tokens(); !maps.Equal(got, want) {
		t.Fatalf("tokens after recover %v, want %v", got, want)
	}
	if id, ok := m2.SandboxOf("b1#1@n1"); !ok || id != warm.GetId() {
		t.Fatalf("SandboxOf the warm one's token: %q %v", id, ok)
	}
	for _, tok := range []string{"b2#0@n1", "", "unknown"} {
		if id, ok := m2.SandboxOf(tok); ok {
			t.Errorf("SandboxOf(%q) = %s", tok, id)
		}
	}
	if _, err := m2.Get(ctx, plain.GetId()); err != nil {
		t.Errorf("the sandbox without a token after recover: %v", err)
	}
	if err := m2.Teardown(ctx); err != nil {
		t.Fatal(err)
	}
}

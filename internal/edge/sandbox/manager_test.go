package sandbox

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"maps"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	dsecv1 "dsec.dev/dsec/api/gen/dsec/v1"
	"dsec.dev/dsec/internal/edge/backend"
	"dsec.dev/dsec/internal/edge/backend/fake"
	"dsec.dev/dsec/internal/edge/image"
	"dsec.dev/dsec/internal/errdefs"
	"dsec.dev/dsec/internal/sandboxid"
)

// newFake is a fake runtime (package fake) for one test: sandboxes
// are files, agents in-process Connect handlers answering Ping.
func newFake(t *testing.T, opts ...fake.Option) *fake.Runtime {
	t.Helper()
	rt := fake.New(t.TempDir(), opts...)
	t.Cleanup(rt.Close)
	if err := rt.Init(context.Background()); err != nil {
		t.Fatal(err)
	}
	return rt
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

func (*fakeImages) Mount(ctx context.Context, id, digest string) (backend.Layer, error) {
	return backend.Layer{Digest: digest, File: "/blobs/" + digest, FSType: backend.FSTypeEROFS, Size: 4096, Dir: "/layers/" + digest}, nil
}
func (*fakeImages) RecordEnvironment(env string, digests []string) error { return nil }

func newTestManager(t *testing.T, dir string, rt *fake.Runtime) *Manager {
	t.Helper()
	return newTestManagerWith(t, dir, rt, &fakeImages{}, nil)
}

// newTestManagerWith makes a Manager on images with rt as its container
// backend; edit, if set, changes its configuration first.
func newTestManagerWith(t *testing.T, dir string, rt *fake.Runtime, images *fakeImages, edit func(*Config)) *Manager {
	t.Helper()
	return newTestManagerOf(t, dir, map[Kind]backend.Runtime{ContainerKind: rt}, images, edit)
}

// newTestManagerOf makes a Manager over the given runtimes, one per kind.
func newTestManagerOf(t *testing.T, dir string, runtimes map[Kind]backend.Runtime, images *fakeImages, edit func(*Config)) *Manager {
	t.Helper()
	cfg := Config{Node: "n1", StateDir: dir, PingInterval: 100 * time.Millisecond, Defaults: Defaults{TTL: time.Hour}}
	if edit != nil {
		edit(&cfg)
	}
	m, err := New(cfg, runtimes, images, nil, slog.New(slog.DiscardHandler))
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
	rt := newFake(t)
	m := newTestManager(t, t.TempDir(), rt)
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
	rt.SetRunningProcesses(1)
	idle, err := m.Create(ctx, &dsecv1.SandboxSpec{Environment: "base:1", IdleTimeoutSeconds: 1}, "")
	if err != nil {
		t.Fatal(err)
	}
	time.Sleep(2500 * time.Millisecond)
	if got, _ := m.Get(ctx, idle.GetId()); got.GetState() != dsecv1.State_STATE_RUNNING {
		t.Fatalf("reaped as idle while a command runs: %v", got)
	}
	rt.SetRunningProcesses(0)
	waitState(t, m, idle.GetId(), dsecv1.State_STATE_STOPPED, dsecv1.Reason_REASON_IDLE)

	// A container that dies is failed with agent_lost and cleaned up.
	dead, err := m.Create(ctx, &dsecv1.SandboxSpec{Environment: "base:1", IdleTimeoutSeconds: -1}, "")
	if err != nil {
		t.Fatal(err)
	}
	rt.Kill(dead.GetId(), false)
	waitState(t, m, dead.GetId(), dsecv1.State_STATE_FAILED, dsecv1.Reason_REASON_AGENT_LOST)
	if _, err := rt.Status(ctx, dead.GetId()); !errors.Is(err, errdefs.ErrNotFound) {
		t.Fatalf("failed sandbox's container still there: %v", err)
	}
}

func TestCreateFailureRollsBack(t *testing.T) {
	rt := newFake(t)
	rt.FailNextStart(errors.New("runc exploded"))
	dir := t.TempDir()
	m := newTestManager(t, dir, rt)
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
	rt := newFake(t)
	dir := t.TempDir()
	m := newTestManager(t, dir, rt)
	ctx := context.Background()
	alive, _ := m.Create(ctx, &dsecv1.SandboxSpec{Environment: "base:1"}, "")
	died, _ := m.Create(ctx, &dsecv1.SandboxSpec{Environment: "base:1"}, "")
	m.Shutdown()
	rt.Kill(died.GetId(), false)
	orphan := sandboxid.New("n1", 0, 0)
	// A sandbox whose create never saved a record.
	if _, err := rt.Start(ctx, backend.Spec{ID: orphan, Layers: []backend.Layer{{Digest: "sha256:x", FSType: backend.FSTypeDir, Dir: "/layers/x"}}, LogPath: "/dev/null"}); err != nil {
		t.Fatal(err)
	}

	m2 := newTestManager(t, dir, rt)
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
	rt := newFake(t)
	m := newTestManagerWith(t, t.TempDir(), rt, &fakeImages{}, func(c *Config) {
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
		{"cpus", &dsecv1.SandboxSpec{Cpus: 3}, "cpus 3.00 is over the node's limit of 2.00 (dsecd --max-cpus, limits.max_cpus)"},
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
	rt := newFake(t)
	m := newTestManagerWith(t, t.TempDir(), rt, &fakeImages{}, func(c *Config) {
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
	rt := newFake(t)
	dir := t.TempDir()
	m := newTestManager(t, dir, rt)
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

	m2 := newTestManager(t, dir, rt)
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

// TestGone: Gone names the IDs of ended and unknown sandboxes, not of
// live ones.
func TestGone(t *testing.T) {
	m := newTestManager(t, t.TempDir(), newFake(t))
	ctx := context.Background()
	var ids []string
	for range 2 {
		sb, err := m.Create(ctx, &dsecv1.SandboxSpec{Environment: "base:1", IdleTimeoutSeconds: -1}, "")
		if err != nil {
			t.Fatal(err)
		}
		ids = append(ids, sb.GetId())
	}
	if err := m.Delete(ctx, ids[1]); err != nil {
		t.Fatal(err)
	}
	unknown := "sb-n1-0123456789abcdef"
	if got := m.Gone([]string{ids[0], ids[1], unknown}); !slices.Equal(got, []string{ids[1], unknown}) {
		t.Fatalf("gone %v, want [%s %s]", got, ids[1], unknown)
	}
}

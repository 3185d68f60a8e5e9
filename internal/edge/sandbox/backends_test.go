package sandbox

import (
	"context"
	"errors"
	"slices"
	"strings"
	"testing"

	dsecv1 "dsec.dev/dsec/api/gen/dsec/v1"
	"dsec.dev/dsec/internal/edge/backend"
	"dsec.dev/dsec/internal/edge/backend/fake"
	"dsec.dev/dsec/internal/edge/state"
	"dsec.dev/dsec/internal/errdefs"
)

// TestBackendsRouteAndRefuse: each sandbox runs in its backend's runtime,
// found again from its record after a restart; what a backend cannot do is
// refused naming it, and a backend the node lacks is refused naming the
// node.
func TestBackendsRouteAndRefuse(t *testing.T) {
	ctx := context.Background()
	ctr := newFake(t)
	fn := newFake(t, fake.WithFeatures(backend.Features{}))
	runtimes := map[Kind]backend.Runtime{ContainerKind: ctr, FnCallKind: fn}
	dir := t.TempDir()
	m := newTestManagerOf(t, dir, runtimes, &fakeImages{}, nil)

	if got := m.Status().Backends; !slices.Equal(got, []dsecv1.Backend{dsecv1.Backend_BACKEND_CONTAINER, dsecv1.Backend_BACKEND_FNCALL}) {
		t.Errorf("Status backends %v", got)
	}
	plain, err := m.Create(ctx, &dsecv1.SandboxSpec{Environment: "base:1"}, "")
	if err != nil {
		t.Fatal(err)
	}
	reward, err := m.Create(ctx, &dsecv1.SandboxSpec{Environment: "base:1", Backend: dsecv1.Backend_BACKEND_FNCALL, User: "u1", Env: map[string]string{"A": "1"}}, "")
	if err != nil {
		t.Fatal(err)
	}
	if plain.GetSpec().GetBackend() != dsecv1.Backend_BACKEND_CONTAINER || reward.GetSpec().GetBackend() != dsecv1.Backend_BACKEND_FNCALL {
		t.Errorf("recorded backends %s, %s", plain.GetSpec().GetBackend(), reward.GetSpec().GetBackend())
	}
	inRuntime := func(rt *fake.Runtime, id string) bool { return slices.Contains(mustList(t, rt), id) }
	if !inRuntime(ctr, plain.GetId()) || inRuntime(fn, plain.GetId()) || !inRuntime(fn, reward.GetId()) || inRuntime(ctr, reward.GetId()) {
		t.Fatalf("container runtime holds %v, fncall %v", mustList(t, ctr), mustList(t, fn))
	}
	// The runtime got the agent's configuration, typed.
	if s, err := fn.Spec(reward.GetId()); err != nil || s.Agent.User != "u1" || s.Agent.Env["A"] != "1" || len(s.Layers) != 1 || s.Layers[0].Dir != "/layers/sha256:aa" || s.Layers[0].File != "/blobs/sha256:aa" {
		t.Errorf("fncall spec %+v, %v", s, err)
	}

	// What the fncall fake cannot do.
	const cannotPause = "backend container/fncall of node n1 cannot pause"
	if _, _, err := m.Pause(ctx, reward.GetId(), false); !errors.Is(err, errdefs.ErrNotSupported) || !strings.Contains(err.Error(), cannotPause) {
		t.Errorf("pause of a fncall sandbox: %v, want not supported saying %q", err, cannotPause)
	}
	if _, _, _, err := m.Resume(ctx, reward.GetId(), false); !errors.Is(err, errdefs.ErrNotSupported) {
		t.Errorf("resume of a fncall sandbox: %v, want not supported", err)
	}
	for _, spec := range []*dsecv1.SandboxSpec{
		{Environment: "base:1", Backend: dsecv1.Backend_BACKEND_FNCALL, OnTimeout: dsecv1.OnTimeout_ON_TIMEOUT_PAUSE},
	} {
		if _, err := m.Create(ctx, spec, ""); !errors.Is(err, errdefs.ErrNotSupported) || !strings.Contains(err.Error(), cannotPause) {
			t.Errorf("create %v: %v, want not supported saying %q", spec, err, cannotPause)
		}
	}
	if _, _, err := m.Pause(ctx, plain.GetId(), false); err != nil {
		t.Errorf("pause of a container sandbox: %v", err)
	}

	// A restarted edge finds each sandbox's runtime from its record.
	m.Shutdown()
	m2 := newTestManagerOf(t, dir, runtimes, &fakeImages{}, nil)
	for _, id := range []string{plain.GetId(), reward.GetId()} {
		if got, err := m2.Get(ctx, id); err != nil || (got.GetState() != dsecv1.State_STATE_RUNNING && got.GetState() != dsecv1.State_STATE_PAUSED) {
			t.Fatalf("%s after a restart: %v, %v", id, got, err)
		}
	}
	if _, release, err := m2.Agent(ctx, reward.GetId()); err != nil {
		t.Errorf("agent of the re-adopted fncall sandbox: %v", err)
	} else {
		release()
	}
	if err := m2.Delete(ctx, reward.GetId()); err != nil {
		t.Fatal(err)
	}
	if inRuntime(fn, reward.GetId()) {
		t.Errorf("fncall sandbox still in its runtime after Delete")
	}
	m2.Shutdown()

	// A node without the fncall backend refuses its creates, and fails the
	// sandboxes a restart finds of it.
	left, err := newTestManagerOf(t, dir, runtimes, &fakeImages{}, nil).Create(ctx,
		&dsecv1.SandboxSpec{Environment: "base:1", Backend: dsecv1.Backend_BACKEND_FNCALL}, "")
	if err != nil {
		t.Fatal(err)
	}
	only := newTestManagerOf(t, dir, map[Kind]backend.Runtime{ContainerKind: ctr}, &fakeImages{}, nil)
	const lacks = "profile fncall is not available under isolation container on node n1 (it offers container)"
	if _, err := only.Create(ctx, &dsecv1.SandboxSpec{Environment: "base:1", Backend: dsecv1.Backend_BACKEND_FNCALL}, ""); !errors.Is(err, errdefs.ErrNotSupported) || !strings.Contains(err.Error(), lacks) {
		t.Errorf("create on a node without fncall: %v, want not supported saying %q", err, lacks)
	}
	if got, err := only.Get(ctx, left.GetId()); err != nil || got.GetState() != dsecv1.State_STATE_FAILED || !strings.Contains(got.GetMessage(), lacks) {
		t.Errorf("fncall sandbox on a node restarted without fncall: %v, %v", got, err)
	}
	if got, err := only.Get(ctx, plain.GetId()); err != nil || got.GetState() != dsecv1.State_STATE_PAUSED {
		t.Errorf("container sandbox after that restart: %v, %v", got, err)
	}
}

// TestKindOf: a spec's isolation and backend name its kind, unset ones read
// as container and the sandbox profile (records from before either).
func TestKindOf(t *testing.T) {
	for _, tc := range []struct {
		spec *dsecv1.SandboxSpec
		want Kind
		name string
	}{
		{&dsecv1.SandboxSpec{}, ContainerKind, "container"},
		{nil, ContainerKind, "container"},
		{&dsecv1.SandboxSpec{Backend: dsecv1.Backend_BACKEND_FNCALL}, FnCallKind, "container/fncall"},
		{&dsecv1.SandboxSpec{Isolation: dsecv1.Isolation_ISOLATION_GVISOR}, GVisorKind, "gvisor"},
		{&dsecv1.SandboxSpec{Isolation: dsecv1.Isolation_ISOLATION_MICROVM, Backend: dsecv1.Backend_BACKEND_CONTAINER}, MicroVMKind, "microvm"},
		{&dsecv1.SandboxSpec{Isolation: dsecv1.Isolation_ISOLATION_GVISOR, Backend: dsecv1.Backend_BACKEND_FNCALL},
			Kind{dsecv1.Isolation_ISOLATION_GVISOR, dsecv1.Backend_BACKEND_FNCALL}, "gvisor/fncall"},
	} {
		if got := KindOf(tc.spec); got != tc.want || got.String() != tc.name {
			t.Errorf("KindOf(%v) = %v (%s), want %v (%s)", tc.spec, got, got, tc.want, tc.name)
		}
	}
}

// TestIsolations: one node with container and gvisor runtimes side by side
// routes each create to its isolation's runtime, records the isolation,
// keeps warm pools apart by it, reports its kinds with their accelerator,
// and refuses an isolation it lacks naming what it offers and what to
// install, leaving nothing behind.
func TestIsolations(t *testing.T) {
	ctx := context.Background()
	ctr := newFake(t)
	gv := newFake(t, fake.WithFeatures(backend.Features{Pause: true, Snapshot: true, Network: true, Accelerator: "systrap"}))
	fn := newFake(t, fake.WithFeatures(backend.Features{}))
	const noQEMU = "no QEMU: apt-get install qemu-system-x86"
	m := newTestManagerOf(t, t.TempDir(), map[Kind]backend.Runtime{ContainerKind: ctr, FnCallKind: fn, GVisorKind: gv}, &fakeImages{},
		func(c *Config) {
			c.Missing = map[dsecv1.Isolation]string{dsecv1.Isolation_ISOLATION_MICROVM: noQEMU, dsecv1.Isolation_ISOLATION_GVISOR: "unused"}
		})

	st := m.Status()
	var kinds []string
	for _, k := range st.Kinds {
		kinds = append(kinds, Kind{k.GetIsolation(), k.GetProfile()}.String()+"@"+k.GetAccelerator())
	}
	if want := []string{"container@", "container/fncall@", "gvisor@systrap"}; !slices.Equal(kinds, want) {
		t.Errorf("status kinds %v, want %v", kinds, want)
	}
	if len(st.Missing) != 1 || st.Missing["microvm"] != noQEMU {
		t.Errorf("status missing %v, want only microvm's", st.Missing)
	}

	plain, err := m.Create(ctx, &dsecv1.SandboxSpec{Environment: "base:1"}, "")
	if err != nil {
		t.Fatal(err)
	}
	sandboxed, err := m.Create(ctx, &dsecv1.SandboxSpec{Environment: "base:1", Isolation: dsecv1.Isolation_ISOLATION_GVISOR}, "")
	if err != nil {
		t.Fatal(err)
	}
	if plain.GetSpec().GetIsolation() != dsecv1.Isolation_ISOLATION_CONTAINER || sandboxed.GetSpec().GetIsolation() != dsecv1.Isolation_ISOLATION_GVISOR {
		t.Errorf("recorded isolations %s, %s", plain.GetSpec().GetIsolation(), sandboxed.GetSpec().GetIsolation())
	}
	if got := mustList(t, gv); !slices.Equal(got, []string{sandboxed.GetId()}) {
		t.Errorf("gvisor runtime holds %v, want only %s", got, sandboxed.GetId())
	}
	if got := mustList(t, ctr); !slices.Equal(got, []string{plain.GetId()}) {
		t.Errorf("container runtime holds %v, want only %s", got, plain.GetId())
	}

	// An isolation the node lacks: refused, with what it offers and what
	// to install, and nothing made.
	const lacks = "isolation microvm is not available on node n1 (it offers container, container/fncall, gvisor): " + noQEMU
	before, _ := m.List(ctx, nil, nil)
	if _, err := m.Create(ctx, &dsecv1.SandboxSpec{Environment: "base:1", Isolation: dsecv1.Isolation_ISOLATION_MICROVM}, ""); !errors.Is(err, errdefs.ErrNotSupported) || !strings.Contains(err.Error(), lacks) {
		t.Errorf("microvm create: %v, want not supported saying %q", err, lacks)
	}
	if _, err := m.SetWarmPool(ctx, &dsecv1.SandboxSpec{Environment: "base:1", Isolation: dsecv1.Isolation_ISOLATION_MICROVM}, 1); !errors.Is(err, errdefs.ErrNotSupported) {
		t.Errorf("microvm warm pool: %v, want not supported", err)
	}
	after, _ := m.List(ctx, nil, nil)
	if len(after) != len(before) || len(mustList(t, ctr))+len(mustList(t, gv))+len(mustList(t, fn)) != 2 {
		t.Errorf("a refused create left sandboxes: %d listed before, %d after", len(before), len(after))
	}
	// A profile the isolation does not offer says so.
	const noProfile = "profile fncall is not available under isolation gvisor on node n1"
	if _, err := m.Create(ctx, &dsecv1.SandboxSpec{Environment: "base:1", Isolation: dsecv1.Isolation_ISOLATION_GVISOR, Backend: dsecv1.Backend_BACKEND_FNCALL}, ""); !errors.Is(err, errdefs.ErrNotSupported) || !strings.Contains(err.Error(), noProfile) {
		t.Errorf("gvisor fncall create: %v, want not supported saying %q", err, noProfile)
	}

	// Warm pools of the two isolations are two pools, each filled by its
	// runtime, and a create takes from its isolation's.
	shape := &dsecv1.SandboxSpec{Environment: "base:1", MemoryMb: 64}
	gshape := &dsecv1.SandboxSpec{Environment: "base:1", MemoryMb: 64, Isolation: dsecv1.Isolation_ISOLATION_GVISOR}
	p1, err := m.SetWarmPool(ctx, shape, 1)
	if err != nil {
		t.Fatal(err)
	}
	p2, err := m.SetWarmPool(ctx, gshape, 1)
	if err != nil {
		t.Fatal(err)
	}
	if p1.GetKey() == p2.GetKey() {
		t.Fatalf("container and gvisor pools share key %s", p1.GetKey())
	}
	waitPools(t, m, gv, "both pools ready", func(ids []string, ps []*dsecv1.WarmPool) bool {
		return len(ps) == 2 && ps[0].GetReady() == 1 && ps[1].GetReady() == 1 && len(ids) == 2
	})
	if n := len(mustList(t, ctr)); n != 2 {
		t.Errorf("container runtime holds %d sandboxes, want its sandbox and its pool's", n)
	}
	taken, err := m.Create(ctx, gshape, "")
	if err != nil {
		t.Fatal(err)
	}
	if !taken.GetFromWarmPool() || !slices.Contains(mustList(t, gv), taken.GetId()) {
		t.Errorf("gvisor create from its pool: from pool %v, in gvisor runtime %v", taken.GetFromWarmPool(), slices.Contains(mustList(t, gv), taken.GetId()))
	}
}

// TestRecordWithoutIsolation: a record written before isolations (no
// isolation, no backend) is a container's: a restarted edge re-adopts it
// through the container runtime, beside a gvisor one, and deletes it there.
func TestRecordWithoutIsolation(t *testing.T) {
	ctx := context.Background()
	ctr, gv := newFake(t), newFake(t)
	runtimes := map[Kind]backend.Runtime{ContainerKind: ctr, GVisorKind: gv}
	dir := t.TempDir()
	m := newTestManagerOf(t, dir, runtimes, &fakeImages{}, nil)
	sb, err := m.Create(ctx, &dsecv1.SandboxSpec{Environment: "base:1"}, "")
	if err != nil {
		t.Fatal(err)
	}
	m.Shutdown()
	st, err := state.New(dir)
	if err != nil {
		t.Fatal(err)
	}
	rec, err := st.Load(sb.GetId())
	if err != nil {
		t.Fatal(err)
	}
	rec.Spec.Isolation, rec.Spec.Backend = dsecv1.Isolation_ISOLATION_UNSPECIFIED, dsecv1.Backend_BACKEND_UNSPECIFIED
	if err := st.Save(rec); err != nil {
		t.Fatal(err)
	}

	m2 := newTestManagerOf(t, dir, runtimes, &fakeImages{}, nil)
	if got, err := m2.Get(ctx, sb.GetId()); err != nil || got.GetState() != dsecv1.State_STATE_RUNNING {
		t.Fatalf("old record after a restart: %v, %v", got, err)
	}
	if err := m2.Delete(ctx, sb.GetId()); err != nil {
		t.Fatal(err)
	}
	if ids := mustList(t, ctr); len(ids) != 0 {
		t.Errorf("container runtime still holds %v after the delete", ids)
	}
}

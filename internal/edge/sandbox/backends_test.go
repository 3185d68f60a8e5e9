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
	runtimes := map[dsecv1.Backend]backend.Runtime{dsecv1.Backend_BACKEND_CONTAINER: ctr, dsecv1.Backend_BACKEND_FNCALL: fn}
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
	const cannotPause = "backend fncall of node n1 cannot pause"
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
	only := newTestManagerOf(t, dir, map[dsecv1.Backend]backend.Runtime{dsecv1.Backend_BACKEND_CONTAINER: ctr}, &fakeImages{}, nil)
	const lacks = "backend fncall is not available on node n1 (it has container)"
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

package root

import (
	"context"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"connectrpc.com/connect"

	dsecv1 "dsec.dev/dsec/api/gen/dsec/v1"
	"dsec.dev/dsec/internal/edge/backend/cgroups"
	"dsec.dev/dsec/internal/qos"
)

// TestQoS: a best_effort sandbox's cpu cgroup is idle (SCHED_IDLE), a
// latency one's (the default) is not; a warm pool's class is part of its
// shape (a best_effort create takes its member, idle; a latency create does
// not); an unknown class is InvalidArgument.
func TestQoS(t *testing.T) {
	d := startDaemon(t)
	ctx := context.Background()
	layout, err := cgroups.Detect()
	if err != nil {
		t.Fatal(err)
	}
	idle := func(id string) bool {
		t.Helper()
		v, err := qos.Idle(layout.Dir("cpu", filepath.Join(d.HostNames().CgroupParent, id)))
		if err != nil {
			t.Fatal(err)
		}
		return v
	}

	lat := create(t, d, nil)
	be := create(t, d, &dsecv1.SandboxSpec{Qos: "best_effort"})
	if got := lat.GetSpec().GetQos(); got != "latency" {
		t.Errorf("default create recorded qos %q, want latency", got)
	}
	if idle(lat.GetId()) {
		t.Error("latency sandbox's cpu cgroup is idle")
	}
	if !idle(be.GetId()) {
		t.Error("best_effort sandbox's cpu cgroup is not idle")
	}
	if got := mustSh(t, d, be.GetId(), "echo ok"); got == "" {
		t.Error("best_effort sandbox runs no command")
	}
	// dsec ls shows each sandbox's class, found by its header.
	out, _, code := d.CLI("", "ls")
	lines := strings.Split(out, "\n")
	col := slices.Index(strings.Fields(lines[0]), "QOS")
	if code != 0 || col < 0 {
		t.Fatalf("dsec ls exited %d without a QOS column:\n%s", code, out)
	}
	seen := 0
	for _, line := range lines[1:] {
		f := strings.Fields(line)
		if len(f) <= col {
			continue
		}
		if f[0] == lat.GetId() && f[col] != "latency" || f[0] == be.GetId() && f[col] != "best_effort" {
			t.Errorf("dsec ls shows %q", line)
		}
		if f[0] == lat.GetId() || f[0] == be.GetId() {
			seen++
		}
	}
	if seen != 2 {
		t.Errorf("dsec ls lists %d of the two sandboxes:\n%s", seen, out)
	}

	_, err = d.Clients.Sandboxes.Create(ctx, connect.NewRequest(&dsecv1.CreateRequest{Spec: &dsecv1.SandboxSpec{Environment: env, Qos: "idle"}}))
	if connect.CodeOf(err) != connect.CodeInvalidArgument {
		t.Errorf("create with qos idle: %v, want InvalidArgument", err)
	}
	_, err = d.Clients.Sandboxes.SetWarmPool(ctx, connect.NewRequest(&dsecv1.SetWarmPoolRequest{Spec: &dsecv1.SandboxSpec{Environment: env, Qos: "Latency"}, Size: 1}))
	if connect.CodeOf(err) != connect.CodeInvalidArgument {
		t.Errorf("warm pool with qos Latency: %v, want InvalidArgument", err)
	}

	shape := &dsecv1.SandboxSpec{Environment: env, MemoryMb: 96, Qos: "best_effort"}
	if _, err := d.Clients.Sandboxes.SetWarmPool(ctx, connect.NewRequest(&dsecv1.SetWarmPoolRequest{Spec: shape, Size: 1})); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		d.Clients.Sandboxes.SetWarmPool(context.Background(), connect.NewRequest(&dsecv1.SetWarmPoolRequest{Spec: shape, Size: 0}))
	})
	waitWarm(t, d, 1)
	other := create(t, d, &dsecv1.SandboxSpec{MemoryMb: 96})
	if other.GetFromWarmPool() {
		t.Error("a latency create took the best_effort pool's member")
	}
	pooled := create(t, d, &dsecv1.SandboxSpec{MemoryMb: 96, Qos: "best_effort"})
	if !pooled.GetFromWarmPool() {
		t.Error("a best_effort create did not take the best_effort pool's member")
	}
	if !idle(pooled.GetId()) {
		t.Error("the best_effort pool's member is not idle")
	}
	if idle(other.GetId()) {
		t.Error("a latency create beside the pool is idle")
	}
}

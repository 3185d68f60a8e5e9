package apiserver

import (
	"context"
	"strings"
	"testing"
	"time"

	"connectrpc.com/connect"

	edgev1 "dsec.dev/dsec/api/gen/dsec/edge/v1"
	dsecv1 "dsec.dev/dsec/api/gen/dsec/v1"
	"dsec.dev/dsec/api/gen/dsec/v1/dsecv1connect"
)

// TestPlacementByIsolation: in a cluster with one gvisor node, gvisor
// creates and warm pools go there and container ones anywhere; an
// isolation no node offers is refused naming what the nodes lack for it;
// GetServerInfo lists each node's kinds.
func TestPlacementByIsolation(t *testing.T) {
	plain, gv := newFakeEdge("n1"), newFakeEdge("n2")
	nodes := nodesOf(plain, gv)
	kind := func(i dsecv1.Isolation, accel string) *dsecv1.SandboxKind {
		return &dsecv1.SandboxKind{Isolation: i, Profile: dsecv1.Backend_BACKEND_CONTAINER, Accelerator: accel}
	}
	const noRunsc = "no runsc: build it with scripts/build-runsc.sh"
	const noQEMU = "no QEMU (apt-get install qemu-system-x86)"
	nodes[0].Status = &edgev1.NodeStatus{Node: "n1", MaxSandboxes: 100,
		Backends: []dsecv1.Backend{dsecv1.Backend_BACKEND_CONTAINER},
		Kinds:    []*dsecv1.SandboxKind{kind(dsecv1.Isolation_ISOLATION_CONTAINER, "")},
		Missing:  map[string]string{"gvisor": noRunsc, "microvm": noQEMU}}
	nodes[1].Status = &edgev1.NodeStatus{Node: "n2", MaxSandboxes: 100,
		Backends: []dsecv1.Backend{dsecv1.Backend_BACKEND_CONTAINER},
		Kinds:    []*dsecv1.SandboxKind{kind(dsecv1.Isolation_ISOLATION_CONTAINER, ""), kind(dsecv1.Isolation_ISOLATION_GVISOR, "systrap")},
		Missing:  map[string]string{"microvm": noQEMU}}
	for i := range nodes {
		nodes[i].LastSeen = time.Now()
	}
	_, _, hs := startRig(t, false, false, Config{CreateConcurrency: 4}, nodes)
	c := dsecv1connect.NewSandboxServiceClient(hs.Client(), hs.URL)
	ctx := context.Background()

	// Containers go to both nodes (a batch of 8 is spread over 2).
	resp, err := c.Create(ctx, connect.NewRequest(&dsecv1.CreateRequest{Spec: &dsecv1.SandboxSpec{Environment: "base:1"}, Count: 8}))
	if err != nil {
		t.Fatal(err)
	}
	on := map[string]int{}
	for _, sb := range resp.Msg.GetSandboxes() {
		on[sb.GetNode()]++
	}
	if on["n1"] == 0 || on["n2"] == 0 {
		t.Errorf("8 containers went to %v, want both nodes", on)
	}

	resp, err = c.Create(ctx, connect.NewRequest(&dsecv1.CreateRequest{
		Spec: &dsecv1.SandboxSpec{Environment: "base:1", Isolation: dsecv1.Isolation_ISOLATION_GVISOR}, Count: 6}))
	if err != nil {
		t.Fatal(err)
	}
	for _, sb := range resp.Msg.GetSandboxes() {
		if sb.GetNode() != "n2" || sb.GetSpec().GetIsolation() != dsecv1.Isolation_ISOLATION_GVISOR {
			t.Errorf("gvisor sandbox %s on %s with isolation %s, want n2's gvisor", sb.GetId(), sb.GetNode(), sb.GetSpec().GetIsolation())
		}
	}
	// No node offers microvm: refused, with what each lacks.
	_, err = c.Create(ctx, connect.NewRequest(&dsecv1.CreateRequest{
		Spec: &dsecv1.SandboxSpec{Environment: "base:1", Isolation: dsecv1.Isolation_ISOLATION_MICROVM}}))
	for _, want := range []string{"no healthy node offers microvm sandboxes (2 healthy nodes offer container, gvisor)", "node n1: " + noQEMU, "node n2: " + noQEMU} {
		if connect.CodeOf(err) != connect.CodeFailedPrecondition || !strings.Contains(err.Error(), want) {
			t.Errorf("microvm create: %v, want FailedPrecondition saying %q", err, want)
		}
	}
	if n := plain.running() + gv.running(); n != 14 {
		t.Errorf("%d sandboxes run, want the 14 made", n)
	}

	_, err = c.Create(ctx, connect.NewRequest(&dsecv1.CreateRequest{
		Spec: &dsecv1.SandboxSpec{Environment: "base:1", Isolation: dsecv1.Isolation(9)}}))
	if connect.CodeOf(err) != connect.CodeInvalidArgument {
		t.Errorf("create of isolation 9: %v, want InvalidArgument", err)
	}

	// A gvisor warm pool is set on n2 only; a microvm one nowhere.
	if _, err := c.SetWarmPool(ctx, connect.NewRequest(&dsecv1.SetWarmPoolRequest{
		Spec: &dsecv1.SandboxSpec{Environment: "base:1", Isolation: dsecv1.Isolation_ISOLATION_GVISOR}, Size: 2})); err != nil {
		t.Fatal(err)
	}
	if p1, _ := plain.WarmPools(ctx); len(p1) != 0 {
		t.Errorf("n1 got pools %v, want none", p1)
	}
	if p2, _ := gv.WarmPools(ctx); len(p2) != 1 {
		t.Errorf("n2 got pools %v, want the gvisor one", p2)
	}
	_, err = c.SetWarmPool(ctx, connect.NewRequest(&dsecv1.SetWarmPoolRequest{
		Spec: &dsecv1.SandboxSpec{Environment: "base:1", Isolation: dsecv1.Isolation_ISOLATION_MICROVM}, Size: 1}))
	if connect.CodeOf(err) != connect.CodeFailedPrecondition || !strings.Contains(err.Error(), "no healthy node offers isolation microvm") {
		t.Errorf("microvm warm pool: %v, want FailedPrecondition", err)
	}

	info, err := c.GetServerInfo(ctx, connect.NewRequest(&dsecv1.GetServerInfoRequest{}))
	if err != nil {
		t.Fatal(err)
	}
	ns := info.Msg.GetNodes()
	if len(ns) != 2 || ns[0].GetName() != "n1" || len(ns[0].GetKinds()) != 1 || ns[0].GetMissing()["gvisor"] != noRunsc ||
		len(ns[1].GetKinds()) != 2 || ns[1].GetKinds()[1].GetAccelerator() != "systrap" {
		t.Errorf("server info nodes %v", ns)
	}
}

package edgetest

import (
	"encoding/json"
	"testing"
	"time"

	"connectrpc.com/connect"

	edgev1 "dsec.dev/dsec/api/gen/dsec/edge/v1"
	"dsec.dev/dsec/internal/errdefs"
	"dsec.dev/dsec/internal/grade"
	"dsec.dev/dsec/sdk/go/receipt"
)

// testReceipt checks SignReceipt: an edge without a key refuses it
// (NotSupported); one with a key signs a receipt of what it saw (a clean
// room it made, its layers, a command it ran, its exit and the reward its
// reward file gives), which verifies
// against Options.ReceiptCA and names the node, and refuses one naming a
// fact it did not see (FailedPrecondition) or a sandbox it never made
// (NotFound). An edge that runs nothing in its sandboxes sees no grader
// run, so it signs nothing.
func testReceipt(t *testing.T, e *edge) {
	ctx := t.Context()
	spec := e.spec()
	spec.Labels[grade.GradeOfLabel] = "sb-graded"
	resp, err := e.h.Create(ctx, connect.NewRequest(&edgev1.CreateRequest{Spec: spec}))
	if err != nil {
		t.Fatalf("Create the clean room: %v", err)
	}
	room := resp.Msg
	now := time.Now().UTC().Truncate(time.Second)
	r := receipt.Receipt{
		Sandbox: "sb-graded", GradeSandbox: room.GetId(),
		Image: room.GetSpec().GetEnvironment(), Layers: room.GetLayerDigests(),
		GraderCommand: []string{"sh", "-c", "exit 3"}, Exit: 3, Outcome: "task",
		Started: now, Finished: now,
	}
	if len(r.Layers) > 0 {
		r.Workspace = r.Layers[len(r.Layers)-1]
	}
	sign := func(r receipt.Receipt) ([]byte, error) {
		payload, err := json.Marshal(r)
		if err != nil {
			t.Fatal(err)
		}
		resp, err := e.h.SignReceipt(ctx, connect.NewRequest(&edgev1.SignReceiptRequest{Receipt: payload}))
		if err != nil {
			return nil, err
		}
		return resp.Msg.GetEnvelope(), nil
	}
	if e.o.ReceiptCA == "" {
		_, err := sign(r)
		wantKind(t, "SignReceipt on an edge without a receipt key", err, errdefs.ErrNotSupported)
		return
	}
	if e.o.Deviations.NoAgent {
		_, err := sign(r)
		wantKind(t, "SignReceipt of a grader an edge without sandboxes' agents never ran", err, errdefs.ErrFailedPrecondition)
		return
	}

	_, err = sign(r)
	wantKind(t, "SignReceipt before the grader ran", err, errdefs.ErrFailedPrecondition)
	if _, err := e.exec(ctx, room.GetId(), "exit 3"); err != nil {
		t.Fatalf("exec the grader: %v", err)
	}
	env, err := sign(r)
	if err != nil {
		t.Fatalf("SignReceipt of what the edge saw: %v", err)
	}
	v, err := receipt.NewVerifierFile(e.o.ReceiptCA)
	if err != nil {
		t.Fatal(err)
	}
	got, err := v.Verify(env)
	if err != nil {
		t.Fatalf("verify the signed receipt: %v", err)
	}
	if got.Node != e.node || got.GradeSandbox != room.GetId() || got.Exit != 3 {
		t.Errorf("the signed receipt names node %q, clean room %q, exit %d; want %q, %q, 3", got.Node, got.GradeSandbox, got.Exit, e.node, room.GetId())
	}

	for _, c := range []struct {
		name string
		edit func(r *receipt.Receipt)
	}{
		{"another exit", func(r *receipt.Receipt) { r.Exit = 0; r.Reward = 1 }},
		{"a reward its exit rules out", func(r *receipt.Receipt) { r.Reward = 1 }},
		{"a command it never ran", func(r *receipt.Receipt) { r.GraderCommand = []string{"sh", "-c", "exit 0"} }},
		{"a fault it never saw", func(r *receipt.Receipt) { r.Outcome, r.Fault = "fault", "node_lost" }},
		{"other layers", func(r *receipt.Receipt) { r.Layers = append(r.Layers, "sha256:"+fake64) }},
		{"a capture not among its layers", func(r *receipt.Receipt) { r.Workspace = "sha256:" + fake64 }},
		{"another graded sandbox", func(r *receipt.Receipt) { r.Sandbox = "sb-other" }},
		{"another environment", func(r *receipt.Receipt) { r.Image = "other:env" }},
	} {
		edited := r
		edited.Layers = append([]string(nil), r.Layers...)
		c.edit(&edited)
		_, err := sign(edited)
		wantKind(t, "SignReceipt of "+c.name, err, errdefs.ErrFailedPrecondition)
	}
	// The reward: the edge reads the reward file as the grader left it.
	wrote := "mkdir -p " + grade.RewardDir + " && echo 0.5 > " + grade.RewardFile
	if _, err := e.exec(ctx, room.GetId(), wrote); err != nil {
		t.Fatalf("exec a grader that writes its reward: %v", err)
	}
	rewarded := r
	rewarded.GraderCommand, rewarded.Exit, rewarded.Reward = []string{"sh", "-c", wrote}, 0, 0.5
	if _, err := sign(rewarded); err != nil {
		t.Errorf("SignReceipt of the reward the grader wrote: %v", err)
	}
	rewarded.Reward = 1
	_, err = sign(rewarded)
	wantKind(t, "SignReceipt of a reward the grader did not write", err, errdefs.ErrFailedPrecondition)

	missing := r
	missing.GradeSandbox = "sb-never-made"
	_, err = sign(missing)
	if err == nil {
		t.Error("SignReceipt of a clean room the edge never made: signed")
	}
	_, err = e.h.SignReceipt(ctx, connect.NewRequest(&edgev1.SignReceiptRequest{Receipt: []byte(`{"sandbox":"x","grade_sandbox":"y","surprise":1}`)}))
	wantKind(t, "SignReceipt of a receipt with an unknown field", err, errdefs.ErrInvalidArgument)

	// Once the clean room is deleted, the edge vouches for nothing in it.
	if err := e.delete(ctx, room.GetId()); err != nil {
		t.Fatal(err)
	}
	if _, err := sign(r); err == nil {
		t.Error("SignReceipt of a deleted clean room: signed")
	}
}

const fake64 = "0000000000000000000000000000000000000000000000000000000000000000"

package edgesvc_test

import (
	"context"
	"errors"
	"fmt"
	"testing"

	"connectrpc.com/connect"

	edgev1 "dsec.dev/dsec/api/gen/dsec/edge/v1"
	dsecv1 "dsec.dev/dsec/api/gen/dsec/v1"
	"dsec.dev/dsec/internal/edge/hollow"
	"dsec.dev/dsec/internal/errdefs"
)

func createMany(svc interface {
	CreateMany(context.Context, *connect.Request[edgev1.CreateManyRequest]) (*connect.Response[edgev1.CreateManyResponse], error)
}, tokens ...string) ([]*edgev1.CreateResult, error) {
	resp, err := svc.CreateMany(context.Background(), connect.NewRequest(&edgev1.CreateManyRequest{
		Spec: &dsecv1.SandboxSpec{Environment: "base:1"}, CreateTokens: tokens}))
	if err != nil {
		return nil, err
	}
	return resp.Msg.GetResults(), nil
}

// TestCreateMany: one call makes a sandbox per token, each answered on its
// own: a token already used returns its sandbox, a reaped one its refusal,
// and once the node is full the rest are refused with ResourceExhausted,
// which the apiserver places elsewhere.
func TestCreateMany(t *testing.T) {
	svc := newService(hollow.Config{MaxSandboxes: 4})
	first := mustCreate(t, svc, "b#0@h1")
	reap(t, svc, &edgev1.ReapRequest{Tokens: []string{"b#9@h1"}})
	tokens := []string{"b#0@h1", "b#1@h1", "b#2@h1", "b#9@h1", "b#3@h1", "b#4@h1", "b#5@h1"}
	results, err := createMany(svc, tokens...)
	if err != nil {
		t.Fatal(err)
	}
	if len(results) != len(tokens) {
		t.Fatalf("%d results for %d tokens", len(results), len(tokens))
	}
	if got := results[0].GetSandbox().GetId(); got != first {
		t.Errorf("token b#0 made %s before, now %q", first, got)
	}
	if c := connect.Code(results[3].GetErrorCode()); c != connect.CodeFailedPrecondition || results[3].GetSandbox() != nil {
		t.Errorf("the reaped token: code %v, sandbox %v; want FailedPrecondition and none", c, results[3].GetSandbox())
	}
	made, refused := map[string]bool{first: true}, 0
	for i, r := range results {
		if i == 0 || i == 3 {
			continue
		}
		switch {
		case r.GetSandbox() != nil && r.GetErrorCode() == 0:
			if made[r.GetSandbox().GetId()] {
				t.Errorf("token %s got sandbox %s, which another has", tokens[i], r.GetSandbox().GetId())
			}
			made[r.GetSandbox().GetId()] = true
		case connect.Code(r.GetErrorCode()) == connect.CodeResourceExhausted && r.GetErrorMessage() != "":
			refused++
		default:
			t.Errorf("token %s: sandbox %v, code %d %q", tokens[i], r.GetSandbox(), r.GetErrorCode(), r.GetErrorMessage())
		}
	}
	if len(made) != 4 || refused != 2 {
		t.Errorf("a node with room for 4 made %d sandboxes and refused %d of 6 new tokens; want 4 and 2", len(made), refused)
	}
}

// TestCreateManyMalformed: a request the node cannot act on fails whole,
// with InvalidArgument, and makes nothing.
func TestCreateManyMalformed(t *testing.T) {
	svc := newService(hollow.Config{})
	tooMany := make([]string, 257)
	for i := range tooMany {
		tooMany[i] = fmt.Sprintf("b#%d@h1", i)
	}
	for name, tokens := range map[string][]string{
		"no tokens":    nil,
		"empty token":  {"b#0@h1", ""},
		"twice":        {"b#0@h1", "b#0@h1"},
		"over the cap": tooMany,
	} {
		if _, err := createMany(svc, tokens...); !errors.Is(err, errdefs.ErrInvalidArgument) {
			t.Errorf("%s: %v, want InvalidArgument", name, err)
		}
	}
	resp, err := svc.List(context.Background(), connect.NewRequest(&edgev1.ListRequest{}))
	if err != nil {
		t.Fatal(err)
	}
	if n := len(resp.Msg.GetSandboxes()); n != 0 {
		t.Errorf("malformed calls made %d sandboxes", n)
	}
}

// TestForkRefusals: a node that cannot fork (a hollow one) says so, and a
// malformed fork is refused before anything is made.
func TestForkRefusals(t *testing.T) {
	svc := newService(hollow.Config{MaxSandboxes: 4})
	fork := func(tokens ...string) error {
		_, err := svc.Fork(context.Background(), connect.NewRequest(&edgev1.ForkRequest{SandboxId: "sb-h1-x", CreateTokens: tokens}))
		return err
	}
	if err := fork("f#0@h1"); !errors.Is(err, errdefs.ErrNotSupported) {
		t.Errorf("fork on a hollow node: %v, want not supported", err)
	}
	var many []string
	for i := range 17 {
		many = append(many, fmt.Sprintf("f#%d@h1", i))
	}
	for name, tokens := range map[string][]string{"no": nil, "17": many, "empty": {""}, "repeated": {"f#0@h1", "f#0@h1"}} {
		if err := fork(tokens...); !errors.Is(err, errdefs.ErrInvalidArgument) {
			t.Errorf("fork with %s tokens: %v, want invalid argument", name, err)
		}
	}
	reap(t, svc, &edgev1.ReapRequest{Tokens: []string{"f#1@h1"}})
	if err := fork("f#0@h1", "f#1@h1"); !errors.Is(err, errdefs.ErrFailedPrecondition) {
		t.Errorf("fork with a reaped token: %v, want failed precondition", err)
	}
}

package apiserver

import (
	"context"
	"fmt"
	"testing"
	"time"

	"connectrpc.com/connect"
	"google.golang.org/protobuf/proto"

	dsecv1 "dsec.dev/dsec/api/gen/dsec/v1"
	"dsec.dev/dsec/api/gen/dsec/v1/dsecv1connect"
	"dsec.dev/dsec/internal/edge/sandbox"
	"dsec.dev/dsec/internal/errdefs"
)

// Fork makes the children of a memory fork on the fake edge: a create
// per token with the parent's spec (edgesvc.Forker).
func (f *fakeEdge) Fork(ctx context.Context, id string, tokens []string) ([]sandbox.ForkResult, time.Duration, error) {
	f.mu.Lock()
	p, ok := f.sbs[id]
	f.mu.Unlock()
	if !ok {
		return nil, 0, fmt.Errorf("sandbox %s: %w", id, errdefs.ErrNotFound)
	}
	out := make([]sandbox.ForkResult, len(tokens))
	for i, t := range tokens {
		sb, err := f.Create(ctx, proto.Clone(p.GetSpec()).(*dsecv1.SandboxSpec), t)
		out[i] = sandbox.ForkResult{Sandbox: sb, Err: err}
	}
	return out, 1500 * time.Microsecond, nil
}

// TestMicroVMFork: a microVM's fork goes to its node's edge as one Fork
// (a memory fork, not a snapshot and creates placed anywhere): every
// child is on the parent's node with its spec, a child the node refuses
// has its error while the others live, the response's snapshot says it
// was a memory save, and exclude, which a memory fork cannot honour, is
// refused.
func TestMicroVMFork(t *testing.T) {
	overBoth(t, func(t *testing.T, newServer func(edges ...*fakeEdge) dsecv1connect.SandboxServiceClient) {
		e1, e2 := newFakeEdge("n1"), newFakeEdge("n2")
		c := newServer(e1, e2)
		spec := &dsecv1.SandboxSpec{Environment: "base:1", Isolation: dsecv1.Isolation_ISOLATION_MICROVM, MemoryMb: 256, TtlSeconds: 600}
		parent, err := e2.Create(context.Background(), spec, "")
		if err != nil {
			t.Fatal(err)
		}
		e2.failAfter = 3 // the parent and two children
		resp, err := c.Fork(context.Background(), connect.NewRequest(&dsecv1.ForkRequest{SandboxId: parent.GetId(), Count: 3}))
		if err != nil {
			t.Fatal(err)
		}
		kids := resp.Msg.GetChildren()
		if len(kids) != 3 {
			t.Fatalf("%d children, want 3", len(kids))
		}
		for i, k := range kids[:2] {
			if k.GetError() != "" || k.GetSandbox().GetNode() != "n2" || !proto.Equal(k.GetSandbox().GetSpec(), spec) {
				t.Errorf("child %d: %v, want a sandbox on n2 with the parent's spec", i, k)
			}
		}
		if kids[2].GetError() == "" || kids[2].GetSandbox() != nil {
			t.Errorf("the child the node refused: %v, want its error", kids[2])
		}
		if e1.creates != 0 {
			t.Errorf("node n1 got %d creates of a fork of n2's sandbox", e1.creates)
		}
		if sn := resp.Msg.GetSnapshot(); sn.GetCaptureMethod() != "memory" || sn.GetSourceSandbox() != parent.GetId() ||
			sn.GetFrozenUs() != 1500 || sn.GetEnvironment() != "base:1" || sn.GetLayer() != "" {
			t.Errorf("the fork's snapshot: %v, want the memory save of %s", sn, parent.GetId())
		}
		_, err = c.Fork(context.Background(), connect.NewRequest(&dsecv1.ForkRequest{SandboxId: parent.GetId(), Count: 1, Exclude: []string{"/tmp"}}))
		if connect.CodeOf(err) != connect.CodeInvalidArgument {
			t.Errorf("a microVM fork with exclude: %v, want invalid_argument", err)
		}
	})
}

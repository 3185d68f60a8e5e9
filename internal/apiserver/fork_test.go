package apiserver

import (
	"context"
	"fmt"
	"log/slog"
	"testing"
	"time"

	"connectrpc.com/connect"
	"google.golang.org/protobuf/proto"

	edgev1 "dsec.dev/dsec/api/gen/dsec/edge/v1"
	dsecv1 "dsec.dev/dsec/api/gen/dsec/v1"
	"dsec.dev/dsec/api/gen/dsec/v1/dsecv1connect"
	"dsec.dev/dsec/internal/edge/edgesvc"
	"dsec.dev/dsec/internal/edge/sandbox"
	"dsec.dev/dsec/internal/errdefs"
	"dsec.dev/dsec/internal/store"
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
	f.mu.Lock()
	f.forks++
	f.mu.Unlock()
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

// TestMicroVMForkIdempotent: a microVM's fork with an idempotency key made
// again gets the children the first made and makes none (the node forks
// once); the key with another request is refused; a fork following a
// reservation of the key that another apiserver holds (which forked and
// went) gets that fork's children from the node, which forks only the
// children missing: none.
func TestMicroVMForkIdempotent(t *testing.T) {
	for _, remote := range []bool{false, true} {
		t.Run(map[bool]string{false: "in-process", true: "remote"}[remote], func(t *testing.T) {
			ctx := context.Background()
			e := newFakeEdge("n1")
			_, st, c := newRig(t, remote, Config{CreateConcurrency: 4}, e)
			spec := &dsecv1.SandboxSpec{Environment: "base:1", Isolation: dsecv1.Isolation_ISOLATION_MICROVM, MemoryMb: 256}
			parent, err := e.Create(ctx, spec, "")
			if err != nil {
				t.Fatal(err)
			}
			ids := func(r *dsecv1.ForkResponse) []string {
				var out []string
				for _, k := range r.GetChildren() {
					out = append(out, k.GetSandbox().GetId()+k.GetError())
				}
				return out
			}
			req := &dsecv1.ForkRequest{SandboxId: parent.GetId(), Count: 2, IdempotencyKey: "k"}
			first, err := c.Fork(ctx, connect.NewRequest(req))
			if err != nil {
				t.Fatal(err)
			}
			again, err := c.Fork(ctx, connect.NewRequest(req))
			if err != nil {
				t.Fatal(err)
			}
			if a, b := ids(first.Msg), ids(again.Msg); fmt.Sprint(a) != fmt.Sprint(b) || len(a) != 2 || a[0] == a[1] {
				t.Errorf("a fork repeated with its key: children %v, the first %v; want the same two", b, a)
			}
			if e.forks != 1 || e.creates != 3 {
				t.Errorf("after a fork and its repeat: %d forks and %d creates on the node, want 1 and 3 (the parent, two children)", e.forks, e.creates)
			}
			_, err = c.Fork(ctx, connect.NewRequest(&dsecv1.ForkRequest{SandboxId: parent.GetId(), Count: 3, IdempotencyKey: "k"}))
			if connect.CodeOf(err) != connect.CodeInvalidArgument {
				t.Errorf("the key with another request: %v, want invalid_argument", err)
			}
			box, err := e.Create(ctx, &dsecv1.SandboxSpec{Environment: "base:1"}, "")
			if err != nil {
				t.Fatal(err)
			}
			_, err = c.Fork(ctx, connect.NewRequest(&dsecv1.ForkRequest{SandboxId: box.GetId(), Count: 1, IdempotencyKey: "k3"}))
			if connect.CodeOf(err) != connect.CodeInvalidArgument {
				t.Errorf("a container's fork with a key: %v, want invalid_argument", err)
			}

			// Another apiserver reserved k2 and forked, and went.
			req2 := &dsecv1.ForkRequest{SandboxId: parent.GetId(), Count: 2, IdempotencyKey: "k2"}
			got, reserved, err := st.ReserveCreate(ctx, store.CreateReservation{Key: "fork:k2", RequestHash: forkHash(req2), Owner: "other", Placements: []string{"n1", "n1"}})
			if err != nil || !reserved {
				t.Fatalf("reserve fork:k2: %v, %v", reserved, err)
			}
			tokens := []string{nodeToken(createToken(batchOf(got), 0), "n1"), nodeToken(createToken(batchOf(got), 1), "n1")}
			svc := edgesvc.New(e, nil, slog.New(slog.DiscardHandler))
			theirs, err := svc.Fork(ctx, connect.NewRequest(&edgev1.ForkRequest{SandboxId: parent.GetId(), CreateTokens: tokens}))
			if err != nil {
				t.Fatal(err)
			}
			ours, err := c.Fork(ctx, connect.NewRequest(req2))
			if err != nil {
				t.Fatal(err)
			}
			var want []string
			for _, r := range theirs.Msg.GetResults() {
				want = append(want, r.GetSandbox().GetId())
			}
			if got := ids(ours.Msg); fmt.Sprint(got) != fmt.Sprint(want) {
				t.Errorf("a fork following another's reservation: children %v, want the other's %v", got, want)
			}
			if e.forks != 2 || e.creates != 6 {
				t.Errorf("after the other's fork and ours: %d forks and %d creates on the node, want 2 and 6 (a container made meanwhile)", e.forks, e.creates)
			}
		})
	}
}

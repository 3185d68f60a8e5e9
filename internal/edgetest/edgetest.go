// Package edgetest is the conformance suite of the apiserver ↔ edge seam:
// EdgeService (api/dsec/edge/v1) as an apiserver calls it (apiserver.Edge).
// Every implementation runs it, fakes included: call Run from its tests
// with Options saying what differs for it. Today they are the edge service
// over a node's real edge (package edgesvc over sandbox.Manager, runc),
// called in process as the all-in-one dsecd calls it and through the remote
// client as a cluster's apiserver does, the
// same service over a hollow edge (package hollow) and over the fake edge
// of the apiserver's tests, and the remote client (package edgeclient)
// reaching the service over the cluster's mutual TLS.
//
// It checks what the service's documentation promises the apiserver:
//
//   - a create's sandbox runs on the node Status names, Get and List show
//     it, and a create token is idempotent: the same token returns the same
//     sandbox, from Create and CreateMany alike;
//   - List answers only its request's project scope, without the
//     excluded labels, and paged, the first page_size matches after the
//     cursor, newest first, with the count of every match;
//   - error kinds (errdefs, which survive the wire): NotFound for a sandbox
//     the node never made, InvalidArgument for a malformed request (no
//     environment, no create tokens, no sandbox ID), FailedPrecondition for
//     a call to a sandbox that has ended and for a create with a token Reap
//     killed;
//   - Delete is idempotent, and an ended sandbox is Gone; Reap removes what
//     a token made;
//   - Pause and Resume, each idempotent (already_paused, already_running);
//   - Fork: a child per token where the edge forks the suite's sandboxes,
//     else FailedPrecondition (their runtime cannot copy their memory) or
//     NotSupported (the edge forks nothing), making nothing (Options.Fork);
//   - the calls that run inside a sandbox (exec, files, processes; an
//     exec's after steps, ExecAfter: its user's leftovers killed and a
//     file read before the exit goes on), unless the implementation runs
//     none (Deviations.NoAgent);
//   - Trajectory: a sandbox's calls recorded, read from an offset, ended
//     and still readable after its deletion, hashed (docs/trajectories.md);
//   - SignReceipt: a grade's receipt signed only when it names what the
//     edge saw (its clean room, layers, the grader's command and exit),
//     verifying against the edge's CA; refused by an edge without a key
//     (docs/receipts.md);
//   - Attest: what the node sees of a sandbox of its own (its trajectory
//     hash, its newest provenance report's flags), signed with its receipt
//     key and verifying against the edge's CA as the node's; NotFound for
//     another node's sandbox, NotSupported from an edge without a key;
//   - RenameRef: a layer's name moved onto what another names, and back;
//     NotFound for a name the edge lacks, NotSupported from an edge that
//     keeps no layers (Options.NoLayers);
//   - LiveUsage: the cost ledger's record of each live sandbox of the
//     projects asked (and those under them), and only theirs, with its
//     sandbox's ID, project, labels, node and start; a sandbox just
//     deleted read ended; none from an edge without a ledger
//     (Options.NoLedger);
//   - a cancelled context: a keyed create whose caller went makes at most
//     one sandbox, which a retry with its token returns; an exec cancelled
//     midway ends with Canceled or DeadlineExceeded, its command killed, and
//     the sandbox serves on.
//
// Unary calls go to the implementation directly, as an apiserver makes
// them; the streams (exec) through a Connect handler over it on a loopback
// server, since only a handler makes the server stream an apiserver hands
// on (the all-in-one apiserver passes its own).
package edgetest

import (
	"context"
	"errors"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"

	"connectrpc.com/connect"

	edgev1 "dsec.dev/dsec/api/gen/dsec/edge/v1"
	"dsec.dev/dsec/api/gen/dsec/edge/v1/edgev1connect"
	dsecv1 "dsec.dev/dsec/api/gen/dsec/v1"
	"dsec.dev/dsec/internal/errdefs"
)

// Options is what differs between the implementations the suite runs
// against.
type Options struct {
	// New returns the edge under test, with no live sandbox and
	// Environment imported. The suite calls it once per group of checks;
	// it may return the same edge every time (a real edge costs seconds to
	// start), since each group deletes what it made before the next. What
	// it registers with t.Cleanup runs after that deletion.
	New func(t *testing.T) edgev1connect.EdgeServiceHandler
	// Environment is what the suite's sandboxes are made from; "" means
	// "busybox:edgetest" (a hollow edge takes any name).
	Environment string
	// Fork is what Fork does with the suite's sandboxes; the zero value is
	// ForkRefused.
	Fork ForkAnswer
	// Deviations are the differences from the contract an implementation
	// documents; the suite checks the documented behaviour in their place.
	Deviations Deviations
	// NoTrajectories: the edge records no trajectories (edgesvc without
	// a recorder): Trajectory answers NotSupported.
	NoTrajectories bool
	// ReceiptCA is what the edge's grade receipts verify against: the
	// cluster's CA bundle, or an all-in-one node's own certificate (the
	// --ca of `dsec receipt verify`). "" means the edge holds no receipt
	// key: SignReceipt answers NotSupported.
	ReceiptCA string
	// NoEvents: the edge keeps no event log (edgesvc without one): Status
	// names no epoch and Events returns none.
	NoEvents bool
	// NoLayers: the edge keeps no layers (edgesvc without a layer service,
	// as over a hollow edge): RenameRef answers NotSupported.
	NoLayers bool
	// NoLedger: the edge keeps no cost ledger (edgesvc without one):
	// LiveUsage answers none.
	NoLedger bool
}

// ForkAnswer is what an edge answers a Fork of the suite's sandboxes.
type ForkAnswer int

const (
	// ForkRefused: their runtime cannot copy a sandbox's memory (runc,
	// gVisor): FailedPrecondition, and nothing made.
	ForkRefused ForkAnswer = iota
	// ForkUnsupported: the edge cannot fork at all (package edgesvc: an
	// edge that is not a Forker, as the hollow edge): NotSupported,
	// whatever the sandbox, and nothing made.
	ForkUnsupported
	// ForkMakes: the edge forks them (a microVM's edge; the apiserver
	// tests' fake): a running child per token on the node, a new ID each.
	ForkMakes
)

// Deviations are documented differences from the contract. Each names the
// documentation that states it.
type Deviations struct {
	// NoAgent: the edge's sandboxes run nothing, and every call that runs
	// inside one is refused with ErrNotSupported (package hollow: "Calls
	// that run inside a sandbox are refused: there is none"). The suite
	// checks that refusal in place of exec, files and processes.
	NoAgent bool
}

func (o Options) env() string {
	if o.Environment != "" {
		return o.Environment
	}
	return "busybox:edgetest"
}

// edge is one implementation under test and the suite's view of it.
type edge struct {
	t    *testing.T
	o    Options
	h    edgev1connect.EdgeServiceHandler
	c    edgev1connect.EdgeServiceClient // h behind a Connect handler, for the streams
	node string
}

// Run runs the suite.
func Run(t *testing.T, o Options) {
	if o.New == nil {
		t.Fatal("edgetest.Options.New is nil")
	}
	for _, g := range []struct {
		name string
		fn   func(t *testing.T, e *edge)
	}{
		{"Lifecycle", testLifecycle},
		{"List", testList},
		{"Errors", testErrors},
		{"Reap", testReap},
		{"Inside", testInside},
		{"Cancel", testCancel},
		{"Trajectory", testTrajectory},
		{"Receipt", testReceipt},
		{"Attest", testAttest},
		{"Events", testEvents},
		{"RenameRef", testRenameRef},
		{"LiveUsage", testLiveUsage},
	} {
		t.Run(g.name, func(t *testing.T) {
			e := open(t, o)
			g.fn(t, e)
		})
	}
}

func open(t *testing.T, o Options) *edge {
	h := o.New(t)
	mux := http.NewServeMux()
	mux.Handle(edgev1connect.NewEdgeServiceHandler(h, connect.WithInterceptors(errdefs.Interceptor{})))
	srv := httptest.NewServer(mux)
	t.Cleanup(srv.Close)
	e := &edge{t: t, o: o, h: h, c: edgev1connect.NewEdgeServiceClient(srv.Client(), srv.URL)}
	st, err := h.Status(t.Context(), connect.NewRequest(&edgev1.StatusRequest{}))
	if err != nil {
		t.Fatalf("Status: %v", err)
	}
	e.node = st.Msg.GetNode()
	if e.node == "" {
		t.Fatal("Status names no node")
	}
	// Registered after New's cleanups, so it runs before them: nothing the
	// suite made outlives it.
	t.Cleanup(e.deleteAll)
	return e
}

// deleteAll deletes every sandbox the edge lists as live.
func (e *edge) deleteAll() {
	ctx := context.Background()
	resp, err := e.h.List(ctx, connect.NewRequest(&edgev1.ListRequest{}))
	if err != nil {
		e.t.Errorf("list at cleanup: %v", err)
		return
	}
	for _, sb := range resp.Msg.GetSandboxes() {
		if sb.GetState() == dsecv1.State_STATE_STOPPED || sb.GetState() == dsecv1.State_STATE_FAILED {
			continue
		}
		if _, err := e.h.Delete(ctx, connect.NewRequest(&dsecv1.DeleteRequest{Id: sb.GetId()})); err != nil {
			e.t.Errorf("delete %s at cleanup: %v", sb.GetId(), err)
		}
	}
}

func (e *edge) spec() *dsecv1.SandboxSpec {
	return &dsecv1.SandboxSpec{Environment: e.o.env(), MemoryMb: 128, Labels: map[string]string{"edgetest": e.t.Name()}}
}

// create makes a sandbox with token and checks it runs on the node.
func (e *edge) create(ctx context.Context, token string) *dsecv1.Sandbox {
	e.t.Helper()
	resp, err := e.h.Create(ctx, connect.NewRequest(&edgev1.CreateRequest{Spec: e.spec(), CreateToken: token}))
	if err != nil {
		e.t.Fatalf("Create with token %q: %v", token, err)
	}
	sb := resp.Msg
	if sb.GetId() == "" || sb.GetState() != dsecv1.State_STATE_RUNNING || sb.GetNode() != e.node {
		e.t.Fatalf("Create made %s in state %v on node %q; want an ID, running, on %q", sb.GetId(), sb.GetState(), sb.GetNode(), e.node)
	}
	return sb
}

func (e *edge) get(ctx context.Context, id string) (*dsecv1.Sandbox, error) {
	resp, err := e.h.Get(ctx, connect.NewRequest(&dsecv1.GetRequest{Id: id}))
	if err != nil {
		return nil, err
	}
	return resp.Msg, nil
}

func (e *edge) delete(ctx context.Context, id string) error {
	_, err := e.h.Delete(ctx, connect.NewRequest(&dsecv1.DeleteRequest{Id: id}))
	return err
}

// live lists the IDs of the edge's live sandboxes of this test.
func (e *edge) live(ctx context.Context) []string {
	e.t.Helper()
	resp, err := e.h.List(ctx, connect.NewRequest(&edgev1.ListRequest{Labels: map[string]string{"edgetest": e.t.Name()},
		States: []dsecv1.State{dsecv1.State_STATE_CREATING, dsecv1.State_STATE_RUNNING, dsecv1.State_STATE_PAUSED}}))
	if err != nil {
		e.t.Fatalf("List: %v", err)
	}
	var ids []string
	for _, sb := range resp.Msg.GetSandboxes() {
		ids = append(ids, sb.GetId())
	}
	return ids
}

// execResult is what an exec's stream brought.
type execResult struct {
	stdout string
	exited *dsecv1.ExecExited
}

// exec runs command in sandbox id through the streaming handler. Its
// error carries the errdefs kind the wire brought back.
func (e *edge) exec(ctx context.Context, id, command string) (execResult, error) {
	return e.execReq(ctx, &dsecv1.ExecRequest{SandboxId: id, Command: command})
}

// execReq runs req through the streaming handler, as exec does.
func (e *edge) execReq(ctx context.Context, req *dsecv1.ExecRequest) (execResult, error) {
	var r execResult
	st, err := e.c.Exec(ctx, connect.NewRequest(req))
	if err != nil {
		return r, errdefs.FromConnect(err)
	}
	defer st.Close()
	var out strings.Builder
	for st.Receive() {
		ev := st.Msg()
		out.Write(ev.GetStdout())
		if x := ev.GetExited(); x != nil {
			r.exited = x
		}
	}
	r.stdout = out.String()
	return r, errdefs.FromConnect(st.Err())
}

// wantKind fails the test unless err is of kind want.
func wantKind(t *testing.T, what string, err, want error) {
	t.Helper()
	if !errors.Is(err, want) {
		t.Errorf("%s: %v, want %v", what, err, want)
	}
}

package apiserver

import (
	"context"
	"fmt"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"connectrpc.com/connect"

	edgev1 "dsec.dev/dsec/api/gen/dsec/edge/v1"
	dsecv1 "dsec.dev/dsec/api/gen/dsec/v1"
	"dsec.dev/dsec/api/gen/dsec/v1/dsecv1connect"
	"dsec.dev/dsec/internal/edge/edgesvc"
	"dsec.dev/dsec/internal/edgeclient"
	"dsec.dev/dsec/internal/errdefs"
	"dsec.dev/dsec/internal/placement"
	"dsec.dev/dsec/internal/sandboxid"
	"dsec.dev/dsec/internal/store"
	"dsec.dev/dsec/internal/watcher"
)

func newTestServer(t *testing.T, edges ...*fakeEdge) dsecv1connect.SandboxServiceClient {
	return newTestServerOver(t, false, edges...)
}

// newTestServerOver serves the fake edges through the edge service either
// in-process (as the all-in-one dsecd does) or over Connect through
// edgeclient (as a cluster's apiserver reaches a remote edge), and returns a
// client of an apiserver in front of them.
func newTestServerOver(t *testing.T, remote bool, edges ...*fakeEdge) dsecv1connect.SandboxServiceClient {
	t.Helper()
	_, _, c := newRig(t, remote, Config{CreateConcurrency: 4}, edges...)
	return c
}

// newRig is newTestServerOver with cfg, returning the server and its store
// too.
func newRig(t *testing.T, remote bool, cfg Config, edges ...*fakeEdge) (*Server, store.Store, dsecv1connect.SandboxServiceClient) {
	t.Helper()
	s, st, hs := startRig(t, remote, false, cfg, nodesOf(edges...))
	return s, st, dsecv1connect.NewSandboxServiceClient(hs.Client(), hs.URL)
}

// startServer starts an apiserver in front of nodes, whose edges are
// edgesvc.Services: called in-process, or served over Connect and reached
// through edgeclient, over HTTP/2 or, with http1, HTTP/1.1 for all but the
// shell (as a cluster's apiserver reaches its edges).
func startServer(t *testing.T, remote, http1 bool, nodes []watcher.Node) *httptest.Server {
	t.Helper()
	_, _, hs := startRig(t, remote, http1, Config{CreateConcurrency: 4}, nodes)
	return hs
}

// startRig is startServer with cfg, returning the server and its store too.
func startRig(t *testing.T, remote, http1 bool, cfg Config, nodes []watcher.Node) (*Server, store.Store, *httptest.Server) {
	t.Helper()
	st, err := store.Open(context.Background(), filepath.Join(t.TempDir(), "meta.db"))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { st.Close() })
	if remote {
		for i, n := range nodes {
			mux := http.NewServeMux()
			mux.Handle(n.Edge.(*edgesvc.Service).Handler())
			es := httptest.NewUnstartedServer(mux)
			es.EnableHTTP2 = true
			es.StartTLS()
			t.Cleanup(es.Close)
			hc := es.Client()
			if http1 {
				tr := es.Client().Transport.(*http.Transport).Clone()
				tr.Protocols = new(http.Protocols)
				tr.Protocols.SetHTTP1(true)
				tr.TLSClientConfig.NextProtos = []string{"http/1.1"}
				hc = &http.Client{Transport: tr}
			}
			nodes[i].Edge = edgeclient.New(hc, es.Client(), es.URL, nil)
		}
	}
	s := New(cfg, st, watcher.NewFixed(nodes...), slog.New(slog.DiscardHandler))
	hs := httptest.NewUnstartedServer(s.Handler())
	hs.Config.Protocols = new(http.Protocols) // as dsecd serves it: HTTP/1.1 and cleartext HTTP/2
	hs.Config.Protocols.SetHTTP1(true)
	hs.Config.Protocols.SetUnencryptedHTTP2(true)
	hs.Start()
	t.Cleanup(hs.Close)
	return s, st, hs
}

// overBoth runs a test against edges in-process and remote.
func overBoth(t *testing.T, test func(t *testing.T, newServer func(edges ...*fakeEdge) dsecv1connect.SandboxServiceClient)) {
	for _, remote := range []bool{false, true} {
		name := "in-process"
		if remote {
			name = "remote"
		}
		t.Run(name, func(t *testing.T) {
			test(t, func(edges ...*fakeEdge) dsecv1connect.SandboxServiceClient {
				return newTestServerOver(t, remote, edges...)
			})
		})
	}
}

func TestCreateIdempotentUnderConcurrentRetries(t *testing.T) {
	overBoth(t, func(t *testing.T, newServer func(edges ...*fakeEdge) dsecv1connect.SandboxServiceClient) {
		e := newFakeEdge("n1")
		c := newServer(e)
		req := &dsecv1.CreateRequest{Spec: &dsecv1.SandboxSpec{Environment: "base:1"}, Count: 3, IdempotencyKey: "k"}
		var wg sync.WaitGroup
		ids := make([][]string, 8)
		for i := range ids {
			wg.Add(1)
			go func() {
				defer wg.Done()
				resp, err := c.Create(context.Background(), connect.NewRequest(req))
				if err != nil {
					t.Error(err)
					return
				}
				for _, sb := range resp.Msg.GetSandboxes() {
					ids[i] = append(ids[i], sb.GetId())
				}
			}()
		}
		wg.Wait()
		if n := e.running(); n != 3 {
			t.Fatalf("8 retries of one create made %d sandboxes, want 3", n)
		}
		for i := range ids {
			if len(ids[i]) != 3 || ids[i][0] != ids[0][0] || ids[i][2] != ids[0][2] {
				t.Fatalf("answer %d differs: %v vs %v", i, ids[i], ids[0])
			}
		}
	})
}

func TestBatchIsAllOrNothing(t *testing.T) {
	overBoth(t, func(t *testing.T, newServer func(edges ...*fakeEdge) dsecv1connect.SandboxServiceClient) {
		e := newFakeEdge("n1")
		e.failAfter = 5
		c := newServer(e)
		_, err := c.Create(context.Background(), connect.NewRequest(&dsecv1.CreateRequest{
			Spec: &dsecv1.SandboxSpec{Environment: "base:1"}, Count: 10}))
		if connect.CodeOf(err) != connect.CodeResourceExhausted {
			t.Fatalf("batch over capacity: %v, want resource_exhausted", err)
		}
		if n := e.running(); n != 0 {
			t.Fatalf("a failed batch left %d sandboxes running", n)
		}
	})
}

// TestEdgeErrorsKeepTheirKind: an edge's answer to a create keeps its kind
// through placement. A request at fault is not tried on other nodes; a
// node that failed is, and when no node is left the failure is returned,
// not "every node was tried" as ResourceExhausted, which callers retry as
// overload for ever.
func TestEdgeErrorsKeepTheirKind(t *testing.T) {
	overBoth(t, func(t *testing.T, newServer func(edges ...*fakeEdge) dsecv1connect.SandboxServiceClient) {
		for _, tc := range []struct {
			name  string
			errs  []error // one edge each
			want  connect.Code
			tries int // creates the edges got for one sandbox: a request at fault goes to one node only
		}{
			{"bad rule", []error{fmt.Errorf(`compile rule "::/0": IPv6: %w`, errdefs.ErrInvalidArgument),
				fmt.Errorf("unused: %w", errdefs.ErrInvalidArgument)}, connect.CodeInvalidArgument, 1},
			{"the only node lacks a feature", []error{fmt.Errorf("backend container of node a cannot pause: %w", errdefs.ErrNotSupported)},
				connect.CodeUnimplemented, 1},
			{"every node fails", []error{fmt.Errorf("mount: %w", errdefs.ErrInternal), fmt.Errorf("mount: %w", errdefs.ErrInternal)},
				connect.CodeInternal, 2},
			// Room may free up on the full one: that is worth a retry.
			{"a full node and a failing one", []error{fmt.Errorf("node is full: %w", errdefs.ErrResourceExhausted),
				fmt.Errorf("mount: %w", errdefs.ErrInternal)}, connect.CodeResourceExhausted, 2},
		} {
			for _, count := range []int32{1, 3} {
				t.Run(fmt.Sprintf("%s/%d", tc.name, count), func(t *testing.T) {
					var edges []*fakeEdge
					for i, err := range tc.errs {
						e := newFakeEdge(string(rune('a' + i)))
						e.failWith = err
						edges = append(edges, e)
					}
					c := newServer(edges...)
					_, err := c.Create(context.Background(), connect.NewRequest(&dsecv1.CreateRequest{
						Spec: &dsecv1.SandboxSpec{Environment: "base:1"}, Count: count}))
					if connect.CodeOf(err) != tc.want || tc.want != connect.CodeResourceExhausted &&
						(strings.Contains(err.Error(), "already tried") || strings.Contains(err.Error(), "--max-sandboxes")) {
						t.Fatalf("create: %v; want %v with the edge's words", err, tc.want)
					}
					if count == 1 {
						tries := 0
						for _, e := range edges {
							tries += e.creates
						}
						if tries != tc.tries {
							t.Errorf("%d creates sent, want %d", tries, tc.tries)
						}
					}
				})
			}
		}
	})
}

func TestValidationAndRouting(t *testing.T) {
	overBoth(t, func(t *testing.T, newServer func(edges ...*fakeEdge) dsecv1connect.SandboxServiceClient) {
		c := newServer(newFakeEdge("n1"))
		ctx := context.Background()
		cases := []struct {
			name string
			call func() error
			want connect.Code
		}{
			{"no environment", func() error {
				_, err := c.Create(ctx, connect.NewRequest(&dsecv1.CreateRequest{Spec: &dsecv1.SandboxSpec{}}))
				return err
			}, connect.CodeInvalidArgument},
			{"count too large", func() error {
				_, err := c.Create(ctx, connect.NewRequest(&dsecv1.CreateRequest{Spec: &dsecv1.SandboxSpec{Environment: "b:1"}, Count: 100000}))
				return err
			}, connect.CodeInvalidArgument},
			{"malformed id", func() error {
				_, err := c.Get(ctx, connect.NewRequest(&dsecv1.GetRequest{Id: "nope"}))
				return err
			}, connect.CodeNotFound},
			{"unknown node", func() error {
				_, err := c.Get(ctx, connect.NewRequest(&dsecv1.GetRequest{Id: sandboxid.New("n9", 0, 0)}))
				return err
			}, connect.CodeNotFound},
			{"unknown sandbox", func() error {
				_, err := c.Get(ctx, connect.NewRequest(&dsecv1.GetRequest{Id: sandboxid.New("n1", 0, 0)}))
				return err
			}, connect.CodeNotFound},
			{"exec without command", func() error {
				s, err := c.Exec(ctx, connect.NewRequest(&dsecv1.ExecRequest{SandboxId: sandboxid.New("n1", 0, 0)}))
				if err != nil {
					return err
				}
				for s.Receive() {
				}
				return s.Err()
			}, connect.CodeInvalidArgument},
			{"exec stdin over the limit", func() error {
				s, err := c.Exec(ctx, connect.NewRequest(&dsecv1.ExecRequest{SandboxId: sandboxid.New("n1", 0, 0), Argv: []string{"cat"},
					Stdin: make([]byte, maxExecStdin+1)}))
				if err != nil {
					return err
				}
				for s.Receive() {
				}
				return s.Err()
			}, connect.CodeInvalidArgument},
		}
		for _, tc := range cases {
			t.Run(tc.name, func(t *testing.T) {
				if got := connect.CodeOf(tc.call()); got != tc.want {
					t.Fatalf("code %v, want %v", got, tc.want)
				}
			})
		}
	})
}

func TestNodeIDRoundTrip(t *testing.T) {
	e := newFakeEdge("node-7")
	id := e.NewID()
	s := New(Config{}, nil, watcher.NewFixed(nodesOf(e)...), slog.New(slog.DiscardHandler))
	got, err := s.edgeFor(id)
	if want, _ := s.fleet.Edge("node-7"); err != nil || got != want {
		t.Fatalf("route %s: %v %v", id, got, err)
	}
}

func TestSetWarmPoolReachesEveryNode(t *testing.T) {
	overBoth(t, func(t *testing.T, newServer func(edges ...*fakeEdge) dsecv1connect.SandboxServiceClient) {
		a, b := newFakeEdge("n1"), newFakeEdge("n2")
		c := newServer(a, b)
		ctx := context.Background()
		spec := &dsecv1.SandboxSpec{Environment: "base:1", Cpus: 0.5}
		for _, tc := range []struct {
			name string
			req  *dsecv1.SetWarmPoolRequest
			want connect.Code
		}{
			{"no environment", &dsecv1.SetWarmPoolRequest{Spec: &dsecv1.SandboxSpec{}, Size: 1}, connect.CodeInvalidArgument},
			{"negative size", &dsecv1.SetWarmPoolRequest{Spec: spec, Size: -1}, connect.CodeInvalidArgument},
			{"huge size", &dsecv1.SetWarmPoolRequest{Spec: spec, Size: maxWarmPoolSize + 1}, connect.CodeInvalidArgument},
		} {
			if _, err := c.SetWarmPool(ctx, connect.NewRequest(tc.req)); connect.CodeOf(err) != tc.want {
				t.Errorf("%s: code %v, want %v", tc.name, connect.CodeOf(err), tc.want)
			}
		}
		p, err := c.SetWarmPool(ctx, connect.NewRequest(&dsecv1.SetWarmPoolRequest{Spec: spec, Size: 3}))
		if err != nil {
			t.Fatal(err)
		}
		if p.Msg.GetNode() != "n1" || p.Msg.GetSize() != 3 {
			t.Errorf("answer %v, want the first node's pool of 3", p.Msg)
		}
		list, err := c.ListWarmPools(ctx, connect.NewRequest(&dsecv1.ListWarmPoolsRequest{}))
		if err != nil {
			t.Fatal(err)
		}
		var nodes []string
		for _, p := range list.Msg.GetPools() {
			nodes = append(nodes, p.GetNode())
		}
		if len(nodes) != 2 || nodes[0] != "n1" || nodes[1] != "n2" {
			t.Errorf("pools on nodes %v, want n1 and n2", nodes)
		}
	})
}

// TestBatchSpreadsOverNodes: a batch is placed in one round, so 300
// sandboxes over 3 equal nodes land evenly (no node over 1.5× its share).
func TestBatchSpreadsOverNodes(t *testing.T) {
	overBoth(t, func(t *testing.T, newServer func(edges ...*fakeEdge) dsecv1connect.SandboxServiceClient) {
		a, b, c := newFakeEdge("a"), newFakeEdge("b"), newFakeEdge("c")
		cl := newServer(a, b, c)
		resp, err := cl.Create(context.Background(), connect.NewRequest(&dsecv1.CreateRequest{
			Spec: &dsecv1.SandboxSpec{Environment: "base:1"}, Count: 300, IdempotencyKey: "spread"}))
		if err != nil {
			t.Fatal(err)
		}
		if len(resp.Msg.GetSandboxes()) != 300 {
			t.Fatalf("%d sandboxes", len(resp.Msg.GetSandboxes()))
		}
		for _, e := range []*fakeEdge{a, b, c} {
			if n := e.running(); n > 150 || n < 50 {
				t.Errorf("node %s got %d of 300", e.node, n)
			}
		}
	})
}

// countingEdge counts the create calls an apiserver makes to an edge.
type countingEdge struct {
	Edge
	creates, createManys, sandboxes atomic.Int64
}

func (c *countingEdge) Create(ctx context.Context, req *connect.Request[edgev1.CreateRequest]) (*connect.Response[dsecv1.Sandbox], error) {
	c.creates.Add(1)
	c.sandboxes.Add(1)
	return c.Edge.Create(ctx, req)
}

func (c *countingEdge) CreateMany(ctx context.Context, req *connect.Request[edgev1.CreateManyRequest]) (*connect.Response[edgev1.CreateManyResponse], error) {
	c.createManys.Add(1)
	c.sandboxes.Add(int64(len(req.Msg.GetCreateTokens())))
	return c.Edge.CreateMany(ctx, req)
}

// TestBatchGoesToNodesInGroups: a batch's sandboxes go to nodes a placement
// group at a time, each node's share in one call: 40 sandboxes over 20
// nodes cost at most 10 calls, not 40; with a group of 1 they spread over
// most nodes, still one call per node.
func TestBatchGoesToNodesInGroups(t *testing.T) {
	for _, tc := range []struct {
		group, maxCalls int
	}{{0, 40 / placement.DefaultGroup}, {1, 20}} {
		var edges []*fakeEdge
		for i := range 20 {
			edges = append(edges, newFakeEdge(fmt.Sprintf("n%02d", i)))
		}
		nodes := nodesOf(edges...)
		counters := make([]*countingEdge, len(nodes))
		for i := range nodes {
			counters[i] = &countingEdge{Edge: nodes[i].Edge}
			nodes[i].Edge = counters[i]
		}
		_, _, hs := startRig(t, false, false, Config{CreateConcurrency: 4, PlacementGroup: tc.group}, nodes)
		cl := dsecv1connect.NewSandboxServiceClient(hs.Client(), hs.URL)
		resp, err := cl.Create(context.Background(), connect.NewRequest(&dsecv1.CreateRequest{
			Spec: &dsecv1.SandboxSpec{Environment: "base:1"}, Count: 40, IdempotencyKey: "groups"}))
		if err != nil {
			t.Fatal(err)
		}
		var calls, many, sent int64
		used := 0
		for i, c := range counters {
			if c.sandboxes.Load() > 0 {
				used++
			}
			calls += c.creates.Load() + c.createManys.Load()
			many += c.createManys.Load()
			sent += c.sandboxes.Load()
			if n := int64(edges[i].running()); n != c.sandboxes.Load() {
				t.Errorf("group %d: node %s runs %d sandboxes, was asked for %d", tc.group, edges[i].node, n, c.sandboxes.Load())
			}
		}
		if len(resp.Msg.GetSandboxes()) != 40 || sent != 40 || calls > int64(tc.maxCalls) {
			t.Errorf("group %d: %d sandboxes made, %d asked of edges in %d calls (%d CreateMany); want 40 in at most %d calls",
				tc.group, len(resp.Msg.GetSandboxes()), sent, calls, many, tc.maxCalls)
		}
		if tc.group == 1 && used < 15 {
			t.Errorf("group 1: 40 sandboxes landed on %d of 20 nodes, want at least 15", used)
		}
	}
}

// TestRefusedCreatesGoElsewhere: a full node's refusal is no failure: the
// sandbox is made on another node.
func TestRefusedCreatesGoElsewhere(t *testing.T) {
	overBoth(t, func(t *testing.T, newServer func(edges ...*fakeEdge) dsecv1connect.SandboxServiceClient) {
		full, free := newFakeEdge("a"), newFakeEdge("b")
		full.failAfter = 0
		cl := newServer(full, free)
		resp, err := cl.Create(context.Background(), connect.NewRequest(&dsecv1.CreateRequest{
			Spec: &dsecv1.SandboxSpec{Environment: "base:1"}, Count: 20}))
		if err != nil {
			t.Fatalf("20 creates with one node full: %v", err)
		}
		for _, sb := range resp.Msg.GetSandboxes() {
			if sb.GetNode() != "b" {
				t.Errorf("sandbox %s on the full node", sb.GetId())
			}
		}
		// Every node full: a typed error naming what ran out.
		free.failAfter = 0
		_, err = cl.Create(context.Background(), connect.NewRequest(&dsecv1.CreateRequest{Spec: &dsecv1.SandboxSpec{Environment: "base:1"}}))
		if connect.CodeOf(err) != connect.CodeResourceExhausted || !strings.Contains(err.Error(), "is full") {
			t.Errorf("create with every node full: %v", err)
		}
	})
}

// TestIdempotentAcrossReplicas: two apiservers over one metadata store and
// the same edges: the same keyed request through both, many times at once,
// makes the batch once; a reservation left by a replica that died before
// creating anything is followed, not duplicated.
func TestIdempotentAcrossReplicas(t *testing.T) {
	st, err := store.Open(context.Background(), filepath.Join(t.TempDir(), "meta.db"))
	if err != nil {
		t.Fatal(err)
	}
	defer st.Close()
	a, b := newFakeEdge("n1"), newFakeEdge("n2")
	nodes := nodesOf(a, b) // one edge service each, shared by both replicas, as one process per node
	var clients []dsecv1connect.SandboxServiceClient
	for _, name := range []string{"api1", "api2"} {
		s := New(Config{Name: name, Replicas: 2}, st, watcher.NewFixed(nodes...), slog.New(slog.DiscardHandler))
		hs := httptest.NewServer(s.Handler())
		defer hs.Close()
		clients = append(clients, dsecv1connect.NewSandboxServiceClient(hs.Client(), hs.URL))
	}
	req := &dsecv1.CreateRequest{Spec: &dsecv1.SandboxSpec{Environment: "base:1"}, Count: 4, IdempotencyKey: "k1"}
	var wg sync.WaitGroup
	answers := make([][]string, 16)
	for i := range answers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			resp, err := clients[i%2].Create(context.Background(), connect.NewRequest(req))
			if err != nil {
				t.Error(err)
				return
			}
			for _, sb := range resp.Msg.GetSandboxes() {
				answers[i] = append(answers[i], sb.GetId())
			}
		}()
	}
	wg.Wait()
	if n := a.running() + b.running(); n != 4 {
		t.Fatalf("16 calls with one key through two replicas made %d sandboxes, want 4", n)
	}
	for i := range answers {
		if strings.Join(answers[i], ",") != strings.Join(answers[0], ",") {
			t.Fatalf("answers differ: %v and %v", answers[i], answers[0])
		}
	}

	// A replica reserved k2 for n2 twice and died before any create: the
	// retry through the other follows that plan.
	req2 := &dsecv1.CreateRequest{Spec: &dsecv1.SandboxSpec{Environment: "base:1"}, Count: 2, IdempotencyKey: "k2"}
	if _, reserved, err := st.ReserveCreate(context.Background(), store.CreateReservation{Key: "k2", RequestHash: requestHash(req2),
		Owner: "api-dead", Placements: []string{"n2", "n2"}}); err != nil || !reserved {
		t.Fatalf("reserve: %v %v", reserved, err)
	}
	before := b.running()
	resp, err := clients[0].Create(context.Background(), connect.NewRequest(req2))
	if err != nil {
		t.Fatal(err)
	}
	for _, sb := range resp.Msg.GetSandboxes() {
		if sb.GetNode() != "n2" {
			t.Errorf("sandbox %s on %s, want the reservation's n2", sb.GetId(), sb.GetNode())
		}
	}
	if b.running() != before+2 {
		t.Errorf("n2 runs %d, want %d", b.running(), before+2)
	}
	again, err := clients[1].Create(context.Background(), connect.NewRequest(req2))
	if err != nil || again.Msg.GetSandboxes()[0].GetId() != resp.Msg.GetSandboxes()[0].GetId() {
		t.Errorf("replay through the other replica: %v", err)
	}
}

// TestRetryOfDoneCreateWhenFull: a keyed create that is done answers its
// retry with the same sandboxes even when placement would now find no
// room, while a new create gets the typed refusal.
func TestRetryOfDoneCreateWhenFull(t *testing.T) {
	e := newFakeEdge("n1")
	nodes := nodesOf(e)
	nodes[0].Status = &edgev1.NodeStatus{Node: "n1", Backends: []dsecv1.Backend{dsecv1.Backend_BACKEND_CONTAINER}, MaxSandboxes: 2}
	nodes[0].LastSeen = time.Now()
	_, _, hs := startRig(t, false, false, Config{CreateConcurrency: 4}, nodes)
	c := dsecv1connect.NewSandboxServiceClient(hs.Client(), hs.URL)
	ctx := context.Background()
	req := &dsecv1.CreateRequest{Spec: &dsecv1.SandboxSpec{Environment: "base:1"}, Count: 2, IdempotencyKey: "full"}
	first, err := c.Create(ctx, connect.NewRequest(req))
	if err != nil {
		t.Fatal(err)
	}
	// The node's report still says 0 live, but this apiserver placed 2 of
	// its 2: a new sandbox has no room.
	if _, err := c.Create(ctx, connect.NewRequest(&dsecv1.CreateRequest{Spec: req.Spec})); connect.CodeOf(err) != connect.CodeResourceExhausted {
		t.Fatalf("a new create with the node full: %v, want ResourceExhausted", err)
	}
	again, err := c.Create(ctx, connect.NewRequest(req))
	if err != nil {
		t.Fatalf("the retry of a done create with the node full: %v", err)
	}
	if len(again.Msg.GetSandboxes()) != 2 || again.Msg.GetSandboxes()[0].GetId() != first.Msg.GetSandboxes()[0].GetId() ||
		again.Msg.GetSandboxes()[1].GetId() != first.Msg.GetSandboxes()[1].GetId() {
		t.Errorf("the retry answered %v, want the first answer %v", again.Msg.GetSandboxes(), first.Msg.GetSandboxes())
	}
	if n := e.running(); n != 2 {
		t.Errorf("%d sandboxes run, want 2", n)
	}
	// The same key with another request is refused, full or not.
	other := &dsecv1.CreateRequest{Spec: &dsecv1.SandboxSpec{Environment: "base:2"}, Count: 2, IdempotencyKey: "full"}
	if _, err := c.Create(ctx, connect.NewRequest(other)); connect.CodeOf(err) != connect.CodeInvalidArgument {
		t.Errorf("the key with another request: %v, want InvalidArgument", err)
	}
}

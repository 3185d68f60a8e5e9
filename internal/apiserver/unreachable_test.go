package apiserver

import (
	"context"
	"log/slog"
	"net/http/httptest"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"connectrpc.com/connect"

	dsecv1 "dsec.dev/dsec/api/gen/dsec/v1"
	"dsec.dev/dsec/api/gen/dsec/v1/dsecv1connect"
	"dsec.dev/dsec/internal/iam"
	"dsec.dev/dsec/internal/store"
	"dsec.dev/dsec/internal/watcher"
)

// downFleet is a fixed fleet in which the nodes marked down read as a
// watcher reads an edge that missed three polls: unhealthy.
type downFleet struct {
	*watcher.Fixed
	mu   sync.Mutex
	down map[string]bool
}

func (f *downFleet) Nodes() []watcher.Node {
	nodes := f.Fixed.Nodes()
	f.mu.Lock()
	defer f.mu.Unlock()
	for i := range nodes {
		if f.down[nodes[i].Name] {
			nodes[i].Healthy = false
			nodes[i].LastSeen, nodes[i].Misses = downSince, 3
			nodes[i].LastErr = "dial tcp 127.0.0.1:18602: connect: connection refused"
		}
	}
	return nodes
}

// downSince is when a node marked down last answered.
var downSince = time.Date(2026, 12, 6, 19, 45, 41, 0, time.UTC)

func (f *downFleet) setDown(node string, down bool) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.down[node] = down
}

// TestListNamesUnreachableNodes: with a node unreachable, List answers the
// other nodes' sandboxes and names the node it could not list
// (unreachable_nodes), whole or paged, and the console's list says so; a
// list of a fleet all up names none. (It answered the rest alone, and dsec
// ls and the console read as if the killed edge's sandboxes were gone.)
func TestListNamesUnreachableNodes(t *testing.T) {
	ctx := context.Background()
	st, err := store.Open(ctx, filepath.Join(t.TempDir(), "meta.db"))
	if err != nil {
		t.Fatal(err)
	}
	defer st.Close()
	if _, err := st.CreatePrincipal(ctx, iam.NodeAdmin(), store.PrincipalSpec{Name: "admin"}); err != nil {
		t.Fatal(err)
	}
	if err := st.Grant(ctx, iam.NodeAdmin(), "admin", "", iam.Admin); err != nil {
		t.Fatal(err)
	}
	tok, _, err := st.MintToken(ctx, iam.NodeAdmin(), store.TokenSpec{Principal: "admin", Role: iam.Admin})
	if err != nil {
		t.Fatal(err)
	}
	fleet := &downFleet{Fixed: watcher.NewFixed(nodesOf(newFakeEdge("n1"), newFakeEdge("n2"))...), down: map[string]bool{}}
	s := New(Config{Auth: st, IAM: st, Events: st, CreateConcurrency: 4}, st, fleet, slog.New(slog.DiscardHandler))
	hs := httptest.NewUnstartedServer(s.Handler())
	hs.Config.ConnContext = ConnContext
	hs.Start()
	defer hs.Close()
	cl := dsecv1connect.NewSandboxServiceClient(hs.Client(), hs.URL, connect.WithInterceptors(bearer(tok)))
	created, err := cl.Create(ctx, connect.NewRequest(&dsecv1.CreateRequest{Count: 4, Spec: &dsecv1.SandboxSpec{Environment: "base:1"}}))
	if err != nil {
		t.Fatal(err)
	}
	onN1 := 0
	for _, sb := range created.Msg.GetSandboxes() {
		if sb.GetNode() == "n1" {
			onN1++
		}
	}
	if onN1 == 0 || onN1 == 4 {
		t.Fatalf("the batch of 4 went %d to n1, want some on each node", onN1)
	}

	list := func(req *dsecv1.ListRequest) *dsecv1.ListResponse {
		t.Helper()
		resp, err := cl.List(ctx, connect.NewRequest(req))
		if err != nil {
			t.Fatal(err)
		}
		return resp.Msg
	}
	if got := list(&dsecv1.ListRequest{}); len(got.GetSandboxes()) != 4 || len(got.GetUnreachableNodes()) != 0 {
		t.Fatalf("every node up: %d sandboxes, unreachable %v", len(got.GetSandboxes()), got.GetUnreachableNodes())
	}
	fleet.setDown("n2", true)
	got := list(&dsecv1.ListRequest{})
	if len(got.GetSandboxes()) != onN1 || !slices.Equal(got.GetUnreachableNodes(), []string{"n2"}) {
		t.Errorf("n2 down: %d sandboxes (want n1's %d), unreachable %v (want [n2])", len(got.GetSandboxes()), onN1, got.GetUnreachableNodes())
	}
	if page := list(&dsecv1.ListRequest{PageSize: 10}); int(page.GetTotal()) != onN1 || !slices.Equal(page.GetUnreachableNodes(), []string{"n2"}) {
		t.Errorf("a page with n2 down: total %d, unreachable %v", page.GetTotal(), page.GetUnreachableNodes())
	}

	b := newBrowser(t, hs)
	if code, _, page := b.signIn(tok); code != 200 || !strings.Contains(page, `id="unreachable"`) || !strings.Contains(page, `>n2</a>`) {
		t.Errorf("the console's list with n2 down: %d, no note naming n2:\n%s", code, page)
	}

	// GetServerInfo and the nodes page say when it last answered and why
	// it does not now.
	info, err := cl.GetServerInfo(ctx, connect.NewRequest(&dsecv1.GetServerInfoRequest{}))
	if err != nil {
		t.Fatal(err)
	}
	for _, n := range info.Msg.GetNodes() {
		switch {
		case n.GetName() == "n2" && (n.GetHealthy() || n.GetLastSeenUnixMs() != downSince.UnixMilli() || !strings.Contains(n.GetUnreachableReason(), "connection refused")):
			t.Errorf("n2 down: %v", n)
		case n.GetName() == "n1" && (!n.GetHealthy() || n.GetUnreachableReason() != ""):
			t.Errorf("n1 up: %v", n)
		}
	}
	if _, _, page := b.do("GET", "/console/nodes", nil); !strings.Contains(page, "unreachable") || !strings.Contains(page, "last answered 2026-12-06 19:45:41") ||
		!strings.Contains(page, "connect: connection refused") {
		t.Errorf("the nodes page with n2 down says not when nor why:\n%s", page)
	}
	fleet.setDown("n2", false)
	if _, _, page := b.do("GET", "/console/sandboxes", nil); strings.Contains(page, `id="unreachable"`) {
		t.Errorf("the console's list with every node up names one unreachable")
	}
}

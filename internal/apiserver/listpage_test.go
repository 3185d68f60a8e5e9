package apiserver

import (
	"context"
	"fmt"
	"log/slog"
	"net/http/httptest"
	"path/filepath"
	"slices"
	"sync"
	"testing"

	"connectrpc.com/connect"

	edgev1 "dsec.dev/dsec/api/gen/dsec/edge/v1"
	dsecv1 "dsec.dev/dsec/api/gen/dsec/v1"
	"dsec.dev/dsec/api/gen/dsec/v1/dsecv1connect"
	"dsec.dev/dsec/internal/edge/edgesvc"
	"dsec.dev/dsec/internal/iam"
	"dsec.dev/dsec/internal/sandboxpage"
	"dsec.dev/dsec/internal/store"
	"dsec.dev/dsec/internal/watcher"
)

// oldEdge answers List as an edge from before the scope and page fields
// does: it reads the request as a dsec.v1.ListRequest (labels and states;
// the rest unknown to it) and answers every match, unfiltered.
type oldEdge struct{ Edge }

func (e oldEdge) List(ctx context.Context, req *connect.Request[edgev1.ListRequest]) (*connect.Response[edgev1.ListResponse], error) {
	resp, err := e.Edge.List(ctx, connect.NewRequest(&edgev1.ListRequest{Labels: req.Msg.GetLabels(), States: req.Msg.GetStates()}))
	if err != nil {
		return nil, err
	}
	return connect.NewResponse(&edgev1.ListResponse{Sandboxes: resp.Msg.GetSandboxes()}), nil
}

// listCountingEdge notes the most sandboxes one List of it answered.
type listCountingEdge struct {
	Edge
	mu   sync.Mutex
	most int
}

func (e *listCountingEdge) List(ctx context.Context, req *connect.Request[edgev1.ListRequest]) (*connect.Response[edgev1.ListResponse], error) {
	resp, err := e.Edge.List(ctx, req)
	if err == nil {
		e.mu.Lock()
		e.most = max(e.most, len(resp.Msg.GetSandboxes()))
		e.mu.Unlock()
	}
	return resp, err
}

// TestListPagesOnNodes: a paged List asks each node for its own page (the
// caller's project scope, the FnCall pool left out, after the cursor),
// and its answers are those of reading every node whole: for tokens of
// the root, of projects, and of principals bound above and below their
// token's project, each
// page walk by next_page_token yields what the caller may see, newest
// first, once, with total counting only that; a node answers at most a
// page and one; and a fleet with a node from before these fields (it
// answers everything) gives the same pages and tokens.
func TestListPagesOnNodes(t *testing.T) {
	ctx := context.Background()
	st, err := store.Open(ctx, filepath.Join(t.TempDir(), "meta.db"))
	if err != nil {
		t.Fatal(err)
	}
	defer st.Close()
	for _, p := range []string{"a", "a/b", "c", "a-b"} {
		if _, err := st.CreateProject(ctx, iam.NodeAdmin(), p); err != nil {
			t.Fatal(err)
		}
	}
	mint := func(name, project string, role iam.Role, grants ...iam.Binding) string {
		t.Helper()
		if _, err := st.CreatePrincipal(ctx, iam.NodeAdmin(), store.PrincipalSpec{Name: name, Project: project}); err != nil {
			t.Fatal(err)
		}
		for _, g := range grants {
			if err := st.Grant(ctx, iam.NodeAdmin(), name, g.Project, g.Role); err != nil {
				t.Fatal(err)
			}
		}
		tok, _, err := st.MintToken(ctx, iam.NodeAdmin(), store.TokenSpec{Principal: name, Project: project, Role: role})
		if err != nil {
			t.Fatal(err)
		}
		return tok
	}
	callers := []struct {
		name string
		tok  string
		sees []string // the projects whose sandboxes it sees; nil: all
	}{
		{"root", mint("root", "", iam.Admin, iam.Binding{Project: "", Role: iam.Admin}), nil},
		{"viewer of a", mint("view-a", "a", iam.Viewer, iam.Binding{Project: "a", Role: iam.Viewer}), []string{"a", "a/b"}},
		{"runner of a/b", mint("run-ab", "a/b", iam.Runner, iam.Binding{Project: "a/b", Role: iam.Runner}), []string{"a/b"}},
		{"root's admin, a token of a/b", mint("deep", "a/b", iam.Viewer, iam.Binding{Project: "", Role: iam.Admin}), []string{"a/b"}},
		{"admin of a/b, viewer of a", mint("two", "a", iam.Admin, iam.Binding{Project: "a", Role: iam.Viewer}, iam.Binding{Project: "a/b", Role: iam.Admin}),
			[]string{"a", "a/b"}},
	}

	// 90 sandboxes over three nodes, in five projects (the root's too),
	// created two to a millisecond (the ID breaks ties), some stopped,
	// some the FnCall pool's.
	edges := []*fakeEdge{newFakeEdge("n1"), newFakeEdge("n2"), newFakeEdge("n3")}
	projects := []string{"", "a", "a/b", "c", "a-b"}
	var all []*dsecv1.Sandbox
	for i := range 90 {
		e := edges[i%3]
		labels := map[string]string{"run": fmt.Sprint(i % 2)}
		if p := projects[i%5]; p != "" {
			labels[ProjectLabel] = p
		}
		if i%11 == 0 {
			labels[FnCallPoolLabel] = "python"
		}
		state := dsecv1.State_STATE_RUNNING
		if i%7 == 0 {
			state = dsecv1.State_STATE_STOPPED
		}
		sb := &dsecv1.Sandbox{Id: e.NewID(), Node: e.node, Spec: &dsecv1.SandboxSpec{Environment: "base:1", Labels: labels},
			State: state, CreatedUnixMs: 1000 + int64(i/2)}
		e.sbs[sb.GetId()] = sb
		all = append(all, sb)
	}
	want := func(sees []string, req *dsecv1.ListRequest) []string {
		var out []*dsecv1.Sandbox
		for _, sb := range all {
			labels := sb.GetSpec().GetLabels()
			_, pool := labels[FnCallPoolLabel]
			_, askPool := req.GetLabels()[FnCallPoolLabel]
			match := (!pool || askPool) && (req.GetAll() || sb.GetState() == dsecv1.State_STATE_RUNNING) &&
				(sees == nil || slices.Contains(sees, labels[ProjectLabel]))
			for k, v := range req.GetLabels() {
				match = match && labels[k] == v
			}
			if match {
				out = append(out, sb)
			}
		}
		sandboxpage.Sort(out)
		var ids []string
		for _, sb := range out {
			ids = append(ids, sb.GetId())
		}
		return ids
	}

	type page struct {
		ids   []string
		next  string
		total int32
	}
	// walk lists every page of req through fleet, by next_page_token.
	walk := func(t *testing.T, fleet []watcher.Node, tok string, req *dsecv1.ListRequest) []page {
		t.Helper()
		s := New(Config{Auth: st, IAM: st}, st, watcher.NewFixed(fleet...), slog.New(slog.DiscardHandler))
		hs := httptest.NewUnstartedServer(s.Handler())
		hs.Config.ConnContext = ConnContext
		hs.Start()
		defer hs.Close()
		cl := dsecv1connect.NewSandboxServiceClient(hs.Client(), hs.URL, connect.WithInterceptors(bearer(tok)))
		var pages []page
		for token := ""; ; {
			req.PageToken = token
			resp, err := cl.List(ctx, connect.NewRequest(req))
			if err != nil {
				t.Fatalf("list page %d: %v", len(pages)+1, err)
			}
			p := page{next: resp.Msg.GetNextPageToken(), total: resp.Msg.GetTotal()}
			for _, sb := range resp.Msg.GetSandboxes() {
				p.ids = append(p.ids, sb.GetId())
			}
			pages = append(pages, p)
			if token = p.next; token == "" || len(pages) > 100 {
				return pages
			}
		}
	}

	for _, c := range callers {
		for _, req := range []*dsecv1.ListRequest{
			{PageSize: 4},
			{PageSize: 7, All: true},
			{PageSize: 3, Labels: map[string]string{"run": "1"}},
			{PageSize: 5, Labels: map[string]string{FnCallPoolLabel: "python"}, All: true},
			{PageSize: 1000},
		} {
			t.Run(fmt.Sprintf("%s/%v", c.name, req), func(t *testing.T) {
				wantIDs := want(c.sees, req)
				counted := make([]*listCountingEdge, len(edges))
				var paged, mixed []watcher.Node
				for i, e := range edges {
					counted[i] = &listCountingEdge{Edge: edgesvc.New(e, nil, slog.New(slog.DiscardHandler))}
					paged = append(paged, watcher.Node{Member: watcher.Member{Name: e.node}, Edge: counted[i]})
					var edge Edge = edgesvc.New(e, nil, slog.New(slog.DiscardHandler))
					if i == 1 {
						edge = oldEdge{edge}
					}
					mixed = append(mixed, watcher.Node{Member: watcher.Member{Name: e.node}, Edge: edge})
				}
				got := walk(t, paged, c.tok, &dsecv1.ListRequest{PageSize: req.PageSize, All: req.All, Labels: req.Labels})
				var ids []string
				for i, p := range got {
					ids = append(ids, p.ids...)
					if int(p.total) != len(wantIDs) {
						t.Errorf("page %d: total %d, want %d", i+1, p.total, len(wantIDs))
					}
					if len(p.ids) != int(min(req.PageSize, int32(len(wantIDs)-i*int(req.PageSize)))) {
						t.Errorf("page %d holds %d", i+1, len(p.ids))
					}
				}
				if !slices.Equal(ids, wantIDs) {
					t.Errorf("walked %d sandboxes:\n%q\nwant %d:\n%q", len(ids), ids, len(wantIDs), wantIDs)
				}
				for i, e := range counted {
					if e.most > int(req.PageSize)+1 {
						t.Errorf("node n%d answered %d sandboxes to a page of %d", i+1, e.most, req.PageSize)
					}
				}
				if old := walk(t, mixed, c.tok, &dsecv1.ListRequest{PageSize: req.PageSize, All: req.All, Labels: req.Labels}); !slices.EqualFunc(old, got, func(a, b page) bool {
					return slices.Equal(a.ids, b.ids) && a.next == b.next && a.total == b.total
				}) {
					t.Errorf("with n2 from before the page fields:\n%+v\nwant as every node paging:\n%+v", old, got)
				}
			})
		}
	}
}

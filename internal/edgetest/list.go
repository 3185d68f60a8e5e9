package edgetest

import (
	"fmt"
	"maps"
	"slices"
	"testing"

	"connectrpc.com/connect"

	edgev1 "dsec.dev/dsec/api/gen/dsec/edge/v1"
	dsecv1 "dsec.dev/dsec/api/gen/dsec/v1"
	"dsec.dev/dsec/internal/iam"
	"dsec.dev/dsec/internal/sandboxpage"
)

// listPoolLabel marks the suite's sandbox that a List leaving it out
// names (as the apiserver names the FnCall pool's).
const listPoolLabel = "edgetest-pool"

// testList: List answers only what its request leaves in: the project
// scope (a project and those under it, not a sibling whose name starts
// alike; none for an empty scope), the excluded labels, and, paged, the
// node's first page_size matches after the cursor, newest first, with
// the count of every match; filtered set. An edge that ignores the scope,
// exclusion or cursor (answering every match, as an edge did before
// them) fails here.
func testList(t *testing.T, e *edge) {
	ctx := t.Context()
	var made []*dsecv1.Sandbox
	for i, labels := range []map[string]string{
		{iam.ProjectLabel: "lp"},
		{iam.ProjectLabel: "lp/sub"},
		{iam.ProjectLabel: "lp-x"},
		{listPoolLabel: "1"}, // the root project's
	} {
		spec := e.spec()
		maps.Copy(spec.Labels, labels)
		resp, err := e.h.Create(ctx, connect.NewRequest(&edgev1.CreateRequest{Spec: spec, CreateToken: fmt.Sprintf("edgetest-list#%d@%s", i, e.node)}))
		if err != nil {
			t.Fatalf("Create %v: %v", labels, err)
		}
		made = append(made, resp.Msg)
	}
	id := func(i int) string { return made[i].GetId() }
	list := func(req *edgev1.ListRequest) ([]string, int) {
		t.Helper()
		req.Labels = map[string]string{"edgetest": t.Name()}
		resp, err := e.h.List(ctx, connect.NewRequest(req))
		if err != nil {
			t.Fatalf("List %v: %v", req, err)
		}
		if !resp.Msg.GetFiltered() {
			t.Fatalf("List %v: filtered not set", req)
		}
		var ids []string
		for _, sb := range resp.Msg.GetSandboxes() {
			ids = append(ids, sb.GetId())
		}
		return ids, int(resp.Msg.GetTotal())
	}
	same := func(got []string, want ...string) bool {
		return slices.Equal(slices.Sorted(slices.Values(got)), slices.Sorted(slices.Values(want)))
	}
	for _, c := range []struct {
		name string
		req  *edgev1.ListRequest
		want []string
	}{
		{"everything", &edgev1.ListRequest{}, []string{id(0), id(1), id(2), id(3)}},
		{"scope lp", &edgev1.ListRequest{Scoped: true, Projects: []string{"lp"}}, []string{id(0), id(1)}},
		{"scope lp/sub and lp-x", &edgev1.ListRequest{Scoped: true, Projects: []string{"lp/sub", "lp-x"}}, []string{id(1), id(2)}},
		{"scope the root", &edgev1.ListRequest{Scoped: true, Projects: []string{""}}, []string{id(0), id(1), id(2), id(3)}},
		{"scope empty", &edgev1.ListRequest{Scoped: true}, nil},
		{"pool left out", &edgev1.ListRequest{ExcludeLabels: []string{listPoolLabel}}, []string{id(0), id(1), id(2)}},
	} {
		if got, total := list(c.req); !same(got, c.want...) || total != len(c.want) {
			t.Errorf("List, %s: %v (total %d), want %v", c.name, got, total, c.want)
		}
	}

	// Pages of two, newest first, by the cursor of each page's last.
	order := slices.Clone(made)
	sandboxpage.Sort(order)
	var ids []string
	for _, sb := range order {
		ids = append(ids, sb.GetId())
	}
	first, total := list(&edgev1.ListRequest{PageSize: 2})
	if !slices.Equal(first, ids[:2]) || total != 4 {
		t.Fatalf("List, first page of 2: %v (total %d), want %v (total 4)", first, total, ids[:2])
	}
	last := order[1]
	rest, total := list(&edgev1.ListRequest{PageSize: 2, AfterCreatedUnixMs: last.GetCreatedUnixMs(), AfterId: last.GetId()})
	if !slices.Equal(rest, ids[2:]) || total != 4 {
		t.Errorf("List, the page of 2 after %s: %v (total %d), want %v (total 4)", last.GetId(), rest, total, ids[2:])
	}
	// A cursor whose sandbox is gone: what comes after its place.
	gone, total := list(&edgev1.ListRequest{PageSize: 2, AfterCreatedUnixMs: last.GetCreatedUnixMs(), AfterId: last.GetId() + "~"})
	if !slices.Equal(gone, ids[2:]) || total != 4 {
		t.Errorf("List, the page of 2 after a gone %s~: %v (total %d), want %v (total 4)", last.GetId(), gone, total, ids[2:])
	}
	// Scope and cursor at once.
	scoped, total := list(&edgev1.ListRequest{PageSize: 10, Scoped: true, Projects: []string{"lp"}, AfterCreatedUnixMs: last.GetCreatedUnixMs(), AfterId: last.GetId()})
	var wantScoped []string
	for _, sb := range order[2:] {
		if p := sb.GetSpec().GetLabels()[iam.ProjectLabel]; p == "lp" || p == "lp/sub" {
			wantScoped = append(wantScoped, sb.GetId())
		}
	}
	if !slices.Equal(scoped, wantScoped) || total != 2 {
		t.Errorf("List of lp after %s: %v (total %d), want %v (total 2)", last.GetId(), scoped, total, wantScoped)
	}
}

package edgeclient_test

import (
	"context"
	"log/slog"
	"maps"
	"net/http"
	"net/http/httptest"
	"slices"
	"testing"

	"connectrpc.com/connect"

	edgev1 "dsec.dev/dsec/api/gen/dsec/edge/v1"
	"dsec.dev/dsec/api/gen/dsec/edge/v1/edgev1connect"
	dsecv1 "dsec.dev/dsec/api/gen/dsec/v1"
	"dsec.dev/dsec/internal/edge/edgesvc"
	"dsec.dev/dsec/internal/edge/hollow"
	"dsec.dev/dsec/internal/edgeclient"
	"dsec.dev/dsec/internal/iam"
)

// TestListAcrossVersions: the edge's List keeps the field numbers of
// dsec.v1.ListRequest and ListResponse, which it carried before the scope
// and page fields, so each side of a cluster halfway through an upgrade
// reads the other over the wire. An edge from before (a handler of the old
// messages) reads a new apiserver's request as its labels and states, and
// its answer, every match, reads as unfiltered; a new edge reads an old
// apiserver's request as unscoped and unpaged, and answers every match.
func TestListAcrossVersions(t *testing.T) {
	ctx := t.Context()
	labels := map[string]string{"run": "1"}
	states := []dsecv1.State{dsecv1.State_STATE_RUNNING, dsecv1.State_STATE_PAUSED}

	var asked *dsecv1.ListRequest
	mux := http.NewServeMux()
	mux.Handle(edgev1connect.EdgeServiceListProcedure, connect.NewUnaryHandler(edgev1connect.EdgeServiceListProcedure,
		func(ctx context.Context, req *connect.Request[dsecv1.ListRequest]) (*connect.Response[dsecv1.ListResponse], error) {
			asked = req.Msg
			return connect.NewResponse(&dsecv1.ListResponse{Sandboxes: []*dsecv1.Sandbox{{Id: "sb-1"}, {Id: "sb-2"}}}), nil
		}))
	old := httptest.NewServer(mux)
	defer old.Close()
	remote := edgeclient.New(old.Client(), old.Client(), old.URL, nil)
	resp, err := remote.List(ctx, connect.NewRequest(&edgev1.ListRequest{Labels: labels, States: states, PageSize: 101,
		Scoped: true, Projects: []string{"a"}, ExcludeLabels: []string{"dsec.fncall/pool"}, AfterCreatedUnixMs: 7, AfterId: "sb-9"}))
	if err != nil {
		t.Fatalf("List of an edge from before: %v", err)
	}
	if !maps.Equal(asked.GetLabels(), labels) || !slices.Equal(asked.GetStates(), states) {
		t.Errorf("the edge from before read labels %v, states %v; want %v, %v", asked.GetLabels(), asked.GetStates(), labels, states)
	}
	if resp.Msg.GetFiltered() || len(resp.Msg.GetSandboxes()) != 2 {
		t.Errorf("its answer: filtered %v, %d sandboxes; want unfiltered, 2", resp.Msg.GetFiltered(), len(resp.Msg.GetSandboxes()))
	}

	h := hollow.New(hollow.Config{Node: "h1"})
	svc := edgesvc.New(h, nil, slog.New(slog.DiscardHandler))
	for _, project := range []string{"a", "b"} {
		spec := &dsecv1.SandboxSpec{Environment: "base:1", Labels: map[string]string{"run": "1", iam.ProjectLabel: project}}
		if _, err := svc.Create(ctx, connect.NewRequest(&edgev1.CreateRequest{Spec: spec})); err != nil {
			t.Fatal(err)
		}
	}
	mux = http.NewServeMux()
	mux.Handle(svc.Handler())
	edge := httptest.NewServer(mux)
	defer edge.Close()
	oldAPI := connect.NewClient[dsecv1.ListRequest, dsecv1.ListResponse](edge.Client(), edge.URL+edgev1connect.EdgeServiceListProcedure)
	got, err := oldAPI.CallUnary(ctx, connect.NewRequest(&dsecv1.ListRequest{Labels: labels, States: states}))
	if err != nil {
		t.Fatalf("List from an apiserver from before: %v", err)
	}
	if n := len(got.Msg.GetSandboxes()); n != 2 {
		t.Errorf("a new edge answered an apiserver from before %d sandboxes, want both projects' 2", n)
	}
}

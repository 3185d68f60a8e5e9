package edgesvc_test

import (
	"context"
	"testing"

	"connectrpc.com/connect"

	edgev1 "dsec.dev/dsec/api/gen/dsec/edge/v1"
	dsecv1 "dsec.dev/dsec/api/gen/dsec/v1"
	"dsec.dev/dsec/internal/edge/hollow"
)

// TestStatusKinds: an edge whose node names no kinds (a hollow one) offers
// containers, as its backends say; Offers is its status for in-process
// callers.
func TestStatusKinds(t *testing.T) {
	svc := newService(hollow.Config{})
	st, err := svc.Status(context.Background(), connect.NewRequest(&edgev1.StatusRequest{}))
	if err != nil {
		t.Fatal(err)
	}
	ks := st.Msg.GetKinds()
	if len(ks) != 1 || ks[0].GetIsolation() != dsecv1.Isolation_ISOLATION_CONTAINER || ks[0].GetProfile() != dsecv1.Backend_BACKEND_CONTAINER {
		t.Errorf("hollow edge's kinds %v, want container alone", ks)
	}
	if got := svc.Offers(); len(got.GetKinds()) != 1 || got.GetNode() != "h1" {
		t.Errorf("Offers %v, want the status", got)
	}
}

package apiserver

import (
	"log/slog"
	"testing"

	"dsec.dev/dsec/api/gen/dsec/edge/v1/edgev1connect"
	"dsec.dev/dsec/internal/edge/edgesvc"
	"dsec.dev/dsec/internal/edgetest"
)

// TestFakeEdgeConformance runs the seam's conformance suite against the
// fake edge these tests route to, so what they prove of the apiserver
// holds of the edges it really calls.
func TestFakeEdgeConformance(t *testing.T) {
	edgetest.Run(t, edgetest.Options{
		New: func(t *testing.T) edgev1connect.EdgeServiceHandler {
			return edgesvc.New(newFakeEdge("n1"), nil, slog.New(slog.DiscardHandler))
		},
		Fork:           edgetest.ForkMakes,
		Deviations:     edgetest.Deviations{NoAgent: true},
		NoLayers:       true, // the service's layers are nil: none
		NoTrajectories: true, // the service records them, not the edge: TestConformanceHollow checks it
		NoEvents:       true, // the fake keeps no event log: TestConformanceHollow checks the service's
		NoLedger:       true, // nor a ledger: TestConformanceHollow checks the service's
	})
}

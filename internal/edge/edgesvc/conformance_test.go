package edgesvc_test

import (
	"log/slog"
	"testing"

	"dsec.dev/dsec/api/gen/dsec/edge/v1/edgev1connect"
	"dsec.dev/dsec/internal/edge/edgesvc"
	"dsec.dev/dsec/internal/edge/eventlog"
	"dsec.dev/dsec/internal/edge/hollow"
	"dsec.dev/dsec/internal/edge/ledger"
	"dsec.dev/dsec/internal/edge/trajectory"
	"dsec.dev/dsec/internal/edgetest"
)

// TestConformanceHollow runs the seam's conformance suite against the
// edge service over a hollow edge, called in process as the all-in-one
// apiserver calls its edge. The real edge runs it in test/root
// (TestEdgeConformance), the remote client in package edgeclient.
func TestConformanceHollow(t *testing.T) {
	edgetest.Run(t, edgetest.Options{
		New: func(t *testing.T) edgev1connect.EdgeServiceHandler {
			log := eventlog.New("h1", 0)
			l := newLedger(t, "h1")
			svc := withRecorder(t, hollow.New(hollow.Config{Node: "h1", Events: log, Ledger: l}))
			svc.SetEvents(log)
			svc.SetLedger(l)
			return svc
		},
		Fork:       edgetest.ForkUnsupported,
		Deviations: edgetest.Deviations{NoAgent: true},
		NoLayers:   true, // a hollow edge keeps none
	})
}

// newLedger is node's cost ledger, kept in memory.
func newLedger(t *testing.T, node string) *ledger.Ledger {
	l, err := ledger.Open(node, "", slog.New(slog.DiscardHandler))
	if err != nil {
		t.Fatal(err)
	}
	return l
}

// withRecorder is the service over e, recording trajectories under a
// temporary directory.
func withRecorder(t *testing.T, e *hollow.Edge) *edgesvc.Service {
	svc := edgesvc.New(e, nil, slog.New(slog.DiscardHandler))
	rec, err := trajectory.New(trajectory.Config{Dir: t.TempDir()}, e)
	if err != nil {
		t.Fatal(err)
	}
	svc.SetRecorder(rec)
	return svc
}

package edgeclient_test

import (
	"log/slog"
	"net"
	"net/http"
	"path/filepath"
	"testing"

	"dsec.dev/dsec/api/gen/dsec/edge/v1/edgev1connect"
	"dsec.dev/dsec/internal/clustertls"
	"dsec.dev/dsec/internal/edge/edgesvc"
	"dsec.dev/dsec/internal/edge/eventlog"
	"dsec.dev/dsec/internal/edge/hollow"
	"dsec.dev/dsec/internal/edge/ledger"
	"dsec.dev/dsec/internal/edge/trajectory"
	"dsec.dev/dsec/internal/edgeclient"
	"dsec.dev/dsec/internal/edgetest"
	"dsec.dev/dsec/internal/receipt"
	sdkreceipt "dsec.dev/dsec/sdk/go/receipt"
)

// TestConformanceRemote runs the seam's conformance suite against the
// remote client, calling an edge service over a hollow edge across the
// cluster's transport: its mutual TLS from a throwaway CA, HTTP/1.1 and
// HTTP/2 as an apiserver dials an edge (Dial). The real edge runs the suite
// through this client in test/root (TestEdgeConformance).
func TestConformanceRemote(t *testing.T) {
	dir := t.TempDir()
	if err := clustertls.InitCluster(dir, []string{"api1"}, []clustertls.EdgeSpec{{Name: "h1", Hosts: []string{"127.0.0.1"}}}); err != nil {
		t.Fatal(err)
	}
	edgetest.Run(t, edgetest.Options{
		New: func(t *testing.T) edgev1connect.EdgeServiceHandler {
			log := eventlog.New("h1", 0)
			l, err := ledger.Open("h1", "", slog.New(slog.DiscardHandler))
			if err != nil {
				t.Fatal(err)
			}
			h := hollow.New(hollow.Config{Node: "h1", Events: log, Ledger: l})
			svc := edgesvc.New(h, nil, slog.New(slog.DiscardHandler))
			svc.SetEvents(log)
			svc.SetLedger(l)
			rec, err := trajectory.New(trajectory.Config{Dir: t.TempDir()}, h)
			if err != nil {
				t.Fatal(err)
			}
			svc.SetRecorder(rec)
			// The edge's receipt key, as dsecd edge gives it: a hollow
			// edge runs no grader, so it signs nothing, over the wire too.
			svc.SetReceipts(func() (*sdkreceipt.Signer, error) {
				return receipt.EdgeSigner(clustertls.ComponentFiles(dir, clustertls.RoleEdge, "h1"))
			})
			return serve(t, dir, svc)
		},
		Fork:       edgetest.ForkUnsupported,
		Deviations: edgetest.Deviations{NoAgent: true},
		NoLayers:   true, // a hollow edge keeps none
		ReceiptCA:  filepath.Join(dir, "ca.crt"),
	})
}

// serve serves svc as `dsecd edge` does (mutual TLS accepting apiservers,
// HTTP/1.1 and HTTP/2) on a loopback port, and returns the remote client
// an apiserver would make of it.
func serve(t *testing.T, dir string, svc *edgesvc.Service) *edgeclient.Remote {
	t.Helper()
	stc, err := clustertls.ServerConfig(clustertls.ComponentFiles(dir, clustertls.RoleEdge, "h1"), clustertls.RoleAPIServer)
	if err != nil {
		t.Fatal(err)
	}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	mux := http.NewServeMux()
	mux.Handle(svc.Handler())
	srv := &http.Server{Handler: mux, TLSConfig: stc, Protocols: new(http.Protocols)}
	srv.Protocols.SetHTTP1(true)
	srv.Protocols.SetHTTP2(true)
	go srv.ServeTLS(ln, "", "")
	t.Cleanup(func() { srv.Close() })
	ctc, err := clustertls.ClientConfig(clustertls.ComponentFiles(dir, clustertls.RoleAPIServer, "api1"), clustertls.RoleEdge, "h1")
	if err != nil {
		t.Fatal(err)
	}
	return edgeclient.Dial(ctc, "https://"+ln.Addr().String(), nil)
}

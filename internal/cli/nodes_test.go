package cli

import (
	"context"
	"strings"
	"testing"
	"time"

	"connectrpc.com/connect"

	dsecv1 "dsec.dev/dsec/api/gen/dsec/v1"
)

// nodesFake answers GetServerInfo with its nodes.
type nodesFake struct {
	fakeSandboxes
	nodes []*dsecv1.NodeInfo
}

func (f *nodesFake) GetServerInfo(context.Context, *connect.Request[dsecv1.GetServerInfoRequest]) (*connect.Response[dsecv1.ServerInfo], error) {
	return connect.NewResponse(&dsecv1.ServerInfo{Name: "api1", Nodes: f.nodes}), nil
}

// TestNodesSaysWhyUnreachable: dsec nodes says of an unhealthy node when
// it last answered, that its LIVE is as of then, and why its polls fail;
// it said only "false", with the killed edge's LIVE of its last report.
func TestNodesSaysWhyUnreachable(t *testing.T) {
	seen := time.Now().Add(-12 * time.Second).UnixMilli()
	f := &nodesFake{nodes: []*dsecv1.NodeInfo{
		{Name: "e1", Healthy: true, Live: 3, MaxSandboxes: 10, LastSeenUnixMs: time.Now().UnixMilli()},
		{Name: "e2", Live: 3, MaxSandboxes: 10, LastSeenUnixMs: seen, UnreachableReason: "dial tcp 127.0.0.1:18602: connect: connection refused"},
		{Name: "e3", UnreachableReason: "context deadline exceeded"},
	}}
	out, errOut, err := runCLIErr(t, startHandler(t, f), "nodes")
	if err != nil || !strings.Contains(out, "e2") {
		t.Fatalf("dsec nodes: %v, %q", err, out)
	}
	for _, want := range []string{
		"dsec: node e2 is unreachable: last answered 12s ago, its LIVE as of then (dial tcp 127.0.0.1:18602: connect: connection refused)\n",
		"dsec: node e3 is unreachable: it has not answered since the apiserver started (context deadline exceeded)\n",
	} {
		if !strings.Contains(errOut, want) {
			t.Errorf("stderr %q, want %q in it", errOut, want)
		}
	}
	if strings.Contains(errOut, "e1") {
		t.Errorf("stderr %q names the healthy node", errOut)
	}
}

func TestParseIsolation(t *testing.T) {
	for _, tc := range []struct {
		in   string
		want dsecv1.Isolation
		ok   bool
	}{
		{"", dsecv1.Isolation_ISOLATION_UNSPECIFIED, true},
		{"container", dsecv1.Isolation_ISOLATION_CONTAINER, true},
		{"gvisor", dsecv1.Isolation_ISOLATION_GVISOR, true},
		{"microvm", dsecv1.Isolation_ISOLATION_MICROVM, true},
		{"MicroVM", dsecv1.Isolation_ISOLATION_MICROVM, true},
		{"unspecified", 0, false},
		{"firecracker", 0, false},
	} {
		got, err := parseIsolation(tc.in)
		if (err == nil) != tc.ok || (tc.ok && got != tc.want) {
			t.Errorf("parseIsolation(%q) = %v, %v; want %v, ok %v", tc.in, got, err, tc.want, tc.ok)
		}
	}
}

func TestKindsText(t *testing.T) {
	ks := []*dsecv1.SandboxKind{
		{Isolation: dsecv1.Isolation_ISOLATION_CONTAINER, Profile: dsecv1.Backend_BACKEND_CONTAINER},
		{Isolation: dsecv1.Isolation_ISOLATION_CONTAINER, Profile: dsecv1.Backend_BACKEND_FNCALL},
		{Isolation: dsecv1.Isolation_ISOLATION_GVISOR, Profile: dsecv1.Backend_BACKEND_CONTAINER, Accelerator: "systrap"},
	}
	if got, want := kindsText(ks), "container, container/fncall, gvisor (systrap)"; got != want {
		t.Errorf("kindsText = %q, want %q", got, want)
	}
	if got, want := missingText(map[string]string{"microvm": "no QEMU", "gvisor": "no runsc"}), "gvisor: no runsc; microvm: no QEMU"; got != want {
		t.Errorf("missingText = %q, want %q", got, want)
	}
}

package dsec

import (
	"context"
	"testing"
	"time"

	"connectrpc.com/connect"
	"github.com/google/go-cmp/cmp"

	dsecv1 "dsec.dev/dsec/api/gen/dsec/v1"
)

func (f *fakeService) GetServerInfo(ctx context.Context, r *connect.Request[dsecv1.GetServerInfoRequest]) (*connect.Response[dsecv1.ServerInfo], error) {
	return connect.NewResponse(f.serverInfo), nil
}

func TestNodes(t *testing.T) {
	_, c := startFake(t, &fakeService{serverInfo: &dsecv1.ServerInfo{Nodes: []*dsecv1.NodeInfo{{
		Name: "n1", Healthy: true, Live: 3, MaxSandboxes: 100,
		Kinds: []*dsecv1.SandboxKind{
			{Isolation: dsecv1.Isolation_ISOLATION_CONTAINER, Profile: dsecv1.Backend_BACKEND_CONTAINER},
			{Isolation: dsecv1.Isolation_ISOLATION_GVISOR, Profile: dsecv1.Backend_BACKEND_CONTAINER, Accelerator: "systrap"},
		},
		Missing: map[string]string{"microvm": "no QEMU"},
	}, {
		Name: "n2", Live: 2, MaxSandboxes: 100, LastSeenUnixMs: 1796550341000, UnreachableReason: "dial tcp: connection refused",
	}}}})
	got, err := c.Nodes(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	want := []Node{{Name: "n1", Healthy: true, Live: 3, MaxSandboxes: 100,
		Kinds:   []NodeKind{{Isolation: IsolationContainer, Profile: "container"}, {Isolation: IsolationGVisor, Profile: "container", Accelerator: "systrap"}},
		Missing: map[string]string{"microvm": "no QEMU"}},
		{Name: "n2", Live: 2, MaxSandboxes: 100, LastSeen: time.UnixMilli(1796550341000), UnreachableReason: "dial tcp: connection refused"}}
	if d := cmp.Diff(want, got); d != "" {
		t.Errorf("Nodes (-want +got):\n%s", d)
	}
}

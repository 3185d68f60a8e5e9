package root

import (
	"context"
	"strconv"
	"strings"
	"testing"
	"time"

	"connectrpc.com/connect"

	dsecv1 "dsec.dev/dsec/api/gen/dsec/v1"
	"dsec.dev/dsec/internal/testutil"
)

// TestGVisorNetwork: a gVisor sandbox with network rules gets the edge's
// network as a container does (runsc's own network stack takes over the
// veth in the sandbox's namespace, so the node's nftables policy, DNS
// allowlist and audit apply unchanged; its DNS goes to vmnet.DNSAddr,
// which the namespace turns round to the edge's resolver): its host name
// is its address, an allowed service answers by name (DNS over UDP and
// TCP), a denied one neither resolves nor connects, nor does the metadata
// address, an upload keeps to the egress cap, the audit log has it all,
// and a live rule update applies at once after a kill -9 and restart of
// dsecd (checkNetworkRules).
func TestGVisorNetwork(t *testing.T) {
	runsc := testutil.Runsc(t)
	e := setupNetwork(t, "--runsc", runsc, "--vm-kernel-dir", t.TempDir(), "--sandbox-egress-bytes", strconv.Itoa(netCheckEgress))
	gv := e.sandboxOf(t, &dsecv1.SandboxSpec{
		Isolation:    dsecv1.Isolation_ISOLATION_GVISOR,
		NetworkRules: map[string]bool{"pypi": true, "npm": false},
	})
	if got := mustSh(t, e.d, gv.GetId(), "uname -r"); !strings.Contains(got, "gvisor") {
		t.Fatalf("uname -r %q in a gvisor sandbox: not gVisor", got)
	}
	checkNetworkRules(t, e, gv, "gVisor sandbox")
}

// TestGVisorOOM: under gVisor an allocation past the memory limit ends the
// whole sandbox (the host's OOM killer kills the sentry): the edge fails
// it with REASON_OOM and a message naming the limit.
func TestGVisorOOM(t *testing.T) {
	runsc := testutil.Runsc(t)
	d := startDaemon(t, "--runsc", runsc, "--vm-kernel-dir", t.TempDir())
	testGVisorOOM(t, d)
}

// testGVisorOOM makes a gVisor sandbox of 128 MiB on d, holds 256 MiB in
// it and waits for it to fail.
func testGVisorOOM(t *testing.T, d *testutil.Daemon) {
	sb := create(t, d, &dsecv1.SandboxSpec{Isolation: dsecv1.Isolation_ISOLATION_GVISOR, MemoryMb: 128})
	ctx := context.Background()
	// The exec's stream ends with the sandbox: no exit to wait for.
	ectx, cancel := context.WithTimeout(ctx, 60*time.Second)
	defer cancel()
	if stream, err := d.Clients.Sandboxes.Exec(ectx, connect.NewRequest(&dsecv1.ExecRequest{
		SandboxId: sb.GetId(), Command: "mkdir -p /tmp/oom && exec /.dsec/bin/dsec-agent hold-memory 256 /tmp/oom",
	})); err == nil {
		for stream.Receive() {
		}
		stream.Close()
	}
	var got *dsecv1.Sandbox
	for deadline := time.Now().Add(30 * time.Second); time.Now().Before(deadline); time.Sleep(100 * time.Millisecond) {
		resp, err := d.Clients.Sandboxes.Get(ctx, connect.NewRequest(&dsecv1.GetRequest{Id: sb.GetId()}))
		if err != nil {
			t.Fatal(err)
		}
		if got = resp.Msg; got.GetState() == dsecv1.State_STATE_FAILED {
			break
		}
	}
	t.Logf("a gVisor sandbox out of memory: %s, %s: %q", got.GetState(), got.GetReason(), got.GetMessage())
	if got.GetState() != dsecv1.State_STATE_FAILED || got.GetReason() != dsecv1.Reason_REASON_OOM ||
		!strings.Contains(got.GetMessage(), "memory limit of 128 MiB") {
		t.Errorf("a gVisor sandbox out of memory is %s, %s: %q; want failed, REASON_OOM, naming its limit of 128 MiB",
			got.GetState(), got.GetReason(), got.GetMessage())
	}
}

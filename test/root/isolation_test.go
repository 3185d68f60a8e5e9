package root

import (
	"context"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"connectrpc.com/connect"

	dsecv1 "dsec.dev/dsec/api/gen/dsec/v1"
	"dsec.dev/dsec/internal/testutil"
)

// TestIsolationsSideBySide: one dsecd offers runc's container isolation
// and gVisor's beside it. A container and a gvisor sandbox run at once,
// each in its own runtime (gVisor's kernel answers uname and dmesg in the
// one, the host's in the other), both survive a daemon restart, the node
// lists what it offers and lacks, and a create asking for microvm, which
// it lacks, is refused naming what to install, with nothing made.
func TestIsolationsSideBySide(t *testing.T) {
	runsc := testutil.Runsc(t)
	// No guest kernel where the node looks for one: it lacks microvm.
	d := startDaemon(t, "--runsc", runsc, "--vm-kernel-dir", t.TempDir())
	ctx := context.Background()

	info, err := d.Clients.Sandboxes.GetServerInfo(ctx, connect.NewRequest(&dsecv1.GetServerInfoRequest{}))
	if err != nil {
		t.Fatal(err)
	}
	nodes := info.Msg.GetNodes()
	if len(nodes) != 1 {
		t.Fatalf("server info lists nodes %v, want t1 alone", nodes)
	}
	var offers []string
	for _, k := range nodes[0].GetKinds() {
		offers = append(offers, k.GetIsolation().String()+"/"+k.GetProfile().String()+"@"+k.GetAccelerator())
	}
	for _, want := range []string{"ISOLATION_CONTAINER/BACKEND_CONTAINER@", "ISOLATION_GVISOR/BACKEND_CONTAINER@systrap"} {
		if !slices.Contains(offers, want) {
			t.Errorf("node t1 offers %v, want %s among them", offers, want)
		}
	}
	lacks := nodes[0].GetMissing()["microvm"]
	if lacks == "" {
		t.Errorf("node t1 does not say why it lacks microvm: missing %v", nodes[0].GetMissing())
	}

	ctr := create(t, d, nil)
	gv := create(t, d, &dsecv1.SandboxSpec{Isolation: dsecv1.Isolation_ISOLATION_GVISOR})
	if got := ctr.GetSpec().GetIsolation(); got != dsecv1.Isolation_ISOLATION_CONTAINER {
		t.Errorf("container sandbox recorded with isolation %s", got)
	}
	if got := gv.GetSpec().GetIsolation(); got != dsecv1.Isolation_ISOLATION_GVISOR {
		t.Errorf("gvisor sandbox recorded with isolation %s", got)
	}
	// Each is in its own runtime's state on the host.
	for _, c := range []struct{ id, dir string }{
		{ctr.GetId(), filepath.Join(d.Root, "runtime", "bundles")},
		{gv.GetId(), filepath.Join(d.Root, "runtime", "gvisor", "bundles")},
	} {
		if _, err := os.Stat(filepath.Join(c.dir, c.id)); err != nil {
			t.Errorf("sandbox %s has no bundle in %s: %v", c.id, c.dir, err)
		}
	}

	check := func(when string) {
		t.Helper()
		host, err := os.ReadFile("/proc/sys/kernel/osrelease")
		if err != nil {
			t.Fatal(err)
		}
		cu := strings.TrimSpace(mustSh(t, d, ctr.GetId(), "uname -r"))
		gu := strings.TrimSpace(mustSh(t, d, gv.GetId(), "uname -r"))
		if cu != strings.TrimSpace(string(host)) {
			t.Errorf("%s: the container's uname -r %q, want the host's %q", when, cu, host)
		}
		if gu == cu {
			t.Errorf("%s: the gvisor sandbox's uname -r is the host's %q, want gVisor's", when, gu)
		}
		if out := mustSh(t, d, gv.GetId(), "dmesg 2>&1 | head -5"); !strings.Contains(out, "gVisor") {
			t.Errorf("%s: dmesg in the gvisor sandbox: %q, want gVisor's kernel log", when, out)
		}
		if out := sh(t, d, ctr.GetId(), "dmesg 2>&1 | head -5").stdout; strings.Contains(out, "gVisor") {
			t.Errorf("%s: dmesg in the container: %q, gVisor's kernel log", when, out)
		}
		t.Logf("%s: uname -r: container %s, gvisor %s", when, cu, gu)
	}
	check("started")
	d.Kill()
	d.Start()
	check("after a restart")

	// microvm, which this node lacks: refused, naming what it offers and
	// what it lacks for it, and nothing made.
	_, err = d.Clients.Sandboxes.Create(ctx, connect.NewRequest(&dsecv1.CreateRequest{
		Spec: &dsecv1.SandboxSpec{Environment: env, Isolation: dsecv1.Isolation_ISOLATION_MICROVM}}))
	if err == nil {
		t.Fatal("a microvm create on a node without microvm was not refused")
	}
	t.Logf("microvm create refused: %v", err)
	for _, want := range []string{"microvm", "gvisor", lacks} {
		if !strings.Contains(err.Error(), want) {
			t.Errorf("microvm create: %v, want it to say %q", err, want)
		}
	}
	list, err := d.Clients.Sandboxes.List(ctx, connect.NewRequest(&dsecv1.ListRequest{All: true}))
	if err != nil {
		t.Fatal(err)
	}
	if n := len(list.Msg.GetSandboxes()); n != 2 {
		t.Errorf("%d sandboxes after the refused create, want the 2 made", n)
	}
	if out, _, code := d.CLI("", "nodes"); code != 0 || !strings.Contains(out, "gvisor (systrap)") || !strings.Contains(out, "microvm: ") {
		t.Errorf("dsec nodes exited %d:\n%s", code, out)
	}
	out, _, code := d.CLI("", "ls")
	lines := strings.Split(out, "\n")
	col := slices.Index(strings.Fields(lines[0]), "ISOLATION")
	if col < 0 {
		t.Fatalf("dsec ls has no ISOLATION column:\n%s", out)
	}
	for _, line := range lines[1:] {
		fields := strings.Fields(line)
		if len(fields) > col && (fields[0] == gv.GetId() && fields[col] != "gvisor" || fields[0] == ctr.GetId() && fields[col] != "container") {
			t.Errorf("dsec ls shows %q", line)
		}
	}
	if code != 0 || strings.Count(out, "sb-") != 2 {
		t.Errorf("dsec ls exited %d:\n%s", code, out)
	}
}

// TestIsolationTurnedOff: a dsecd told --runsc none offers containers only
// and refuses a gvisor create saying why, with nothing made.
func TestIsolationTurnedOff(t *testing.T) {
	d := startDaemon(t, "--runsc", "none")
	ctx := context.Background()
	_, err := d.Clients.Sandboxes.Create(ctx, connect.NewRequest(&dsecv1.CreateRequest{
		Spec: &dsecv1.SandboxSpec{Environment: env, Isolation: dsecv1.Isolation_ISOLATION_GVISOR}}))
	if err == nil || !strings.Contains(err.Error(), "gvisor") || !strings.Contains(err.Error(), "dsecd --runsc none") {
		t.Errorf("gvisor create on a node with gVisor off: %v, want a refusal saying --runsc none", err)
	}
	list, err := d.Clients.Sandboxes.List(ctx, connect.NewRequest(&dsecv1.ListRequest{All: true}))
	if err != nil || len(list.Msg.GetSandboxes()) != 0 {
		t.Errorf("sandboxes after the refused create: %v, %v", list.Msg.GetSandboxes(), err)
	}
	// Containers are as ever.
	sb := create(t, d, nil)
	if out := mustSh(t, d, sb.GetId(), "echo ok"); out != "ok\n" {
		t.Errorf("container on a node with gVisor off: %q", out)
	}
}

package root

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"strings"
	"testing"
	"time"

	"connectrpc.com/connect"
	"google.golang.org/protobuf/encoding/protojson"

	dsecv1 "dsec.dev/dsec/api/gen/dsec/v1"
	"dsec.dev/dsec/internal/bench"
	"dsec.dev/dsec/internal/testutil"
	dsec "dsec.dev/dsec/sdk/go"
)

// TestMicroVMFork: dsec fork -n 3 of a networked microVM makes three
// children from one memory snapshot of it, on its node. Each sees the
// parent's state at the fork (a file on its disk, a file in its RAM's
// tmpfs, a session's shell variable), has the parent's spec (its network
// rules: an allowed host answers, a denied one does not), and its own
// identity: machine-id, host name (its ID), MAC, address and random
// stream differ between siblings and from the parent, while boot_id, the
// kernel's, is the parent's (read before the fork). Writes stay in the VM that made them. The
// children are listed, metered, re-adopted after a dsecd kill -9 and
// restart, and deleted with nothing left; a child refused (the node full)
// reports its error while the others live. A parent paused to disk is
// forked from its pause's save and stays paused; a keyed fork of it made
// again gets the same child. Then dsec bench vm's fork
// part at its smallest. Four boots (the parent, the bench's parent and
// its two cold creates); the rest are restores.
func TestMicroVMFork(t *testing.T) {
	allInOneOnly(t)
	e := setupNetwork(t, "--vm-kernel-dir", testutil.VMKernelDir(t), "--max-sandboxes", "4")
	parent := e.sandboxOf(t, &dsecv1.SandboxSpec{
		Isolation: dsecv1.Isolation_ISOLATION_MICROVM, MemoryMb: 256, TtlSeconds: 1800,
		NetworkRules: map[string]bool{"pypi": true, "npm": false},
	})
	pid := parent.GetId()
	// The kernel makes boot_id at its first read: read before the fork, it
	// is in the memory the children copy.
	mustSh(t, e.d, pid, "echo on the disk > /root/disk.txt && echo in the ram > /dev/shm/ram.txt && cat /proc/sys/kernel/random/boot_id")
	session(t, e.d, pid, "export MARK=kept-by-the-shell")

	out, errOut, code := e.d.CLI("", "fork", "-n", "3", "--json", pid)
	if code != 0 {
		t.Fatalf("dsec fork -n 3 %s: %s", pid, errOut)
	}
	var resp dsecv1.ForkResponse
	if err := protojson.Unmarshal([]byte(out), &resp); err != nil {
		t.Fatalf("parse dsec fork's output: %v\n%s", err, out)
	}
	var kids []*dsecv1.Sandbox
	for i, c := range resp.GetChildren() {
		if c.GetError() != "" {
			t.Fatalf("fork child %d: %s", i, c.GetError())
		}
		sb := c.GetSandbox()
		kids = append(kids, sb)
		t.Cleanup(func() {
			e.d.Clients.Sandboxes.Delete(context.Background(), connect.NewRequest(&dsecv1.DeleteRequest{Id: sb.GetId()}))
		})
	}
	if len(kids) != 3 {
		t.Fatalf("dsec fork -n 3 made %d children", len(kids))
	}
	snap := resp.GetSnapshot()
	t.Logf("fork: the parent stood still %d µs (%s)", snap.GetFrozenUs(), snap.GetCaptureMethod())
	if snap.GetCaptureMethod() != "memory" || snap.GetSourceSandbox() != pid {
		t.Errorf("the fork's snapshot: %v, want a memory save of %s", snap, pid)
	}

	// The parent's state at the fork, in every child, and its spec.
	for _, k := range kids {
		id := k.GetId()
		if k.GetNode() != parent.GetNode() || k.GetSpec().GetTtlSeconds() != 1800 || k.GetSpec().GetIsolation() != dsecv1.Isolation_ISOLATION_MICROVM {
			t.Errorf("child %s: node %s, spec %v: want the parent's node %s and spec", id, k.GetNode(), k.GetSpec(), parent.GetNode())
		}
		if got := mustSh(t, e.d, id, "cat /root/disk.txt /dev/shm/ram.txt"); got != "on the disk\nin the ram\n" {
			t.Errorf("child %s reads %q, want the parent's files", id, got)
		}
		if got := session(t, e.d, id, "echo $MARK"); got != "kept-by-the-shell\n" {
			t.Errorf("child %s's session: %q, want the parent's variable", id, got)
		}
		if out := e.probeOK(t, id, "get http://pypi.test/"); !strings.Contains(out, "hello from pypi.test") {
			t.Errorf("pypi from child %s: %q", id, out)
		}
		e.probeFails(t, id, "get http://npm.test/")
		if out := strings.TrimSpace(e.probeOK(t, id, "resolve "+id)); out != k.GetAddress() {
			t.Errorf("child %s's host name resolves to %q, want its address %s", id, out, k.GetAddress())
		}
	}

	// Identity: everything but boot_id differs.
	type ident struct{ bootID, machineID, host, mac, addr, random string }
	read := func(id string) ident {
		f := strings.Split(mustSh(t, e.d, id, "cat /proc/sys/kernel/random/boot_id; cat /etc/machine-id 2>/dev/null || echo none; hostname; "+
			"cat /sys/class/net/eth0/address; ip -4 addr show dev eth0 | grep -o 'inet [0-9./]*'; head -c 16 /dev/urandom | od -An -tx1 | tr -d ' \\n'"), "\n")
		if len(f) < 6 {
			t.Fatalf("the identity of %s: %q", id, f)
		}
		return ident{f[0], f[1], f[2], f[3], f[4], f[5]}
	}
	all := []string{pid}
	ids := map[string]ident{pid: read(pid)}
	for _, k := range kids {
		all = append(all, k.GetId())
		ids[k.GetId()] = read(k.GetId())
		if got := ids[k.GetId()]; got.host != k.GetId() || !strings.Contains(got.addr, k.GetAddress()+"/") {
			t.Errorf("child %s: host name %q, address %q: want its ID and its address %s", k.GetId(), got.host, got.addr, k.GetAddress())
		}
	}
	t.Logf("identities: %v", ids)
	for i, a := range all {
		for _, b := range all[i+1:] {
			x, y := ids[a], ids[b]
			if x.bootID != y.bootID {
				t.Errorf("boot_id of %s %q and %s %q: a fork's children share the kernel's boot", a, x.bootID, b, y.bootID)
			}
			for _, f := range []struct{ name, x, y string }{
				{"machine-id", x.machineID, y.machineID}, {"host name", x.host, y.host}, {"MAC", x.mac, y.mac},
				{"address", x.addr, y.addr}, {"/dev/urandom", x.random, y.random},
			} {
				if f.x == f.y {
					t.Errorf("%s and %s share their %s %q", a, b, f.name, f.x)
				}
			}
		}
	}

	// Writes stay in the VM that made them; the parent's disk is its own
	// again after the fork.
	mustSh(t, e.d, kids[0].GetId(), "echo mine > /root/child0.txt")
	mustSh(t, e.d, pid, "echo parent > /root/parent.txt && sync")
	for _, id := range []string{pid, kids[1].GetId(), kids[2].GetId()} {
		if got := mustSh(t, e.d, id, "ls /root"); strings.Contains(got, "child0.txt") {
			t.Errorf("%s sees the file child %s wrote: %q", id, kids[0].GetId(), got)
		}
	}
	if got := mustSh(t, e.d, kids[0].GetId(), "ls /root"); strings.Contains(got, "parent.txt") {
		t.Errorf("child %s sees the file its parent wrote after the fork: %q", kids[0].GetId(), got)
	}

	// Listed and metered.
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	list, err := e.d.Clients.Sandboxes.List(ctx, connect.NewRequest(&dsecv1.ListRequest{}))
	if err != nil {
		t.Fatal(err)
	}
	listed := map[string]bool{}
	for _, sb := range list.Msg.GetSandboxes() {
		listed[sb.GetId()] = true
	}
	for _, k := range kids {
		if !listed[k.GetId()] {
			t.Errorf("child %s is not listed", k.GetId())
		}
		m, err := e.d.Clients.Sandboxes.Metrics(ctx, connect.NewRequest(&dsecv1.MetricsRequest{SandboxId: k.GetId()}))
		if err != nil {
			t.Errorf("metrics of child %s: %v", k.GetId(), err)
		} else if m.Msg.GetMemoryUsedBytes() == 0 || m.Msg.GetCpuUsedUsec() == 0 {
			t.Errorf("metrics of child %s: no memory: %v", k.GetId(), m.Msg)
		}
	}

	// The node is full (the parent and three children): a fourth child,
	// forked through the Go SDK, is refused on its own.
	token, err := os.ReadFile(e.d.TokenFile())
	if err != nil {
		t.Fatal(err)
	}
	sdk, err := dsec.NewClient(e.d.Addr, dsec.WithToken(strings.TrimSpace(string(token))))
	if err != nil {
		t.Fatal(err)
	}
	defer sdk.Close()
	snapInfo, extra, err := sdk.Fork(ctx, pid, 1)
	if err != nil {
		t.Fatalf("fork of a full node: %v, want the child's error", err)
	}
	if len(extra) != 1 || extra[0].Err == nil || extra[0].Sandbox != nil || snapInfo.GetCaptureMethod() != "memory" {
		t.Errorf("fork of a full node: %+v (snapshot %v), want one child with an error", extra, snapInfo)
	} else {
		t.Logf("a child on a full node: %v", extra[0].Err)
	}
	if got := mustSh(t, e.d, pid, "cat /root/disk.txt"); got != "on the disk\n" {
		t.Errorf("the parent after forks: %q", got)
	}

	// Re-adopted after a restart.
	e.d.Kill()
	e.d.Start()
	for _, k := range kids {
		if got := mustSh(t, e.d, k.GetId(), "hostname"); got != k.GetId()+"\n" {
			t.Errorf("child %s after a dsecd restart: %q", k.GetId(), got)
		}
	}

	for _, k := range kids {
		if _, err := e.d.Clients.Sandboxes.Delete(ctx, connect.NewRequest(&dsecv1.DeleteRequest{Id: k.GetId()})); err != nil {
			t.Fatalf("delete child %s: %v", k.GetId(), err)
		}
		if out, _ := exec.Command("pgrep", "-f", "dsec-"+k.GetId()).Output(); len(out) > 0 {
			t.Errorf("QEMU of %s still runs after its delete: %s", k.GetId(), out)
		}
	}
	if out, _ := exec.Command("pgrep", "-f", fmt.Sprintf("dsec-%s", pid)).Output(); len(out) == 0 {
		t.Errorf("the parent's QEMU is gone after its children's delete")
	}

	// A parent paused to disk is forked from its pause's save, and stays
	// paused; the fork, keyed, made again gets the same child.
	pctx, pcancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer pcancel()
	if _, errOut, code := e.d.CLI("", "pause", pid); code != 0 {
		t.Fatalf("dsec pause %s: %s", pid, errOut)
	}
	var firstChild string
	for round := range 2 {
		out, errOut, code := e.d.CLI("", "fork", "--idempotency-key", "paused-parent", pid)
		if code != 0 {
			t.Fatalf("dsec fork --idempotency-key of a paused parent (round %d): %s", round, errOut)
		}
		child := strings.TrimSpace(out)
		if round == 0 {
			firstChild = child
			t.Cleanup(func() {
				e.d.Clients.Sandboxes.Delete(context.Background(), connect.NewRequest(&dsecv1.DeleteRequest{Id: child}))
			})
		} else if child != firstChild {
			t.Errorf("a keyed fork made again: child %q, the first %q; want the same", child, firstChild)
		}
		got, err := e.d.Clients.Sandboxes.Get(pctx, connect.NewRequest(&dsecv1.GetRequest{Id: pid}))
		if err != nil || got.Msg.GetState() != dsecv1.State_STATE_PAUSED {
			t.Errorf("the paused parent after a fork: %v, %v; want it paused still", got.Msg.GetState(), err)
		}
	}
	if got := mustSh(t, e.d, firstChild, "cat /root/parent.txt /dev/shm/ram.txt"); got != "parent\nin the ram\n" {
		t.Errorf("the child of the paused parent reads %q, want the parent's files at its pause", got)
	}
	if _, err := e.d.Clients.Sandboxes.Delete(pctx, connect.NewRequest(&dsecv1.DeleteRequest{Id: firstChild})); err != nil {
		t.Fatalf("delete child %s: %v", firstChild, err)
	}
	if got := mustSh(t, e.d, pid, "cat /root/parent.txt"); got != "parent\n" {
		t.Errorf("the parent resumed after its fork while paused: %q", got)
	}

	// dsec bench vm's fork part at its smallest, on the same node: its
	// parent and two cold boots, two children a fork.
	bctx, bcancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer bcancel()
	rep, err := bench.RunVM(bctx, e.d.Clients, bench.VMOptions{Env: env, Parts: []string{"fork"}, Forks: 2, MemoryMiB: 256, Parallel: 2})
	if err != nil {
		t.Fatalf("bench vm --only fork: %v", err)
	}
	if f := rep.Fork; f == nil || f.ForkExec.N == 0 || f.ColdExec.N == 0 || f.Faster <= 0 || len(rep.Checks) != 1 {
		t.Errorf("bench vm --only fork: %+v, checks %+v", rep.Fork, rep.Checks)
	} else {
		t.Logf("bench vm --only fork --forks 2: %s %s", rep.Checks[0].Value, rep.Checks[0].Verdict)
	}
}

package microvm_test

import (
	"context"
	"fmt"
	"net/netip"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/vishvananda/netlink"
	"github.com/vishvananda/netns"

	"dsec.dev/dsec/internal/agent/agentclient"
	"dsec.dev/dsec/internal/edge/backend"
	"dsec.dev/dsec/internal/edge/netctl"
	"dsec.dev/dsec/internal/edge/netpolicy"
	"dsec.dev/dsec/internal/testutil"
	"dsec.dev/dsec/internal/vm/vmnet"
)

// TestNetwork starts a VM on a network the edge's own controller made
// (netctl: namespace, veth, address, nftables policy, audit; a pool,
// table, veth prefix and NFLOG group of the test's) and checks from inside
// the guest that it holds the sandbox's address, reaches the host its rules
// allow and is refused one they do not, with both attempts in the
// sandbox's audit log; Delete removes the tap. docs/microvm.md has the
// wiring (package vmnet) and its own, longer test.
func TestNetwork(t *testing.T) {
	f := setup(t)
	ctx := context.Background()
	root := t.TempDir()
	ctl, err := netctl.Open(ctx, netctl.Config{
		Dir: filepath.Join(root, "net"), Pool: netip.MustParsePrefix("10.211.0.0/24"),
		Table: "dsecvmbe", VethPrefix: "dvb", LogGroup: 2101,
	})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if err := ctl.Teardown(context.Background()); err != nil {
			t.Errorf("teardown the edge's network: %v", err)
		}
	})
	allowed, denied, gw := netip.MustParseAddr("198.18.9.10"), netip.MustParseAddr("198.18.9.11"), netip.MustParseAddr("198.18.9.1")
	testutil.RequireUnrouted(t, allowed, denied, gw)
	host := testutil.StartNetHost(t, "vmbh1", allowed, gw)

	cfg := config(t, f, root)
	rt := newRuntime(t, cfg)
	if !rt.Features().Network {
		t.Fatal("Features().Network is false")
	}
	s := spec(root, "sb-net", f)
	att, err := ctl.Attach(ctx, s.ID, map[string]bool{allowed.String() + "/32": true})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { ctl.Detach(context.Background(), s.ID) })
	s.NetnsPath, s.ResolvConf, s.Agent.Address = att.NetnsPath, att.ResolvConf, att.Addr
	since := time.Now().Add(-time.Second)
	dial, err := rt.Start(ctx, s)
	if err != nil {
		t.Fatal(err)
	}
	client := agentclient.New(dial)
	defer client.Close()

	if out := execOut(t, client, "busybox", "ip", "-4", "addr", "show", "eth0"); !strings.Contains(out, "inet "+att.Addr+"/32") {
		t.Errorf("the guest's eth0 lacks the sandbox's address %s:\n%s", att.Addr, out)
	}
	if out := execOut(t, client, "sh", "-c", fmt.Sprintf("echo hi | busybox nc -w 10 %s %d", allowed, testutil.EchoPort)); !strings.HasPrefix(out, "echo:hi from ") {
		t.Errorf("nc to the allowed host: %q", out)
	}
	if out := execOut(t, client, "sh", "-c", fmt.Sprintf("echo hi | busybox nc -w 10 %s %d; echo exit $?", denied, testutil.EchoPort)); strings.Contains(out, "echo:") || strings.HasSuffix(out, "exit 0\n") {
		t.Errorf("nc to a host the rules deny: %q", out)
	}
	for what, ok := range map[string]func(netpolicy.Event) bool{
		"allowed": func(e netpolicy.Event) bool { return e.Kind == "connect" && e.Verdict == "allow" && e.Dest == allowed },
		"denied":  func(e netpolicy.Event) bool { return e.Kind == "connect" && e.Verdict == "deny" && e.Dest == denied },
	} {
		found := false
		for deadline := time.Now().Add(10 * time.Second); !found && time.Now().Before(deadline); time.Sleep(50 * time.Millisecond) {
			evs, err := ctl.Log(s.ID, since, 0)
			if err != nil {
				t.Fatal(err)
			}
			found = slices.ContainsFunc(evs, ok)
		}
		if !found {
			t.Errorf("no %s connect in the sandbox's audit log", what)
		}
	}
	if host.Accepted() != 1 {
		t.Errorf("the test host accepted %d connections, want 1", host.Accepted())
	}

	// Paused to disk and resumed, the VM's card is on the same tap again.
	if _, err := rt.(backend.Pauser).Pause(ctx, s.ID, true); err != nil {
		t.Fatal(err)
	}
	if _, err := rt.(backend.Pauser).Resume(ctx, s.ID, false); err != nil {
		t.Fatal(err)
	}
	if out := execOut(t, client, "sh", "-c", fmt.Sprintf("echo hi | busybox nc -w 10 %s %d", allowed, testutil.EchoPort)); !strings.HasPrefix(out, "echo:hi from ") {
		t.Errorf("nc to the allowed host after a pause and resume: %q", out)
	}
	if host.Accepted() != 2 {
		t.Errorf("the test host accepted %d connections after the resume, want 2", host.Accepted())
	}

	if err := rt.Delete(ctx, s.ID); err != nil {
		t.Fatal(err)
	}
	nsf, err := os.Open(att.NetnsPath)
	if err != nil {
		t.Fatal(err)
	}
	defer nsf.Close()
	h, err := netlink.NewHandleAt(netns.NsHandle(nsf.Fd()))
	if err != nil {
		t.Fatal(err)
	}
	defer h.Close()
	if _, err := h.LinkByName(vmnet.TapName); err == nil {
		t.Errorf("Delete left %s in the sandbox's namespace", vmnet.TapName)
	}
	assertNothingLeft(t, rt, cfg, s.ID)
}

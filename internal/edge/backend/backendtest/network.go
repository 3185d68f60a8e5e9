package backendtest

import (
	"context"
	"errors"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"dsec.dev/dsec/internal/edge/backend"
	"dsec.dev/dsec/internal/errdefs"
	"dsec.dev/dsec/internal/testutil"
)

// testNetwork checks the contract of Features.Network. With it: a Start
// whose NetnsPath is no network namespace fails and leaves nothing; a
// sandbox started in a namespace the suite made (loopback, and a veth to a
// test host in a namespace of its own on 198.18.0.0/15) reaches the test
// host and has the spec's resolv.conf at /etc/resolv.conf; one started
// without a NetnsPath has loopback and no other interface. Without it, a
// spec naming a NetnsPath or a ResolvConf is refused with
// errdefs.ErrNotSupported, leaving nothing: a runtime never starts a
// sandbox with less network than it was asked for.
func testNetwork(t *testing.T, n *node) {
	ctx := context.Background()
	refused := func(t *testing.T, s backend.Spec, want error) {
		t.Helper()
		_, err := n.rt.Start(ctx, s)
		if err == nil || (want != nil && !errors.Is(err, want)) {
			t.Errorf("Start of %s with netns %q and resolv.conf %q: %v, want %v", s.ID, s.NetnsPath, s.ResolvConf, err, want)
		}
		if slices.Contains(n.list(), s.ID) {
			t.Errorf("a refused Start of %s left it listed", s.ID)
		}
		if _, err := n.rt.Status(ctx, s.ID); !errors.Is(err, errdefs.ErrNotFound) {
			t.Errorf("Status of %s after a refused Start: %v, want not found", s.ID, err)
		}
	}
	resolv := filepath.Join(n.root, "resolv.conf")
	if err := os.WriteFile(resolv, []byte("nameserver "+testHostIP+"\noptions ndots:0\n"), 0o644); err != nil {
		t.Fatal(err)
	}

	if !n.rt.Features().Network {
		s := n.spec("nonet")
		s.NetnsPath = filepath.Join(n.root, "netns")
		refused(t, s, errdefs.ErrNotSupported)
		s = n.spec("nonet")
		s.ResolvConf = resolv
		refused(t, s, errdefs.ErrNotSupported)
		return
	}

	t.Run("MissingNetns", func(t *testing.T) {
		s := n.spec("nonetns")
		s.NetnsPath = filepath.Join(n.root, "no-such-netns")
		refused(t, s, nil)
	})

	t.Run("Netns", func(t *testing.T) {
		testutil.RequireRoot(t)
		testutil.RequireCommand(t, "ip")
		tn := makeTestNet(t)
		s := n.spec("net")
		s.NetnsPath, s.ResolvConf = tn.netnsPath, resolv
		sb := n.startSandbox(s)
		if n.o.NoCommands {
			return
		}
		// busybox nc: its static wget crashes in glibc's service lookup.
		host, port, _ := strings.Cut(tn.addr, ":")
		if got := sb.must(t, `printf 'GET / HTTP/1.0\r\n\r\n' | nc -w 20 `+host+" "+port); !strings.HasSuffix(got, tn.token) {
			t.Errorf("the test host from the sandbox: %q, want an HTTP answer of %q", got, tn.token)
		}
		want, _ := os.ReadFile(resolv)
		got := sb.must(t, "cat /etc/resolv.conf")
		switch {
		case n.o.Deviations.OwnResolvConf && !strings.Contains(got, "nameserver "):
			t.Errorf("/etc/resolv.conf in the sandbox: %q, want a nameserver (Deviations.OwnResolvConf)", got)
		case !n.o.Deviations.OwnResolvConf && got != strings.TrimSpace(string(want)):
			t.Errorf("/etc/resolv.conf in the sandbox: %q, want the spec's %q", got, want)
		}
		n.delete(s.ID)
		n.gone(s.ID)
	})

	t.Run("LoopbackOnly", func(t *testing.T) {
		n.needCommands(t)
		s := n.spec("lo")
		sb := n.startSandbox(s)
		var ifaces []string
		for l := range strings.Lines(sb.must(t, "cat /proc/net/dev")) {
			if name, _, ok := strings.Cut(l, ":"); ok && !strings.Contains(name, "|") {
				ifaces = append(ifaces, strings.TrimSpace(name))
			}
		}
		if !slices.Equal(ifaces, []string{"lo"}) {
			t.Errorf("interfaces of a sandbox without a netns: %v, want lo alone", ifaces)
		}
		// Connection refused, not unreachable: loopback is up.
		if r := sb.exec("nc -w 10 127.0.0.1 1 </dev/null"); r.ok() || !strings.Contains(r.stderr, "refused") {
			t.Errorf("nc to a closed loopback port: %s; want connection refused", r)
		}
		n.delete(s.ID)
		n.gone(s.ID)
	})
}

package testutil

import (
	"bufio"
	"fmt"
	"net"
	"net/netip"
	"os"
	"path/filepath"
	"runtime"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"
)

// TestNet is where test hosts live: the benchmarking range, which no
// machine of ours routes (never 192.0.2.0/24, the machines' own network).
var TestNet = netip.MustParsePrefix("198.18.0.0/15")

// RequireUnrouted fails the test when the host already routes any of
// addrs (its default route aside): a test host there would shadow what is
// there. Only the test's own addresses are checked: tests of other
// packages running at the same time have test hosts of their own in
// TestNet, each on addresses no other test uses.
func RequireUnrouted(t testing.TB, addrs ...netip.Addr) {
	t.Helper()
	routes, err := netlink.RouteListFiltered(unix.AF_INET, &netlink.Route{Table: unix.RT_TABLE_UNSPEC}, netlink.RT_FILTER_TABLE)
	if err != nil {
		t.Fatal(err)
	}
	for _, r := range routes {
		if r.Dst == nil {
			continue
		}
		a, _ := netip.AddrFromSlice(r.Dst.IP.To4())
		ones, _ := r.Dst.Mask.Size()
		p := netip.PrefixFrom(a, ones)
		for _, addr := range addrs {
			if ones > 0 && p.Contains(addr) {
				t.Fatalf("the host already routes %s (%s): a test host there would shadow it", addr, p)
			}
		}
	}
}

// NetHost is a test host: a network namespace of the test's with one
// address in TestNet, routed from the host through a veth of its own whose
// host side holds gw. It serves TCP on EchoPort: a line in, "echo:LINE
// from SOURCE" back. Everything is removed when the test ends.
type NetHost struct {
	Addr  netip.Addr
	Netns string

	mu    sync.Mutex
	conns int
}

// EchoPort is the NetHost's echo server's port.
const EchoPort = 7000

// StartNetHost makes a test host at addr behind the host veth named veth.
func StartNetHost(t testing.TB, veth string, addr, gw netip.Addr) *NetHost {
	t.Helper()
	if !TestNet.Contains(addr) || !TestNet.Contains(gw) {
		t.Fatalf("test host %s (gateway %s) outside %s", addr, gw, TestNet)
	}
	h := &NetHost{Addr: addr, Netns: filepath.Join(t.TempDir(), veth)}
	if err := makeNetns(h.Netns); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if l, err := netlink.LinkByName(veth); err == nil {
			netlink.LinkDel(l)
		}
		unix.Unmount(h.Netns, unix.MNT_DETACH)
	})
	nsf, err := os.Open(h.Netns)
	if err != nil {
		t.Fatal(err)
	}
	defer nsf.Close()
	la := netlink.NewLinkAttrs()
	la.Name = veth
	check := func(err error) {
		t.Helper()
		if err != nil {
			t.Fatalf("test host %s: %v", addr, err)
		}
	}
	check(netlink.LinkAdd(&netlink.Veth{LinkAttrs: la, PeerName: "eth0", PeerNamespace: netlink.NsFd(int(nsf.Fd()))}))
	l, err := netlink.LinkByName(veth)
	check(err)
	check(netlink.AddrAdd(l, &netlink.Addr{IPNet: host32(gw), Scope: unix.RT_SCOPE_LINK}))
	check(netlink.LinkSetUp(l))
	check(netlink.RouteAdd(&netlink.Route{LinkIndex: l.Attrs().Index, Dst: host32(addr), Scope: netlink.SCOPE_LINK}))
	check(InNetns(nsf, func() error {
		for _, name := range []string{"lo", "eth0"} {
			l, err := netlink.LinkByName(name)
			if err != nil {
				return err
			}
			if err := netlink.LinkSetUp(l); err != nil {
				return err
			}
		}
		eth, err := netlink.LinkByName("eth0")
		if err != nil {
			return err
		}
		if err := netlink.AddrAdd(eth, &netlink.Addr{IPNet: host32(addr)}); err != nil {
			return err
		}
		return netlink.RouteAdd(&netlink.Route{LinkIndex: eth.Attrs().Index, Gw: gw.AsSlice(), Flags: int(netlink.FLAG_ONLINK)})
	}))
	ln := h.Listen(t, EchoPort)
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			h.mu.Lock()
			h.conns++
			h.mu.Unlock()
			go func() {
				defer c.Close()
				c.SetDeadline(time.Now().Add(30 * time.Second))
				line, _ := bufio.NewReader(c).ReadString('\n')
				from, _, _ := net.SplitHostPort(c.RemoteAddr().String())
				fmt.Fprintf(c, "echo:%s from %s\n", strings.TrimSpace(line), from)
			}()
		}
	}()
	return h
}

// Listen listens on TCP port of h's address, in h's namespace, until the
// test ends.
func (h *NetHost) Listen(t testing.TB, port int) net.Listener {
	t.Helper()
	nsf, err := os.Open(h.Netns)
	if err != nil {
		t.Fatal(err)
	}
	defer nsf.Close()
	var ln net.Listener
	if err := InNetns(nsf, func() error {
		var err error
		ln, err = net.Listen("tcp4", netip.AddrPortFrom(h.Addr, uint16(port)).String())
		return err
	}); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { ln.Close() })
	return ln
}

// Accepted is how many connections h's echo server accepted.
func (h *NetHost) Accepted() int {
	h.mu.Lock()
	defer h.mu.Unlock()
	return h.conns
}

// InNetns runs fn on a thread inside the network namespace ns; sockets fn
// makes belong to it and work from any thread afterwards.
func InNetns(ns *os.File, fn func() error) error {
	errc := make(chan error, 1)
	go func() {
		runtime.LockOSThread()
		orig, err := os.Open("/proc/thread-self/ns/net")
		if err != nil {
			runtime.UnlockOSThread()
			errc <- err
			return
		}
		defer orig.Close()
		if err := unix.Setns(int(ns.Fd()), unix.CLONE_NEWNET); err != nil {
			runtime.UnlockOSThread()
			errc <- fmt.Errorf("enter netns: %w", err)
			return
		}
		fnErr := fn()
		if err := unix.Setns(int(orig.Fd()), unix.CLONE_NEWNET); err != nil {
			// The thread stays locked and ends with the goroutine.
			errc <- fmt.Errorf("return to the host's netns: %w", err)
			return
		}
		runtime.UnlockOSThread()
		errc <- fnErr
	}()
	return <-errc
}

// makeNetns makes a network namespace bind-mounted at path.
func makeNetns(path string) error {
	if err := os.WriteFile(path, nil, 0o444); err != nil {
		return err
	}
	errc := make(chan error, 1)
	go func() {
		// Locked to the end: the thread dies with the goroutine and never
		// serves another from the new namespace.
		runtime.LockOSThread()
		if err := unix.Unshare(unix.CLONE_NEWNET); err != nil {
			errc <- fmt.Errorf("unshare netns: %w", err)
			return
		}
		errc <- unix.Mount("/proc/thread-self/ns/net", path, "", unix.MS_BIND, "")
	}()
	return <-errc
}

func host32(a netip.Addr) *net.IPNet {
	return &net.IPNet{IP: a.AsSlice(), Mask: net.CIDRMask(32, 32)}
}

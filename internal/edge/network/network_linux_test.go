package network

import (
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"math/big"
	"net"
	"net/http"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"

	"dsec.dev/dsec/internal/edge/netpolicy"
	"dsec.dev/dsec/internal/testutil"
)

// The test network: every address lives on loopback or in a namespace the
// test makes, so no packet ever leaves the machine, even one that should be
// blocked. The fake metadata host uses 169.254.213.254 rather than
// 169.254.169.254 so the test never shadows the machine's own metadata
// service.
var (
	testPool    = netip.MustParsePrefix("10.219.0.0/24")
	testHostGW  = netip.MustParseAddr("198.18.0.1")
	pypiAddr    = netip.MustParseAddr("198.18.1.10")
	npmAddr     = netip.MustParseAddr("198.18.2.10")
	unlistedAdr = netip.MustParseAddr("198.18.3.10")
	metaAddr    = netip.MustParseAddr("169.254.213.254")
)

func requireNet(t testing.TB) {
	t.Helper()
	testutil.RequireRoot(t)
	testutil.RequireCommand(t, "nft")
	testutil.RequireCommand(t, "ip")
}

// events collects audit events.
type events struct {
	mu  sync.Mutex
	all []netpolicy.Event
}

func (e *events) add(ev netpolicy.Event) {
	e.mu.Lock()
	e.all = append(e.all, ev)
	e.mu.Unlock()
}

// wait returns the first event matching f, polling for up to 10 s.
func (e *events) wait(f func(netpolicy.Event) bool) (netpolicy.Event, bool) {
	deadline := time.Now().Add(10 * time.Second)
	for time.Now().Before(deadline) {
		e.mu.Lock()
		for _, ev := range e.all {
			if f(ev) {
				e.mu.Unlock()
				return ev, true
			}
		}
		e.mu.Unlock()
		time.Sleep(50 * time.Millisecond)
	}
	return netpolicy.Event{}, false
}

// The tests' network must not meet a dsecd's running on the same host
// (the end-to-end tests run at the same time): its own table, veth prefix,
// NFLOG group and pool.
const (
	tableName  = "dsectest"
	vethPrefix = "dst"
	logGroup   = 2131
)

func testConfig(cfg Config) Config {
	cfg.Table, cfg.VethPrefix, cfg.LogGroup = tableName, vethPrefix, logGroup
	if !cfg.Pool.IsValid() {
		cfg.Pool = testPool
	}
	return cfg
}

func newTestNode(t testing.TB, cfg Config) *Node {
	t.Helper()
	dir := t.TempDir()
	cfg = testConfig(cfg)
	cfg.NetnsDir = filepath.Join(dir, "netns")
	cfg.Log = slog.New(slog.NewTextHandler(io.Discard, nil))
	n, err := Setup(context.Background(), cfg)
	if err != nil {
		t.Fatalf("Setup: %v", err)
	}
	t.Cleanup(func() {
		if err := n.Teardown(context.Background()); err != nil {
			t.Errorf("Teardown: %v", err)
		}
		assertClean(t, cfg.NetnsDir)
	})
	return n
}

// assertClean checks that no dsec veth, table or netns mount is left.
func assertClean(t testing.TB, netnsDir string) {
	t.Helper()
	out, _ := exec.Command("ip", "-o", "link", "show").CombinedOutput()
	for _, line := range strings.Split(string(out), "\n") {
		if strings.Contains(line, ": "+vethPrefix) || strings.Contains(line, tableName+":") {
			t.Errorf("link left behind: %s", line)
		}
	}
	out, _ = exec.Command("nft", "list", "tables").CombinedOutput()
	if strings.Contains(string(out), "inet "+tableName+"\n") || strings.HasSuffix(strings.TrimSpace(string(out)), "inet "+tableName) {
		t.Errorf("nft table left behind: %s", out)
	}
	mi, _ := os.ReadFile("/proc/self/mountinfo")
	if strings.Contains(string(mi), netnsDir) {
		t.Errorf("netns mounts left behind under %s", netnsDir)
	}
}

// testHost is a namespace with an address, reachable from the host through
// its own veth, like a package mirror would be.
type testHost struct {
	name  string
	addr  netip.Addr
	netns string
}

func newTestHost(t testing.TB, name string, addr netip.Addr) *testHost {
	t.Helper()
	h := &testHost{name: name, addr: addr, netns: filepath.Join(t.TempDir(), name)}
	veth := "dst" + name
	deleteLink(veth)
	if err := createNetns(h.netns); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if err := deleteLink(veth); err != nil {
			t.Error(err)
		}
		if err := removeNetns(h.netns); err != nil {
			t.Error(err)
		}
	})
	nsf, err := os.Open(h.netns)
	if err != nil {
		t.Fatal(err)
	}
	defer nsf.Close()
	la := netlink.NewLinkAttrs()
	la.Name = veth
	if err := netlink.LinkAdd(&netlink.Veth{LinkAttrs: la, PeerName: "eth0", PeerNamespace: netlink.NsFd(int(nsf.Fd()))}); err != nil {
		t.Fatalf("add veth %s: %v", veth, err)
	}
	link, err := netlink.LinkByName(veth)
	if err != nil {
		t.Fatal(err)
	}
	must(t, netlink.AddrAdd(link, &netlink.Addr{IPNet: ipnet(testHostGW, 32), Scope: unix.RT_SCOPE_LINK}))
	must(t, netlink.LinkSetUp(link))
	must(t, netlink.RouteAdd(&netlink.Route{LinkIndex: link.Attrs().Index, Dst: ipnet(addr, 32), Scope: netlink.SCOPE_LINK}))
	must(t, inNetns(h.netns, func() error {
		lo, err := netlink.LinkByName("lo")
		if err != nil {
			return err
		}
		if err := netlink.LinkSetUp(lo); err != nil {
			return err
		}
		eth, err := netlink.LinkByName("eth0")
		if err != nil {
			return err
		}
		if err := netlink.AddrAdd(eth, &netlink.Addr{IPNet: ipnet(addr, 32)}); err != nil {
			return err
		}
		if err := netlink.LinkSetUp(eth); err != nil {
			return err
		}
		return netlink.RouteAdd(&netlink.Route{LinkIndex: eth.Attrs().Index, Gw: testHostGW.AsSlice(), Flags: int(netlink.FLAG_ONLINK)})
	}))
	return h
}

func ipnet(a netip.Addr, bits int) *net.IPNet {
	return &net.IPNet{IP: a.AsSlice(), Mask: net.CIDRMask(bits, 32)}
}

func must(t testing.TB, err error) {
	t.Helper()
	if err != nil {
		t.Fatal(err)
	}
}

// listen opens a TCP listener inside netns (the host's when netns is "").
func listen(t testing.TB, netns, addr string) net.Listener {
	t.Helper()
	var ln net.Listener
	open := func() error {
		var err error
		ln, err = net.Listen("tcp4", addr)
		return err
	}
	if netns == "" {
		must(t, open())
	} else {
		must(t, inNetns(netns, open))
	}
	t.Cleanup(func() { ln.Close() })
	return ln
}

// serveHTTP answers "hello from <name>" on ln.
func serveHTTP(t testing.TB, ln net.Listener, name string) {
	srv := &http.Server{Handler: http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		fmt.Fprintf(w, "hello from %s", name)
	})}
	go srv.Serve(ln)
	t.Cleanup(func() { srv.Close() })
}

// serveEcho echoes every connection on ln.
func serveEcho(t testing.TB, ln net.Listener) {
	var wg sync.WaitGroup
	var mu sync.Mutex
	var conns []net.Conn
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			mu.Lock()
			conns = append(conns, c)
			mu.Unlock()
			wg.Add(1)
			go func() {
				defer wg.Done()
				io.Copy(c, c)
				c.Close()
			}()
		}
	}()
	t.Cleanup(func() {
		ln.Close()
		mu.Lock()
		for _, c := range conns {
			c.Close()
		}
		mu.Unlock()
		wg.Wait()
	})
}

func selfSigned(t testing.TB, ip netip.Addr) (tls.Certificate, *x509.CertPool) {
	t.Helper()
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	must(t, err)
	tmpl := &x509.Certificate{
		SerialNumber: big.NewInt(1),
		Subject:      pkix.Name{CommonName: "pypi.test"},
		NotBefore:    time.Now().Add(-time.Hour),
		NotAfter:     time.Now().Add(time.Hour),
		IPAddresses:  []net.IP{ip.AsSlice()},
		KeyUsage:     x509.KeyUsageDigitalSignature,
		ExtKeyUsage:  []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth},
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, &key.PublicKey, key)
	must(t, err)
	cert, err := x509.ParseCertificate(der)
	must(t, err)
	pool := x509.NewCertPool()
	pool.AddCert(cert)
	return tls.Certificate{Certificate: [][]byte{der}, PrivateKey: key}, pool
}

// dial connects from inside netns.
func dial(netns, network, addr string, timeout time.Duration) (net.Conn, error) {
	var c net.Conn
	err := inNetns(netns, func() error {
		var err error
		c, err = net.DialTimeout(network, addr, timeout)
		return err
	})
	return c, err
}

// get fetches url with a client whose sockets live in netns.
func get(netns, url string, roots *x509.CertPool) (string, error) {
	client := &http.Client{
		Timeout: 3 * time.Second,
		Transport: &http.Transport{
			DisableKeepAlives: true,
			TLSClientConfig:   &tls.Config{RootCAs: roots},
			DialContext: func(ctx context.Context, network, addr string) (net.Conn, error) {
				return dial(netns, "tcp4", addr, 2*time.Second)
			},
		},
	}
	resp, err := client.Get(url)
	if err != nil {
		return "", err
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	return string(b), err
}

func echoOnce(c net.Conn) error {
	c.SetDeadline(time.Now().Add(3 * time.Second))
	if _, err := c.Write([]byte("ping")); err != nil {
		return err
	}
	buf := make([]byte, 4)
	if _, err := io.ReadFull(c, buf); err != nil {
		return err
	}
	if string(buf) != "ping" {
		return fmt.Errorf("echo %q", buf)
	}
	return nil
}

func allow(p netip.Addr, proto string, port uint16, source string) netpolicy.CIDRRule {
	return netpolicy.CIDRRule{Prefix: netip.PrefixFrom(p, 32), Port: netpolicy.Port{Proto: proto, Port: port}, Allow: true, Source: source}
}

func TestNetworkPolicy(t *testing.T) {
	requireNet(t)
	ev := &events{}
	n := newTestNode(t, Config{MaxConns: 6, Audit: ev.add})

	pypi := newTestHost(t, "pypi", pypiAddr)
	npm := newTestHost(t, "npm", npmAddr)
	unlisted := newTestHost(t, "unlisted", unlistedAdr)
	meta := newTestHost(t, "meta", metaAddr)
	for _, h := range []*testHost{pypi, npm, unlisted, meta} {
		serveHTTP(t, listen(t, h.netns, h.addr.String()+":80"), h.name)
	}
	cert, roots := selfSigned(t, pypiAddr)
	serveHTTP(t, tls.NewListener(listen(t, pypi.netns, pypiAddr.String()+":443"), &tls.Config{Certificates: []tls.Certificate{cert}}), "pypi-tls")
	serveEcho(t, listen(t, pypi.netns, pypiAddr.String()+":9000"))

	ctx := context.Background()
	a, err := n.Attach(ctx, "sb-test-a", nil)
	if err != nil {
		t.Fatalf("Attach: %v", err)
	}
	if !testPool.Contains(a.Addr) || a.Gateway != gatewayOf(testPool) || a.Addr == a.Gateway {
		t.Fatalf("attachment %+v", a)
	}
	url := func(h netip.Addr) string { return "http://" + h.String() + "/" }

	t.Run("EmptyPolicyDeniesEverything", func(t *testing.T) {
		for _, h := range []netip.Addr{pypiAddr, npmAddr, unlistedAdr, metaAddr} {
			if body, err := get(a.NetnsPath, url(h), nil); err == nil {
				t.Errorf("%s reachable with an empty policy: %q", h, body)
			}
		}
	})

	pypiPolicy := &netpolicy.Policy{CIDRs: []netpolicy.CIDRRule{
		allow(pypiAddr, "tcp", 80, "pypi"),
		allow(pypiAddr, "tcp", 443, "pypi"),
		allow(pypiAddr, "tcp", 9000, "pypi-echo"),
	}}
	must(t, n.Update(ctx, a.ID, pypiPolicy, false))

	t.Run("CIDRAllow", func(t *testing.T) {
		if body, err := get(a.NetnsPath, url(pypiAddr), nil); err != nil || body != "hello from pypi" {
			t.Errorf("pypi over http: %q %v", body, err)
		}
		if body, err := get(a.NetnsPath, "https://"+pypiAddr.String()+"/", roots); err != nil || body != "hello from pypi-tls" {
			t.Errorf("pypi over https: %q %v", body, err)
		}
		for _, h := range []netip.Addr{npmAddr, unlistedAdr, metaAddr} {
			if body, err := get(a.NetnsPath, url(h), nil); err == nil {
				t.Errorf("%s reachable with only pypi allowed: %q", h, body)
			}
		}
	})

	t.Run("Audit", func(t *testing.T) {
		if _, ok := ev.wait(func(e netpolicy.Event) bool {
			return e.Kind == "connect" && e.SandboxID == a.ID && e.Verdict == "allow" && e.Dest == pypiAddr && e.Port == 80 && e.Proto == "tcp" && e.Rule == "pypi"
		}); !ok {
			t.Errorf("no allow event for pypi:80; got %+v", ev.all)
		}
		if _, ok := ev.wait(func(e netpolicy.Event) bool {
			return e.Kind == "connect" && e.SandboxID == a.ID && e.Verdict == "deny" && e.Dest == npmAddr && e.Port == 80 && e.Rule == "reserved"
		}); !ok {
			t.Errorf("no deny event for npm:80")
		}
		if _, ok := ev.wait(func(e netpolicy.Event) bool {
			return e.Kind == "connect" && e.Verdict == "deny" && e.Dest == metaAddr && e.Rule == "reserved"
		}); !ok {
			t.Errorf("no deny event for the metadata address")
		}
		// Bytes are reported when conntrack forgets the connection (after
		// TIME_WAIT); make that happen now.
		if err := deleteFlows(a.Addr); err != nil {
			t.Fatal(err)
		}
		if e, ok := ev.wait(func(e netpolicy.Event) bool {
			return e.Kind == "close" && e.SandboxID == a.ID && e.Dest == pypiAddr && e.Port == 80
		}); !ok || e.BytesIn == 0 || e.BytesOut == 0 {
			t.Errorf("close event for pypi:80: %+v %v", e, ok)
		}
	})

	t.Run("AllowResolvedUntilTTL", func(t *testing.T) {
		if _, err := get(a.NetnsPath, url(unlistedAdr), nil); err == nil {
			t.Fatal("unlisted reachable before AllowResolved")
		}
		must(t, n.AllowResolved(a.ID, unlistedAdr, []netpolicy.Port{{Proto: "tcp", Port: 80}}, 2*time.Second, "unlisted.test"))
		if body, err := get(a.NetnsPath, url(unlistedAdr), nil); err != nil || body != "hello from unlisted" {
			t.Fatalf("unlisted after AllowResolved: %q %v", body, err)
		}
		if _, ok := ev.wait(func(e netpolicy.Event) bool {
			return e.Kind == "connect" && e.Verdict == "allow" && e.Dest == unlistedAdr && e.Rule == "resolved" && e.Name == "unlisted.test"
		}); !ok {
			t.Errorf("no resolved allow event with the name")
		}
		deadline := time.Now().Add(15 * time.Second)
		for {
			if _, err := get(a.NetnsPath, url(unlistedAdr), nil); err != nil {
				break
			}
			if time.Now().After(deadline) {
				t.Fatal("unlisted still reachable long after the TTL")
			}
			time.Sleep(250 * time.Millisecond)
		}
	})

	// b allows everything public and npm explicitly (the test hosts live in
	// reserved ranges, which 0.0.0.0/0 does not open).
	allowAll := &netpolicy.Policy{CIDRs: []netpolicy.CIDRRule{
		allow(npmAddr, "", 0, "npm"),
		{Prefix: netip.MustParsePrefix("0.0.0.0/0"), Allow: true, Source: "all"},
	}}
	b, err := n.Attach(ctx, "sb-test-b", allowAll)
	if err != nil {
		t.Fatalf("Attach b: %v", err)
	}

	t.Run("SandboxToSandboxDenied", func(t *testing.T) {
		lnB := listen(t, b.NetnsPath, b.Addr.String()+":8080")
		serveHTTP(t, lnB, "b")
		lnA := listen(t, a.NetnsPath, a.Addr.String()+":8080")
		serveHTTP(t, lnA, "a")
		if body, err := get(a.NetnsPath, "http://"+b.Addr.String()+":8080/", nil); err == nil {
			t.Errorf("a reached b: %q", body)
		}
		// b allows 0.0.0.0/0, which still does not open the pool.
		if body, err := get(b.NetnsPath, "http://"+a.Addr.String()+":8080/", nil); err == nil {
			t.Errorf("b reached a: %q", body)
		}
		if body, err := get(b.NetnsPath, url(npmAddr), nil); err != nil {
			t.Errorf("b cannot reach npm: %q %v", body, err)
		}
		if body, err := get(b.NetnsPath, url(unlistedAdr), nil); err == nil {
			t.Errorf("0.0.0.0/0 opened a reserved range: %q", body)
		}
	})

	t.Run("LinkLocalDenied", func(t *testing.T) {
		if body, err := get(b.NetnsPath, url(metaAddr), nil); err == nil {
			t.Errorf("metadata reachable under allow-all: %q", body)
		}
	})

	t.Run("HostServicesDenied", func(t *testing.T) {
		anyLn := listen(t, "", "0.0.0.0:0")
		serveHTTP(t, anyLn, "host-any")
		gwLn := listen(t, "", b.Gateway.String()+":0")
		serveHTTP(t, gwLn, "host-gw")
		anyPort := anyLn.Addr().(*net.TCPAddr).Port
		gwPort := gwLn.Addr().(*net.TCPAddr).Port
		// The listeners work from the host itself.
		if body, err := get("/proc/self/ns/net", fmt.Sprintf("http://%s:%d/", b.Gateway, gwPort), nil); err != nil {
			t.Fatalf("host listener on the gateway does not answer the host: %q %v", body, err)
		}
		targets := []string{
			fmt.Sprintf("%s:%d", b.Gateway, anyPort),
			fmt.Sprintf("%s:%d", b.Gateway, gwPort),
			fmt.Sprintf("%s:%d", testHostGW, anyPort),
		}
		addrs, _ := net.InterfaceAddrs()
		for _, ad := range addrs {
			if ipn, ok := ad.(*net.IPNet); ok && ipn.IP.To4() != nil && !ipn.IP.IsLoopback() {
				targets = append(targets, fmt.Sprintf("%s:%d", ipn.IP, anyPort))
			}
		}
		for _, tgt := range targets {
			if c, err := dial(b.NetnsPath, "tcp4", tgt, 500*time.Millisecond); err == nil {
				c.Close()
				t.Errorf("host service %s reachable from a sandbox", tgt)
			}
		}
		ports := []int{anyPort, gwPort}
		for p := 1; p <= 1024; p++ {
			ports = append(ports, p)
		}
		open := scan(b.NetnsPath, b.Gateway, ports)
		if len(open) > 0 {
			t.Errorf("scan of the gateway found open ports %v", open)
		}
	})

	t.Run("ExplicitReservedAllow", func(t *testing.T) {
		must(t, n.Update(ctx, b.ID, &netpolicy.Policy{CIDRs: append([]netpolicy.CIDRRule{
			allow(metaAddr, "tcp", 80, "metadata")}, allowAll.CIDRs...)}, false))
		if body, err := get(b.NetnsPath, url(metaAddr), nil); err != nil || body != "hello from meta" {
			t.Errorf("explicitly allowed link-local address: %q %v", body, err)
		}
		if _, err := get(b.NetnsPath, "http://"+a.Addr.String()+":8080/", nil); err == nil {
			t.Errorf("b reached a")
		}
	})

	t.Run("UpdateAndCut", func(t *testing.T) {
		c, err := dial(a.NetnsPath, "tcp4", pypiAddr.String()+":9000", 2*time.Second)
		if err != nil {
			t.Fatalf("dial echo: %v", err)
		}
		defer c.Close()
		must(t, echoOnce(c))
		only80 := &netpolicy.Policy{CIDRs: []netpolicy.CIDRRule{allow(pypiAddr, "tcp", 80, "pypi")}}
		must(t, n.Update(ctx, a.ID, only80, false))
		if c2, err := dial(a.NetnsPath, "tcp4", pypiAddr.String()+":9000", time.Second); err == nil {
			c2.Close()
			t.Error("new connection to 9000 allowed after Update")
		}
		if err := echoOnce(c); err != nil {
			t.Errorf("established connection broken by Update without cut: %v", err)
		}
		if _, err := get(a.NetnsPath, url(pypiAddr), nil); err != nil {
			t.Errorf("pypi:80 after Update: %v", err)
		}
		must(t, n.Update(ctx, a.ID, only80, true))
		if err := echoOnce(c); err == nil {
			t.Error("established connection survived Update with cut")
		}
		// Switch back: new connections follow the new policy.
		must(t, n.Update(ctx, a.ID, pypiPolicy, false))
		c3, err := dial(a.NetnsPath, "tcp4", pypiAddr.String()+":9000", 2*time.Second)
		if err != nil {
			t.Fatalf("dial echo after allowing again: %v", err)
		}
		c3.Close()
	})

	t.Run("ConnectionLimit", func(t *testing.T) {
		c, err := n.Attach(ctx, "sb-test-c", pypiPolicy)
		if err != nil {
			t.Fatal(err)
		}
		defer n.Detach(ctx, c.ID)
		var conns []net.Conn
		defer func() {
			for _, c := range conns {
				c.Close()
			}
		}()
		for i := 0; i < 6; i++ {
			conn, err := dial(c.NetnsPath, "tcp4", pypiAddr.String()+":9000", 2*time.Second)
			if err != nil {
				t.Fatalf("connection %d under the limit: %v", i, err)
			}
			conns = append(conns, conn)
			must(t, echoOnce(conn))
		}
		start := time.Now()
		if c, err := dial(c.NetnsPath, "tcp4", pypiAddr.String()+":9000", time.Second); err == nil {
			c.Close()
			t.Fatal("connection over the limit succeeded")
		} else {
			t.Logf("over the limit: %v after %v", err, time.Since(start))
		}
		if _, ok := ev.wait(func(e netpolicy.Event) bool {
			return e.Kind == "connect" && e.SandboxID == c.ID && e.Verdict == "deny" && e.Rule == "limit"
		}); !ok {
			t.Error("no deny event for the connection limit")
		}
	})

	t.Run("ListenDNS", func(t *testing.T) {
		pc, ln, err := n.ListenDNS(a.ID)
		if err != nil {
			t.Fatalf("ListenDNS: %v", err)
		}
		defer pc.Close()
		defer ln.Close()
		go func() {
			buf := make([]byte, 512)
			for {
				k, from, err := pc.ReadFrom(buf)
				if err != nil {
					return
				}
				pc.WriteTo(buf[:k], from)
			}
		}()
		accepted := make(chan struct{}, 4)
		go func() {
			for {
				c, err := ln.Accept()
				if err != nil {
					return
				}
				accepted <- struct{}{}
				c.Close()
			}
		}()
		c, err := dial(a.NetnsPath, "udp4", "127.0.0.53:53", time.Second)
		if err != nil {
			t.Fatalf("dial udp dns: %v", err)
		}
		defer c.Close()
		if err := echoOnce(c); err != nil {
			t.Errorf("udp dns from the sandbox: %v", err)
		}
		tc, err := dial(a.NetnsPath, "tcp4", "127.0.0.53:53", time.Second)
		if err != nil {
			t.Fatalf("dial tcp dns from the sandbox: %v", err)
		}
		tc.Close()
		select {
		case <-accepted:
		case <-time.After(3 * time.Second):
			t.Error("tcp dns listener did not accept")
		}
		// Not at the host, not in another sandbox.
		for _, ns := range []string{"/proc/self/ns/net", b.NetnsPath} {
			if c, err := dial(ns, "tcp4", "127.0.0.53:53", 500*time.Millisecond); err == nil {
				c.Close()
				select {
				case <-accepted:
					t.Errorf("sandbox dns listener reachable from %s", ns)
				case <-time.After(500 * time.Millisecond):
				}
			}
		}
	})

	t.Run("Detach", func(t *testing.T) {
		must(t, n.Detach(ctx, b.ID))
		if _, err := netlink.LinkByName(b.HostVeth); err == nil {
			t.Error("veth of b still there")
		}
		if _, err := os.Stat(b.NetnsPath); !errors.Is(err, os.ErrNotExist) {
			t.Errorf("netns of b still there: %v", err)
		}
		out, _ := exec.Command("nft", "list", "table", "inet", tableName).CombinedOutput()
		if strings.Contains(string(out), chainName(b.ID)) || strings.Contains(string(out), setName(b.ID)) {
			t.Errorf("rules of b still there:\n%s", out)
		}
		if err := n.Detach(ctx, b.ID); err == nil {
			t.Error("second Detach succeeded")
		}
	})
}

// scan returns the ports of addr that accept a TCP connection from netns.
func scan(netns string, addr netip.Addr, ports []int) []int {
	var mu sync.Mutex
	var open []int
	work := make(chan int)
	var wg sync.WaitGroup
	for range 64 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for p := range work {
				c, err := dial(netns, "tcp4", fmt.Sprintf("%s:%d", addr, p), 300*time.Millisecond)
				if err == nil {
					c.Close()
					mu.Lock()
					open = append(open, p)
					mu.Unlock()
				}
			}
		}()
	}
	for _, p := range ports {
		work <- p
	}
	close(work)
	wg.Wait()
	return open
}

func TestRestartRecover(t *testing.T) {
	requireNet(t)
	ctx := context.Background()
	dir := t.TempDir()
	cfg := testConfig(Config{NetnsDir: filepath.Join(dir, "netns"), Pool: testPool})
	n1, err := Setup(ctx, cfg)
	if err != nil {
		t.Fatalf("Setup: %v", err)
	}
	t.Cleanup(func() {
		// Whatever happened, leave nothing behind.
		n, err := Setup(ctx, cfg)
		if err == nil {
			n.Teardown(ctx)
		}
		assertClean(t, cfg.NetnsDir)
	})
	pol := &netpolicy.Policy{CIDRs: []netpolicy.CIDRRule{allow(pypiAddr, "tcp", 80, "pypi")}}
	atts := map[string]*Attachment{}
	for _, id := range []string{"sb-r-keep", "sb-r-drop1", "sb-r-drop2"} {
		a, err := n1.Attach(ctx, id, pol)
		if err != nil {
			t.Fatalf("Attach %s: %v", id, err)
		}
		atts[id] = a
	}
	must(t, n1.Close()) // the daemon exits; sandboxes live on

	n2, err := Setup(ctx, cfg)
	if err != nil {
		t.Fatalf("Setup after restart: %v", err)
	}
	if got := n2.sandboxes["sb-r-keep"]; got == nil || got.addr != atts["sb-r-keep"].Addr {
		t.Fatalf("restarted node did not learn sb-r-keep: %+v", got)
	}
	// A new sandbox must not reuse a learned address.
	c, err := n2.Attach(ctx, "sb-r-new", nil)
	if err != nil {
		t.Fatalf("Attach after restart: %v", err)
	}
	for _, a := range atts {
		if a.Addr == c.Addr {
			t.Fatalf("address %s handed out twice", c.Addr)
		}
	}
	must(t, n2.Recover(ctx, map[string]*netpolicy.Policy{"sb-r-keep": pol}))
	for _, id := range []string{"sb-r-drop1", "sb-r-drop2", "sb-r-new"} {
		if _, err := netlink.LinkByName(cfg.vethName(id)); err == nil {
			t.Errorf("veth of %s survived Recover", id)
		}
		if _, err := os.Stat(filepath.Join(cfg.NetnsDir, id)); err == nil {
			t.Errorf("netns of %s survived Recover", id)
		}
	}
	out, _ := exec.Command("nft", "list", "table", "inet", tableName).CombinedOutput()
	for _, id := range []string{"sb-r-drop1", "sb-r-drop2", "sb-r-new"} {
		if strings.Contains(string(out), hashOf(id)) {
			t.Errorf("rules of %s survived Recover", id)
		}
	}
	if !strings.Contains(string(out), chainName("sb-r-keep")) {
		t.Errorf("chain of the kept sandbox is gone:\n%s", out)
	}
	if _, err := netlink.LinkByName(cfg.vethName("sb-r-keep")); err != nil {
		t.Errorf("veth of the kept sandbox is gone: %v", err)
	}
	must(t, n2.Update(ctx, "sb-r-keep", nil, true))
	must(t, n2.Teardown(ctx))
	assertClean(t, cfg.NetnsDir)
}

func BenchmarkAttach(b *testing.B) {
	requireNet(b)
	ctx := context.Background()
	n := newTestNode(b, Config{})
	pol := &netpolicy.Policy{CIDRs: []netpolicy.CIDRRule{allow(pypiAddr, "tcp", 80, "pypi")}}
	i := 0
	var attach, detach time.Duration
	for b.Loop() {
		id := fmt.Sprintf("sb-bench-%d", i)
		i++
		start := time.Now()
		if _, err := n.Attach(ctx, id, pol); err != nil {
			b.Fatal(err)
		}
		mid := time.Now()
		if err := n.Detach(ctx, id); err != nil {
			b.Fatal(err)
		}
		attach += mid.Sub(start)
		detach += time.Since(mid)
	}
	b.ReportMetric(float64(attach.Microseconds())/float64(i), "attach-µs/op")
	b.ReportMetric(float64(detach.Microseconds())/float64(i), "detach-µs/op")
}

// TestManySandboxes attaches 500 sandboxes and checks that updating one
// leaves the others' rules untouched (same rule handles).
func TestManySandboxes(t *testing.T) {
	requireNet(t)
	if testing.Short() {
		t.Skip("attaches 500 sandboxes")
	}
	ctx := context.Background()
	n := newTestNode(t, Config{Pool: netip.MustParsePrefix("10.220.0.0/22")})
	pol := &netpolicy.Policy{CIDRs: []netpolicy.CIDRRule{allow(pypiAddr, "tcp", 80, "pypi")}}
	const count = 500
	start := time.Now()
	for i := range count {
		if _, err := n.Attach(ctx, fmt.Sprintf("sb-many-%d", i), pol); err != nil {
			t.Fatalf("Attach %d: %v", i, err)
		}
	}
	t.Logf("attached %d sandboxes in %v", count, time.Since(start))
	listChain := func(id string) string {
		out, err := exec.Command("nft", "-a", "list", "chain", "inet", tableName, chainName(id)).CombinedOutput()
		if err != nil {
			t.Fatalf("list chain: %v\n%s", err, out)
		}
		return string(out)
	}
	before := listChain("sb-many-7")
	start = time.Now()
	must(t, n.Update(ctx, "sb-many-3", &netpolicy.Policy{CIDRs: []netpolicy.CIDRRule{allow(npmAddr, "tcp", 80, "npm")}}, true))
	t.Logf("Update with %d sandboxes attached took %v", count, time.Since(start))
	if after := listChain("sb-many-7"); after != before {
		t.Errorf("updating sb-many-3 rewrote sb-many-7:\nbefore:\n%s\nafter:\n%s", before, after)
	}
	if got := listChain("sb-many-3"); !strings.Contains(got, `"dsec:A:npm"`) {
		t.Errorf("sb-many-3 not updated:\n%s", got)
	}
	start = time.Now()
	a, err := n.Attach(ctx, "sb-many-last", pol)
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("Attach with %d sandboxes attached took %v (addr %s)", count, time.Since(start), a.Addr)
}

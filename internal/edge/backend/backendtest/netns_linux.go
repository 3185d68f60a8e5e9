package backendtest

import (
	"fmt"
	"net"
	"net/http"
	"os"
	"os/exec"
	"runtime"
	"strings"
	"testing"

	"github.com/vishvananda/netns"
)

// The test network: two addresses on 198.18.0.0/15 (benchmarking space,
// never the host's own network), both ends in namespaces the suite makes.
const (
	testHostIP    = "198.19.250.1"
	testSandboxIP = "198.19.250.2"
)

// testNet is a network namespace for a sandbox (loopback up, eth0 with
// testSandboxIP/32 and a default route to testHostIP) whose veth's other
// end is in a test host's namespace serving a token over HTTP at addr.
type testNet struct {
	netnsPath string
	addr      string
	token     string
}

// makeTestNet makes a testNet; t's cleanup removes both namespaces (and
// so the veth) and stops the server.
func makeTestNet(t *testing.T) *testNet {
	t.Helper()
	seq.Lock()
	seq.n++
	name := fmt.Sprintf("dsec-btt-%d-%d", os.Getpid(), seq.n)
	seq.Unlock()
	sbx, host := name+"-s", name+"-h"
	ip := func(args ...string) {
		t.Helper()
		if out, err := exec.Command("ip", args...).CombinedOutput(); err != nil {
			t.Fatalf("ip %s: %v: %s", strings.Join(args, " "), err, out)
		}
	}
	for _, ns := range []string{sbx, host} {
		ip("netns", "add", ns)
		t.Cleanup(func() {
			if out, err := exec.Command("ip", "netns", "del", ns).CombinedOutput(); err != nil {
				t.Errorf("ip netns del %s: %v: %s", ns, err, out)
			}
		})
		ip("-n", ns, "link", "set", "lo", "up")
	}
	// Shaped as the edge's (package network): a /32 on each end of the
	// veth, a route to the other, and the sandbox's default route onlink.
	ip("-n", host, "link", "add", "veth0", "type", "veth", "peer", "name", "eth0", "netns", sbx)
	ip("-n", host, "addr", "add", testHostIP+"/32", "dev", "veth0")
	ip("-n", host, "link", "set", "veth0", "up")
	ip("-n", host, "route", "add", testSandboxIP+"/32", "dev", "veth0")
	ip("-n", sbx, "addr", "add", testSandboxIP+"/32", "dev", "eth0")
	ip("-n", sbx, "link", "set", "eth0", "up")
	ip("-n", sbx, "route", "add", testHostIP+"/32", "dev", "eth0")
	ip("-n", sbx, "route", "add", "default", "via", testHostIP, "dev", "eth0", "onlink")

	ln, err := listenIn("/run/netns/"+host, testHostIP+":0")
	if err != nil {
		t.Fatalf("listen in the test host's namespace: %v", err)
	}
	tn := &testNet{netnsPath: "/run/netns/" + sbx, addr: ln.Addr().String(), token: "hello from " + host}
	srv := &http.Server{Handler: http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		fmt.Fprint(w, tn.token)
	})}
	go srv.Serve(ln)
	t.Cleanup(func() { srv.Close() })
	return tn
}

// listenIn listens on addr in the network namespace at path. The socket
// stays in that namespace whichever thread serves it; the thread that
// entered it is not unlocked, so it ends with its goroutine.
func listenIn(path, addr string) (net.Listener, error) {
	type res struct {
		ln  net.Listener
		err error
	}
	ch := make(chan res, 1)
	go func() {
		runtime.LockOSThread()
		ns, err := netns.GetFromPath(path)
		if err != nil {
			ch <- res{err: err}
			return
		}
		defer ns.Close()
		if err := netns.Set(ns); err != nil {
			ch <- res{err: err}
			return
		}
		ln, err := net.Listen("tcp", addr)
		ch <- res{ln, err}
	}()
	r := <-ch
	return r.ln, r.err
}

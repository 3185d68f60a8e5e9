package root

import (
	"context"
	"encoding/json"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"connectrpc.com/connect"
	"github.com/miekg/dns"

	dsecv1 "dsec.dev/dsec/api/gen/dsec/v1"
	"dsec.dev/dsec/internal/testutil"
)

// testHost is a host the network tests make in a network namespace of their
// own, reachable from the node through a veth: stand-ins for "pypi", "npm",
// an unlisted host and a metadata service. No test packet ever leaves for an
// address outside loopback and these namespaces.
type testHost struct {
	name string
	ns   string
	addr string // the host's address
}

// netprobeBinary builds the static probe tool once per test.
func netprobeBinary(t *testing.T) string {
	t.Helper()
	out := filepath.Join(t.TempDir(), "netprobe")
	cmd := exec.Command("go", "build", "-o", out, "./test/root/testdata/netprobe")
	cmd.Dir = testutil.RepoRoot()
	cmd.Env = append(os.Environ(), "CGO_ENABLED=0")
	if b, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("build netprobe: %v\n%s", err, b)
	}
	return out
}

func run(t *testing.T, args ...string) {
	t.Helper()
	if out, err := exec.Command(args[0], args[1:]...).CombinedOutput(); err != nil {
		t.Fatalf("%s: %v\n%s", strings.Join(args, " "), err, out)
	}
}

// startTestHost makes namespace ns with address addr (host side gw, a /30 or
// /32 point-to-point link) and runs `netprobe serve name` in it.
func startTestHost(t *testing.T, probe, name string, idx int, addr string) testHost {
	t.Helper()
	ns := fmt.Sprintf("dsect-%s", name)
	hostIf := fmt.Sprintf("dsect%d", idx)
	gw := fmt.Sprintf("198.18.%d.1", idx)
	exec.Command("ip", "netns", "del", ns).Run() // a leftover of a killed run
	run(t, "ip", "netns", "add", ns)
	t.Cleanup(func() { exec.Command("ip", "netns", "del", ns).Run() })
	run(t, "ip", "link", "add", hostIf, "type", "veth", "peer", "name", "eth0", "netns", ns)
	t.Cleanup(func() { exec.Command("ip", "link", "del", hostIf).Run() })
	run(t, "ip", "addr", "add", gw+"/32", "dev", hostIf)
	run(t, "ip", "link", "set", hostIf, "up")
	run(t, "ip", "route", "add", addr+"/32", "dev", hostIf)
	run(t, "ip", "-n", ns, "addr", "add", addr+"/32", "dev", "eth0")
	run(t, "ip", "-n", ns, "link", "set", "lo", "up")
	run(t, "ip", "-n", ns, "link", "set", "eth0", "up")
	run(t, "ip", "-n", ns, "route", "add", gw+"/32", "dev", "eth0")
	run(t, "ip", "-n", ns, "route", "add", "default", "via", gw, "dev", "eth0", "onlink")
	cmd := exec.Command("ip", "netns", "exec", ns, probe, "serve", name+".test")
	cmd.Stdout, cmd.Stderr = os.Stderr, os.Stderr
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { cmd.Process.Kill(); cmd.Wait() })
	// Wait until it serves, from inside its own namespace.
	deadline := time.Now().Add(10 * time.Second)
	for {
		if exec.Command("ip", "netns", "exec", ns, probe, "connect", "127.0.0.1:80").Run() == nil {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("test host %s does not serve", name)
		}
		time.Sleep(50 * time.Millisecond)
	}
	return testHost{name: name, ns: ns, addr: addr}
}

// startDNS serves the test zone on a loopback port: NAME.test -> address.
func startDNS(t *testing.T, zone map[string]string) string {
	t.Helper()
	pc, err := net.ListenPacket("udp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	srv := &dns.Server{PacketConn: pc, Handler: dns.HandlerFunc(func(w dns.ResponseWriter, q *dns.Msg) {
		m := new(dns.Msg)
		m.SetReply(q)
		for _, qq := range q.Question {
			name := strings.TrimSuffix(strings.ToLower(qq.Name), ".")
			if a, ok := zone[name]; ok && qq.Qtype == dns.TypeA {
				rr, _ := dns.NewRR(fmt.Sprintf("%s 30 IN A %s", qq.Name, a))
				m.Answer = append(m.Answer, rr)
			} else if !ok {
				m.Rcode = dns.RcodeNameError
			}
		}
		w.WriteMsg(m)
	})}
	go srv.ActivateAndServe()
	t.Cleanup(func() { srv.Shutdown() })
	return pc.LocalAddr().String()
}

type netEnv struct {
	d     *testutil.Daemon
	probe string
	pypi  testHost
	npm   testHost
	other testHost
	meta  testHost
}

// For is e seen from t (testutil.Daemon.For).
func (e *netEnv) For(t *testing.T) *netEnv {
	c := *e
	c.d = e.d.For(t)
	return &c
}

// setupNetwork starts the test hosts, their DNS and a dsecd (with args
// added to its flags) that knows their services.
func setupNetwork(t *testing.T, args ...string) *netEnv {
	testutil.RequireRoot(t)
	testutil.RequireCommand(t, "ip")
	testutil.RequireCommand(t, "go")
	probe := netprobeBinary(t)
	e := &netEnv{probe: probe}
	e.pypi = startTestHost(t, probe, "pypi", 1, "198.18.1.2")
	e.npm = startTestHost(t, probe, "npm", 2, "198.18.2.2")
	e.other = startTestHost(t, probe, "other", 3, "198.18.3.2")
	e.meta = startTestHost(t, probe, "meta", 4, "169.254.214.254") // not the VM's own metadata address, nor internal/edge/network's test's meta host (packages test at once)
	upstream := startDNS(t, map[string]string{
		"pypi.test": e.pypi.addr, "files.pypi.test": e.pypi.addr, "npm.test": e.npm.addr, "other.test": e.other.addr,
	})
	services := filepath.Join(t.TempDir(), "services.json")
	web := []map[string]any{{"proto": "tcp", "port": 80}, {"proto": "tcp", "port": 443}}
	cat := map[string]any{"services": map[string]any{
		"pypi": map[string]any{"domains": []string{"pypi.test", "*.pypi.test"}, "ports": web},
		"npm":  map[string]any{"domains": []string{"npm.test"}, "ports": web},
		// A service this node knows no hosts for: a rule allowing it allows nothing.
		"intranet": map[string]any{},
		// An operator's service served by an internal mirror (the "other"
		// test host): tasks reach the mirror, never the service's own hosts.
		"pyindex": map[string]any{"domains": []string{"index.pyindex.test"}, "ports": web,
			"mirror": map[string]any{"url": "http://mirror.internal.test/simple/", "addrs": []string{"198.18.3.2"},
				"env": map[string]string{"PIP_INDEX_URL": "http://mirror.internal.test/simple/"}}},
	}}
	b, _ := json.Marshal(cat)
	if err := os.WriteFile(services, b, 0o644); err != nil {
		t.Fatal(err)
	}
	e.d = startDaemon(t, append([]string{"--dns-upstream", upstream, "--network-services", services}, args...)...)
	return e
}

// sandbox makes a busybox sandbox with rules and copies the probe into it.
func (e *netEnv) sandbox(t *testing.T, rules map[string]bool) *dsecv1.Sandbox {
	t.Helper()
	return e.sandboxOf(t, &dsecv1.SandboxSpec{NetworkRules: rules})
}

// sandboxOf makes a busybox sandbox of spec and copies the probe into it.
func (e *netEnv) sandboxOf(t *testing.T, spec *dsecv1.SandboxSpec) *dsecv1.Sandbox {
	t.Helper()
	sb := create(t, e.d, spec)
	data, err := os.ReadFile(e.probe)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	if _, err := e.d.Clients.Sandboxes.WriteFile(ctx, connect.NewRequest(&dsecv1.WriteFileRequest{
		SandboxId: sb.GetId(), Path: "/usr/local/bin/netprobe", Data: data, Mode: 0o755, MakeParents: true,
	})); err != nil {
		t.Fatal(err)
	}
	return sb
}

func (e *netEnv) probeOK(t *testing.T, id string, args string) string {
	t.Helper()
	r := sh(t, e.d, id, "netprobe "+args)
	if r.exit.GetStatus() != dsecv1.ExitStatus_EXIT_STATUS_OK {
		t.Errorf("netprobe %s in %s failed, want it to succeed: %s", args, id, r)
	}
	return r.stdout
}

func (e *netEnv) probeFails(t *testing.T, id string, args string) {
	t.Helper()
	r := sh(t, e.d, id, "netprobe "+args)
	if r.exit.GetStatus() == dsecv1.ExitStatus_EXIT_STATUS_OK {
		t.Errorf("netprobe %s in %s succeeded, want it denied: %s", args, id, r)
	}
}

func TestNetworkPolicy(t *testing.T) {
	e := setupNetwork(t)
	before := scrapeMetrics(t, e.d)

	// No rules: loopback only, nothing reachable.
	plain := e.sandbox(t, nil)
	if plain.GetAddress() != "" {
		t.Errorf("sandbox without rules got address %q", plain.GetAddress())
	}
	e.probeFails(t, plain.GetId(), "get http://"+e.pypi.addr+"/")

	sb := e.sandbox(t, map[string]bool{"pypi": true, "npm": false})
	if sb.GetAddress() == "" {
		t.Fatal("networked sandbox has no address")
	}
	id := sb.GetId()
	if len(sb.GetWarnings()) != 0 {
		t.Errorf("rules that all mean something got warnings %q", sb.GetWarnings())
	}
	// A rule that allows nothing here is not refused, but said at create:
	// in the record and on the CLI's stderr.
	out, errOut, code := e.d.CLI("", "create", "--network-rules", `{"intranet": true, "pypi": true}`, env)
	if code != 0 {
		t.Fatalf("create with a rule that allows nothing: %s", errOut)
	}
	warned := strings.TrimSpace(out)
	t.Cleanup(func() { e.d.CLI("", "rm", warned) })
	const warning = `service "intranet" has no domains or CIDRs on this node; allowing it allows nothing`
	if errOut != "dsec: warning: "+warning+"\n" {
		t.Errorf("create's stderr = %q, want the warning", errOut)
	}
	if out, _, _ := e.d.CLI("", "inspect", warned); !strings.Contains(out, strings.ReplaceAll(warning, `"`, `\"`)) {
		t.Errorf("inspect of %s lacks the warning:\n%s", warned, out)
	}
	// Its host name is its address, in its own /etc/hosts, not a DNS query.
	if out := strings.TrimSpace(e.probeOK(t, id, "resolve "+id)); out != sb.GetAddress() {
		t.Errorf("the sandbox's host name resolves to %q, want its address %s", out, sb.GetAddress())
	}
	if out := e.probeOK(t, id, "get http://pypi.test/"); !strings.Contains(out, "hello from pypi.test") {
		t.Errorf("pypi over HTTP: %q", out)
	}
	if out := e.probeOK(t, id, "get https://files.pypi.test/"); !strings.Contains(out, "hello from pypi.test") {
		t.Errorf("pypi over TLS: %q", out)
	}
	e.probeFails(t, id, "resolve npm.test")
	e.probeFails(t, id, "get http://npm.test/")
	e.probeFails(t, id, "get http://other.test/")
	// Raw IPs of hosts never allowed, and the metadata address.
	e.probeFails(t, id, "connect "+e.npm.addr+":80")
	e.probeFails(t, id, "connect "+e.other.addr+":80")
	e.probeFails(t, id, "connect "+e.meta.addr+":80")
	// An allowed name's address on a port the service does not list.
	e.probeFails(t, id, "connect "+e.pypi.addr+":7")

	// Another sandbox, the node's services and the API: all denied.
	peer := e.sandbox(t, map[string]bool{"pypi": true})
	if r := sh(t, e.d, peer.GetId(), "netprobe serve peer.test >/dev/null 2>&1 &"); r.exit.GetStatus() != dsecv1.ExitStatus_EXIT_STATUS_OK {
		t.Fatalf("start peer server: %s", r)
	}
	e.probeFails(t, id, "connect "+peer.GetAddress()+":80")
	hostLn, err := net.Listen("tcp", "0.0.0.0:0")
	if err != nil {
		t.Fatal(err)
	}
	defer hostLn.Close()
	go func() {
		for {
			c, err := hostLn.Accept()
			if err != nil {
				return
			}
			c.Close()
		}
	}()
	_, hostPort, _ := net.SplitHostPort(hostLn.Addr().String())
	gw := gatewayOf(t, e, id)
	_, apiPort, _ := net.SplitHostPort(e.d.Addr)
	out = e.probeOK(t, id, fmt.Sprintf("scan %s 1-1024 %s %s", gw, hostPort, apiPort))
	if strings.TrimSpace(out) != "" {
		t.Errorf("port scan of the node from a sandbox found open ports: %q", out)
	}
	e.probeFails(t, id, "connect "+e.pypi.addr[:len(e.pypi.addr)-1]+"1:"+hostPort) // the node's end of the test link

	// The audit log lists each attempt with its verdict.
	logOut, errOut, code := e.d.CLI("", "net", "log", id, "--json")
	if code != 0 {
		t.Fatalf("dsec net log: %s", errOut)
	}
	var log struct {
		Events []struct {
			Kind, Verdict, Destination, Name, Protocol string
			Port                                       int
		} `json:"events"`
	}
	if err := json.Unmarshal([]byte(logOut), &log); err != nil {
		t.Fatalf("net log JSON: %v\n%s", err, logOut)
	}
	has := func(kind, verdict, dest string, port int, name string) bool {
		for _, ev := range log.Events {
			if ev.Kind == kind && ev.Verdict == verdict && (dest == "" || ev.Destination == dest) &&
				(port == 0 || ev.Port == port) && (name == "" || ev.Name == name) {
				return true
			}
		}
		return false
	}
	for _, c := range []struct {
		kind, verdict, dest string
		port                int
		name                string
	}{
		{"dns", "allow", "", 0, "pypi.test"},
		{"dns", "deny", "", 0, "npm.test"},
		{"connect", "allow", e.pypi.addr, 80, ""},
		{"connect", "allow", e.pypi.addr, 443, ""},
		{"connect", "deny", e.npm.addr, 80, ""},
		{"connect", "deny", e.meta.addr, 80, ""},
	} {
		if !has(c.kind, c.verdict, c.dest, c.port, c.name) {
			t.Errorf("audit log lacks %s %s %s:%d %s; it has:\n%s", c.kind, c.verdict, c.dest, c.port, c.name, logOut)
		}
	}
	// The node's metrics counted them: at least the log's events of each
	// kind and verdict (the peer sandbox's own are counted too).
	after := scrapeMetrics(t, e.d)
	for _, kv := range [][2]string{{"dns", "allow"}, {"dns", "deny"}, {"connect", "allow"}, {"connect", "deny"}} {
		logged := 0
		for _, ev := range log.Events {
			if ev.Kind == kv[0] && ev.Verdict == kv[1] {
				logged++
			}
		}
		labels := map[string]string{"kind": kv[0], "verdict": kv[1]}
		moved := testutil.MetricValue(after, "dsec_network_events_total", labels) - testutil.MetricValue(before, "dsec_network_events_total", labels)
		if logged == 0 || moved < float64(logged) {
			t.Errorf("dsec_network_events_total%v moved by %v; the sandbox's log has %d such events", labels, moved, logged)
		}
	}
}

// A networked sandbox keeps its address, rules and DNS across a kill -9 and
// restart of dsecd, and the audit log goes on.
func TestNetworkSurvivesDaemonRestart(t *testing.T) {
	e := setupNetwork(t)
	sb := e.sandbox(t, map[string]bool{"pypi": true})
	id := sb.GetId()
	e.probeOK(t, id, "get http://pypi.test/")
	e.d.Kill()
	e.d.Start()
	got := e.d.CLI
	out, errOut, code := got("", "inspect", id)
	if code != 0 || !strings.Contains(out, sb.GetAddress()) {
		t.Fatalf("inspect after restart: %s %s", out, errOut)
	}
	e.probeOK(t, id, "get http://pypi.test/")
	e.probeFails(t, id, "get http://npm.test/")
	e.probeFails(t, id, "connect "+e.npm.addr+":80")
	if _, errOut, code := got("", "net", "set", id, `{"npm": true}`); code != 0 {
		t.Fatalf("net set after restart: %s", errOut)
	}
	e.probeOK(t, id, "get http://npm.test/")
	logOut, _, _ := got("", "net", "log", id, "--json")
	if !strings.Contains(logOut, `"npm.test"`) || !strings.Contains(logOut, `"pypi.test"`) {
		t.Errorf("audit log after restart lacks queries from before and after it:\n%s", logOut)
	}
}

func TestNetworkMirror(t *testing.T) {
	e := setupNetwork(t)
	sb := e.sandbox(t, map[string]bool{"pyindex": true})
	id := sb.GetId()
	if out := e.probeOK(t, id, "resolve index.pyindex.test"); strings.TrimSpace(out) != e.other.addr {
		t.Errorf("the service's domain resolves to %q, want the mirror %s", out, e.other.addr)
	}
	if out := e.probeOK(t, id, "get http://mirror.internal.test/simple/"); !strings.Contains(out, "hello from other.test") {
		t.Errorf("mirror over HTTP: %q", out)
	}
	if out := mustSh(t, e.d, id, "echo $PIP_INDEX_URL"); strings.TrimSpace(out) != "http://mirror.internal.test/simple/" {
		t.Errorf("PIP_INDEX_URL = %q", out)
	}
	// The mirror's host is reachable through the mirror only, not by its
	// own public name, and other services stay closed.
	e.probeFails(t, id, "resolve other.test")
	e.probeFails(t, id, "get http://pypi.test/")
}

// gatewayOf reads the sandbox's default gateway.
func gatewayOf(t *testing.T, e *netEnv, id string) string {
	t.Helper()
	out := mustSh(t, e.d, id, "ip route show default 2>/dev/null || route -n")
	for _, f := range strings.Fields(out) {
		if ip := net.ParseIP(f); ip != nil && ip.To4() != nil && !ip.Equal(net.IPv4zero) {
			return f
		}
	}
	t.Fatalf("no default gateway in %q", out)
	return ""
}

func TestNetworkLiveUpdate(t *testing.T) {
	e := setupNetwork(t)
	sb := e.sandbox(t, map[string]bool{"pypi": true})
	id := sb.GetId()
	e.probeOK(t, id, "get http://pypi.test/")
	e.probeFails(t, id, "get http://npm.test/")

	// A held connection to pypi's echo port by raw CIDR rule, then rules
	// that drop it, with cut: the next connection follows the new rules at
	// once, and the held one is broken.
	if _, errOut, code := e.d.CLI("", "net", "set", id, `{"npm": true, "`+e.pypi.addr+`/32:7/tcp": true}`); code != 0 {
		t.Fatalf("dsec net set: %s", errOut)
	}
	e.probeOK(t, id, "get http://npm.test/")
	e.probeFails(t, id, "get http://pypi.test/")
	hold := execBackground(t, e.d, id, "netprobe hold "+e.pypi.addr+":7")
	waitOutput(t, e.d, id, hold, "connected")
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	if _, err := e.d.Clients.Sandboxes.SetNetworkRules(ctx, connect.NewRequest(&dsecv1.SetNetworkRulesRequest{
		SandboxId: id, Rules: map[string]bool{"npm": true}, Cut: true,
	})); err != nil {
		t.Fatal(err)
	}
	e.probeFails(t, id, "connect "+e.pypi.addr+":7")
	waitOutput(t, e.d, id, hold, "cut:")

	// A sandbox made without rules cannot be given a network later.
	plain := create(t, e.d, nil)
	if _, err := e.d.Clients.Sandboxes.SetNetworkRules(ctx, connect.NewRequest(&dsecv1.SetNetworkRulesRequest{
		SandboxId: plain.GetId(), Rules: map[string]bool{"pypi": true},
	})); connect.CodeOf(err) != connect.CodeFailedPrecondition {
		t.Errorf("rules on a loopback-only sandbox: %v, want failed_precondition", err)
	}
	// Bad rules are refused with a clear error and change nothing.
	if _, err := e.d.Clients.Sandboxes.SetNetworkRules(ctx, connect.NewRequest(&dsecv1.SetNetworkRulesRequest{
		SandboxId: id, Rules: map[string]bool{"no-such-service": true},
	})); connect.CodeOf(err) != connect.CodeInvalidArgument {
		t.Errorf("unknown service: %v, want invalid_argument", err)
	}
	e.probeOK(t, id, "get http://npm.test/")
	if _, err := e.d.Clients.Sandboxes.Create(ctx, connect.NewRequest(&dsecv1.CreateRequest{Spec: &dsecv1.SandboxSpec{
		Environment: env, NetworkRules: map[string]bool{"10.0.0.0/33": true},
	}})); connect.CodeOf(err) != connect.CodeInvalidArgument {
		t.Errorf("bad CIDR at create: %v, want invalid_argument", err)
	}
}

// execBackground starts a background command and returns its process ID.
func execBackground(t *testing.T, d *testutil.Daemon, id, command string) string {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	stream, err := d.Clients.Sandboxes.Exec(ctx, connect.NewRequest(&dsecv1.ExecRequest{SandboxId: id, Command: command, Background: true}))
	if err != nil {
		t.Fatal(err)
	}
	defer stream.Close()
	for stream.Receive() {
		if s := stream.Msg().GetStarted(); s != nil {
			return s.GetProcessId()
		}
	}
	t.Fatalf("background %q did not start: %v", command, stream.Err())
	return ""
}

// waitOutput waits until a background process's output contains want.
func waitOutput(t *testing.T, d *testutil.Daemon, id, pid, want string) {
	t.Helper()
	deadline := time.Now().Add(20 * time.Second)
	for time.Now().Before(deadline) {
		ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
		stream, err := d.Clients.Sandboxes.Attach(ctx, connect.NewRequest(&dsecv1.AttachRequest{SandboxId: id, ProcessId: pid}))
		var out strings.Builder
		if err == nil {
			for stream.Receive() {
				out.Write(stream.Msg().GetStdout())
			}
			stream.Close()
		}
		cancel()
		if strings.Contains(out.String(), want) {
			return
		}
		time.Sleep(100 * time.Millisecond)
	}
	t.Fatalf("process %s never printed %q", pid, want)
}

package root

import (
	"encoding/json"
	"strconv"
	"strings"
	"testing"

	dsecv1 "dsec.dev/dsec/api/gen/dsec/v1"
)

// netCheckEgress is the per-sandbox egress cap, in bytes/s, of the dsecd
// that checkNetworkRules runs against (--sandbox-egress-bytes).
const netCheckEgress = 2_000_000

// checkNetworkRules checks what a sandbox of another isolation (what)
// with rules {"pypi": true, "npm": false} gets of the edge's network, as a
// container does: its host name is its address, an allowed service
// answers by name (over UDP and TCP DNS), a denied one neither resolves
// nor connects, nor does the metadata address, an upload keeps to the
// node's egress cap, the audit log has it all, and a live rule update
// applies at once after a kill -9 and restart of dsecd.
func checkNetworkRules(t *testing.T, e *netEnv, sb *dsecv1.Sandbox, what string) {
	t.Helper()
	id := sb.GetId()
	if sb.GetAddress() == "" {
		t.Fatalf("the networked %s has no address", what)
	}
	if out := strings.TrimSpace(e.probeOK(t, id, "resolve "+id)); out != sb.GetAddress() {
		t.Errorf("the %s's host name resolves to %q, want its address %s", what, out, sb.GetAddress())
	}
	if out := e.probeOK(t, id, "get http://pypi.test/"); !strings.Contains(out, "hello from pypi.test") {
		t.Errorf("pypi from the %s: %q", what, out)
	}
	if out := strings.TrimSpace(e.probeOK(t, id, "resolve-tcp pypi.test")); out != e.pypi.addr {
		t.Errorf("pypi.test over TCP DNS from the %s: %q, want %s", what, out, e.pypi.addr)
	}
	e.probeFails(t, id, "resolve npm.test")
	e.probeFails(t, id, "resolve-tcp npm.test")
	e.probeFails(t, id, "connect "+e.npm.addr+":80")
	e.probeFails(t, id, "connect "+e.meta.addr+":80")
	checkEgressCap(t, e, id, what)

	logOut, errOut, code := e.d.CLI("", "net", "log", id, "--json")
	if code != 0 {
		t.Fatalf("dsec net log: %s", errOut)
	}
	for _, want := range []string{`"pypi.test"`, `"npm.test"`, `"` + e.pypi.addr + `"`, `"` + e.npm.addr + `"`} {
		if !strings.Contains(logOut, want) {
			t.Errorf("the %s's audit log lacks %s:\n%s", what, want, logOut)
		}
	}
	var log struct {
		Events []struct{ Kind, Protocol, Name, Verdict string }
	}
	if err := json.Unmarshal([]byte(logOut), &log); err != nil {
		t.Fatalf("dsec net log --json: %v\n%s", err, logOut)
	}
	tcpDNS := map[string]string{}
	for _, ev := range log.Events {
		if ev.Kind == "dns" && ev.Protocol == "tcp" {
			tcpDNS[ev.Name] = ev.Verdict
		}
	}
	if tcpDNS["pypi.test"] != "allow" || tcpDNS["npm.test"] != "deny" {
		t.Errorf("the %s's audit log has DNS over TCP %v, want pypi.test allowed and npm.test denied:\n%s", what, tcpDNS, logOut)
	}

	e.d.Kill()
	e.d.Start()
	e.probeOK(t, id, "get http://pypi.test/")
	if _, errOut, code := e.d.CLI("", "net", "set", id, `{"npm": true}`); code != 0 {
		t.Fatalf("net set after the restart: %s", errOut)
	}
	if out := e.probeOK(t, id, "get http://npm.test/"); !strings.Contains(out, "hello from npm.test") {
		t.Errorf("npm from the %s after net set: %q", what, out)
	}
	e.probeFails(t, id, "get http://pypi.test/")
}

// checkEgressCap uploads three seconds' worth of the egress cap to pypi
// and checks it took at least about that long: the cap's tbf on the
// veth holds for what the sandbox sends. (A slower machine only makes the
// upload slower, so the bound cannot fail for load.)
func checkEgressCap(t *testing.T, e *netEnv, id, what string) {
	t.Helper()
	const bytes = 3 * netCheckEgress
	out := strings.Fields(e.probeOK(t, id, "post http://pypi.test/ "+strconv.Itoa(bytes)))
	if len(out) != 2 {
		t.Errorf("upload from the %s: %q", what, out)
		return
	}
	secs, err := strconv.ParseFloat(out[1], 64)
	if err != nil || secs <= 0 {
		t.Errorf("upload from the %s: %q", what, out)
		return
	}
	rate := float64(bytes) / secs
	t.Logf("upload of %d bytes from the %s: %.2f s, %.0f bytes/s under a cap of %d", bytes, what, secs, rate, netCheckEgress)
	if rate > 1.25*netCheckEgress {
		t.Errorf("the %s uploaded at %.0f bytes/s, over the egress cap of %d", what, rate, netCheckEgress)
	}
}

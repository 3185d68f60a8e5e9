package network

import (
	"net/netip"
	"testing"

	"dsec.dev/dsec/internal/edge/netpolicy"
)

func TestPlanEvaluate(t *testing.T) {
	pool := netip.MustParsePrefix("10.213.0.0/16")
	cidr := func(p string, proto string, port uint16, allow bool, src string) netpolicy.CIDRRule {
		return netpolicy.CIDRRule{Prefix: netip.MustParsePrefix(p), Port: netpolicy.Port{Proto: proto, Port: port}, Allow: allow, Source: src}
	}
	allowAll := &netpolicy.Policy{CIDRs: []netpolicy.CIDRRule{cidr("0.0.0.0/0", "", 0, true, "all")}}
	mixed := &netpolicy.Policy{CIDRs: []netpolicy.CIDRRule{
		cidr("169.254.169.254/32", "tcp", 80, true, "metadata"),
		cidr("10.1.2.3/32", "", 0, true, "mirror"),
		cidr("1.2.3.0/24", "", 0, false, "bad"),
		cidr("1.0.0.0/8", "tcp", 443, true, "web"),
	}}
	tests := []struct {
		name     string
		pol      *netpolicy.Policy
		addr     string
		proto    uint8
		port     uint16
		resolved bool
		allow    bool
		rule     string
	}{
		{"nil policy denies", nil, "1.1.1.1", protoTCP, 443, false, false, "default"},
		{"nil policy resolved public", nil, "1.1.1.1", protoTCP, 443, true, true, "resolved"},
		{"allow all public", allowAll, "8.8.8.8", protoUDP, 53, false, true, "all"},
		{"allow all not pool", allowAll, "10.213.0.7", protoTCP, 80, false, false, "reserved"},
		{"allow all not link-local", allowAll, "169.254.169.254", protoTCP, 80, false, false, "reserved"},
		{"allow all not private", allowAll, "192.168.1.1", protoTCP, 80, false, false, "reserved"},
		{"allow all not loopback", allowAll, "127.0.0.1", protoTCP, 80, false, false, "reserved"},
		{"resolved private", nil, "192.168.1.1", protoTCP, 80, true, true, "resolved"},
		{"resolved never link-local", nil, "169.254.169.254", protoTCP, 80, true, false, "reserved"},
		{"resolved never pool", nil, "10.213.0.9", protoTCP, 80, true, false, "reserved"},
		{"explicit metadata", mixed, "169.254.169.254", protoTCP, 80, false, true, "metadata"},
		{"explicit metadata other port", mixed, "169.254.169.254", protoTCP, 81, false, false, "reserved"},
		{"explicit mirror any port", mixed, "10.1.2.3", protoUDP, 9, false, true, "mirror"},
		{"deny before broader allow", mixed, "1.2.3.4", protoTCP, 443, false, false, "bad"},
		{"deny beats resolved", mixed, "1.2.3.4", protoTCP, 443, true, false, "bad"},
		{"broader allow", mixed, "1.9.9.9", protoTCP, 443, false, true, "web"},
		{"broader allow wrong proto", mixed, "1.9.9.9", protoUDP, 443, false, false, "default"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			allow, rule := evaluate(plan(tt.pol, pool), pool, netip.MustParseAddr(tt.addr), tt.proto, tt.port, tt.resolved)
			if allow != tt.allow || rule != tt.rule {
				t.Errorf("evaluate = %v %q, want %v %q", allow, rule, tt.allow, tt.rule)
			}
		})
	}
}

func TestNames(t *testing.T) {
	id := "sb-node1-0123456789abcdef"
	cfg, err := Config{NetnsDir: "/x"}.withDefaults()
	if err != nil {
		t.Fatal(err)
	}
	if v := cfg.vethName(id); len(v) > 15 || v[:3] != "dsv" {
		t.Errorf("vethName = %q", v)
	}
	if cfg.vethName(id) == cfg.vethName(id+"x") {
		t.Error("vethName does not depend on the id")
	}
	for _, bad := range []string{"", "a/b", "..", "."} {
		if validID(bad) == nil {
			t.Errorf("validID(%q) = nil", bad)
		}
	}
}

func TestMatchDomain(t *testing.T) {
	tests := []struct {
		pattern, name string
		want          bool
	}{
		{"pypi.org", "pypi.org", true},
		{"pypi.org", "PyPI.org.", true},
		{"pypi.org", "x.pypi.org", false},
		{"*.pythonhosted.org", "files.pythonhosted.org", true},
		{"*.pythonhosted.org", "pythonhosted.org", false},
		{"*.pythonhosted.org", "evilpythonhosted.org", false},
	}
	for _, tt := range tests {
		if got := matchDomain(tt.pattern, tt.name); got != tt.want {
			t.Errorf("matchDomain(%q, %q) = %v", tt.pattern, tt.name, got)
		}
	}
}

func TestParse(t *testing.T) {
	v, r, ok := parsePrefix("dsec:A:pypi")
	if !ok || v != "allow" || r != "pypi" {
		t.Errorf("parsePrefix = %q %q %v", v, r, ok)
	}
	if _, _, ok := parsePrefix("other"); ok {
		t.Error("parsePrefix accepted a foreign prefix")
	}
}

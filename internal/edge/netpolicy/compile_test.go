package netpolicy

import (
	"errors"
	"fmt"
	"net/netip"
	"strings"
	"testing"

	"github.com/google/go-cmp/cmp"

	"dsec.dev/dsec/internal/errdefs"
)

func testCatalog() *Catalog {
	c := DefaultCatalog()
	c.Services["pypi"] = Service{
		Domains: []string{"index.pypi.test", "*.files.pypi.test"},
		Ports:   []Port{{Proto: "tcp", Port: 443}},
	}
	c.Services["corp"] = Service{
		Domains: []string{"git.corp.test"},
		Ports:   []Port{{Proto: "tcp", Port: 22}},
		CIDRs:   []netip.Prefix{netip.MustParsePrefix("192.0.2.0/24")},
	}
	return c
}

func TestCompileKeys(t *testing.T) {
	tests := []struct {
		key     string
		wantErr error // nil: valid
		cidr    *CIDRRule
		domain  string
	}{
		{key: "10.0.0.0/8", cidr: &CIDRRule{Prefix: netip.MustParsePrefix("10.0.0.0/8")}},
		{key: "10.1.2.3", cidr: &CIDRRule{Prefix: netip.MustParsePrefix("10.1.2.3/32")}},
		{key: "10.1.2.3/16", cidr: &CIDRRule{Prefix: netip.MustParsePrefix("10.1.0.0/16")}},
		{key: "10.0.0.0/8:443", cidr: &CIDRRule{Prefix: netip.MustParsePrefix("10.0.0.0/8"), Port: Port{Port: 443}}},
		{key: "10.1.2.3:53/udp", cidr: &CIDRRule{Prefix: netip.MustParsePrefix("10.1.2.3/32"), Port: Port{Proto: "udp", Port: 53}}},
		{key: "0.0.0.0/0:80/tcp", cidr: &CIDRRule{Prefix: netip.MustParsePrefix("0.0.0.0/0"), Port: Port{Proto: "tcp", Port: 80}}},
		{key: "example.test", domain: "example.test"},
		{key: "Example.TEST.", domain: "example.test"},
		{key: "*.example.test", domain: "*.example.test"},
		{key: "a-b_c.example.test", domain: "a-b_c.example.test"},
		{key: "pypi"},
		{key: "corp"},

		{key: "nosuchservice", wantErr: errdefs.ErrInvalidArgument},
		{key: "", wantErr: errdefs.ErrInvalidArgument},
		{key: "10.0.0.0/33", wantErr: errdefs.ErrInvalidArgument},
		{key: "10.0.0.256", wantErr: errdefs.ErrInvalidArgument},
		{key: "10.0.0.1:0", wantErr: errdefs.ErrInvalidArgument},
		{key: "10.0.0.1:70000", wantErr: errdefs.ErrInvalidArgument},
		{key: "10.0.0.1:53/icmp", wantErr: errdefs.ErrInvalidArgument},
		{key: "10.0.0.1:", wantErr: errdefs.ErrInvalidArgument},
		{key: "example.test:443", wantErr: errdefs.ErrInvalidArgument},
		{key: "ex*ample.test", wantErr: errdefs.ErrInvalidArgument},
		{key: "a.*.example.test", wantErr: errdefs.ErrInvalidArgument},
		{key: "*", wantErr: errdefs.ErrInvalidArgument},
		{key: "-bad.example.test", wantErr: errdefs.ErrInvalidArgument},
		{key: "bad..example.test", wantErr: errdefs.ErrInvalidArgument},
		{key: "sp ace.test", wantErr: errdefs.ErrInvalidArgument},
		{key: strings.Repeat("a", 64) + ".test", wantErr: errdefs.ErrInvalidArgument},
		{key: "2001:db8::/32", wantErr: errdefs.ErrInvalidArgument},
		{key: "::1", wantErr: errdefs.ErrInvalidArgument},
		{key: "[2001:db8::1]:443", wantErr: errdefs.ErrInvalidArgument},
		{key: "2001:db8:0:0:0:0:0:1", wantErr: errdefs.ErrInvalidArgument},
		{key: "::ffff:10.0.0.1", wantErr: errdefs.ErrInvalidArgument},
		{key: "10.0.0.1:53:udp", wantErr: errdefs.ErrInvalidArgument},
	}
	for _, tt := range tests {
		t.Run(tt.key, func(t *testing.T) {
			p, _, err := Compile(map[string]bool{tt.key: true}, testCatalog())
			if tt.wantErr != nil {
				if !errors.Is(err, tt.wantErr) {
					t.Fatalf("Compile(%q) error = %v, want %v", tt.key, err, tt.wantErr)
				}
				if !strings.Contains(err.Error(), fmt.Sprintf("%q", tt.key)) {
					t.Errorf("error %q does not name the key", err)
				}
				return
			}
			if err != nil {
				t.Fatalf("Compile(%q): %v", tt.key, err)
			}
			if tt.cidr != nil {
				want := *tt.cidr
				want.Allow, want.Source = true, tt.key
				if diff := cmp.Diff([]CIDRRule{want}, p.CIDRs, cmp.Comparer(func(a, b netip.Prefix) bool { return a == b })); diff != "" {
					t.Errorf("CIDRs (-want +got):\n%s", diff)
				}
			}
			if tt.domain != "" {
				if len(p.Domains) != 1 || p.Domains[0].Pattern != tt.domain || !p.Domains[0].Allow {
					t.Errorf("Domains = %+v, want one allow %q", p.Domains, tt.domain)
				}
			}
		})
	}
}

// TestCompileIPv6Message: an IPv6 key is the request's fault (no node
// enforces IPv6), InvalidArgument naming the rule, so that placement does
// not try it on other nodes and report them all full.
func TestCompileIPv6Message(t *testing.T) {
	for _, key := range []string{"2001:db8::/32:443", "::/0"} {
		_, _, err := Compile(map[string]bool{key: true}, nil)
		if !errors.Is(err, errdefs.ErrInvalidArgument) || !strings.Contains(err.Error(), `rule "`+key+`"`) ||
			!strings.Contains(err.Error(), "network rules are IPv4 only") {
			t.Errorf("rule %q: error = %v", key, err)
		}
	}
}

func TestCompileLimits(t *testing.T) {
	rules := map[string]bool{}
	for i := 0; i <= MaxRules; i++ {
		rules[fmt.Sprintf("h%d.example.test", i)] = true
	}
	_, _, err := Compile(rules, nil)
	if !errors.Is(err, errdefs.ErrInvalidArgument) || !strings.Contains(err.Error(), "at most 256") {
		t.Fatalf("error = %v", err)
	}
	if _, _, err := Compile(map[string]bool{strings.Repeat("a.", 200) + "test": true}, nil); !errors.Is(err, errdefs.ErrInvalidArgument) {
		t.Fatalf("long key: error = %v", err)
	}
}

func TestCompileUnknownServiceNamesIt(t *testing.T) {
	_, _, err := Compile(map[string]bool{"pipy": true}, testCatalog())
	if !errors.Is(err, errdefs.ErrInvalidArgument) || !strings.Contains(err.Error(), `"pipy"`) || !strings.Contains(err.Error(), "pypi") {
		t.Fatalf("error = %v", err)
	}
}

func TestCompileServiceWithoutDomainsWarns(t *testing.T) {
	p, warnings, err := Compile(map[string]bool{"npm": true}, DefaultCatalog())
	if err != nil {
		t.Fatal(err)
	}
	if len(p.Domains) != 0 || len(p.CIDRs) != 0 {
		t.Errorf("policy allows something: %+v", p)
	}
	if len(warnings) != 1 || !strings.Contains(warnings[0], `"npm"`) {
		t.Errorf("warnings = %q", warnings)
	}
}

func TestCIDROrder(t *testing.T) {
	p, _, err := Compile(map[string]bool{
		"10.0.0.0/8":         true,
		"10.0.0.0/8:443":     false,
		"10.0.0.0/8:53/udp":  true,
		"10.0.0.0/8:53":      false,
		"10.1.0.0/16":        false,
		"10.1.2.3":           true,
		"10.1.2.3:22":        true,
		"10.1.2.0/24:22/tcp": false,
		"10.9.0.0/16":        true,
	}, nil)
	if err != nil {
		t.Fatal(err)
	}
	var got []string
	for _, r := range p.CIDRs {
		got = append(got, fmt.Sprintf("%s %v", r.Source, r.Allow))
	}
	want := []string{
		"10.1.2.3:22 true",
		"10.1.2.3 true",
		"10.1.2.0/24:22/tcp false",
		"10.1.0.0/16 false",
		"10.9.0.0/16 true",
		"10.0.0.0/8:53/udp true",
		"10.0.0.0/8:53 false",
		"10.0.0.0/8:443 false",
		"10.0.0.0/8 true",
	}
	if diff := cmp.Diff(want, got); diff != "" {
		t.Errorf("order (-want +got):\n%s", diff)
	}

	for _, tt := range []struct {
		addr  string
		proto string
		port  uint16
		allow bool
		rule  string
	}{
		{"10.1.2.3", "tcp", 22, true, "10.1.2.3:22"},
		{"10.1.2.4", "tcp", 22, false, "10.1.2.0/24:22/tcp"},
		{"10.1.2.4", "udp", 22, false, "10.1.0.0/16"},
		{"10.5.0.1", "udp", 53, true, "10.0.0.0/8:53/udp"},
		{"10.5.0.1", "tcp", 53, false, "10.0.0.0/8:53"},
		{"10.5.0.1", "tcp", 443, false, "10.0.0.0/8:443"},
		{"10.5.0.1", "tcp", 80, true, "10.0.0.0/8"},
	} {
		allow, rule, matched := p.Addr(netip.MustParseAddr(tt.addr), tt.proto, tt.port)
		if !matched || allow != tt.allow || rule != tt.rule {
			t.Errorf("Addr(%s %s/%d) = %v %q %v, want %v %q", tt.addr, tt.proto, tt.port, allow, rule, matched, tt.allow, tt.rule)
		}
	}
	if _, _, matched := p.Addr(netip.MustParseAddr("192.0.2.1"), "tcp", 80); matched {
		t.Error("an address outside every rule matched")
	}
}

func TestCIDRDenyBeatsServiceAllowOnSamePrefix(t *testing.T) {
	p, _, err := Compile(map[string]bool{"corp": true, "192.0.2.0/24:22/tcp": false}, testCatalog())
	if err != nil {
		t.Fatal(err)
	}
	allow, rule, _ := p.Addr(netip.MustParseAddr("192.0.2.9"), "tcp", 22)
	if allow || rule != "192.0.2.0/24:22/tcp" {
		t.Errorf("Addr = %v %q, want deny by the CIDR key", allow, rule)
	}
	if len(p.CIDRs) != 1 {
		t.Errorf("the shadowed allow was kept: %+v", p.CIDRs)
	}
}

func TestNamePrecedence(t *testing.T) {
	p, _, err := Compile(map[string]bool{
		"pypi":                  true,  // index.pypi.test, *.files.pypi.test on 443/tcp
		"*.pypi.test":           false, // shorter wildcard: loses to the service's exact and longer ones
		"bad.files.pypi.test":   false, // exact deny beats the wildcard allow
		"*.example.test":        true,
		"*.deep.example.test":   false,
		"ok.deep.example.test":  true,
		"example.test":          false,
		"both.test":             true,
		"git.corp.test":         true, // domain key (every port) + service (22): every port
		"corp":                  true,
		"tie.files.pypi.test":   true,
		"*.tie.files.pypi.test": true,
		"x.tie.files.pypi.test": false,
	}, testCatalog())
	if err != nil {
		t.Fatal(err)
	}
	https := []Port{{Proto: "tcp", Port: 443}}
	for _, tt := range []struct {
		name  string
		allow bool
		ports []Port
		rule  string
	}{
		{"index.pypi.test", true, https, "pypi"},
		{"INDEX.pypi.test.", true, https, "pypi"},
		{"a.files.pypi.test", true, https, "pypi"},
		{"files.pypi.test", false, nil, "*.pypi.test"},
		{"other.pypi.test", false, nil, "*.pypi.test"},
		{"bad.files.pypi.test", false, nil, "bad.files.pypi.test"},
		{"a.example.test", true, nil, "*.example.test"},
		{"example.test", false, nil, "example.test"},
		{"x.deep.example.test", false, nil, "*.deep.example.test"},
		{"ok.deep.example.test", true, nil, "ok.deep.example.test"},
		{"git.corp.test", true, nil, "corp,git.corp.test"},
		{"unknown.test", false, nil, ""},
		{"both.test", true, nil, "both.test"},
		{"x.tie.files.pypi.test", false, nil, "x.tie.files.pypi.test"},
		{"y.tie.files.pypi.test", true, nil, "*.tie.files.pypi.test"},
	} {
		allow, ports, rule := p.Name(tt.name)
		if allow != tt.allow || rule != tt.rule || !cmp.Equal(ports, tt.ports) {
			t.Errorf("Name(%q) = %v %v %q, want %v %v %q", tt.name, allow, ports, rule, tt.allow, tt.ports, tt.rule)
		}
	}
	var nilPolicy *Policy
	if allow, _, _ := nilPolicy.Name("index.pypi.test"); allow {
		t.Error("nil policy allowed a name")
	}
}

func TestNameDenyWinsTie(t *testing.T) {
	c := testCatalog()
	c.Services["other"] = Service{Domains: []string{"index.pypi.test"}}
	p, _, err := Compile(map[string]bool{"pypi": true, "other": false}, c)
	if err != nil {
		t.Fatal(err)
	}
	if allow, _, rule := p.Name("index.pypi.test"); allow || rule != "other" {
		t.Errorf("Name = %v %q, want deny by other", allow, rule)
	}
	if allow, _, _ := p.Name("a.files.pypi.test"); !allow {
		t.Error("the rest of the service was denied too")
	}
}

func TestCompileMirror(t *testing.T) {
	c := testCatalog()
	s := c.Services["pypi"]
	s.Mirror = &Mirror{URL: "http://mirror.internal.test:3141/simple/", Addrs: []netip.Addr{netip.MustParseAddr("10.20.0.5")}}
	s.CIDRs = []netip.Prefix{netip.MustParsePrefix("198.51.100.0/24")}
	c.Services["pypi"] = s
	c.Services["npm"] = Service{Ports: webPorts, Mirror: &Mirror{URL: "http://10.20.0.6:4873/"}}

	p, warnings, err := Compile(map[string]bool{"pypi": true, "npm": true}, c)
	if err != nil {
		t.Fatal(err)
	}
	if len(warnings) != 0 {
		t.Errorf("warnings = %q", warnings)
	}
	wantEnv := map[string]string{
		"PIP_INDEX_URL":       "http://mirror.internal.test:3141/simple/",
		"UV_INDEX_URL":        "http://mirror.internal.test:3141/simple/",
		"PIP_TRUSTED_HOST":    "mirror.internal.test",
		"NPM_CONFIG_REGISTRY": "http://10.20.0.6:4873/",
	}
	if diff := cmp.Diff(wantEnv, p.Env); diff != "" {
		t.Errorf("Env (-want +got):\n%s", diff)
	}
	mirror := []netip.Addr{netip.MustParseAddr("10.20.0.5")}
	for _, name := range []string{"mirror.internal.test", "index.pypi.test", "a.files.pypi.test"} {
		if got := p.Host(name); !cmp.Equal(got, mirror, cmp.Comparer(func(a, b netip.Addr) bool { return a == b })) {
			t.Errorf("Host(%q) = %v, want %v", name, got, mirror)
		}
		if allow, _, _ := p.Name(name); !allow {
			t.Errorf("Name(%q) denied", name)
		}
	}
	if p.Host("other.test") != nil {
		t.Error("Host answered an unrelated name")
	}
	if allow, ports, _ := p.Name("mirror.internal.test"); !allow || !cmp.Equal(ports, []Port{{Proto: "tcp", Port: 3141}}) {
		t.Errorf("mirror name: %v %v", allow, ports)
	}
	for _, tt := range []struct {
		addr  string
		port  uint16
		allow bool
	}{
		{"10.20.0.5", 3141, true},
		{"10.20.0.5", 22, false},
		{"10.20.0.6", 4873, true},
		{"198.51.100.7", 443, false}, // the service's own range is not opened
	} {
		allow, _, _ := p.Addr(netip.MustParseAddr(tt.addr), "tcp", tt.port)
		if allow != tt.allow {
			t.Errorf("Addr(%s:%d) = %v, want %v", tt.addr, tt.port, allow, tt.allow)
		}
	}
}

func TestCompileMirrorWithoutAddrs(t *testing.T) {
	c := testCatalog()
	s := c.Services["pypi"]
	s.Mirror = &Mirror{URL: "https://mirror.internal.test/simple/", Env: map[string]string{"PIP_INDEX_URL": "https://mirror.internal.test/simple/"}}
	c.Services["pypi"] = s
	p, warnings, err := Compile(map[string]bool{"pypi": true}, c)
	if err != nil {
		t.Fatal(err)
	}
	if len(warnings) != 1 {
		t.Errorf("warnings = %q", warnings)
	}
	if allow, _, _ := p.Name("index.pypi.test"); allow {
		t.Error("the service's own domain is allowed although it would resolve to the internet")
	}
	if allow, ports, _ := p.Name("mirror.internal.test"); !allow || !cmp.Equal(ports, []Port{{Proto: "tcp", Port: 443}}) {
		t.Errorf("mirror: %v %v", allow, ports)
	}
	if len(p.Hosts) != 0 || len(p.Env) != 1 {
		t.Errorf("Hosts %v Env %v", p.Hosts, p.Env)
	}
}

func TestCompileKeepsRules(t *testing.T) {
	rules := map[string]bool{"pypi": true, "10.0.0.0/8": false}
	p, _, err := Compile(rules, testCatalog())
	if err != nil {
		t.Fatal(err)
	}
	rules["pypi"] = false
	if !p.Rules["pypi"] || len(p.Rules) != 2 {
		t.Errorf("Rules = %v", p.Rules)
	}
}

package netpolicy

import (
	"errors"
	"net/netip"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/google/go-cmp/cmp"

	"dsec.dev/dsec/internal/errdefs"
)

var addrCmp = cmp.Comparer(func(a, b netip.Addr) bool { return a == b })
var prefixCmp = cmp.Comparer(func(a, b netip.Prefix) bool { return a == b })

func TestDefaultCatalog(t *testing.T) {
	c := DefaultCatalog()
	want := []string{"debian", "github", "goproxy", "huggingface", "npm", "pypi"}
	if diff := cmp.Diff(want, c.Names()); diff != "" {
		t.Fatalf("names (-want +got):\n%s", diff)
	}
	for name, s := range c.Services {
		if len(s.Domains) != 0 || len(s.CIDRs) != 0 || s.Mirror != nil {
			t.Errorf("%s has built-in destinations: %+v", name, s)
		}
		if diff := cmp.Diff(webPorts, s.Ports); diff != "" {
			t.Errorf("%s ports (-want +got):\n%s", name, diff)
		}
	}
}

func TestLoadCatalog(t *testing.T) {
	c, err := LoadCatalog(filepath.Join("testdata", "catalog.json"))
	if err != nil {
		t.Fatal(err)
	}
	want := map[string]Service{
		"pypi": {
			Domains: []string{"index.pypi.test", "*.files.pypi.test"},
			Ports:   []Port{{Proto: "tcp", Port: 443}},
			Mirror:  &Mirror{URL: "http://mirror.internal.test:3141/simple/", Addrs: []netip.Addr{netip.MustParseAddr("10.20.0.5")}},
		},
		"npm": {Domains: []string{"registry.npm.test"}, Ports: webPorts}, // ports kept from the default
		"corp-git": {
			Domains: []string{"git.corp.test"},
			Ports:   []Port{{Proto: "tcp", Port: 22}, {Proto: "tcp", Port: 443}},
			CIDRs:   []netip.Prefix{netip.MustParsePrefix("192.0.2.0/24")},
		},
		"debian":      {Ports: webPorts},
		"github":      {Ports: webPorts},
		"goproxy":     {Ports: webPorts},
		"huggingface": {Ports: webPorts},
	}
	if diff := cmp.Diff(want, c.Services, addrCmp, prefixCmp); diff != "" {
		t.Errorf("services (-want +got):\n%s", diff)
	}

	// The example catalog compiles, and its mirror sets the default variable.
	p, _, err := Compile(map[string]bool{"pypi": true, "corp-git": true, "npm": false}, c)
	if err != nil {
		t.Fatal(err)
	}
	if p.Env["PIP_INDEX_URL"] != "http://mirror.internal.test:3141/simple/" {
		t.Errorf("Env = %v", p.Env)
	}
	if allow, _, _ := p.Name("registry.npm.test"); allow {
		t.Error("denied service's domain allowed")
	}
}

func TestLoadCatalogErrors(t *testing.T) {
	tests := []struct {
		name, json string
		want       error
	}{
		{"syntax", `{"services": {`, errdefs.ErrInvalidArgument},
		{"unknown field", `{"services": {"x": {"domain": ["a.test"]}}}`, errdefs.ErrInvalidArgument},
		{"dotted name", `{"services": {"a.b": {}}}`, errdefs.ErrInvalidArgument},
		{"upper-case name", `{"services": {"PyPI": {}}}`, errdefs.ErrInvalidArgument},
		{"bad domain", `{"services": {"x": {"domains": ["a..test"]}}}`, errdefs.ErrInvalidArgument},
		{"bad proto", `{"services": {"x": {"ports": [{"proto": "sctp", "port": 1}]}}}`, errdefs.ErrInvalidArgument},
		{"ipv6 cidr", `{"services": {"x": {"cidrs": ["2001:db8::/32"]}}}`, errdefs.ErrNotSupported},
		{"bad mirror url", `{"services": {"x": {"mirror": {"url": "ftp://m.test/"}}}}`, errdefs.ErrInvalidArgument},
		{"ipv6 mirror addr", `{"services": {"x": {"mirror": {"url": "http://m.test/", "addrs": ["::1"]}}}}`, errdefs.ErrNotSupported},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			path := filepath.Join(t.TempDir(), "catalog.json")
			if err := os.WriteFile(path, []byte(tt.json), 0o600); err != nil {
				t.Fatal(err)
			}
			if _, err := LoadCatalog(path); !errors.Is(err, tt.want) {
				t.Fatalf("LoadCatalog error = %v, want %v", err, tt.want)
			}
		})
	}
	if _, err := LoadCatalog(filepath.Join(t.TempDir(), "missing.json")); err == nil {
		t.Fatal("missing file loaded")
	}
}

func writeFile(t *testing.T, path, text string) {
	t.Helper()
	if err := os.MkdirAll(filepath.Dir(path), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(path, []byte(text), 0o600); err != nil {
		t.Fatal(err)
	}
}

func TestDiscoverHost(t *testing.T) {
	dir := t.TempDir()
	files := HostFiles{
		AptSourcesList: filepath.Join(dir, "sources.list"),
		AptSourcesDir:  filepath.Join(dir, "sources.list.d"),
		GOPROXY:        "http://proxy.go.test:8081,https://proxy2.go.test|direct",
		NpmRC:          []string{filepath.Join(dir, "npmrc"), filepath.Join(dir, "missing-npmrc")},
		PipConf:        []string{filepath.Join(dir, "pip.conf")},
	}
	writeFile(t, files.AptSourcesList, `# main archive
deb http://deb.debian.test/debian bookworm main
deb [arch=amd64 signed-by=/usr/share/keyrings/x.gpg] https://security.debian.test/ bookworm-security main
deb-src http://deb.debian.test/debian bookworm main
deb cdrom:[Disc 1]/ bookworm main
deb http://10.30.0.7:3142/debian bookworm main
`)
	writeFile(t, filepath.Join(files.AptSourcesDir, "extra.list"), "deb http://extra.debian.test/ stable main # trailing comment\n")
	writeFile(t, filepath.Join(files.AptSourcesDir, "debian.sources"), `Types: deb
URIs: http://deb822.debian.test/debian
 http://deb822b.debian.test/debian
Suites: bookworm
Components: main

Types: deb
URIs: http://disabled.debian.test/debian
Suites: bookworm
Enabled: no
`)
	writeFile(t, filepath.Join(files.AptSourcesDir, "ignored.txt"), "deb http://ignored.debian.test/ x y\n")
	writeFile(t, files.NpmRC[0], `; comment
registry="https://registry.npm.test/"
@corp:registry=https://npm.corp.test/
always-auth=true
`)
	writeFile(t, files.PipConf[0], `[global]
index-url = https://index.pypi.test/simple
extra-index-url =
    https://extra1.pypi.test/simple
    https://extra2.pypi.test/simple
timeout = 60
`)

	c := DefaultCatalog()
	c.Services["npm"] = Service{Domains: []string{"operator.npm.test"}, Ports: webPorts}
	notes := DiscoverHost(c, files)
	t.Logf("notes:\n%s", strings.Join(notes, "\n"))

	want := map[string]Service{
		"debian": {
			Domains: []string{"deb.debian.test", "security.debian.test", "extra.debian.test", "deb822.debian.test", "deb822b.debian.test"},
			Ports:   append(append([]Port(nil), webPorts...), Port{Proto: "tcp", Port: 3142}),
			CIDRs:   []netip.Prefix{netip.MustParsePrefix("10.30.0.7/32")},
		},
		"goproxy": {
			Domains: []string{"proxy.go.test", "proxy2.go.test"},
			Ports:   append(append([]Port(nil), webPorts...), Port{Proto: "tcp", Port: 8081}),
		},
		"npm":         {Domains: []string{"operator.npm.test", "registry.npm.test", "npm.corp.test"}, Ports: webPorts},
		"pypi":        {Domains: []string{"index.pypi.test", "extra1.pypi.test", "extra2.pypi.test"}, Ports: webPorts},
		"github":      {Ports: webPorts},
		"huggingface": {Ports: webPorts},
	}
	if diff := cmp.Diff(want, c.Services, addrCmp, prefixCmp); diff != "" {
		t.Errorf("services (-want +got):\n%s", diff)
	}
	found := false
	for _, n := range notes {
		found = found || strings.Contains(n, "cdrom")
	}
	if !found {
		t.Errorf("no note about the skipped cdrom source: %q", notes)
	}

	// Discovery is idempotent.
	DiscoverHost(c, files)
	if diff := cmp.Diff(want, c.Services, addrCmp, prefixCmp); diff != "" {
		t.Errorf("second discovery changed services (-want +got):\n%s", diff)
	}
}

func TestDiscoverHostNothing(t *testing.T) {
	c := DefaultCatalog()
	notes := DiscoverHost(c, HostFiles{AptSourcesList: filepath.Join(t.TempDir(), "none"), GOPROXY: "off"})
	if len(notes) != 0 {
		t.Errorf("notes = %q", notes)
	}
	if diff := cmp.Diff(DefaultCatalog(), c); diff != "" {
		t.Errorf("catalog changed (-want +got):\n%s", diff)
	}
}

func TestDefaultHostFiles(t *testing.T) {
	t.Setenv("GOPROXY", "http://proxy.go.test")
	f := DefaultHostFiles("/home/u")
	if f.GOPROXY != "http://proxy.go.test" || f.AptSourcesList == "" || len(f.NpmRC) != 2 || len(f.PipConf) != 3 {
		t.Errorf("DefaultHostFiles = %+v", f)
	}
}

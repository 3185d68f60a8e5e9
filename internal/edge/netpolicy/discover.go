package netpolicy

import (
	"bufio"
	"fmt"
	"net/netip"
	"net/url"
	"os"
	"path/filepath"
	"strconv"
	"strings"
)

// HostFiles says where DiscoverHost looks. DefaultHostFiles fills it for the
// running host; tests point it at temporary files. Empty fields are skipped.
type HostFiles struct {
	AptSourcesList string   // one-line format: "deb [opts] URI suite comps"
	AptSourcesDir  string   // *.list (one-line) and *.sources (deb822) files
	GOPROXY        string   // $GOPROXY, or the output of `go env GOPROXY`
	NpmRC          []string // npmrc files: "registry=URL", "@scope:registry=URL"
	PipConf        []string // pip.conf files: "index-url", "extra-index-url"
}

// DefaultHostFiles returns the usual locations on a Debian-like host, with
// GOPROXY from the environment and per-user files under home (if not empty).
func DefaultHostFiles(home string) HostFiles {
	f := HostFiles{
		AptSourcesList: "/etc/apt/sources.list",
		AptSourcesDir:  "/etc/apt/sources.list.d",
		GOPROXY:        os.Getenv("GOPROXY"),
		NpmRC:          []string{"/etc/npmrc"},
		PipConf:        []string{"/etc/pip.conf"},
	}
	if home != "" {
		f.NpmRC = append(f.NpmRC, filepath.Join(home, ".npmrc"))
		f.PipConf = append(f.PipConf,
			filepath.Join(home, ".config", "pip", "pip.conf"),
			filepath.Join(home, ".pip", "pip.conf"))
	}
	return f
}

// DiscoverHost adds to c the package hosts the node itself is configured
// with: debian from apt sources, goproxy from GOPROXY, npm from npmrc
// registry lines, pypi from pip.conf index URLs. A host name becomes a domain
// of the service; an IPv4 literal becomes a /32 CIDR; an explicit URL port is
// added to the service's ports. It only adds, never removes, so an operator
// catalog loaded before keeps its entries. It returns notes about what it
// found or could not read, for the caller to log; missing files are silent.
func DiscoverHost(c *Catalog, files HostFiles) []string {
	if c.Services == nil {
		c.Services = map[string]Service{}
	}
	var notes []string
	add := func(service, source, raw string) {
		if err := addEndpoint(c, service, raw); err != nil {
			notes = append(notes, fmt.Sprintf("%s: %s: %v", source, service, err))
			return
		}
		notes = append(notes, fmt.Sprintf("%s: %s: added %s", source, service, raw))
	}
	read := func(path string) (string, bool) {
		data, err := os.ReadFile(path)
		if err != nil {
			if !os.IsNotExist(err) {
				notes = append(notes, fmt.Sprintf("read %s: %v", path, err))
			}
			return "", false
		}
		return string(data), true
	}

	// debian
	var aptFiles []string
	if files.AptSourcesList != "" {
		aptFiles = append(aptFiles, files.AptSourcesList)
	}
	if files.AptSourcesDir != "" {
		for _, pat := range []string{"*.list", "*.sources"} {
			m, _ := filepath.Glob(filepath.Join(files.AptSourcesDir, pat))
			aptFiles = append(aptFiles, m...)
		}
	}
	for _, path := range aptFiles {
		text, ok := read(path)
		if !ok {
			continue
		}
		var uris []string
		if strings.HasSuffix(path, ".sources") {
			uris = deb822URIs(text)
		} else {
			uris = oneLineAptURIs(text)
		}
		for _, u := range uris {
			add("debian", path, u)
		}
	}

	// goproxy: a list separated by ',' or '|'; "direct" and "off" name no host.
	for _, entry := range strings.FieldsFunc(files.GOPROXY, func(r rune) bool { return r == ',' || r == '|' }) {
		entry = strings.TrimSpace(entry)
		if entry == "" || entry == "direct" || entry == "off" {
			continue
		}
		add("goproxy", "GOPROXY", entry)
	}

	// npm
	for _, path := range files.NpmRC {
		text, ok := read(path)
		if !ok {
			continue
		}
		for _, kv := range iniValues(text) {
			if kv[0] == "registry" || strings.HasSuffix(kv[0], ":registry") {
				add("npm", path, unquote(kv[1]))
			}
		}
	}

	// pypi
	for _, path := range files.PipConf {
		text, ok := read(path)
		if !ok {
			continue
		}
		for _, kv := range iniValues(text) {
			if kv[0] == "index-url" || kv[0] == "extra-index-url" || kv[0] == "index_url" || kv[0] == "extra_index_url" {
				for _, u := range strings.Fields(kv[1]) {
					add("pypi", path, unquote(u))
				}
			}
		}
	}
	return notes
}

// addEndpoint adds the host (and explicit port) of a URL to a service.
func addEndpoint(c *Catalog, service, raw string) error {
	u, err := url.Parse(raw)
	if err != nil {
		return fmt.Errorf("parse URL: %w", err)
	}
	if u.Scheme != "http" && u.Scheme != "https" {
		return fmt.Errorf("skip URL scheme %q", u.Scheme)
	}
	host := strings.ToLower(u.Hostname())
	if host == "" {
		return fmt.Errorf("URL %q has no host", raw)
	}
	s, known := c.Services[service]
	if !known {
		s.Ports = append([]Port(nil), webPorts...)
	}
	if a, err := netip.ParseAddr(host); err == nil {
		if !a.Is4() {
			return fmt.Errorf("address %s: this node enforces IPv4 only", a)
		}
		p := netip.PrefixFrom(a, 32)
		found := false
		for _, x := range s.CIDRs {
			found = found || x == p
		}
		if !found {
			s.CIDRs = append(s.CIDRs, p)
		}
	} else {
		d, err := normalizeDomain(host)
		if err != nil {
			return err
		}
		s.Domains = appendUnique(s.Domains, d)
	}
	if ps := u.Port(); ps != "" && len(s.Ports) > 0 {
		n, err := strconv.ParseUint(ps, 10, 16)
		if err != nil || n == 0 {
			return fmt.Errorf("URL %q: bad port", raw)
		}
		p := Port{Proto: "tcp", Port: uint16(n)}
		found := false
		for _, x := range s.Ports {
			found = found || x == p
		}
		if !found {
			s.Ports = append(s.Ports, p)
		}
	}
	c.Services[service] = s
	return nil
}

// oneLineAptURIs returns the URIs of "deb" and "deb-src" lines.
func oneLineAptURIs(text string) []string {
	var out []string
	sc := bufio.NewScanner(strings.NewReader(text))
	for sc.Scan() {
		line := sc.Text()
		if i := strings.IndexByte(line, '#'); i >= 0 {
			line = line[:i]
		}
		f := strings.Fields(line)
		if len(f) < 2 || (f[0] != "deb" && f[0] != "deb-src") {
			continue
		}
		f = f[1:]
		if strings.HasPrefix(f[0], "[") { // options: skip to the closing bracket
			for len(f) > 0 && !strings.HasSuffix(f[0], "]") {
				f = f[1:]
			}
			if len(f) > 0 {
				f = f[1:]
			}
		}
		if len(f) > 0 {
			out = append(out, f[0])
		}
	}
	return out
}

// deb822URIs returns the URIs of the enabled stanzas of a .sources file.
func deb822URIs(text string) []string {
	var out, stanza []string
	enabled := true
	flush := func() {
		if enabled {
			out = append(out, stanza...)
		}
		stanza, enabled = nil, true
	}
	key := ""
	sc := bufio.NewScanner(strings.NewReader(text))
	for sc.Scan() {
		line := sc.Text()
		if strings.TrimSpace(line) == "" {
			flush()
			key = ""
			continue
		}
		if strings.HasPrefix(line, "#") {
			continue
		}
		if line[0] == ' ' || line[0] == '\t' { // continuation of the last field
			if key == "uris" {
				stanza = append(stanza, strings.Fields(line)...)
			}
			continue
		}
		k, v, ok := strings.Cut(line, ":")
		if !ok {
			continue
		}
		key = strings.ToLower(strings.TrimSpace(k))
		switch key {
		case "uris":
			stanza = append(stanza, strings.Fields(v)...)
		case "enabled":
			enabled = !strings.EqualFold(strings.TrimSpace(v), "no")
		}
	}
	flush()
	return out
}

// iniValues returns the key=value pairs of an ini-like file (section headers
// ignored; indented lines continue the previous value, as pip allows).
func iniValues(text string) [][2]string {
	var out [][2]string
	sc := bufio.NewScanner(strings.NewReader(text))
	for sc.Scan() {
		line := sc.Text()
		trim := strings.TrimSpace(line)
		if trim == "" || trim[0] == '#' || trim[0] == ';' || trim[0] == '[' {
			continue
		}
		if (line[0] == ' ' || line[0] == '\t') && len(out) > 0 {
			out[len(out)-1][1] += " " + trim
			continue
		}
		k, v, ok := strings.Cut(trim, "=")
		if !ok {
			continue
		}
		out = append(out, [2]string{strings.ToLower(strings.TrimSpace(k)), strings.TrimSpace(v)})
	}
	return out
}

func unquote(s string) string {
	if len(s) >= 2 && (s[0] == '"' || s[0] == '\'') && s[len(s)-1] == s[0] {
		return s[1 : len(s)-1]
	}
	return s
}

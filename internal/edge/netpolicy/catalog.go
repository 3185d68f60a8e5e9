package netpolicy

import (
	"bytes"
	"encoding/json"
	"fmt"
	"net/netip"
	"net/url"
	"os"
	"sort"
	"strconv"
	"strings"

	"dsec.dev/dsec/internal/errdefs"
)

// Service is one named service of the node's catalog: what allowing (or
// denying) its name in a sandbox's rules means.
type Service struct {
	// Domains are name patterns ("index.example" or "*.files.example").
	Domains []string `json:"domains,omitempty"`
	// Ports are where the service's domains and CIDRs may be reached.
	// Empty means every port.
	Ports []Port `json:"ports,omitempty"`
	// CIDRs are address ranges of the service (IPv4 only).
	CIDRs []netip.Prefix `json:"cidrs,omitempty"`
	// Mirror, when set, replaces the service by an internal copy: see Mirror.
	Mirror *Mirror `json:"mirror,omitempty"`
}

// Mirror points a named service at an internal copy of it. When a rules
// mapping allows a service that has a Mirror, Compile:
//
//   - allows the mirror's own host and port (from URL): a domain rule when the
//     host is a name, and CIDR rules for the host if it is an IPv4 literal and
//     for every address in Addrs;
//   - answers the service's Domains with Addrs through Policy.Hosts, so the
//     resolver never asks upstream about them and a tool that ignores Env
//     still lands on the mirror (given it listens on the service's ports);
//     when Addrs is empty (and the host is a name) the service's Domains are
//     not allowed at all;
//   - does not allow the service's CIDRs: the point of a mirror is that the
//     sandbox needs no open internet;
//   - copies Env into Policy.Env; when Env is nil, a default for well-known
//     services is used (see DefaultMirrorEnv).
type Mirror struct {
	// URL is the mirror's base URL ("http://10.0.0.5:3141/simple/").
	URL string `json:"url"`
	// Addrs are where the mirror's host lives, for hosts the sandbox
	// cannot resolve through upstream DNS.
	Addrs []netip.Addr `json:"addrs,omitempty"`
	// Env holds variables a sandbox needs to use the mirror.
	Env map[string]string `json:"env,omitempty"`
}

// Catalog is the node's set of named services. It is built once at startup
// (DefaultCatalog, LoadCatalog, DiscoverHost) and read-only afterwards.
type Catalog struct {
	Services map[string]Service `json:"services"`
}

// webPorts are the ports of the built-in services.
var webPorts = []Port{{Proto: "tcp", Port: 80}, {Proto: "tcp", Port: 443}}

// builtinServices are the names every node knows. Their domains come from
// node configuration only (LoadCatalog, DiscoverHost).
var builtinServices = []string{"debian", "github", "goproxy", "huggingface", "npm", "pypi"}

// DefaultMirrorEnv returns the variables set for a mirror of a well-known
// service whose Mirror.Env is nil, or nil if there are none.
func DefaultMirrorEnv(service, mirrorURL string) map[string]string {
	switch service {
	case "pypi":
		env := map[string]string{"PIP_INDEX_URL": mirrorURL, "UV_INDEX_URL": mirrorURL}
		if u, err := url.Parse(mirrorURL); err == nil && u.Scheme == "http" {
			// pip ignores a plain-HTTP index unless its host is trusted.
			env["PIP_TRUSTED_HOST"] = u.Hostname()
		}
		return env
	case "npm":
		return map[string]string{"NPM_CONFIG_REGISTRY": mirrorURL}
	case "goproxy":
		return map[string]string{"GOPROXY": mirrorURL}
	case "huggingface":
		return map[string]string{"HF_ENDPOINT": mirrorURL}
	}
	return nil
}

// DefaultCatalog returns the built-in services (pypi, npm, goproxy, debian,
// github, huggingface) with their ports (80 and 443 over TCP) and no domains.
func DefaultCatalog() *Catalog {
	c := &Catalog{Services: make(map[string]Service, len(builtinServices))}
	for _, name := range builtinServices {
		c.Services[name] = Service{Ports: append([]Port(nil), webPorts...)}
	}
	return c
}

// Names returns the catalog's service names, sorted.
func (c *Catalog) Names() []string {
	names := make([]string, 0, len(c.Services))
	for n := range c.Services {
		names = append(names, n)
	}
	sort.Strings(names)
	return names
}

// LoadCatalog reads an operator's catalog file and merges it over
// DefaultCatalog. The file is JSON (see testdata/catalog.json):
//
//	{
//	  "services": {
//	    "pypi": {
//	      "domains": ["index.pypi.test", "*.files.pypi.test"],
//	      "ports":   [{"proto": "tcp", "port": 443}],
//	      "cidrs":   ["192.0.2.0/24"],
//	      "mirror":  {"url": "http://mirror.internal.test:3141/simple/",
//	                  "addrs": ["10.20.0.5"],
//	                  "env": {"PIP_INDEX_URL": "http://mirror.internal.test:3141/simple/"}}
//	    },
//	    "corp-git": {"domains": ["git.corp.test"]}
//	  }
//	}
//
// A service named in the file and in the defaults keeps the default's fields
// the file leaves out; fields the file sets replace the default's. New names
// add services (a name is lower-case letters, digits, '-' and '_', without
// dots, so it cannot be mistaken for a domain). Unknown fields are errors.
func LoadCatalog(path string) (*Catalog, error) {
	data, err := os.ReadFile(path)
	if err != nil {
		return nil, fmt.Errorf("read catalog: %w", err)
	}
	var file Catalog
	dec := json.NewDecoder(bytes.NewReader(data))
	dec.DisallowUnknownFields()
	if err := dec.Decode(&file); err != nil {
		return nil, fmt.Errorf("parse catalog %s: %v: %w", path, err, errdefs.ErrInvalidArgument)
	}
	c := DefaultCatalog()
	for name, s := range file.Services {
		if err := validateService(name, s); err != nil {
			return nil, fmt.Errorf("load catalog %s: %w", path, err)
		}
		merged := c.Services[name]
		if s.Domains != nil {
			merged.Domains = normalizeDomains(s.Domains)
		}
		if s.Ports != nil {
			merged.Ports = s.Ports
		}
		if s.CIDRs != nil {
			merged.CIDRs = maskPrefixes(s.CIDRs)
		}
		if s.Mirror != nil {
			merged.Mirror = s.Mirror
		}
		c.Services[name] = merged
	}
	return c, nil
}

func validServiceName(name string) bool {
	if name == "" || len(name) > 63 {
		return false
	}
	for _, r := range name {
		if !(r >= 'a' && r <= 'z' || r >= '0' && r <= '9' || r == '-' || r == '_') {
			return false
		}
	}
	return true
}

func validateService(name string, s Service) error {
	if !validServiceName(name) {
		return fmt.Errorf("service name %q (want lower-case letters, digits, '-', '_'): %w", name, errdefs.ErrInvalidArgument)
	}
	for _, d := range s.Domains {
		if _, err := normalizeDomain(d); err != nil {
			return fmt.Errorf("service %s: %w", name, err)
		}
	}
	for _, p := range s.Ports {
		if p.Proto != "" && p.Proto != "tcp" && p.Proto != "udp" {
			return fmt.Errorf("service %s: port protocol %q (want tcp or udp): %w", name, p.Proto, errdefs.ErrInvalidArgument)
		}
	}
	for _, p := range s.CIDRs {
		if !p.Addr().Is4() {
			return fmt.Errorf("service %s: CIDR %s: this node enforces IPv4 only: %w", name, p, errdefs.ErrNotSupported)
		}
	}
	if s.Mirror != nil {
		if _, _, err := mirrorEndpoint(s.Mirror.URL); err != nil {
			return fmt.Errorf("service %s: %w", name, err)
		}
		for _, a := range s.Mirror.Addrs {
			if !a.Is4() {
				return fmt.Errorf("service %s: mirror address %s: this node enforces IPv4 only: %w", name, a, errdefs.ErrNotSupported)
			}
		}
	}
	return nil
}

// mirrorEndpoint returns the host and TCP port of a mirror URL.
func mirrorEndpoint(raw string) (string, uint16, error) {
	u, err := url.Parse(raw)
	if err != nil || (u.Scheme != "http" && u.Scheme != "https") || u.Hostname() == "" {
		return "", 0, fmt.Errorf("mirror URL %q (want http:// or https:// with a host): %w", raw, errdefs.ErrInvalidArgument)
	}
	port := uint16(80)
	if u.Scheme == "https" {
		port = 443
	}
	if p := u.Port(); p != "" {
		n, err := strconv.ParseUint(p, 10, 16)
		if err != nil || n == 0 {
			return "", 0, fmt.Errorf("mirror URL %q: port %q: %w", raw, p, errdefs.ErrInvalidArgument)
		}
		port = uint16(n)
	}
	host := strings.ToLower(u.Hostname())
	if a, err := netip.ParseAddr(host); err == nil {
		if !a.Is4() {
			return "", 0, fmt.Errorf("mirror URL %q: this node enforces IPv4 only: %w", raw, errdefs.ErrNotSupported)
		}
		return host, port, nil
	}
	if _, err := normalizeDomain(host); err != nil || strings.HasPrefix(host, "*") {
		return "", 0, fmt.Errorf("mirror URL %q: host: %w", raw, errdefs.ErrInvalidArgument)
	}
	return host, port, nil
}

func normalizeDomains(ds []string) []string {
	out := make([]string, 0, len(ds))
	for _, d := range ds {
		n, _ := normalizeDomain(d)
		out = appendUnique(out, n)
	}
	return out
}

func maskPrefixes(ps []netip.Prefix) []netip.Prefix {
	out := make([]netip.Prefix, 0, len(ps))
	for _, p := range ps {
		out = append(out, p.Masked())
	}
	return out
}

func appendUnique(list []string, s string) []string {
	for _, x := range list {
		if x == s {
			return list
		}
	}
	return append(list, s)
}

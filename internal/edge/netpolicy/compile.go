package netpolicy

import (
	"fmt"
	"maps"
	"net/netip"
	"slices"
	"sort"
	"strconv"
	"strings"

	"dsec.dev/dsec/internal/errdefs"
)

// Size limits of one sandbox's rules.
const (
	MaxRules         = 256  // keys in one rules mapping
	MaxKeyLen        = 300  // bytes in one key
	MaxCompiledRules = 4096 // CIDR plus domain rules after services expand
)

// Compile turns a rules mapping into a Policy. Each key is one of:
//
//   - a service name of cat (no dot: "pypi", "corp-git"); unknown names are
//     errors (errdefs.ErrInvalidArgument);
//   - a domain pattern: "example.org" or "*.example.org" (every name under
//     example.org, not example.org itself);
//   - an IPv4 CIDR or address with an optional port and protocol:
//     "10.0.0.0/8", "10.1.2.3", "10.0.0.0/8:443", "10.1.2.3:53/udp".
//     A port without protocol means TCP and UDP. IPv6 is refused with
//     errdefs.ErrInvalidArgument: no node enforces it, so the request, not
//     the node, is at fault, and no other node would take it.
//
// and each value is true (allow) or false (deny). A nil cat means
// DefaultCatalog. The warnings say which rules allow nothing on this node
// (a service without domains) or conflict (two mirrors setting one
// variable); the caller logs them or passes them back.
func Compile(rules map[string]bool, cat *Catalog) (*Policy, []string, error) {
	if cat == nil {
		cat = DefaultCatalog()
	}
	if len(rules) > MaxRules {
		return nil, nil, fmt.Errorf("compile rules: %d rules, at most %d allowed: %w", len(rules), MaxRules, errdefs.ErrInvalidArgument)
	}
	c := compiler{cat: cat, p: &Policy{Rules: maps.Clone(rules)}, domains: map[string]*DomainRule{}}
	if c.p.Rules == nil {
		c.p.Rules = map[string]bool{}
	}
	keys := slices.Sorted(maps.Keys(rules)) // deterministic output and warnings
	for _, key := range keys {
		if err := c.add(key, rules[key]); err != nil {
			return nil, nil, fmt.Errorf("compile rule %q: %w", key, err)
		}
		if len(c.p.CIDRs)+len(c.domains) > MaxCompiledRules {
			return nil, nil, fmt.Errorf("compile rules: more than %d rules after expanding services: %w", MaxCompiledRules, errdefs.ErrInvalidArgument)
		}
	}
	c.finish()
	return c.p, c.warnings, nil
}

type compiler struct {
	cat      *Catalog
	p        *Policy
	domains  map[string]*DomainRule // by pattern, merged
	warnings []string
}

func (c *compiler) add(key string, allow bool) error {
	if len(key) > MaxKeyLen {
		return fmt.Errorf("key longer than %d bytes: %w", MaxKeyLen, errdefs.ErrInvalidArgument)
	}
	switch {
	case key == "":
		return fmt.Errorf("empty key: %w", errdefs.ErrInvalidArgument)
	case strings.ContainsAny(key, ":/[") || looksLikeAddr(key):
		r, err := ParseCIDRKey(key)
		if err != nil {
			return err
		}
		r.Allow = allow
		c.p.CIDRs = append(c.p.CIDRs, r)
	case strings.ContainsAny(key, ".*"):
		d, err := normalizeDomain(key)
		if err != nil {
			return err
		}
		if !strings.Contains(strings.TrimPrefix(d, "*."), ".") {
			c.warnings = append(c.warnings, fmt.Sprintf("rule %q covers a whole top-level domain", key))
		}
		c.addDomain(d, nil, allow, key)
	default:
		return c.addService(key, allow)
	}
	return nil
}

func (c *compiler) addService(name string, allow bool) error {
	s, ok := c.cat.Services[name]
	if !ok {
		return fmt.Errorf("unknown service %q (this node knows %s): %w", name, strings.Join(c.cat.Names(), ", "), errdefs.ErrInvalidArgument)
	}
	if !allow {
		// A deny covers the service's names and ranges on every port.
		for _, d := range s.Domains {
			c.addDomain(d, nil, false, name)
		}
		for _, p := range s.CIDRs {
			c.p.CIDRs = append(c.p.CIDRs, CIDRRule{Prefix: p, Allow: false, Source: name})
		}
		if len(s.Domains) == 0 && len(s.CIDRs) == 0 {
			c.warnings = append(c.warnings, fmt.Sprintf("service %q has no domains or CIDRs on this node; denying it changes nothing", name))
		}
		return nil
	}
	if s.Mirror != nil {
		return c.addMirror(name, s)
	}
	if len(s.Domains) == 0 && len(s.CIDRs) == 0 {
		c.warnings = append(c.warnings, fmt.Sprintf("service %q has no domains or CIDRs on this node; allowing it allows nothing", name))
		return nil
	}
	for _, d := range s.Domains {
		c.addDomain(d, s.Ports, true, name)
	}
	for _, p := range s.CIDRs {
		c.addCIDRPorts(p, s.Ports, true, name)
	}
	return nil
}

func (c *compiler) addMirror(name string, s Service) error {
	host, port, err := mirrorEndpoint(s.Mirror.URL)
	if err != nil {
		return fmt.Errorf("service %s: %w", name, err)
	}
	mport := []Port{{Proto: "tcp", Port: port}}
	addrs := slices.Clone(s.Mirror.Addrs)
	if a, err := netip.ParseAddr(host); err == nil {
		addrs = append(addrs, a)
	} else {
		c.addDomain(host, mport, true, name)
		if len(s.Mirror.Addrs) > 0 {
			c.addHost(host, s.Mirror.Addrs)
		}
	}
	for _, a := range addrs {
		c.addCIDRPorts(netip.PrefixFrom(a, 32), mport, true, name)
	}
	if len(addrs) > 0 {
		for _, d := range s.Domains {
			c.addDomain(d, s.Ports, true, name)
			c.addHost(d, addrs)
		}
	} else if len(s.Domains) > 0 {
		c.warnings = append(c.warnings, fmt.Sprintf("service %q: mirror has no addresses, so its own domains stay unreachable; use the mirror through its URL", name))
	}
	env := s.Mirror.Env
	if env == nil {
		env = DefaultMirrorEnv(name, s.Mirror.URL)
	}
	for _, k := range slices.Sorted(maps.Keys(env)) {
		if old, ok := c.p.Env[k]; ok && old != env[k] {
			c.warnings = append(c.warnings, fmt.Sprintf("service %q: %s already set to %q by another mirror; keeping it", name, k, old))
			continue
		}
		if c.p.Env == nil {
			c.p.Env = map[string]string{}
		}
		c.p.Env[k] = env[k]
	}
	return nil
}

func (c *compiler) addHost(name string, addrs []netip.Addr) {
	if c.p.Hosts == nil {
		c.p.Hosts = map[string][]netip.Addr{}
	}
	for _, a := range addrs {
		if !slices.Contains(c.p.Hosts[name], a) {
			c.p.Hosts[name] = append(c.p.Hosts[name], a)
		}
	}
}

func (c *compiler) addCIDRPorts(p netip.Prefix, ports []Port, allow bool, source string) {
	if len(ports) == 0 {
		c.p.CIDRs = append(c.p.CIDRs, CIDRRule{Prefix: p, Allow: allow, Source: source})
		return
	}
	for _, port := range ports {
		c.p.CIDRs = append(c.p.CIDRs, CIDRRule{Prefix: p, Port: port, Allow: allow, Source: source})
	}
}

// addDomain merges a rule into the one for its pattern: a deny replaces
// allows (deny wins a tie); allows join their ports, where "every port"
// absorbs the rest.
func (c *compiler) addDomain(pattern string, ports []Port, allow bool, source string) {
	r, ok := c.domains[pattern]
	if !ok {
		c.domains[pattern] = &DomainRule{Pattern: pattern, Ports: slices.Clone(ports), Allow: allow, Source: source}
		return
	}
	switch {
	case r.Allow && !allow:
		*r = DomainRule{Pattern: pattern, Allow: false, Source: source}
		return
	case !r.Allow && allow:
		return
	case !r.Allow && !allow:
		r.Source = joinSource(r.Source, source)
		return
	}
	r.Source = joinSource(r.Source, source)
	if len(r.Ports) == 0 {
		return // already every port
	}
	if len(ports) == 0 {
		r.Ports = nil
		return
	}
	for _, p := range ports {
		if !slices.Contains(r.Ports, p) {
			r.Ports = append(r.Ports, p)
		}
	}
}

func joinSource(a, b string) string {
	for _, s := range strings.Split(a, ",") {
		if s == b {
			return a
		}
	}
	return a + "," + b
}

// finish sorts the rules into their evaluation order and drops duplicates.
func (c *compiler) finish() {
	for _, r := range c.domains {
		c.p.Domains = append(c.p.Domains, *r)
	}
	sort.Slice(c.p.Domains, func(i, j int) bool {
		a, b := c.p.Domains[i], c.p.Domains[j]
		if sa, sb := specificity(a.Pattern), specificity(b.Pattern); sa != sb {
			return sa > sb
		}
		return a.Pattern < b.Pattern
	})
	sort.SliceStable(c.p.CIDRs, func(i, j int) bool { return cidrBefore(c.p.CIDRs[i], c.p.CIDRs[j]) })
	out := c.p.CIDRs[:0]
	for i, r := range c.p.CIDRs {
		if i > 0 && sameMatch(out[len(out)-1], r) {
			// Same match; the earlier one (deny, if any) decides. Keep its
			// verdict, remember the other source.
			last := &out[len(out)-1]
			if last.Allow == r.Allow {
				last.Source = joinSource(last.Source, r.Source)
			}
			continue
		}
		out = append(out, r)
	}
	c.p.CIDRs = out
}

func sameMatch(a, b CIDRRule) bool { return a.Prefix == b.Prefix && a.Port == b.Port }

// cidrBefore is the first-match order: longer prefix, then a specific port,
// then a specific protocol, then deny before allow for the same match.
func cidrBefore(a, b CIDRRule) bool {
	if a.Prefix.Bits() != b.Prefix.Bits() {
		return a.Prefix.Bits() > b.Prefix.Bits()
	}
	if (a.Port.Port != 0) != (b.Port.Port != 0) {
		return a.Port.Port != 0
	}
	if (a.Port.Proto != "") != (b.Port.Proto != "") {
		return a.Port.Proto != ""
	}
	// Rules of equal rank so far never overlap unless they are for the same
	// prefix and port, so sort those next to each other, deny first.
	if c := a.Prefix.Addr().Compare(b.Prefix.Addr()); c != 0 {
		return c < 0
	}
	if a.Port != b.Port {
		return a.Port.Port < b.Port.Port || a.Port.Port == b.Port.Port && a.Port.Proto < b.Port.Proto
	}
	return !a.Allow && b.Allow
}

// specificity ranks patterns: exact names above every wildcard, then more
// labels above fewer.
func specificity(pattern string) int {
	labels := strings.Count(pattern, ".") + 1
	if strings.HasPrefix(pattern, "*.") {
		return labels - 1
	}
	return 1000 + labels
}

// ParseCIDRKey parses "CIDR[:PORT[/PROTO]]" (IPv4; a bare address is a /32;
// PROTO tcp or udp, empty for both). The returned rule has Allow false.
func ParseCIDRKey(key string) (CIDRRule, error) {
	if isIPv6Key(key) {
		return CIDRRule{}, ipv6Refused()
	}
	if strings.Count(key, ":") > 1 {
		return CIDRRule{}, fmt.Errorf("key %q (want CIDR[:PORT[/PROTO]]): %w", key, errdefs.ErrInvalidArgument)
	}
	addrPart, portPart, hasPort := strings.Cut(key, ":")
	var prefix netip.Prefix
	if strings.Contains(addrPart, "/") {
		p, err := netip.ParsePrefix(addrPart)
		if err != nil {
			return CIDRRule{}, fmt.Errorf("CIDR %q: %w", addrPart, errdefs.ErrInvalidArgument)
		}
		prefix = p.Masked()
	} else {
		a, err := netip.ParseAddr(addrPart)
		if err != nil {
			if hasPort && !looksLikeAddr(addrPart) {
				return CIDRRule{}, fmt.Errorf("key %q: a domain takes no port (ports come from services; use a CIDR key for address rules): %w", key, errdefs.ErrInvalidArgument)
			}
			return CIDRRule{}, fmt.Errorf("address %q: %w", addrPart, errdefs.ErrInvalidArgument)
		}
		prefix = netip.PrefixFrom(a, a.BitLen())
	}
	if !prefix.Addr().Is4() {
		return CIDRRule{}, ipv6Refused()
	}
	r := CIDRRule{Prefix: prefix, Source: key}
	if !hasPort {
		return r, nil
	}
	portStr, proto, hasProto := strings.Cut(portPart, "/")
	n, err := strconv.ParseUint(portStr, 10, 16)
	if err != nil || n == 0 {
		return CIDRRule{}, fmt.Errorf("port %q (want 1-65535): %w", portStr, errdefs.ErrInvalidArgument)
	}
	r.Port.Port = uint16(n)
	if hasProto {
		if proto != "tcp" && proto != "udp" {
			return CIDRRule{}, fmt.Errorf("protocol %q (want tcp or udp): %w", proto, errdefs.ErrInvalidArgument)
		}
		r.Port.Proto = proto
	}
	return r, nil
}

// ipv6Refused is the refusal of an IPv6 key. Its caller names the key.
func ipv6Refused() error {
	return fmt.Errorf("an IPv6 address or prefix: dsec's network rules are IPv4 only (sandboxes have no IPv6 route): %w", errdefs.ErrInvalidArgument)
}

// isIPv6Key reports whether key is an IPv6 address or prefix, bare, in
// brackets, or followed by a port.
func isIPv6Key(key string) bool {
	if strings.HasPrefix(key, "[") || strings.Contains(key, "::") {
		return true
	}
	if a, err := netip.ParseAddr(key); err == nil {
		return a.Is6()
	}
	if p, err := netip.ParsePrefix(key); err == nil {
		return p.Addr().Is6()
	}
	return strings.Count(key, ":") >= 7 // a full address with a port
}

// looksLikeAddr reports whether s is digits and dots only (a mistyped
// address must not pass as a domain).
func looksLikeAddr(s string) bool {
	if s == "" {
		return false
	}
	for _, r := range s {
		if !(r >= '0' && r <= '9' || r == '.') {
			return false
		}
	}
	return true
}

// normalizeDomain lower-cases a domain pattern, drops a trailing dot and
// checks it: labels of letters, digits, '-' and '_' (1-63 bytes, no '-' at
// either end), at least two labels, at most 253 bytes, an optional leading
// "*." and no other '*'.
func normalizeDomain(s string) (string, error) {
	d := strings.TrimSuffix(strings.ToLower(s), ".")
	bad := func(why string) (string, error) {
		return "", fmt.Errorf("domain %q: %s: %w", s, why, errdefs.ErrInvalidArgument)
	}
	if len(d) > 253 {
		return bad("longer than 253 bytes")
	}
	rest := strings.TrimPrefix(d, "*.")
	if strings.Contains(rest, "*") {
		return bad("a wildcard is allowed only as the whole first label (*.example.org)")
	}
	labels := strings.Split(rest, ".")
	if len(labels) < 2 && rest == d {
		return bad("want at least two labels")
	}
	for _, l := range labels {
		if l == "" || len(l) > 63 {
			return bad("empty or over-long label")
		}
		if l[0] == '-' || l[len(l)-1] == '-' {
			return bad("label starts or ends with '-'")
		}
		for _, r := range l {
			if !(r >= 'a' && r <= 'z' || r >= '0' && r <= '9' || r == '-' || r == '_') {
				return bad(fmt.Sprintf("character %q", r))
			}
		}
	}
	if looksLikeAddr(rest) {
		return bad("looks like an address")
	}
	return d, nil
}

// Name says whether qname may be resolved and on which ports its addresses
// may be reached (empty: every port), and names the rules key(s) that
// decided (DomainRule.Source, comma-separated when several keys merged).
// The most specific matching pattern wins: an exact name over any wildcard,
// a longer wildcard suffix over a shorter one; deny wins a tie. No match is a
// deny with an empty rule. A nil Policy denies everything.
func (p *Policy) Name(qname string) (allow bool, ports []Port, rule string) {
	if p == nil {
		return false, nil, ""
	}
	name := strings.TrimSuffix(strings.ToLower(qname), ".")
	for _, r := range p.Domains { // sorted most specific first by Compile
		if matchPattern(r.Pattern, name) {
			return r.Allow, r.Ports, r.Source
		}
	}
	return false, nil, ""
}

// Host returns the fixed answer for qname from Hosts (exact key first, then
// the longest matching "*." key), or nil.
func (p *Policy) Host(qname string) []netip.Addr {
	if p == nil || len(p.Hosts) == 0 {
		return nil
	}
	name := strings.TrimSuffix(strings.ToLower(qname), ".")
	if a, ok := p.Hosts[name]; ok {
		return a
	}
	best, bestLen := "", -1
	for k := range p.Hosts {
		if strings.HasPrefix(k, "*.") && matchPattern(k, name) && len(k) > bestLen {
			best, bestLen = k, len(k)
		}
	}
	if bestLen < 0 {
		return nil
	}
	return p.Hosts[best]
}

// Addr evaluates the CIDR rules for a connection the way the kernel does:
// the first rule (in CIDRs order) whose prefix, port and protocol match
// decides. matched is false when none does; the caller then checks the
// addresses learned through allowed names, and denies otherwise.
func (p *Policy) Addr(addr netip.Addr, proto string, port uint16) (allow bool, rule string, matched bool) {
	if p == nil {
		return false, "", false
	}
	for _, r := range p.CIDRs {
		if !r.Prefix.Contains(addr) {
			continue
		}
		if r.Port.Port != 0 && r.Port.Port != port {
			continue
		}
		if r.Port.Proto != "" && r.Port.Proto != proto {
			continue
		}
		return r.Allow, r.Source, true
	}
	return false, "", false
}

func matchPattern(pattern, name string) bool {
	if suffix, ok := strings.CutPrefix(pattern, "*"); ok {
		return strings.HasSuffix(name, suffix) && len(name) > len(suffix)
	}
	return pattern == name
}

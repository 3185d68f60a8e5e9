package network

import (
	"net/netip"
	"strings"

	"dsec.dev/dsec/internal/edge/netpolicy"
)

// Reserved ranges. Hard ones open only through a CIDR rule naming a prefix
// inside them; soft ones also through a resolved address.
var (
	hardReserved = []netip.Prefix{
		netip.MustParsePrefix("0.0.0.0/8"),
		netip.MustParsePrefix("127.0.0.0/8"),
		netip.MustParsePrefix("169.254.0.0/16"),
		netip.MustParsePrefix("224.0.0.0/4"),
		netip.MustParsePrefix("240.0.0.0/4"),
	}
	softReserved = []netip.Prefix{
		netip.MustParsePrefix("10.0.0.0/8"),
		netip.MustParsePrefix("100.64.0.0/10"),
		netip.MustParsePrefix("172.16.0.0/12"),
		netip.MustParsePrefix("192.0.0.0/24"),
		netip.MustParsePrefix("192.0.2.0/24"),
		netip.MustParsePrefix("192.168.0.0/16"),
		netip.MustParsePrefix("198.18.0.0/15"),
		netip.MustParsePrefix("198.51.100.0/24"),
		netip.MustParsePrefix("203.0.113.0/24"),
	}
)

const (
	protoTCP = 6
	protoUDP = 17
)

type stepKind int

const (
	stepCIDR         stepKind = iota // one CIDR rule
	stepHard                         // reject hard-reserved
	stepResolvedSoft                 // accept resolved addresses inside soft-reserved
	stepSoft                         // reject soft-reserved
	stepResolved                     // accept resolved addresses
	stepDefault                      // reject
)

// step is one verdict rule of a sandbox chain, in order. Both the nftables
// rules and the Go evaluation used by Update(cut) come from the same steps.
type step struct {
	kind   stepKind
	prefix netip.Prefix // stepCIDR
	proto  uint8        // stepCIDR: 0 any
	port   uint16       // stepCIDR: 0 any
	allow  bool
	rule   string // names the step in audit records
}

// hardSet is the hard-reserved ranges of a node with the given pool.
func hardSet(pool netip.Prefix) []netip.Prefix {
	return append([]netip.Prefix{pool}, hardReserved...)
}

func insideAny(p netip.Prefix, ranges []netip.Prefix) bool {
	for _, r := range ranges {
		if r.Bits() <= p.Bits() && r.Contains(p.Addr()) {
			return true
		}
	}
	return false
}

func containsAny(a netip.Addr, ranges []netip.Prefix) bool {
	for _, r := range ranges {
		if r.Contains(a) {
			return true
		}
	}
	return false
}

// plan turns a policy into the ordered verdict steps of its chain. IPv6
// rules are skipped: sandboxes have no IPv6.
func plan(pol *netpolicy.Policy, pool netip.Prefix) []step {
	var inside, outside []step
	reserved := append(hardSet(pool), softReserved...)
	if pol != nil {
		for _, c := range pol.CIDRs {
			if !c.Prefix.IsValid() || !c.Prefix.Addr().Is4() {
				continue
			}
			p := c.Prefix.Masked()
			protos := []uint8{0}
			switch c.Port.Proto {
			case "tcp":
				protos = []uint8{protoTCP}
			case "udp":
				protos = []uint8{protoUDP}
			case "":
				if c.Port.Port != 0 {
					protos = []uint8{protoTCP, protoUDP}
				}
			default:
				continue // unknown protocol: the rule cannot match
			}
			for _, pr := range protos {
				s := step{kind: stepCIDR, prefix: p, proto: pr, port: c.Port.Port, allow: c.Allow, rule: c.Source}
				if insideAny(p, reserved) {
					inside = append(inside, s)
				} else {
					outside = append(outside, s)
				}
			}
		}
	}
	steps := inside
	steps = append(steps,
		step{kind: stepHard, rule: "reserved"},
		step{kind: stepResolvedSoft, allow: true, rule: "resolved"},
		step{kind: stepSoft, rule: "reserved"})
	steps = append(steps, outside...)
	steps = append(steps,
		step{kind: stepResolved, allow: true, rule: "resolved"},
		step{kind: stepDefault, rule: "default"})
	return steps
}

// evaluate is what the chain decides for a new connection to addr:port over
// proto, given whether the resolved sets hold it.
func evaluate(steps []step, pool netip.Prefix, addr netip.Addr, proto uint8, port uint16, resolved bool) (allow bool, rule string) {
	for _, s := range steps {
		switch s.kind {
		case stepCIDR:
			if s.prefix.Contains(addr) && (s.proto == 0 || s.proto == proto) && (s.port == 0 || s.port == port) {
				return s.allow, s.rule
			}
		case stepHard:
			if containsAny(addr, hardSet(pool)) {
				return false, s.rule
			}
		case stepResolvedSoft:
			if resolved && containsAny(addr, softReserved) {
				return true, s.rule
			}
		case stepSoft:
			if containsAny(addr, softReserved) {
				return false, s.rule
			}
		case stepResolved:
			if resolved {
				return true, s.rule
			}
		case stepDefault:
			return false, s.rule
		}
	}
	return false, "default"
}

func protoNumber(p string) uint8 {
	switch p {
	case "tcp":
		return protoTCP
	case "udp":
		return protoUDP
	}
	return 0
}

func protoName(n uint8) string {
	switch n {
	case protoTCP:
		return "tcp"
	case protoUDP:
		return "udp"
	case 1:
		return "icmp"
	}
	return ""
}

// resolvedKey is one element of a sandbox's resolved sets; port 0 is the
// every-port set.
type resolvedKey struct {
	addr  netip.Addr
	proto uint8
	port  uint16
}

// resolvedKeys expands AllowResolved's ports into set elements.
func resolvedKeys(addr netip.Addr, ports []netpolicy.Port) []resolvedKey {
	if len(ports) == 0 {
		ports = []netpolicy.Port{{}}
	}
	seen := map[resolvedKey]bool{}
	var keys []resolvedKey
	for _, p := range ports {
		protos := []uint8{protoTCP, protoUDP}
		if n := protoNumber(p.Proto); n != 0 {
			protos = []uint8{n}
		}
		for _, pr := range protos {
			k := resolvedKey{addr: addr, proto: pr, port: p.Port}
			if !seen[k] {
				seen[k] = true
				keys = append(keys, k)
			}
		}
	}
	return keys
}

// nameAllowed reports whether a name resolved earlier is still allowed by a
// policy's domain rules: the first matching rule decides.
func nameAllowed(pol *netpolicy.Policy, name string) bool {
	if pol == nil {
		return false
	}
	if _, ok := pol.Hosts[name]; ok {
		return true
	}
	for _, d := range pol.Domains {
		if matchDomain(d.Pattern, name) {
			return d.Allow
		}
	}
	return false
}

func matchDomain(pattern, name string) bool {
	pattern = trimDot(pattern)
	name = trimDot(name)
	if len(pattern) > 2 && pattern[:2] == "*." {
		suffix := pattern[1:]
		return len(name) > len(suffix) && strings.EqualFold(name[len(name)-len(suffix):], suffix)
	}
	return strings.EqualFold(pattern, name)
}

func trimDot(s string) string {
	if len(s) > 0 && s[len(s)-1] == '.' {
		return s[:len(s)-1]
	}
	return s
}

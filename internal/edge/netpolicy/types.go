package netpolicy

import (
	"net/netip"
	"time"
)

// Port is a transport protocol and port. Proto is "tcp", "udp" or "" for
// both; Port 0 means every port.
type Port struct {
	Proto string `json:"proto,omitempty"`
	Port  uint16 `json:"port,omitempty"`
}

// CIDRRule allows or denies an address range, optionally narrowed to one
// port and protocol.
type CIDRRule struct {
	Prefix netip.Prefix `json:"prefix"`
	Port   Port         `json:"port"`
	Allow  bool         `json:"allow"`
	Source string       `json:"source"` // the rules key it came from
}

// DomainRule allows or denies names matching Pattern ("index.example" or
// "*.files.example") on Ports (empty: every port).
type DomainRule struct {
	Pattern string `json:"pattern"`
	Ports   []Port `json:"ports,omitempty"`
	Allow   bool   `json:"allow"`
	Source  string `json:"source"`
}

// Policy is one sandbox's compiled network rules. The zero Policy (or nil)
// denies everything. Address rules are evaluated by the kernel in the order
// CIDRs lists them (most specific first, deny before allow on a tie); names
// by Name.
type Policy struct {
	Rules   map[string]bool `json:"rules"` // as the caller gave them
	CIDRs   []CIDRRule      `json:"cidrs"`
	Domains []DomainRule    `json:"domains"`
	// Hosts are fixed answers for names, from mirrors in the catalog:
	// the resolver answers them without asking upstream. A key is a name
	// or a "*.suffix" pattern (see Policy.Host).
	Hosts map[string][]netip.Addr `json:"hosts,omitempty"`
	// Env holds variables a sandbox should see for its mirrors
	// (PIP_INDEX_URL and the like).
	Env map[string]string `json:"env,omitempty"`
}

// Event is one audit record: a connection attempt or a DNS query.
type Event struct {
	Time      time.Time  `json:"time"`
	SandboxID string     `json:"sandbox_id"`
	Kind      string     `json:"kind"`    // "connect" or "dns"
	Verdict   string     `json:"verdict"` // "allow" or "deny"
	Proto     string     `json:"proto,omitempty"`
	Dest      netip.Addr `json:"dest,omitempty"`
	Port      uint16     `json:"port,omitempty"`
	Name      string     `json:"name,omitempty"` // DNS name asked, or known for Dest
	BytesOut  int64      `json:"bytes_out,omitempty"`
	BytesIn   int64      `json:"bytes_in,omitempty"`
	Rule      string     `json:"rule,omitempty"` // the rules key that decided, if any
	// DNS events only: the query type, the addresses answered, and why a
	// query got no answer (upstream failure, limits) when it did not.
	QType   string       `json:"qtype,omitempty"`
	Answers []netip.Addr `json:"answers,omitempty"`
	Detail  string       `json:"detail,omitempty"`
}

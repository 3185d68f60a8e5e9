// Package netpolicy turns a sandbox's network rules (service names, domain
// patterns and CIDRs mapped to allow or deny) into a Policy, holds the node's
// catalog of named services and mirrors, answers sandboxes' DNS queries with
// only the names their policy allows, and keeps the per-sandbox audit log.
// The kernel side (veths, nftables) lives in internal/edge/network.
//
// # Rules
//
// Scripts pass rules as a JSON mapping from key to true (allow) or false
// (deny); Compile turns it into a Policy. A key is a service name of the
// node's Catalog ("pypi"), a domain pattern ("example.org", "*.example.org")
// or "CIDR[:PORT[/PROTO]]" ("10.0.0.0/8", "10.1.2.3:443/tcp"). Everything not
// allowed is denied. The node enforces IPv4 only; IPv6 keys are refused.
//
// # Precedence
//
// Addresses. A connection is decided by Policy.CIDRs in order, first match
// wins. Compile orders them: longer prefix first; for the same prefix, a rule
// with a port before one for every port; then one with a protocol before one
// for both; then deny before allow. Only when no CIDR rule matches does the
// set of addresses learned through allowed names count (the resolver adds
// them with their port set and TTL); otherwise the connection is denied. So a
// CIDR deny beats an address learned through an allowed domain, and a CIDR
// allow stands even for an address whose name is denied (a name rule only
// decides what the resolver answers). Policy.Addr evaluates this order.
//
// Names. Policy.Name decides a DNS query: the most specific matching pattern
// wins — an exact name over every wildcard, a longer wildcard suffix over a
// shorter one ("*.a.example.org" over "*.example.org"); "*.example.org"
// matches names under example.org but not example.org itself. When one
// pattern is both allowed and denied (by two keys, e.g. a service and a
// domain), deny wins. Allows of one pattern join their ports; a domain key
// allows every port, a service its catalog ports. No match: denied.
//
// Services. Allowing a service adds its domains (on its ports) and CIDRs (on
// its ports); denying it denies its domains and CIDRs on every port. A
// service without domains or CIDRs on this node allows nothing: Compile
// says so in its warnings. A service with a Mirror allows the mirror instead
// (see Mirror).
//
// # Resolver
//
// Each sandbox's DNS queries reach the node's Resolver on sockets made for
// that sandbox. It refuses denied names, answers allowed ones (from
// Policy.Hosts or upstream), and hands every A answer to the network side
// (ResolverConfig.Allow) before replying, so a connection to it never races
// the rule. AAAA and other types get empty answers.
//
// # Audit
//
// AuditLog keeps each sandbox's connection and DNS events, bounded, in
// memory and in a JSON-lines file per sandbox, readable after a restart.
package netpolicy

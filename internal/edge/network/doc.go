// Package network owns the kernel side of per-sandbox network policy on an
// edge node: network namespaces, veth pairs, addresses and routes, the node's
// nftables table `dsec`, the egress bandwidth cap, and the audit stream of
// connection attempts. Rules are compiled elsewhere (internal/edge/netpolicy)
// into a *netpolicy.Policy; this package enforces one.
//
// # Topology: routed veths, no bridge
//
// Every sandbox gets a network namespace bind-mounted at Config.NetnsDir/<id>
// and a veth pair. The host side is named "dsv" + 12 hex digits of a hash of
// the id (15 characters, the kernel's limit) and carries the id in its
// interface alias ("dsec:<id>"), which is how a restarted daemon finds its
// sandboxes again. The sandbox side is "eth0" with one /32 from the node's
// pool (Config.Pool, default 10.213.0.0/16). The first address of the pool
// is the gateway: every host-side veth holds it as a /32, and the host routes
// each sandbox's /32 to its veth. Inside the sandbox lo is up and the default
// route points at the gateway (onlink). Because there is no bridge, every
// packet from a sandbox crosses the host's IP input or forward path, where
// the table below sees it; sandboxes cannot talk to each other at layer 2.
//
// Setup turns on net.ipv4.ip_forward and net.netfilter.nf_conntrack_acct.
// Both are node-wide and stay on after Teardown: switching forwarding off
// again could break other users of the node, and the filter table, not the
// sysctl, is what keeps sandboxes contained. Sandbox traffic leaving through
// any interface that is not a sandbox veth is masqueraded.
//
// # The nftables table (inet dsec)
//
//   - input: anything arriving from a sandbox veth is dropped. No service of
//     the node (the dsec API, sshd, anything on 0.0.0.0 or on the gateway) can
//     be reached from a sandbox, and a port scan of the host finds nothing.
//   - forward: replies (ct state established,related) pass. A packet from a
//     sandbox veth is dispatched by its source address through the verdict
//     map "sandboxes" to that sandbox's own chain "sb_<hash>"; anything else
//     from a sandbox veth (IPv6, unknown source) is dropped, and new
//     connections towards a sandbox veth are dropped.
//   - sb_<hash>, in order: drop when the packet did not come in on the
//     sandbox's own veth (no spoofing of another sandbox's address); set the
//     conntrack mark to the sandbox's address (so its connections can be
//     listed and flushed without walking the whole conntrack table; dsec
//     owns the ct mark of sandbox traffic); reject
//     when the sandbox already has Config.MaxConns tracked connections (ct
//     count); the policy's CIDR rules whose prefix lies inside a reserved
//     range; reject the hard-reserved ranges (the pool, so sandbox to sandbox,
//     0/8, loopback, link-local 169.254/16, multicast, 240/4); resolved
//     addresses inside the soft-reserved ranges (private, CGNAT and
//     documentation networks, where a node's own network usually lives);
//     reject the soft-reserved ranges; the remaining CIDR rules in order;
//     the resolved addresses; reject. So a reserved range opens only through
//     a CIDR rule naming a prefix inside it (a rule for 0.0.0.0/0 does not
//     open the pool or 169.254.169.254), and a resolved name opens a private
//     address only because the resolver (trusted, and responsible for
//     refusing DNS rebinding) said so.
//   - resolved addresses live in two per-sandbox sets with per-element
//     timeouts filled by AllowResolved: "r_<hash>" (addr . proto . port) and
//     "ra_<hash>" (addr . proto, for every port).
//   - Denials are "reject" (TCP reset, ICMP admin-prohibited otherwise) so a
//     sandbox's tools fail fast instead of hanging; the input hook drops.
//   - The table is inet, so IPv6 from a sandbox is dropped too (sandboxes
//     get no IPv6 address or route). The node's own addresses are reached
//     through input and so are closed even to a CIDR rule naming them.
//
// Update replaces one sandbox's chain and prunes its resolved sets (keeping
// the addresses whose name is still in the policy's Hosts or whose first
// matching DomainRule allows it) in one nftables transaction; no other sandbox's rules are touched, so the cost of
// an Update does not grow with the number of sandboxes. With cut=true the
// conntrack entries of the sandbox that the new policy no longer allows are
// deleted, so their next packet is evaluated as new and rejected (TCP gets a
// reset). The connection limit counts the connections made through the
// current chain, so it starts from zero after an Update.
//
// # Audit
//
// Every verdict rule of a sandbox chain also logs the packet to NFLOG group
// 2130 (queue threshold 1, so records are sent at once) with a prefix
// "dsec:<A|D>:<rule>", where rule is the deciding
// CIDRRule's Source, "resolved", "reserved", "limit" or "default". Only
// packets that are not part of an established flow reach the chain, so this
// is one record per new connection attempt (a retransmitted SYN of a denied
// connection is logged again). The reader turns each into a netpolicy.Event
// of Kind "connect" with the sandbox (by source address), destination, port,
// protocol, verdict and rule, and the name the address was resolved from when
// AllowResolved knows it. When an allowed connection ends, conntrack's
// DESTROY event (with accounting on) becomes a second Event of Kind "close"
// carrying BytesOut and BytesIn. Events are delivered from one goroutine;
// Config.Audit must not block for long.
//
// # DNS
//
// ListenDNS creates a UDP socket and a TCP listener on 127.0.0.53:53 inside
// the sandbox's namespace (the calling thread enters the namespace only while
// creating them). The edge serves its resolver on them and bind-mounts a
// resolv.conf naming 127.0.0.53, so DNS needs nothing open on the host.
//
// # Egress bandwidth
//
// A tbf qdisc on the sandbox side of the veth, installed from the host over
// netlink, caps what the sandbox sends at Config.EgressBytesPerSec. Sandboxes
// must not hold CAP_NET_ADMIN in their namespace (the runtimes drop it), or
// they could remove it.
//
// # Lifecycle
//
// Setup is idempotent and re-adopts what a previous daemon left: it learns
// every dsec veth (id from the alias, address from its route) so new
// addresses never collide. Recover then keeps the given sandboxes (re-installing
// their chains) and removes every other dsec namespace, veth, chain and set.
// Close stops the audit readers and leaves sandboxes running (daemon
// shutdown); Teardown removes everything this package made.
package network

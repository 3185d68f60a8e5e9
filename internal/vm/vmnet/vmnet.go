// Package vmnet connects a microVM to the network the edge made for its
// sandbox: a tap device inside the sandbox's network namespace, wired to
// the namespace's veth with tc redirects, so the guest's packets leave
// through the same veth, with the same address and MAC, as a container's
// would. The node's nftables policy, egress cap, conntrack marks and audit
// (package network) see a VM's traffic exactly as a container's, and the
// policy-checking resolver the edge serves inside the namespace (package
// netctl) answers the guest's DNS.
//
// # How the namespace is wired
//
// The edge's namespace has eth0 (the sandbox's side of the veth, holding
// the sandbox's address A/32 and a default route to the pool's gateway)
// and lo, where the resolver listens on 127.0.0.53. Attach, in that
// namespace:
//
//   - makes a persistent tap device tap0 (IFF_VNET_HDR, the veth's MTU) and
//     returns it open, for QEMU to inherit;
//   - moves A off eth0: the guest holds it now (with eth0's MAC), so the
//     namespace must not think it local;
//   - redirects every frame between eth0 and tap0 with ingress qdiscs and
//     mirred filters (Kata Containers' "tcfilter" model), so the guest is
//     on the veth's wire: its ARP, its packets, its replies;
//   - except for the namespace's own resolver: frames from the guest to
//     DNSAddr (ARP for it and IPv4 to it) are let into the namespace's stack
//     instead, where tap0 holds DNSAddr and an nftables rule (table ip
//     dsecvm) sends them to 127.0.0.53 (route_localnet on tap0, and
//     forwarding off there: the namespace routes nothing); the replies
//     go back to A through tap0 by a route and a permanent neighbour entry.
//
// The guest configures eth0 as the edge configured the container's: A/32,
// the veth's MAC and MTU, a default route to the gateway (on-link), plus an
// on-link route to DNSAddr, its only nameserver (Guest.Args gives it
// dsec-agent's guest-mode flags for this).
//
// The tap is persistent, so it outlives a QEMU process (a paused VM's next
// QEMU opens it again with Attach); Detach removes it. Removing the
// namespace removes it too.
//
// # A gVisor sentry
//
// runsc's own network stack (the sentry's netstack) takes the same
// namespace over otherwise: it copies eth0's address, routes and MAC,
// removes the address from eth0 and sends and receives the veth's frames
// through a packet socket on eth0, so the namespace's IP stack never sees
// what the sentry sends, and 127.0.0.53 is the sentry's own loopback. Its
// nameserver is DNSAddr too: AttachSentry (after runsc has started)
// turns frames to and from DNSAddr round on eth0's egress into its
// ingress, where the namespace's stack (for the queries: the same table
// ip dsecvm, on eth0) or the sentry's packet socket (for the replies)
// takes them. Everything else leaves through the veth untouched.
package vmnet

import (
	"net"
	"net/netip"
	"os"
	"strconv"
)

// DNSAddr is the address the guest sends its DNS to. It is link-local
// (never routed off the node, and denied by the edge's policy), on-link
// for the guest, and answered inside the sandbox's namespace by the edge's
// resolver.
var DNSAddr = netip.MustParseAddr("169.254.0.53")

// Names of the devices in the sandbox's namespace.
const (
	VethName = "eth0" // the sandbox's side of the edge's veth
	TapName  = "tap0" // the VM's tap device
)

// nftTable is the nftables table vmnet keeps in the sandbox's namespace.
const nftTable = "dsecvm"

// Link is a VM's attachment to its sandbox's network.
type Link struct {
	// Tap is the open tap device, for QEMU to inherit (-netdev tap,fd=N).
	// The caller owns it and closes it once QEMU has it.
	Tap   *os.File
	Guest Guest
}

// Guest is the network configuration the guest gives its interface.
type Guest struct {
	MAC         net.HardwareAddr
	Addr        netip.Prefix // the sandbox's address (a /32)
	Gateway     netip.Addr   // on-link
	MTU         int
	Nameservers []netip.Addr // on-link too
}

// Sentry is what AttachSentry needs of a gVisor sandbox's network, read
// (ReadSentry) before runsc takes eth0's address off it.
type Sentry struct {
	Addr netip.Prefix     // the sandbox's address (a /32)
	MAC  net.HardwareAddr // the veth's, which the sentry keeps
}

// Args are dsec-agent guest mode's flags for g (words after "--" on the
// kernel command line).
func (g Guest) Args() []string {
	args := []string{
		"--net-mac=" + g.MAC.String(),
		"--net-addr=" + g.Addr.String(),
		"--net-gateway=" + g.Gateway.String(),
		"--net-mtu=" + strconv.Itoa(g.MTU),
	}
	for _, ns := range g.Nameservers {
		args = append(args, "--net-dns="+ns.String())
	}
	return args
}

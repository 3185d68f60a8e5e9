package vmnet

import (
	"context"
	"fmt"
	"net"
	"os"

	"github.com/vishvananda/netlink"
	"github.com/vishvananda/netlink/nl"
	"github.com/vishvananda/netns"
	"golang.org/x/sys/unix"

	"dsec.dev/dsec/internal/errdefs"
)

// ReadSentry reads what AttachSentry needs from the namespace at nsPath
// before runsc takes its veth over: the sandbox's address on eth0 and the
// veth's MAC.
func ReadSentry(nsPath string) (Sentry, error) {
	nsf, err := os.Open(nsPath)
	if err != nil {
		return Sentry{}, fmt.Errorf("read sentry network: open netns: %w", err)
	}
	defer nsf.Close()
	h, err := netlink.NewHandleAt(netns.NsHandle(nsf.Fd()))
	if err != nil {
		return Sentry{}, fmt.Errorf("read sentry network: open netlink in %s: %w", nsPath, err)
	}
	defer h.Close()
	veth, err := h.LinkByName(VethName)
	if err != nil {
		return Sentry{}, fmt.Errorf("read sentry network: find %s in %s: %w", VethName, nsPath, err)
	}
	g, err := readGuest(h, veth)
	if err != nil {
		return Sentry{}, fmt.Errorf("read sentry network: %w", err)
	}
	return Sentry{Addr: g.Addr, MAC: g.MAC}, nil
}

// AttachSentry wires the namespace at nsPath for the resolver once runsc
// has started in it (and taken the sandbox's address off eth0, so the
// namespace no longer thinks it local): frames the sentry sends to
// DNSAddr, and the namespace's replies from it, are turned round on eth0's
// egress into its ingress (a clsact qdisc, mirred ingress redirects); the
// namespace's stack takes the queries (table ip dsecvm sends them to
// 127.0.0.53, route_localnet on eth0) and the sentry's packet socket the
// replies (a route to the sandbox's address on eth0 and a permanent
// neighbour entry with the veth's MAC, the sentry's). Every step
// replaces, so attaching again leaves the same state.
func AttachSentry(ctx context.Context, nsPath string, s Sentry) error {
	nsf, err := os.Open(nsPath)
	if err != nil {
		return fmt.Errorf("attach sentry network: open netns: %w", err)
	}
	defer nsf.Close()
	h, err := netlink.NewHandleAt(netns.NsHandle(nsf.Fd()))
	if err != nil {
		return fmt.Errorf("attach sentry network: open netlink in %s: %w", nsPath, err)
	}
	defer h.Close()
	veth, err := h.LinkByName(VethName)
	if err != nil {
		return fmt.Errorf("attach sentry network: find %s in %s: %w", VethName, nsPath, err)
	}
	if err := inNetns(nsf, func() error {
		// The namespace routes nothing: what reaches its stack for the
		// sandbox's address is dropped, not sent back out of eth0.
		for name, v := range map[string]string{"route_localnet": "1", "forwarding": "0"} {
			if err := os.WriteFile("/proc/sys/net/ipv4/conf/"+VethName+"/"+name, []byte(v), 0o644); err != nil {
				return err
			}
		}
		return nil
	}); err != nil {
		return fmt.Errorf("attach sentry network: %w", err)
	}
	if err := turnDNS(h, veth, s); err != nil {
		return fmt.Errorf("attach sentry network: %w", err)
	}
	if err := addDNSRedirect(nsf, VethName); err != nil {
		return fmt.Errorf("attach sentry network: %w", err)
	}
	return nil
}

func turnDNS(h *netlink.Handle, veth netlink.Link, s Sentry) error {
	vi := veth.Attrs().Index
	addrs, err := h.AddrList(veth, unix.AF_INET)
	if err != nil {
		return fmt.Errorf("list addresses of %s: %w", VethName, err)
	}
	for _, a := range addrs {
		if a.IP.Equal(s.Addr.Addr().AsSlice()) {
			return fmt.Errorf("%s still holds %s: runsc has not taken the veth over: %w", VethName, s.Addr, errdefs.ErrFailedPrecondition)
		}
	}
	addr := &net.IPNet{IP: s.Addr.Addr().AsSlice(), Mask: net.CIDRMask(s.Addr.Bits(), 32)}
	if err := h.RouteReplace(&netlink.Route{LinkIndex: vi, Dst: addr, Scope: netlink.SCOPE_LINK, Protocol: unix.RTPROT_STATIC}); err != nil {
		return fmt.Errorf("route %s to %s: %w", s.Addr, VethName, err)
	}
	if err := h.NeighSet(&netlink.Neigh{LinkIndex: vi, Family: unix.AF_INET, State: netlink.NUD_PERMANENT, IP: addr.IP, HardwareAddr: s.MAC}); err != nil {
		return fmt.Errorf("add the sentry's neighbour entry: %w", err)
	}
	// A fresh clsact qdisc: an earlier attach's filters go with the old
	// one. The node's egress cap (a root qdisc) is not touched.
	clsact := &netlink.Clsact{QdiscAttrs: netlink.QdiscAttrs{LinkIndex: vi, Handle: netlink.MakeHandle(0xffff, 0), Parent: netlink.HANDLE_CLSACT}}
	h.QdiscDel(clsact)
	if err := h.QdiscAdd(clsact); err != nil {
		return fmt.Errorf("add clsact qdisc to %s: %w", VethName, err)
	}
	dnsIP := ipv4Uint32(DNSAddr)
	for _, f := range []netlink.Filter{
		// The sentry's queries (IPv4 destination, 16 bytes in) and the
		// resolver's replies (IPv4 source, 12 bytes in).
		turn(vi, 1, 16, dnsIP),
		turn(vi, 2, 12, dnsIP),
	} {
		if err := h.FilterAdd(f); err != nil {
			return fmt.Errorf("add tc filter on %s: %w", VethName, err)
		}
	}
	return nil
}

// turn sends IPv4 frames leaving link whose 32-bit word at off (from the
// network header) is val back into link's ingress. The frame's type stays
// PACKET_HOST (nothing parses its MAC header again), so the namespace's
// stack takes it whatever its destination MAC.
func turn(link int, prio uint16, off int32, val uint32) netlink.Filter {
	redir := netlink.NewMirredAction(link)
	redir.MirredAction = netlink.TCA_INGRESS_REDIR
	return &netlink.U32{
		FilterAttrs: netlink.FilterAttrs{LinkIndex: link, Parent: netlink.HANDLE_MIN_EGRESS, Priority: prio, Protocol: unix.ETH_P_IP},
		Sel:         &netlink.TcU32Sel{Flags: nl.TC_U32_TERMINAL, Keys: []netlink.TcU32Key{{Mask: 0xffffffff, Val: val, Off: off}}},
		Actions:     []netlink.Action{redir},
	}
}

package vmnet

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/netip"
	"os"
	"runtime"

	"github.com/google/nftables"
	"github.com/google/nftables/expr"
	"github.com/vishvananda/netlink"
	"github.com/vishvananda/netlink/nl"
	"github.com/vishvananda/netns"
	"golang.org/x/sys/unix"

	"dsec.dev/dsec/internal/errdefs"
)

// Attach wires a tap device into the network namespace at nsPath, which
// the edge made for a sandbox (package network: eth0 with the sandbox's
// address and a default route), and returns it open with the guest's
// settings. Attaching again (a new QEMU for a paused VM) opens the same
// tap; it fails while another process holds it.
func Attach(ctx context.Context, nsPath string) (l *Link, err error) {
	nsf, err := os.Open(nsPath)
	if err != nil {
		return nil, fmt.Errorf("attach vm network: open netns: %w", err)
	}
	defer nsf.Close()
	h, err := netlink.NewHandleAt(netns.NsHandle(nsf.Fd()))
	if err != nil {
		return nil, fmt.Errorf("attach vm network: open netlink in %s: %w", nsPath, err)
	}
	defer h.Close()

	veth, err := h.LinkByName(VethName)
	if err != nil {
		return nil, fmt.Errorf("attach vm network: find %s in %s: %w", VethName, nsPath, err)
	}
	g, err := readGuest(h, veth)
	if err != nil {
		return nil, fmt.Errorf("attach vm network: %w", err)
	}

	var tap *os.File
	if err := inNetns(nsf, func() error {
		var err error
		tap, err = openTap(TapName)
		if err != nil {
			return err
		}
		// The resolver listens on 127.0.0.53: packets to DNSAddr are sent
		// there, which a non-loopback device allows only with
		// route_localnet. Nothing the guest sends is routed on by the
		// namespace (new namespaces may start with forwarding on).
		for name, v := range map[string]string{"route_localnet": "1", "forwarding": "0"} {
			if err := os.WriteFile("/proc/sys/net/ipv4/conf/"+TapName+"/"+name, []byte(v), 0o644); err != nil {
				return err
			}
		}
		return nil
	}); err != nil {
		if tap != nil {
			tap.Close()
		}
		return nil, fmt.Errorf("attach vm network: %w", err)
	}
	defer func() {
		if err != nil {
			tap.Close()
			Detach(context.WithoutCancel(ctx), nsPath)
		}
	}()
	if err := wire(h, veth, g); err != nil {
		return nil, fmt.Errorf("attach vm network: %w", err)
	}
	if err := addDNSRedirect(nsf, TapName); err != nil {
		return nil, fmt.Errorf("attach vm network: %w", err)
	}
	return &Link{Tap: tap, Guest: g}, nil
}

// readGuest reads the guest's settings from the namespace: the veth's MAC
// and MTU, the sandbox's address (on the veth the first time, routed to
// the tap once Attach moved it) and the default route's gateway.
func readGuest(h *netlink.Handle, veth netlink.Link) (Guest, error) {
	g := Guest{MAC: veth.Attrs().HardwareAddr, MTU: veth.Attrs().MTU, Nameservers: []netip.Addr{DNSAddr}}
	addrs, err := h.AddrList(veth, unix.AF_INET)
	if err != nil {
		return g, fmt.Errorf("list addresses of %s: %w", VethName, err)
	}
	for _, a := range addrs {
		if ip, ok := netip.AddrFromSlice(a.IP.To4()); ok {
			ones, _ := a.Mask.Size()
			g.Addr = netip.PrefixFrom(ip, ones)
			break
		}
	}
	routes, err := h.RouteList(nil, unix.AF_INET)
	if err != nil {
		return g, fmt.Errorf("list routes: %w", err)
	}
	for _, r := range routes {
		switch {
		case (r.Dst == nil || r.Dst.IP.IsUnspecified()) && r.Gw != nil && r.LinkIndex == veth.Attrs().Index:
			g.Gateway, _ = netip.AddrFromSlice(r.Gw.To4())
		case !g.Addr.IsValid() && r.Dst != nil && r.Protocol == unix.RTPROT_STATIC:
			// The address Attach moved off the veth: the route to the tap.
			if l, err := h.LinkByIndex(r.LinkIndex); err == nil && l.Attrs().Name == TapName {
				ip, _ := netip.AddrFromSlice(r.Dst.IP.To4())
				ones, _ := r.Dst.Mask.Size()
				g.Addr = netip.PrefixFrom(ip, ones)
			}
		}
	}
	if !g.Addr.IsValid() || !g.Gateway.IsValid() {
		return g, fmt.Errorf("read the sandbox's network: %s has no IPv4 address or default route (address %v, gateway %v): %w",
			VethName, g.Addr, g.Gateway, errdefs.ErrFailedPrecondition)
	}
	return g, nil
}

// openTap opens (making it the first time) the persistent tap device name
// in the calling thread's network namespace.
func openTap(name string) (*os.File, error) {
	fd, err := unix.Open("/dev/net/tun", unix.O_RDWR|unix.O_CLOEXEC, 0)
	if err != nil {
		return nil, fmt.Errorf("open /dev/net/tun: %w", err)
	}
	ifr, err := unix.NewIfreq(name)
	if err != nil {
		unix.Close(fd)
		return nil, fmt.Errorf("tap %s: %w", name, err)
	}
	// IFF_VNET_HDR lets QEMU pass checksum and segmentation offloads.
	ifr.SetUint16(unix.IFF_TAP | unix.IFF_NO_PI | unix.IFF_VNET_HDR)
	if err := unix.IoctlIfreq(fd, unix.TUNSETIFF, ifr); err != nil {
		unix.Close(fd)
		return nil, fmt.Errorf("make tap %s: %w", name, err)
	}
	if err := unix.IoctlSetInt(fd, unix.TUNSETPERSIST, 1); err != nil {
		unix.Close(fd)
		return nil, fmt.Errorf("make tap %s persistent: %w", name, err)
	}
	return os.NewFile(uintptr(fd), "/dev/net/tun:"+name), nil
}

// wire moves the sandbox's address from the veth to the guest and
// redirects the veth's frames to the tap and back, all but those for the
// namespace's resolver. Every step replaces, so a second Attach leaves
// the same state.
func wire(h *netlink.Handle, veth netlink.Link, g Guest) error {
	tap, err := h.LinkByName(TapName)
	if err != nil {
		return fmt.Errorf("find %s: %w", TapName, err)
	}
	if err := h.LinkSetMTU(tap, g.MTU); err != nil {
		return fmt.Errorf("set the MTU of %s: %w", TapName, err)
	}
	if err := h.LinkSetUp(tap); err != nil {
		return fmt.Errorf("set %s up: %w", TapName, err)
	}
	addr := &net.IPNet{IP: g.Addr.Addr().AsSlice(), Mask: net.CIDRMask(g.Addr.Bits(), 32)}
	if err := h.AddrDel(veth, &netlink.Addr{IPNet: addr}); err != nil && !errors.Is(err, unix.EADDRNOTAVAIL) {
		return fmt.Errorf("move %s off %s: %w", g.Addr, VethName, err)
	}
	// Removing the address may take the default route with it; the guest
	// reads the gateway from it on the next Attach.
	if err := h.RouteReplace(&netlink.Route{LinkIndex: veth.Attrs().Index, Gw: g.Gateway.AsSlice(), Flags: int(netlink.FLAG_ONLINK)}); err != nil {
		return fmt.Errorf("keep the default route: %w", err)
	}
	dns := &net.IPNet{IP: DNSAddr.AsSlice(), Mask: net.CIDRMask(32, 32)}
	if err := h.AddrReplace(tap, &netlink.Addr{IPNet: dns}); err != nil {
		return fmt.Errorf("add %s to %s: %w", DNSAddr, TapName, err)
	}
	ti := tap.Attrs().Index
	if err := h.RouteReplace(&netlink.Route{LinkIndex: ti, Dst: addr, Scope: netlink.SCOPE_LINK, Src: DNSAddr.AsSlice(), Protocol: unix.RTPROT_STATIC}); err != nil {
		return fmt.Errorf("route %s to %s: %w", g.Addr, TapName, err)
	}
	if err := h.NeighSet(&netlink.Neigh{LinkIndex: ti, Family: unix.AF_INET, State: netlink.NUD_PERMANENT, IP: addr.IP, HardwareAddr: g.MAC}); err != nil {
		return fmt.Errorf("add the guest's neighbour entry: %w", err)
	}
	vi := veth.Attrs().Index
	for _, idx := range []int{vi, ti} {
		// A fresh qdisc: an earlier Attach's filters go with the old one.
		h.QdiscDel(ingressQdisc(idx))
		if err := h.QdiscAdd(ingressQdisc(idx)); err != nil {
			return fmt.Errorf("add ingress qdisc: %w", err)
		}
	}
	dnsIP := ipv4Uint32(DNSAddr)
	for _, f := range []netlink.Filter{
		// Everything the host sends the sandbox goes to the guest.
		redirect(vi, 1, ti),
		// ARP for the resolver's address (its target protocol address, 24
		// bytes into an IPv4 ARP) and IPv4 to it stay here.
		pass(ti, 1, unix.ETH_P_ARP, 24, dnsIP),
		pass(ti, 2, unix.ETH_P_IP, 16, dnsIP),
		// The rest of what the guest sends leaves through the veth (and its
		// egress cap).
		redirect(ti, 3, vi),
	} {
		if err := h.FilterAdd(f); err != nil {
			return fmt.Errorf("add tc filter on link %d: %w", f.Attrs().LinkIndex, err)
		}
	}
	return nil
}

func ingressFilter(link int, prio uint16, proto uint16) netlink.FilterAttrs {
	return netlink.FilterAttrs{LinkIndex: link, Parent: netlink.MakeHandle(0xffff, 0), Priority: prio, Protocol: proto}
}

func ingressQdisc(link int) *netlink.Ingress {
	return &netlink.Ingress{QdiscAttrs: netlink.QdiscAttrs{LinkIndex: link, Handle: netlink.MakeHandle(0xffff, 0), Parent: netlink.HANDLE_INGRESS}}
}

// redirect sends every frame arriving on link out of to's egress: a u32
// filter without keys matches all (kernels without cls_matchall have u32).
func redirect(link int, prio uint16, to int) netlink.Filter {
	return &netlink.U32{
		FilterAttrs: ingressFilter(link, prio, unix.ETH_P_ALL),
		Actions:     []netlink.Action{netlink.NewMirredAction(to)},
	}
}

// pass lets frames of proto whose 32-bit word at off (from the network
// header) is val up into the namespace's stack: a terminal u32 match
// without actions ends the classification with TC_ACT_OK (and needs no
// act_gact, which kernels may lack).
func pass(link int, prio uint16, proto uint16, off int32, val uint32) netlink.Filter {
	return &netlink.U32{
		FilterAttrs: ingressFilter(link, prio, proto),
		Sel:         &netlink.TcU32Sel{Flags: nl.TC_U32_TERMINAL, Keys: []netlink.TcU32Key{{Mask: 0xffffffff, Val: val, Off: off}}},
	}
}

func ipv4Uint32(a netip.Addr) uint32 {
	b := a.As4()
	return uint32(b[0])<<24 | uint32(b[1])<<16 | uint32(b[2])<<8 | uint32(b[3])
}

// addDNSRedirect (re)makes the namespace's table ip dsecvm: IPv4 arriving
// on link ifname (the guest's tap, or eth0 for a gVisor sentry) to DNSAddr
// is sent to the resolver on 127.0.0.53.
func addDNSRedirect(nsf *os.File, ifname string) error {
	c, err := nftables.New(nftables.WithNetNSFd(int(nsf.Fd())))
	if err != nil {
		return fmt.Errorf("open nftables in the netns: %w", err)
	}
	t := &nftables.Table{Name: nftTable, Family: nftables.TableFamilyIPv4}
	c.AddTable(t)
	c.DelTable(t) // start empty: the old chain's rules go
	c.AddTable(t)
	ch := c.AddChain(&nftables.Chain{
		Name: "prerouting", Table: t, Type: nftables.ChainTypeNAT,
		Hooknum: nftables.ChainHookPrerouting, Priority: nftables.ChainPriorityNATDest,
	})
	iif := make([]byte, unix.IFNAMSIZ)
	copy(iif, ifname)
	dns, resolver := DNSAddr.As4(), [4]byte{127, 0, 0, 53}
	c.AddRule(&nftables.Rule{Table: t, Chain: ch, Exprs: []expr.Any{
		&expr.Meta{Key: expr.MetaKeyIIFNAME, Register: 1},
		&expr.Cmp{Op: expr.CmpOpEq, Register: 1, Data: iif},
		&expr.Payload{DestRegister: 1, Base: expr.PayloadBaseNetworkHeader, Offset: 16, Len: 4},
		&expr.Cmp{Op: expr.CmpOpEq, Register: 1, Data: dns[:]},
		&expr.Immediate{Register: 1, Data: resolver[:]},
		&expr.NAT{Type: expr.NATTypeDestNAT, Family: unix.NFPROTO_IPV4, RegAddrMin: 1},
	}})
	if err := c.Flush(); err != nil {
		return fmt.Errorf("install table ip %s in the netns: %w", nftTable, err)
	}
	return nil
}

// Detach removes what Attach added to the namespace at nsPath: the tap,
// the veth's ingress qdisc and its filters, the nftables table. A missing
// namespace or piece is not an error. The sandbox's address stays off the
// veth: the namespace is the VM's until the edge removes it.
func Detach(ctx context.Context, nsPath string) error {
	nsf, err := os.Open(nsPath)
	if errors.Is(err, os.ErrNotExist) {
		return nil
	}
	if err != nil {
		return fmt.Errorf("detach vm network: open netns: %w", err)
	}
	defer nsf.Close()
	var st unix.Statfs_t
	if err := unix.Fstatfs(int(nsf.Fd()), &st); err != nil || st.Type != unix.NSFS_MAGIC {
		return nil // the edge's namespace is gone already (its file is not a namespace)
	}
	h, err := netlink.NewHandleAt(netns.NsHandle(nsf.Fd()))
	if err != nil {
		return fmt.Errorf("detach vm network: open netlink in %s: %w", nsPath, err)
	}
	defer h.Close()
	var errs []error
	if tap, err := h.LinkByName(TapName); err == nil {
		if err := h.LinkDel(tap); err != nil {
			errs = append(errs, fmt.Errorf("delete %s: %w", TapName, err))
		}
	}
	if veth, err := h.LinkByName(VethName); err == nil {
		if err := h.QdiscDel(ingressQdisc(veth.Attrs().Index)); err != nil && !errors.Is(err, unix.ENOENT) && !errors.Is(err, unix.EINVAL) {
			errs = append(errs, fmt.Errorf("delete the ingress qdisc of %s: %w", VethName, err))
		}
	}
	c, err := nftables.New(nftables.WithNetNSFd(int(nsf.Fd())))
	if err == nil {
		t := &nftables.Table{Name: nftTable, Family: nftables.TableFamilyIPv4}
		c.AddTable(t)
		c.DelTable(t)
		err = c.Flush()
	}
	if err != nil {
		errs = append(errs, fmt.Errorf("delete table ip %s: %w", nftTable, err))
	}
	if err := errors.Join(errs...); err != nil {
		return fmt.Errorf("detach vm network in %s: %w", nsPath, err)
	}
	return nil
}

// inNetns runs fn on a thread inside the namespace ns. Devices and sockets
// fn makes belong to it. A thread that cannot get back stays locked and
// ends with its goroutine.
func inNetns(ns *os.File, fn func() error) error {
	errc := make(chan error, 1)
	go func() {
		runtime.LockOSThread()
		orig, err := os.Open("/proc/thread-self/ns/net")
		if err != nil {
			runtime.UnlockOSThread()
			errc <- fmt.Errorf("open current netns: %w", err)
			return
		}
		defer orig.Close()
		if err := unix.Setns(int(ns.Fd()), unix.CLONE_NEWNET); err != nil {
			runtime.UnlockOSThread()
			errc <- fmt.Errorf("enter netns: %w", err)
			return
		}
		fnErr := fn()
		if err := unix.Setns(int(orig.Fd()), unix.CLONE_NEWNET); err != nil {
			errc <- errors.Join(fnErr, fmt.Errorf("return to the host's netns: %w", err))
			return
		}
		runtime.UnlockOSThread()
		errc <- fnErr
	}()
	return <-errc
}

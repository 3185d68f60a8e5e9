package agent

import (
	"context"
	"fmt"
	"net"
	"net/netip"
	"os"
	"regexp"
	"unsafe"

	"connectrpc.com/connect"
	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"

	agentv1 "dsec.dev/dsec/api/gen/dsec/agent/v1"
	"dsec.dev/dsec/internal/errdefs"
)

// minEntropy is the least a Reidentify must bring: a CRNG seed.
const minEntropy = 32

var machineIDPattern = regexp.MustCompile(`^[0-9a-f]{32}$`)

// Reidentify gives a microVM restored from a shared memory snapshot its
// own identity: entropy first (the CRNG reseeded from it), then the host
// name, machine-id, link-layer addresses and the network's address.
func (h *handler) Reidentify(ctx context.Context, req *connect.Request[agentv1.ReidentifyRequest]) (*connect.Response[agentv1.ReidentifyResponse], error) {
	h.touch()
	if err := h.reidentify(req.Msg); err != nil {
		return nil, errdefs.ToConnect(err)
	}
	return connect.NewResponse(&agentv1.ReidentifyResponse{}), nil
}

func (h *handler) reidentify(r *agentv1.ReidentifyRequest) error {
	if !h.cfg.Guest {
		return fmt.Errorf("reidentify: this agent is not a microVM's init: %w", errdefs.ErrFailedPrecondition)
	}
	if len(r.GetEntropy()) < minEntropy {
		return fmt.Errorf("reidentify: %d bytes of entropy, at least %d: %w", len(r.GetEntropy()), minEntropy, errdefs.ErrInvalidArgument)
	}
	if id := r.GetMachineId(); id != "" && !machineIDPattern.MatchString(id) {
		return fmt.Errorf("reidentify: machine-id %q: 32 lowercase hex digits: %w", id, errdefs.ErrInvalidArgument)
	}
	macs := map[string]net.HardwareAddr{}
	for old, mac := range r.GetMacs() {
		hw, err := net.ParseMAC(mac)
		if err != nil || len(hw) != 6 {
			return fmt.Errorf("reidentify: MAC %q: %w", mac, errdefs.ErrInvalidArgument)
		}
		oldHW, err := net.ParseMAC(old)
		if err != nil {
			return fmt.Errorf("reidentify: MAC %q: %w", old, errdefs.ErrInvalidArgument)
		}
		macs[oldHW.String()] = hw
	}
	var gn *guestNetwork
	if n := r.GetNetwork(); n != nil {
		var err error
		if gn, err = parseGuestNetwork(n); err != nil {
			return fmt.Errorf("reidentify: %w", err)
		}
	}
	if err := reseed(r.GetEntropy()); err != nil {
		return err
	}
	if len(macs) > 0 {
		if err := setMACs(macs); err != nil {
			return fmt.Errorf("reidentify: %w", err)
		}
	}
	addr := h.cfg.Address
	if gn != nil {
		if err := gn.apply(); err != nil {
			return fmt.Errorf("reidentify: %w", err)
		}
		addr = gn.addr.Addr().String()
	}
	if name := r.GetHostname(); name != "" || gn != nil {
		if name == "" {
			name = currentHostname()
		} else if err := unix.Sethostname([]byte(name)); err != nil {
			return fmt.Errorf("reidentify: set host name %q: %w", name, err)
		}
		if err := writeHostFiles(name, addr); err != nil {
			return fmt.Errorf("reidentify: %w", err)
		}
	}
	if id := r.GetMachineId(); id != "" {
		if err := os.MkdirAll("/etc", 0o755); err != nil {
			return fmt.Errorf("reidentify: %w", err)
		}
		if err := replaceFile("/etc/machine-id", id+"\n"); err != nil {
			return fmt.Errorf("reidentify: %w", err)
		}
	}
	return nil
}

// guestNetwork is a ReidentifyRequest's network, parsed.
type guestNetwork struct {
	mac     net.HardwareAddr
	addr    netip.Prefix
	gateway netip.Addr
}

func parseGuestNetwork(n *agentv1.GuestNetwork) (*guestNetwork, error) {
	var g guestNetwork
	var err error
	if g.mac, err = net.ParseMAC(n.GetMac()); err != nil || len(g.mac) != 6 {
		return nil, fmt.Errorf("network: MAC %q: %w", n.GetMac(), errdefs.ErrInvalidArgument)
	}
	if g.addr, err = netip.ParsePrefix(n.GetAddress()); err != nil || !g.addr.Addr().Is4() {
		return nil, fmt.Errorf("network: address %q: an IPv4 address/prefix: %w", n.GetAddress(), errdefs.ErrInvalidArgument)
	}
	if g.gateway, err = netip.ParseAddr(n.GetGateway()); err != nil || !g.gateway.Is4() {
		return nil, fmt.Errorf("network: gateway %q: an IPv4 address: %w", n.GetGateway(), errdefs.ErrInvalidArgument)
	}
	return &g, nil
}

// apply gives the interface with g's MAC g's address in place of its
// IPv4 ones, forgets its neighbours and routes the default via g's
// gateway. Other routes on the interface (to the nameserver) do not
// depend on the address and stay.
func (g *guestNetwork) apply() error {
	links, err := netlink.LinkList()
	if err != nil {
		return fmt.Errorf("set network: %w", err)
	}
	var link netlink.Link
	for _, l := range links {
		if l.Attrs().HardwareAddr.String() == g.mac.String() {
			link = l
		}
	}
	if link == nil {
		return fmt.Errorf("set network: no interface has MAC %s: %w", g.mac, errdefs.ErrNotFound)
	}
	name := link.Attrs().Name
	want := &net.IPNet{IP: g.addr.Addr().AsSlice(), Mask: net.CIDRMask(g.addr.Bits(), 32)}
	if err := netlink.AddrReplace(link, &netlink.Addr{IPNet: want}); err != nil {
		return fmt.Errorf("set network: add %s to %s: %w", g.addr, name, err)
	}
	addrs, err := netlink.AddrList(link, unix.AF_INET)
	if err != nil {
		return fmt.Errorf("set network: list the addresses of %s: %w", name, err)
	}
	for _, a := range addrs {
		if !a.IP.Equal(want.IP) {
			if err := netlink.AddrDel(link, &a); err != nil {
				return fmt.Errorf("set network: remove %s from %s: %w", a.IPNet, name, err)
			}
		}
	}
	neighs, err := netlink.NeighList(link.Attrs().Index, unix.AF_INET)
	if err != nil {
		return fmt.Errorf("set network: list the neighbours of %s: %w", name, err)
	}
	for _, n := range neighs {
		if err := netlink.NeighDel(&n); err != nil {
			return fmt.Errorf("set network: forget neighbour %s on %s: %w", n.IP, name, err)
		}
	}
	gw := &netlink.Route{LinkIndex: link.Attrs().Index, Gw: g.gateway.AsSlice(), Flags: int(netlink.FLAG_ONLINK)}
	if err := netlink.RouteReplace(gw); err != nil {
		return fmt.Errorf("set network: route the default via %s: %w", g.gateway, err)
	}
	return nil
}

// reseed adds entropy to the kernel's input pool, credited in full
// (RNDADDENTROPY), and reseeds the CRNG from the pool at once
// (RNDRESEEDCRNG): without the reseed the CRNG, a copy of the sibling's,
// would go on until its next scheduled reseed.
func reseed(entropy []byte) error {
	f, err := os.OpenFile("/dev/urandom", os.O_WRONLY, 0)
	if err != nil {
		return fmt.Errorf("reseed: %w", err)
	}
	defer f.Close()
	// struct rand_pool_info { int entropy_count; int buf_size; __u32 buf[]; }
	info := make([]byte, 8+len(entropy)+3)
	*(*int32)(unsafe.Pointer(&info[0])) = int32(8 * len(entropy))
	*(*int32)(unsafe.Pointer(&info[4])) = int32(len(entropy))
	copy(info[8:], entropy)
	if _, _, errno := unix.Syscall(unix.SYS_IOCTL, f.Fd(), unix.RNDADDENTROPY, uintptr(unsafe.Pointer(&info[0]))); errno != 0 {
		return fmt.Errorf("reseed: add entropy: %w", errno)
	}
	if _, _, errno := unix.Syscall(unix.SYS_IOCTL, f.Fd(), unix.RNDRESEEDCRNG, 0); errno != 0 {
		return fmt.Errorf("reseed: reseed the CRNG: %w", errno)
	}
	return nil
}

// setMACs gives each interface whose address is a key of macs that
// value; an address no interface has is an error (NotFound). An interface
// the driver cannot change while up is taken down for it and up again.
func setMACs(macs map[string]net.HardwareAddr) error {
	ifs, err := net.Interfaces()
	if err != nil {
		return fmt.Errorf("set MAC: %w", err)
	}
	done := 0
	for _, ifc := range ifs {
		mac, ok := macs[ifc.HardwareAddr.String()]
		if !ok || len(ifc.HardwareAddr) == 0 {
			continue
		}
		if err := setMAC(ifc, mac); err != nil {
			return err
		}
		done++
	}
	if done < len(macs) {
		return fmt.Errorf("set MAC: %d of %d addresses match no interface: %w", len(macs)-done, len(macs), errdefs.ErrNotFound)
	}
	return nil
}

func setMAC(ifc net.Interface, mac net.HardwareAddr) error {
	fd, err := unix.Socket(unix.AF_INET, unix.SOCK_DGRAM|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		return fmt.Errorf("set MAC of %s: %w", ifc.Name, err)
	}
	defer unix.Close(fd)
	// struct ifreq with ifr_hwaddr, a struct sockaddr.
	var req struct {
		name   [unix.IFNAMSIZ]byte
		family uint16
		data   [14]byte
		_      [8]byte
	}
	copy(req.name[:], ifc.Name)
	req.family = unix.ARPHRD_ETHER
	copy(req.data[:], mac)
	set := func() unix.Errno {
		_, _, errno := unix.Syscall(unix.SYS_IOCTL, uintptr(fd), unix.SIOCSIFHWADDR, uintptr(unsafe.Pointer(&req)))
		return errno
	}
	errno := set()
	if errno == unix.EBUSY && ifc.Flags&net.FlagUp != 0 {
		if err := setUp(fd, ifc.Name, false); err != nil {
			return err
		}
		errno = set()
		if err := setUp(fd, ifc.Name, true); err != nil {
			return err
		}
	}
	if errno != 0 {
		return fmt.Errorf("set MAC of %s to %s: %w", ifc.Name, mac, errno)
	}
	return nil
}

// setUp brings interface name up or down.
func setUp(fd int, name string, up bool) error {
	ifr, err := unix.NewIfreq(name)
	if err != nil {
		return fmt.Errorf("set %s up=%v: %w", name, up, err)
	}
	if err := unix.IoctlIfreq(fd, unix.SIOCGIFFLAGS, ifr); err != nil {
		return fmt.Errorf("read %s's flags: %w", name, err)
	}
	flags := ifr.Uint16()
	if up {
		flags |= unix.IFF_UP
	} else {
		flags &^= unix.IFF_UP
	}
	ifr.SetUint16(flags)
	if err := unix.IoctlIfreq(fd, unix.SIOCSIFFLAGS, ifr); err != nil {
		return fmt.Errorf("set %s up=%v: %w", name, up, err)
	}
	return nil
}

package guest

import (
	"fmt"
	"net"
	"net/netip"
	"strings"
)

// Network is the guest's interface as the host wired it (package vmnet
// gives these as flags): the sandbox's address and its veth's MAC and MTU,
// a default route to the gateway, and nameservers, both on-link.
type Network struct {
	MAC         net.HardwareAddr
	Addr        netip.Prefix
	Gateway     netip.Addr
	MTU         int
	Nameservers []netip.Addr
}

// ParseNetwork reads guest mode's --net-* flags; a zero mac means the
// guest has no network (loopback only).
func ParseNetwork(mac, addr, gateway string, mtu int, nameservers []string) (*Network, error) {
	if mac == "" {
		return nil, nil
	}
	var n Network
	var err error
	if n.MAC, err = net.ParseMAC(mac); err != nil {
		return nil, fmt.Errorf("parse --net-mac: %w", err)
	}
	if n.Addr, err = netip.ParsePrefix(addr); err != nil || !n.Addr.Addr().Is4() {
		return nil, fmt.Errorf("parse --net-addr %q: an IPv4 address/prefix", addr)
	}
	if n.Gateway, err = netip.ParseAddr(gateway); err != nil || !n.Gateway.Is4() {
		return nil, fmt.Errorf("parse --net-gateway %q: an IPv4 address", gateway)
	}
	if mtu < 68 || mtu > 65535 {
		return nil, fmt.Errorf("parse --net-mtu %d: 68 to 65535", mtu)
	}
	n.MTU = mtu
	for _, s := range nameservers {
		a, err := netip.ParseAddr(s)
		if err != nil || !a.Is4() {
			return nil, fmt.Errorf("parse --net-dns %q: an IPv4 address", s)
		}
		n.Nameservers = append(n.Nameservers, a)
	}
	return &n, nil
}

// resolvConf is the guest's /etc/resolv.conf, with the options the edge
// gives a container's.
func (n *Network) resolvConf() string {
	var b strings.Builder
	for _, a := range n.Nameservers {
		fmt.Fprintf(&b, "nameserver %s\n", a)
	}
	b.WriteString("options timeout:2 attempts:2\n")
	return b.String()
}

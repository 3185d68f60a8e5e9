package guest

import (
	"bytes"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"time"

	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"
)

// upLoopback brings lo up: every sandbox has loopback, with or without a
// network.
func upLoopback() error {
	lo, err := netlink.LinkByName("lo")
	if err != nil {
		return fmt.Errorf("find lo: %w", err)
	}
	if err := netlink.LinkSetUp(lo); err != nil {
		return fmt.Errorf("set lo up: %w", err)
	}
	return nil
}

// configure gives the interface with n's MAC (waiting for its driver up
// to wait) n's address, MTU and routes, and returns its name.
func (n *Network) configure(wait time.Duration) (string, error) {
	link, err := linkByMAC(n.MAC, wait)
	if err != nil {
		return "", err
	}
	name := link.Attrs().Name
	if err := netlink.LinkSetMTU(link, n.MTU); err != nil {
		return "", fmt.Errorf("set the MTU of %s: %w", name, err)
	}
	addr := &net.IPNet{IP: n.Addr.Addr().AsSlice(), Mask: net.CIDRMask(n.Addr.Bits(), 32)}
	if err := netlink.AddrReplace(link, &netlink.Addr{IPNet: addr}); err != nil {
		return "", fmt.Errorf("add %s to %s: %w", n.Addr, name, err)
	}
	if err := netlink.LinkSetUp(link); err != nil {
		return "", fmt.Errorf("set %s up: %w", name, err)
	}
	idx := link.Attrs().Index
	for _, a := range n.Nameservers {
		if n.Addr.Contains(a) {
			continue
		}
		dst := &net.IPNet{IP: a.AsSlice(), Mask: net.CIDRMask(32, 32)}
		if err := netlink.RouteReplace(&netlink.Route{LinkIndex: idx, Dst: dst, Scope: netlink.SCOPE_LINK}); err != nil {
			return "", fmt.Errorf("route to nameserver %s: %w", a, err)
		}
	}
	if err := netlink.RouteReplace(&netlink.Route{LinkIndex: idx, Gw: n.Gateway.AsSlice(), Flags: int(netlink.FLAG_ONLINK)}); err != nil {
		return "", fmt.Errorf("add the default route via %s: %w", n.Gateway, err)
	}
	return name, nil
}

// linkByMAC waits for the interface whose MAC is mac: the host's card,
// which virtio_net makes as it loads.
func linkByMAC(mac net.HardwareAddr, wait time.Duration) (netlink.Link, error) {
	deadline := time.Now().Add(wait)
	for {
		links, err := netlink.LinkList()
		if err == nil {
			for _, l := range links {
				if bytes.Equal(l.Attrs().HardwareAddr, mac) {
					return l, nil
				}
			}
		}
		if time.Now().After(deadline) {
			return nil, fmt.Errorf("find the network card %s: no interface has that MAC after %s (%d links, %v)", mac, wait, len(links), err)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// writeResolvConf writes n's /etc/resolv.conf in the root, replacing
// (not following) what the image has there: often a symlink into /run.
func (n *Network) writeResolvConf() error {
	if err := os.MkdirAll("/etc", 0o755); err != nil {
		return fmt.Errorf("write /etc/resolv.conf: %w", err)
	}
	tmp := filepath.Join("/etc", ".dsec-resolv.conf")
	os.Remove(tmp)
	if err := os.WriteFile(tmp, []byte(n.resolvConf()), 0o644); err != nil {
		return fmt.Errorf("write /etc/resolv.conf: %w", err)
	}
	if err := unix.Rename(tmp, "/etc/resolv.conf"); err != nil {
		os.Remove(tmp)
		return fmt.Errorf("write /etc/resolv.conf: %w", err)
	}
	return nil
}

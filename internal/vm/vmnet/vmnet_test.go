package vmnet

import (
	"flag"
	"net"
	"net/netip"
	"strings"
	"testing"

	"dsec.dev/dsec/internal/agent/guest"
)

// The flags Args renders are the ones guest mode parses, and they say the
// same network back.
func TestGuestArgs(t *testing.T) {
	g := Guest{
		MAC: net.HardwareAddr{0x02, 0x42, 0, 0, 0, 7}, Addr: netip.MustParsePrefix("10.213.0.7/32"),
		Gateway: netip.MustParseAddr("10.213.0.1"), MTU: 1500, Nameservers: []netip.Addr{DNSAddr},
	}
	fs := flag.NewFlagSet("guest", flag.ContinueOnError)
	mac := fs.String("net-mac", "", "")
	addr := fs.String("net-addr", "", "")
	gw := fs.String("net-gateway", "", "")
	mtu := fs.Int("net-mtu", 0, "")
	var dns []string
	fs.Func("net-dns", "", func(v string) error { dns = append(dns, v); return nil })
	if err := fs.Parse(g.Args()); err != nil {
		t.Fatalf("parse %q: %v", g.Args(), err)
	}
	n, err := guest.ParseNetwork(*mac, *addr, *gw, *mtu, dns)
	if err != nil {
		t.Fatal(err)
	}
	if n.MAC.String() != g.MAC.String() || n.Addr != g.Addr || n.Gateway != g.Gateway || n.MTU != g.MTU || len(n.Nameservers) != 1 || n.Nameservers[0] != DNSAddr {
		t.Errorf("guest mode read %+v from %q", n, strings.Join(g.Args(), " "))
	}
	for _, bad := range [][]string{
		{"02:42:00:00:00:07", "10.213.0.7", "10.213.0.1"}, // no prefix
		{"02:42:00:00:00:07", "10.213.0.7/32", "fe80::1"}, // IPv6 gateway
		{"not-a-mac", "10.213.0.7/32", "10.213.0.1"},      // bad MAC
	} {
		if _, err := guest.ParseNetwork(bad[0], bad[1], bad[2], 1500, nil); err == nil {
			t.Errorf("ParseNetwork(%q) accepted", bad)
		}
	}
	if n, err := guest.ParseNetwork("", "", "", 1500, nil); n != nil || err != nil {
		t.Errorf("no --net-mac: %+v, %v; want no network", n, err)
	}
}

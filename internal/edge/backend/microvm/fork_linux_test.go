package microvm

import (
	"net"
	"net/netip"
	"testing"

	"dsec.dev/dsec/internal/edge/backend"
	"dsec.dev/dsec/internal/vm/qemu"
	"dsec.dev/dsec/internal/vm/vmnet"
)

func TestUseLayers(t *testing.T) {
	cfg := qemu.Config{Drives: []qemu.Drive{
		{Path: "/parent/l0", ReadOnly: true}, {Path: "/parent/l1", ReadOnly: true}, {Path: "/child/upper.ext4", Serial: upperSerial},
	}}
	if err := useLayers(&cfg, []backend.Layer{{File: "/child/l0"}, {File: "/child/l1"}}); err != nil {
		t.Fatal(err)
	}
	if cfg.Drives[0].Path != "/child/l0" || cfg.Drives[1].Path != "/child/l1" || cfg.Drives[2].Path != "/child/upper.ext4" {
		t.Errorf("drives after useLayers: %+v", cfg.Drives)
	}
	for _, n := range []int{1, 3} {
		ls := make([]backend.Layer, n)
		if err := useLayers(&cfg, ls); err == nil {
			t.Errorf("useLayers with %d layers for a VM of 2: no error", n)
		}
	}
}

func TestReidentifyRequest(t *testing.T) {
	oldMAC, _ := net.ParseMAC("52:54:00:00:00:01")
	newMAC, _ := net.ParseMAC("52:54:00:00:00:02")
	link := &vmnet.Link{Guest: vmnet.Guest{MAC: newMAC, Addr: netip.MustParsePrefix("10.213.0.7/32"), Gateway: netip.MustParseAddr("10.213.0.1")}}
	a, err := reidentifyRequest("sb-x", &qemu.NIC{MAC: oldMAC}, link)
	if err != nil {
		t.Fatal(err)
	}
	b, err := reidentifyRequest("sb-y", nil, nil)
	if err != nil {
		t.Fatal(err)
	}
	if a.GetHostname() != "sb-x" || len(a.GetEntropy()) < 32 || len(a.GetMachineId()) != 32 {
		t.Errorf("request: %v", a)
	}
	if string(a.GetEntropy()) == string(b.GetEntropy()) || a.GetMachineId() == b.GetMachineId() {
		t.Error("two requests share their entropy or machine-id")
	}
	if a.GetMacs()[oldMAC.String()] != newMAC.String() || a.GetNetwork().GetAddress() != "10.213.0.7/32" ||
		a.GetNetwork().GetGateway() != "10.213.0.1" || a.GetNetwork().GetMac() != newMAC.String() {
		t.Errorf("the network of the request: %v, %v", a.GetMacs(), a.GetNetwork())
	}
	if b.GetNetwork() != nil || len(b.GetMacs()) != 0 {
		t.Errorf("a request without a network: %v", b)
	}
}

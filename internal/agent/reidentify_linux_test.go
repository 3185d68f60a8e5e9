package agent

import (
	"errors"
	"testing"

	agentv1 "dsec.dev/dsec/api/gen/dsec/agent/v1"
	"dsec.dev/dsec/internal/errdefs"
)

func TestParseGuestNetwork(t *testing.T) {
	for _, tc := range []struct {
		name string
		in   *agentv1.GuestNetwork
		ok   bool
	}{
		{"good", &agentv1.GuestNetwork{Mac: "52:54:00:12:34:56", Address: "10.213.0.5/32", Gateway: "10.213.0.1"}, true},
		{"no mac", &agentv1.GuestNetwork{Address: "10.213.0.5/32", Gateway: "10.213.0.1"}, false},
		{"long mac", &agentv1.GuestNetwork{Mac: "52:54:00:12:34:56:78:9a", Address: "10.213.0.5/32", Gateway: "10.213.0.1"}, false},
		{"no prefix", &agentv1.GuestNetwork{Mac: "52:54:00:12:34:56", Address: "10.213.0.5", Gateway: "10.213.0.1"}, false},
		{"ipv6 address", &agentv1.GuestNetwork{Mac: "52:54:00:12:34:56", Address: "fd00::5/128", Gateway: "10.213.0.1"}, false},
		{"no gateway", &agentv1.GuestNetwork{Mac: "52:54:00:12:34:56", Address: "10.213.0.5/32"}, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			g, err := parseGuestNetwork(tc.in)
			if tc.ok {
				if err != nil || g.addr.String() != tc.in.GetAddress() || g.gateway.String() != tc.in.GetGateway() || g.mac.String() != tc.in.GetMac() {
					t.Fatalf("parse %v: %+v, %v", tc.in, g, err)
				}
				return
			}
			if !errors.Is(err, errdefs.ErrInvalidArgument) {
				t.Fatalf("parse %v: %v, want invalid argument", tc.in, err)
			}
		})
	}
}

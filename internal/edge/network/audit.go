package network

import (
	"encoding/binary"
	"net/netip"
	"strings"
)

// logPrefix is the NFLOG prefix of a verdict: "dsec:A:<rule>" or
// "dsec:D:<rule>", cut to fit the kernel's 127 bytes.
func logPrefix(allow bool, rule string) string {
	v := "D"
	if allow {
		v = "A"
	}
	p := "dsec:" + v + ":" + rule
	if len(p) > 120 {
		p = p[:120]
	}
	return p
}

// parsePrefix splits "dsec:A:<rule>" into verdict and rule.
func parsePrefix(p string) (verdict, rule string, ok bool) {
	rest, ok := strings.CutPrefix(p, "dsec:")
	if !ok || len(rest) < 2 || rest[1] != ':' {
		return "", "", false
	}
	switch rest[0] {
	case 'A':
		verdict = "allow"
	case 'D':
		verdict = "deny"
	default:
		return "", "", false
	}
	return verdict, rest[2:], true
}

type packetInfo struct {
	src, dst netip.Addr
	proto    uint8
	dport    uint16
}

func parseIPv4(b []byte) (packetInfo, bool) {
	if len(b) < 20 || b[0]>>4 != 4 {
		return packetInfo{}, false
	}
	ihl := int(b[0]&0x0f) * 4
	p := packetInfo{
		src:   netip.AddrFrom4([4]byte(b[12:16])),
		dst:   netip.AddrFrom4([4]byte(b[16:20])),
		proto: b[9],
	}
	if (p.proto == protoTCP || p.proto == protoUDP) && len(b) >= ihl+4 {
		p.dport = binary.BigEndian.Uint16(b[ihl+2 : ihl+4])
	}
	return p, true
}

package container

import (
	"bufio"
	"bytes"
	"fmt"
	"net/netip"
	"os"
	"path/filepath"
	"strings"

	"dsec.dev/dsec/internal/edge/backend"
	"dsec.dev/dsec/internal/vm/vmnet"
)

// gvisorDNS prepares the DNS of gVisor sandbox s when its resolv.conf
// names a resolver on the namespace's loopback (the edge's, on
// 127.0.0.53): under runsc that address is the sentry's own loopback, so
// the sandbox gets a resolv.conf of its own in bundle naming
// vmnet.DNSAddr instead, and the caller wires the namespace with
// vmnet.AttachSentry once runsc has started. It returns the resolv.conf to
// mount and whether to wire; any other resolv.conf is the spec's.
func gvisorDNS(s backend.Spec, bundle string) (resolv string, sentry *vmnet.Sentry, err error) {
	if s.NetnsPath == "" || s.ResolvConf == "" {
		return s.ResolvConf, nil, nil
	}
	b, err := os.ReadFile(s.ResolvConf)
	if err != nil {
		return "", nil, fmt.Errorf("read resolv.conf %s: %w", s.ResolvConf, err)
	}
	out, ok := loopbackNameservers(b)
	if !ok {
		return s.ResolvConf, nil, nil
	}
	sn, err := vmnet.ReadSentry(s.NetnsPath)
	if err != nil {
		return "", nil, err
	}
	resolv = filepath.Join(bundle, "resolv.conf")
	if err := os.WriteFile(resolv, out, 0o644); err != nil {
		return "", nil, fmt.Errorf("write the gVisor sandbox's resolv.conf: %w", err)
	}
	return resolv, &sn, nil
}

// loopbackNameservers returns resolv.conf b with its loopback nameservers
// replaced by vmnet.DNSAddr (once), and whether it had any.
func loopbackNameservers(b []byte) ([]byte, bool) {
	var out bytes.Buffer
	found := false
	sc := bufio.NewScanner(bytes.NewReader(b))
	for sc.Scan() {
		line := sc.Text()
		if f := strings.Fields(line); len(f) >= 2 && f[0] == "nameserver" {
			if a, err := netip.ParseAddr(f[1]); err == nil && a.IsLoopback() {
				if !found {
					fmt.Fprintf(&out, "nameserver %s\n", vmnet.DNSAddr)
				}
				found = true
				continue
			}
		}
		out.WriteString(line + "\n")
	}
	return out.Bytes(), found
}

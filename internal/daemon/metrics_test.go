package daemon

import (
	"net"
	"strings"
	"testing"
)

// TestListenMetrics: --metrics-listen is bound before the daemon is ready:
// a taken address is an error that names the flag and the address, not a
// warning behind a node nobody can scrape; "none" and "" ask for no port.
func TestListenMetrics(t *testing.T) {
	taken, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer taken.Close()
	addr := taken.Addr().String()
	if _, err := listenMetrics(addr); err == nil || !strings.Contains(err.Error(), "--metrics-listen") || !strings.Contains(err.Error(), addr) {
		t.Errorf("a taken address: %v", err)
	}
	ln, err := listenMetrics("127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	ln.Close()
	for addr, want := range map[string]bool{"": false, "none": false, "127.0.0.1:9101": true} {
		if got := metricsOn(addr); got != want {
			t.Errorf("metricsOn(%q) = %v", addr, got)
		}
	}
}

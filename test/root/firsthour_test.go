package root

import (
	"context"
	"os"
	"strings"
	"testing"
	"time"

	"connectrpc.com/connect"

	dsecv1 "dsec.dev/dsec/api/gen/dsec/v1"
	"dsec.dev/dsec/internal/testutil"
)

// copyIn writes a host file into a sandbox with the given mode.
func copyIn(t *testing.T, d *testutil.Daemon, id, hostPath, path string, mode uint32) {
	t.Helper()
	data, err := os.ReadFile(hostPath)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	if _, err := d.Clients.Sandboxes.WriteFile(ctx, connect.NewRequest(&dsecv1.WriteFileRequest{
		SandboxId: id, Path: path, Data: data, Mode: mode, MakeParents: true})); err != nil {
		t.Fatalf("write %s into %s: %v", path, id, err)
	}
}

// TestHostFiles: a sandbox whose image has no /etc/hosts (the busybox base
// has none) still resolves localhost and its own host name, as a Docker
// container does, so test suites that serve on localhost and dial it pass.
func TestHostFiles(t *testing.T) {
	d := startDaemon(t)
	probe := netprobeBinary(t)

	for _, tc := range []struct {
		name, hostname string
	}{
		{"default host name", ""},
		{"host name asked for", "box-1"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			sb := create(t, d, &dsecv1.SandboxSpec{Hostname: tc.hostname})
			copyIn(t, d, sb.GetId(), probe, "/usr/local/bin/netprobe", 0o755)
			want := tc.hostname
			if want == "" {
				want = sb.GetId()
			}
			if got := strings.TrimSpace(mustSh(t, d, sb.GetId(), "hostname")); got != want {
				t.Fatalf("hostname = %q, want %q", got, want)
			}
			if got := mustSh(t, d, sb.GetId(), "cat /etc/hostname"); got != want+"\n" {
				t.Errorf("/etc/hostname = %q, want %q", got, want+"\n")
			}
			hosts := mustSh(t, d, sb.GetId(), "cat /etc/hosts")
			for _, line := range []string{"127.0.0.1\tlocalhost\n", "::1\tlocalhost ip6-localhost ip6-loopback\n", "127.0.1.1\t" + want + "\n"} {
				if !strings.Contains(hosts, line) {
					t.Errorf("/etc/hosts lacks %q:\n%s", line, hosts)
				}
			}
			if r := sh(t, d, sb.GetId(), "netprobe self localhost"); r.exit.GetStatus() != dsecv1.ExitStatus_EXIT_STATUS_OK ||
				!strings.HasPrefix(r.stdout, "connected to ") {
				t.Errorf("dial localhost:PORT from a program listening on loopback: %s", r)
			}
			if got := strings.TrimSpace(mustSh(t, d, sb.GetId(), "netprobe resolve "+want)); got != "127.0.1.1" {
				t.Errorf("the sandbox's own host name resolves to %q, want 127.0.1.1", got)
			}
			// The sandbox owns the files: a test may add names of its own.
			mustSh(t, d, sb.GetId(), "echo '127.0.0.1 db.internal' >> /etc/hosts")
			if r := sh(t, d, sb.GetId(), "netprobe self db.internal"); r.exit.GetStatus() != dsecv1.ExitStatus_EXIT_STATUS_OK {
				t.Errorf("dial a name added to /etc/hosts: %s", r)
			}
		})
	}
}

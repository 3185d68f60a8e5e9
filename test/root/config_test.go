package root

import (
	"context"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	"dsec.dev/dsec/internal/testutil"
	dsec "dsec.dev/dsec/sdk/go"
)

// TestConfigFile (both passes): a dsecd — the cluster's edge in the
// cluster pass — started with --config FILE runs with the file's
// settings and a flag's over them; a file with a key no role has stops
// it before it starts, naming the line and the key.
func TestConfigFile(t *testing.T) {
	dir := t.TempDir()
	path := filepath.Join(dir, "dsecd.yaml")
	if err := os.WriteFile(path, []byte("limits:\n  max_sandboxes: 7\n  max_cpus: 1\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	d := testutil.StartDaemon(t, "--config", path, "--max-cpus", "1.5")
	c := sdkClient(t, d.Addr, d.Token())
	ctx := context.Background()
	nodes, err := c.Nodes(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if len(nodes) != 1 || nodes[0].MaxSandboxes != 7 {
		t.Errorf("nodes %+v: want one admitting the file's 7 sandboxes", nodes)
	}
	// The flag's 1.5 cores, over the file's 1: a create asking for 2 is
	// refused before anything starts.
	_, err = c.Create(ctx, "base:latest", &dsec.CreateOptions{CPUs: 2})
	if err == nil || !strings.Contains(err.Error(), "limit of 1.50") {
		t.Errorf("a create of 2 cores: %v, want refused at the limit of 1.50", err)
	}

	bad := filepath.Join(dir, "bad.toml")
	if err := os.WriteFile(bad, []byte("root = \"/nowhere\"\n[limits]\nmax_sandbox = 7\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	out, err := exec.Command(filepath.Join(d.Bin, "dsecd"), "--config", bad).CombinedOutput()
	if code := exitCode(err); code != 2 || !strings.Contains(string(out), `bad.toml:3: unknown key "limits.max_sandbox"`) {
		t.Errorf("dsecd --config with an unknown key: exit %d, %s", code, out)
	}
}

// exitCode is a finished command's exit code (-1 when it did not run).
func exitCode(err error) int {
	if err == nil {
		return 0
	}
	if ee, ok := err.(*exec.ExitError); ok {
		return ee.ExitCode()
	}
	return -1
}

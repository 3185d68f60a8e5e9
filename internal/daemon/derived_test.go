package daemon

import (
	"encoding/json"
	"os"
	"path/filepath"
	"testing"

	"dsec.dev/dsec/internal/edge/claims"
)

// TestDerivedHostNames: dsecd config print --root R notes the host names
// R was first started with, where its sandboxes' cgroups and veths are,
// and the all-in-one's socket under R; a root never started notes no
// host names.
func TestDerivedHostNames(t *testing.T) {
	root := t.TempDir()
	if _, ok := Derived(root)["cgroup_parent"]; ok {
		t.Error("a root never started notes a cgroup parent")
	}
	names := claims.Defaults(2)
	b, err := json.Marshal(names)
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(root, claims.File), b, 0o644); err != nil {
		t.Fatal(err)
	}
	d := Derived(root)
	for key, want := range map[string]string{
		"cgroup_parent":     names.CgroupParent,
		"network.nft_table": names.Table,
		"network.pool":      names.Pool.String(),
		"socket":            filepath.Join(root, "dsecd.sock"),
	} {
		if d[key] != want {
			t.Errorf("%s: noted %q, want %q", key, d[key], want)
		}
	}
	if d["runsc"] == "" {
		t.Error("runsc: noted nothing")
	}
}

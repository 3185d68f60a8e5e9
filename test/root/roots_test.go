package root

import (
	"context"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	dsecv1 "dsec.dev/dsec/api/gen/dsec/v1"
	"dsec.dev/dsec/internal/edge/claims"
	"dsec.dev/dsec/internal/testutil"
)

// TestTwoRoots: two dsecds on different roots of one host, both left to
// the defaults, take different host names (nftables table, veth prefix,
// NFLOG group, address pool, cgroup parent); tearing one root down removes
// its own and leaves the other's network, cgroups and sandboxes alone; a
// third asking for a name the first holds is refused, naming that root.
func TestTwoRoots(t *testing.T) {
	a := startDaemon(t)
	b := startDaemon(t)
	na, nb := a.HostNames(), b.HostNames()
	if na.Table == nb.Table || na.VethPrefix == nb.VethPrefix || na.LogGroup == nb.LogGroup ||
		na.Pool.Overlaps(nb.Pool) || na.CgroupParent == nb.CgroupParent {
		t.Fatalf("two roots share host names: %+v and %+v", na, nb)
	}
	// A sandbox with network rules on each: a veth, a chain in its node's
	// table, cgroups under its node's parent. The rule allows one test
	// address no packet is sent to.
	rules := map[string]bool{"198.18.7.1/32": true}
	sa := create(t, a, &dsecv1.SandboxSpec{NetworkRules: rules})
	create(t, b, &dsecv1.SandboxSpec{NetworkRules: rules})

	b.Kill()
	if out, err := exec.Command(filepath.Join(b.Bin, "dsecd"), "teardown", "--root", b.Root).CombinedOutput(); err != nil {
		t.Fatalf("dsecd teardown of the second root: %v\n%s", err, out)
	}
	if err := exec.Command("nft", "list", "table", "inet", nb.Table).Run(); err == nil {
		t.Errorf("the second root's nftables table %s outlived its teardown", nb.Table)
	}
	if _, ok, err := claims.Recall(b.Root); ok || err != nil {
		t.Errorf("the second root still remembers host names after its teardown (%v)", err)
	}
	// The first root's node is whole.
	if out, err := exec.Command("nft", "list", "table", "inet", na.Table).CombinedOutput(); err != nil {
		t.Errorf("the first root's table %s is gone: %v %s", na.Table, err, out)
	}
	for _, ctrl := range []string{"memory", "pids", "freezer"} {
		if _, err := os.Stat(filepath.Join("/sys/fs/cgroup", ctrl, na.CgroupParent, sa.GetId())); err != nil {
			t.Errorf("the first root's sandbox lost its %s cgroup: %v", ctrl, err)
		}
	}
	mustSh(t, a, sa.GetId(), "true")
	create(t, a, &dsecv1.SandboxSpec{NetworkRules: rules})

	// A name the first root holds, asked for on a third root, refuses the
	// start and names the holder.
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	third := t.TempDir()
	out, err := exec.CommandContext(ctx, filepath.Join(a.Bin, "dsecd"), "--root", third, "--listen", "none",
		"--sandboxfusion-listen", "none", "--nft-table", na.Table).CombinedOutput()
	if err == nil || !strings.Contains(string(out), "is used by the dsecd of root "+a.Root) {
		t.Errorf("a third root asking for table %s: %v\n%s", na.Table, err, out)
	}
	if _, ok, _ := claims.Recall(third); ok {
		t.Error("the refused root remembers host names")
	}

	// The ready line says how to reach this dsecd from another shell.
	if !testutil.ClusterMode() {
		want := `clients="export DSEC_ADDR=` + a.Addr + ` DSEC_TOKEN_FILE=` + a.TokenFile() + `"`
		if log := a.Log(); !strings.Contains(log, want) || !strings.Contains(log, "token_file="+a.TokenFile()) {
			t.Errorf("the ready line lacks %s:\n%s", want, log)
		}
	}
}

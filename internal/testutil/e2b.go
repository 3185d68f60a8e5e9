package testutil

import (
	"os"
	"path/filepath"
	"testing"
)

// E2BBaseEnv is the environment E2B's base and code-interpreter templates
// map to (internal/e2b DefaultTemplates).
const E2BBaseEnv = "e2b-base"

// E2BBaseTree is the e2b-base environment's tree, built by
// scripts/build-e2b-base.sh: $DSEC_E2B_BASE_TREE, else the script's
// default /var/cache/dsec/e2b-base. CI builds it before the suite; a test
// without it skips, or fails under DSEC_TEST_ROOT=1.
func E2BBaseTree(t testing.TB) string {
	t.Helper()
	tree := os.Getenv("DSEC_E2B_BASE_TREE")
	if tree == "" {
		tree = "/var/cache/dsec/e2b-base"
	}
	Require(t, fileExists(filepath.Join(tree, "etc", "dsec-e2b-base")),
		"the e2b-base environment is not built at "+tree+" (scripts/build-e2b-base.sh "+tree+", or set DSEC_E2B_BASE_TREE)")
	return tree
}

// ImportE2BBase imports the e2b-base tree (E2BBaseTree) into the daemon as
// the environment e2b-base.
func (d *Daemon) ImportE2BBase() {
	d.t.Helper()
	tree := E2BBaseTree(d.t)
	if out, errOut, code := d.CLI("", "layer", "import", "--kind", "base", "--allow-setuid", E2BBaseEnv+":latest", tree); code != 0 {
		d.t.Fatalf("import the e2b-base environment: %s %s", out, errOut)
	}
}

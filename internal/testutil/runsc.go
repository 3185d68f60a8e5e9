package testutil

import (
	"os"
	"testing"
)

// Runsc is the gVisor runsc binary the tests run sandboxes under
// ($DSEC_RUNSC, built by scripts/build-runsc.sh); without it the test
// skips, or fails under Strict.
func Runsc(t testing.TB) string {
	t.Helper()
	path := os.Getenv("DSEC_RUNSC")
	Require(t, path != "", "DSEC_RUNSC is not set (scripts/build-runsc.sh builds runsc)")
	fi, err := os.Stat(path)
	Require(t, err == nil && fi.Mode().IsRegular() && fi.Mode()&0o111 != 0,
		"no runsc at DSEC_RUNSC="+path+" (run scripts/build-runsc.sh)")
	return path
}

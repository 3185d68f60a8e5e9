// Package testutil holds helpers shared by dsec's tests: gating on root and
// kernel features, finding the binaries and test layers the suites use,
// starting a test daemon, and throwaway PostgreSQL clusters.
package testutil

import (
	"io/fs"
	"os"
	"os/exec"
	"path/filepath"
	"sort"
	"strings"
	"testing"
)

// Strict reports whether CI asked for every root and kernel test to run
// (DSEC_TEST_ROOT=1). Under it a missing requirement fails instead of skipping.
func Strict() bool { return os.Getenv("DSEC_TEST_ROOT") == "1" }

// Require skips t with reason when ok is false, or fails it under Strict.
func Require(t testing.TB, ok bool, reason string) {
	t.Helper()
	if ok {
		return
	}
	if Strict() {
		t.Fatalf("DSEC_TEST_ROOT=1 but %s", reason)
	}
	t.Skipf("skipping: %s (set DSEC_TEST_ROOT=1 to make this a failure)", reason)
}

// RequireRoot skips (or fails under Strict) unless the test runs as root.
func RequireRoot(t testing.TB) {
	t.Helper()
	Require(t, os.Geteuid() == 0, "test needs root")
}

// RequireCommand skips (or fails under Strict) unless name is on PATH, and
// returns its path.
func RequireCommand(t testing.TB, name string) string {
	t.Helper()
	p, err := exec.LookPath(name)
	Require(t, err == nil, name+" is not installed")
	return p
}

// TreeSnapshot lists every path under dir with its mode and mtime, one per
// line, sorted: two snapshots differ when anything under dir was added,
// removed, retyped or written.
func TreeSnapshot(t testing.TB, dir string) string {
	t.Helper()
	var lines []string
	err := filepath.Walk(dir, func(p string, fi os.FileInfo, err error) error {
		if err != nil {
			return err
		}
		lines = append(lines, p+" "+fi.Mode().String()+" "+fi.ModTime().String())
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	sort.Strings(lines)
	return strings.Join(lines, "\n")
}

// CheckListable fails t for every entry under dir that readdir lists but
// lstat cannot find, which is how a whiteout that hides nothing shows
// through overlayfs.
func CheckListable(t testing.TB, dir string) {
	t.Helper()
	err := filepath.WalkDir(dir, func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			t.Errorf("walk %s: %v", p, err)
			return nil
		}
		if _, err := os.Lstat(p); err != nil {
			t.Errorf("%s is listed but: %v", p, err)
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
}

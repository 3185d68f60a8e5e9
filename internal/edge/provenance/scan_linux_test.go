package provenance

import (
	"os"
	"path/filepath"
	"slices"
	"testing"

	"golang.org/x/sys/unix"

	dsecv1 "dsec.dev/dsec/api/gen/dsec/v1"
	"dsec.dev/dsec/internal/testutil"
)

func write(t *testing.T, root, rel, data string) {
	t.Helper()
	p := filepath.Join(root, rel)
	if err := os.MkdirAll(filepath.Dir(p), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(p, []byte(data), 0o644); err != nil {
		t.Fatal(err)
	}
}

const dpkgBefore = "Package: bash\nStatus: install ok installed\nVersion: 5.2\n\nPackage: curl\nStatus: install ok installed\nVersion: 7.88\n\n"
const dpkgAfter = "Package: bash\nStatus: install ok installed\nVersion: 5.2\n\nPackage: curl\nStatus: install ok installed\nVersion: 8.0\n\nPackage: jq\nStatus: install ok installed\nVersion: 1.6\n\n"

// TestScan: a writable layer against its layer below, each kind of change
// classified: created, modified and removed files (a whiteout, made as
// overlayfs makes one), what replaces or shadows a tool, what touches the
// tests (and what a test run writes, which does not), dpkg's and pip's
// installs, the workspace count, a baseline's entries left out.
func TestScan(t *testing.T) {
	testutil.RequireRoot(t) // a whiteout is a 0/0 character device
	dir := t.TempDir()
	lower, upper := filepath.Join(dir, "lower"), filepath.Join(dir, "upper")
	for _, f := range []string{"usr/bin/python3", "usr/bin/pytest", "work/sol.py", "work/tests/test_a.py",
		"usr/lib/python3/dist-packages/_pytest/main.py", "usr/lib/python3.11/json/__init__.py", "etc/motd",
		"etc/python3.11/sitecustomize.py"} {
		write(t, lower, f, "old\n")
	}
	write(t, lower, "var/lib/dpkg/status", dpkgBefore)
	if err := os.MkdirAll(upper, 0o755); err != nil {
		t.Fatal(err)
	}
	write(t, upper, "etc/hostname", "sb\n")
	base, err := TakeBaseline(upper)
	if err != nil {
		t.Fatal(err)
	}
	write(t, upper, "work/sol.py", "new\n")
	write(t, upper, "work/tests/__pycache__/test_a.cpython-311.pyc", "x")
	write(t, upper, "work/conftest.py", "x")
	write(t, upper, "usr/bin/pytest", "#!/bin/sh\n")
	write(t, upper, "usr/local/bin/python3", "#!/bin/sh\n")
	write(t, upper, "usr/local/bin/mytool", "#!/bin/sh\n")
	write(t, upper, "usr/lib/python3/dist-packages/_pytest/main.py", "x")
	write(t, upper, "usr/lib/python3.11/json/__init__.py", "x")
	// Debian's /usr/lib/python3.11/sitecustomize.py links here: a write
	// through the link.
	write(t, upper, "etc/python3.11/sitecustomize.py", "import sys; sys.exit(0)\n")
	write(t, upper, "usr/local/lib/python3.11/dist-packages/requests-2.31.0.dist-info/METADATA", "x")
	write(t, upper, "var/lib/dpkg/status", dpkgAfter)
	if err := unix.Mknod(filepath.Join(upper, "etc/motd"), unix.S_IFCHR, 0); err != nil {
		t.Fatal(err)
	}
	paths := &dsecv1.ProvenancePaths{Workspace: []string{"/work"}, Tests: []string{"/work/tests"}}
	res, err := Scan(upper, ScanOptions{Lower: []string{lower}, Paths: paths, ListFiles: true, Baseline: base})
	if err != nil {
		t.Fatal(err)
	}
	changes := map[string]string{}
	for _, f := range res.Files {
		changes[f.GetPath()] = f.GetChange()
	}
	for p, want := range map[string]string{"/work/sol.py": Modified, "/work/conftest.py": Created, "/etc/motd": Removed,
		"/usr/bin/pytest": Modified, "/usr/local/bin/python3": Created} {
		if changes[p] != want {
			t.Errorf("%s: %q, want %q", p, changes[p], want)
		}
	}
	if _, ok := changes["/etc/hostname"]; ok {
		t.Errorf("/etc/hostname, in the baseline and unchanged, is listed")
	}
	var replaced, tests []string
	for _, f := range res.Replaced {
		replaced = append(replaced, f.GetPath())
	}
	for _, f := range res.TestsChanged {
		tests = append(tests, f.GetPath())
	}
	slices.Sort(replaced)
	wantReplaced := []string{"/etc/python3.11/sitecustomize.py", "/usr/bin/pytest", "/usr/lib/python3.11/json/__init__.py", "/usr/lib/python3/dist-packages/_pytest/main.py", "/usr/local/bin/python3"}
	if !slices.Equal(replaced, wantReplaced) {
		t.Errorf("replaced %v, want %v", replaced, wantReplaced)
	}
	if !slices.Equal(tests, []string{"/work/conftest.py"}) {
		t.Errorf("tests changed %v, want /work/conftest.py alone", tests)
	}
	var pkgs []string
	for _, p := range res.Packages {
		pkgs = append(pkgs, p.GetManager()+":"+p.GetName()+"="+p.GetVersion()+":"+p.GetChange())
	}
	slices.Sort(pkgs)
	wantPkgs := []string{"dpkg:curl=8.0:upgraded", "dpkg:jq=1.6:installed", "pip:requests=2.31.0:installed"}
	if !slices.Equal(pkgs, wantPkgs) {
		t.Errorf("packages %v, want %v", pkgs, wantPkgs)
	}
	if res.Outside == 0 || res.Outside == res.FilesTotal {
		t.Errorf("%d of %d entries outside the workspace; want some, not all", res.Outside, res.FilesTotal)
	}
}

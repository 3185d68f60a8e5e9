package provenance

import (
	"os"
	"path/filepath"
	"testing"
	"time"

	dsecv1 "dsec.dev/dsec/api/gen/dsec/v1"
)

// TestBaselineSeesRestoredMtime: an entry of the baseline rewritten to its
// size with its modification time set back (touch -r, utimensat), or
// replaced by a file renamed over it with the old times, is a change: its
// inode change time moved (and a replacement's inode differs), which no
// process sets back. Before, mode, size and mtime alone matched and the
// rewritten test file was left out as the platform's. An entry left alone
// stays out, also against a baseline saved before inodes were recorded.
func TestBaselineSeesRestoredMtime(t *testing.T) {
	upper := t.TempDir()
	write(t, upper, "work/tests/test_a.py", "assert answer() == 42\n")
	write(t, upper, "work/tests/test_b.py", "assert answer() == 43\n")
	write(t, upper, "etc/hostname", "sb\n")
	old := time.Date(2026, 1, 2, 3, 4, 5, 6, time.UTC)
	for _, f := range []string{"work/tests/test_a.py", "work/tests/test_b.py"} {
		if err := os.Chtimes(filepath.Join(upper, f), old, old); err != nil {
			t.Fatal(err)
		}
	}
	base, err := TakeBaseline(upper)
	if err != nil {
		t.Fatal(err)
	}
	// The agent rewrites test_a to its size and sets its times back;
	// test_b is replaced by a rename with the old times.
	write(t, upper, "work/tests/test_a.py", "assert answer() == 41\n")
	if err := os.Chtimes(filepath.Join(upper, "work/tests/test_a.py"), old, old); err != nil {
		t.Fatal(err)
	}
	write(t, upper, "work/tests/.b.tmp", "assert answer() == 44\n")
	if err := os.Chtimes(filepath.Join(upper, "work/tests/.b.tmp"), old, old); err != nil {
		t.Fatal(err)
	}
	if err := os.Rename(filepath.Join(upper, "work/tests/.b.tmp"), filepath.Join(upper, "work/tests/test_b.py")); err != nil {
		t.Fatal(err)
	}
	for _, f := range []string{"work/tests/test_a.py", "work/tests/test_b.py"} {
		info, err := os.Stat(filepath.Join(upper, f))
		if err != nil {
			t.Fatal(err)
		}
		if st := base["/"+f]; st.Size != info.Size() || st.ModTime != info.ModTime().UnixNano() || st.Mode != info.Mode() {
			t.Fatalf("%s: the tamper did not restore mode, size and mtime: %+v, now %v %d %v", f, st, info.Mode(), info.Size(), info.ModTime())
		}
	}
	paths := &dsecv1.ProvenancePaths{Workspace: []string{"/work"}, Tests: []string{"/work/tests"}}
	res, err := Scan(upper, ScanOptions{Paths: paths, ListFiles: true, Baseline: base})
	if err != nil {
		t.Fatal(err)
	}
	changed := map[string]bool{}
	for _, f := range res.TestsChanged {
		if f.GetKind() == "file" { // the dir the rename changed is listed too
			changed[f.GetPath()] = true
		}
	}
	if !changed["/work/tests/test_a.py"] || !changed["/work/tests/test_b.py"] || len(changed) != 2 {
		t.Errorf("tests changed %v; want test_a.py (rewritten, mtime set back) and test_b.py (renamed over, mtime set back)", res.TestsChanged)
	}
	for _, f := range res.Files {
		if f.GetPath() == "/etc/hostname" {
			t.Errorf("/etc/hostname, left alone, is listed: %v", f)
		}
	}

	// A baseline saved before inodes were recorded still leaves out what
	// is unchanged.
	legacy := Baseline{}
	for rel, st := range base {
		st.Ino, st.ChangeTime = 0, 0
		legacy[rel] = st
	}
	info, err := os.Lstat(filepath.Join(upper, "etc/hostname"))
	if err != nil {
		t.Fatal(err)
	}
	if !legacy.unchanged("/etc/hostname", info) {
		t.Error("an old baseline's unchanged entry counts as changed")
	}
}

package snapshot

import (
	"os"
	"path/filepath"
	"sort"
	"testing"

	"github.com/google/go-cmp/cmp"
	"golang.org/x/sys/unix"
)

// TestKeepOnly checks a grade's capture: only the include paths stay, a
// directory on their way keeps nothing else and no opaque mark, and a
// symlink or whiteout on the way goes; a trusted path goes with any
// ancestor the sandbox made something other than a directory.
func TestKeepOnly(t *testing.T) {
	needRoot(t)
	dir := t.TempDir()
	mk := func(rel, content string) {
		p := filepath.Join(dir, rel)
		if err := os.MkdirAll(filepath.Dir(p), 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(p, []byte(content), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	mk("work/src/solution.py", "x")
	mk("work/tests/test_x.py", "forged")
	mk("work/tests/conftest.py", "forced pass")
	mk("work/notes.txt", "outside")
	mk("usr/bin/python3", "fake interpreter")
	mk("tmp/evil/test_y.py", "forged")
	mk("repo/a.txt", "a")
	if err := os.Symlink("/tmp/evil", filepath.Join(dir, "work2")); err != nil {
		t.Fatal(err)
	}
	if err := unix.Mknod(filepath.Join(dir, "gone"), unix.S_IFCHR, 0); err != nil {
		t.Fatal(err)
	}
	if err := unix.Setxattr(filepath.Join(dir, "work"), "trusted.overlay.opaque", []byte("y"), 0); err != nil {
		t.Fatal(err)
	}
	// repo/tests is a symlink the sandbox made on the way to a trusted path.
	if err := os.Symlink("/tmp/evil", filepath.Join(dir, "repo/tests")); err != nil {
		t.Fatal(err)
	}

	root, err := openDir(unix.AT_FDCWD, dir)
	if err != nil {
		t.Fatal(err)
	}
	defer root.Close()
	found, err := keepOnly(root, []string{"work/src", "work/tests", "work2/sub", "repo", "nothing/here"})
	if err != nil {
		t.Fatal(err)
	}
	if diff := cmp.Diff([]string{"/repo", "/work/src", "/work/tests"}, sorted(found)); diff != "" {
		t.Errorf("included (-want +got):\n%s", diff)
	}
	for _, rel := range []string{"work/tests", "repo/tests/x.py"} {
		if _, err := clearWay(root, rel); err != nil {
			t.Fatal(err)
		}
	}
	var got []string
	filepath.Walk(dir, func(p string, fi os.FileInfo, err error) error {
		if err != nil {
			t.Fatal(err)
		}
		if rel, _ := filepath.Rel(dir, p); rel != "." {
			got = append(got, rel)
		}
		return nil
	})
	want := []string{"repo", "repo/a.txt", "work", "work/src", "work/src/solution.py"}
	if diff := cmp.Diff(want, sorted(got)); diff != "" {
		t.Errorf("tree after keepOnly and clearWay (-want +got):\n%s", diff)
	}
	if _, err := unix.Getxattr(filepath.Join(dir, "work"), "trusted.overlay.opaque", make([]byte, 8)); err != unix.ENODATA {
		t.Errorf("work's opaque mark: %v; want it cleared (ENODATA)", err)
	}
}

func sorted(s []string) []string {
	s = append([]string(nil), s...)
	sort.Strings(s)
	return s
}

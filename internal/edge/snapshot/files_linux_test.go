package snapshot

import (
	"os"
	"path/filepath"
	"testing"

	"dsec.dev/dsec/internal/testutil"
)

// TestWriteFiles writes files into a tree as a clean room's root: through
// the tree's symlinks (resolved in it, absolute ones too), never out of it
// (a symlink climbing out stops at root; one naming a host path names it
// in root), replacing a file and a
// symlink at a path (the link's target untouched), refusing a directory
// at a path, and making missing directories.
func TestWriteFiles(t *testing.T) {
	testutil.RequireRoot(t) // the files are chowned to root
	base := t.TempDir()
	root, outside := filepath.Join(base, "root"), filepath.Join(base, "outside")
	for _, d := range []string{root + "/usr/lib", root + "/home/user/project/tests", outside} {
		if err := os.MkdirAll(d, 0o755); err != nil {
			t.Fatal(err)
		}
	}
	must := func(err error) {
		t.Helper()
		if err != nil {
			t.Fatal(err)
		}
	}
	must(os.Symlink("/usr/lib", root+"/lib"))                    // absolute: resolves in root
	must(os.Symlink("../../../../..", root+"/home/user/up"))     // climbs: stops at root
	must(os.Symlink(outside, root+"/home/user/project/out"))     // a host path: resolves in root
	must(os.WriteFile(outside+"/victim", []byte("host"), 0o644)) // what a followed link would write
	must(os.Symlink(outside+"/victim", root+"/home/user/project/tests/test_a.py"))
	must(os.WriteFile(root+"/home/user/project/tests/test_b.py", []byte("forged"), 0o777))
	must(os.MkdirAll(root+"/home/user/project/tests/dir.py", 0o755))

	files := []File{
		{Path: "/home/user/project/tests/test_a.py", Data: []byte("a"), Mode: 0o644},
		{Path: "/home/user/project/tests/test_b.py", Data: []byte("b")},
		{Path: "/lib/dsec/reward", Data: nil, Mode: 0o666},
		{Path: "/home/user/up/etc/escaped", Data: []byte("in root")},
		{Path: "/new/deep/dir/file", Data: []byte("deep")},
	}
	if err := WriteFiles(root, files); err != nil {
		t.Fatal(err)
	}
	for p, want := range map[string]string{
		"/home/user/project/tests/test_a.py": "a",
		"/home/user/project/tests/test_b.py": "b",
		"/usr/lib/dsec/reward":               "",
		"/etc/escaped":                       "in root",
		"/new/deep/dir/file":                 "deep",
	} {
		st, err := os.Lstat(root + p)
		if err != nil || !st.Mode().IsRegular() {
			t.Errorf("%s: %v, %v; want a regular file", p, st, err)
			continue
		}
		if b, _ := os.ReadFile(root + p); string(b) != want {
			t.Errorf("%s holds %q, want %q", p, b, want)
		}
	}
	if st, err := os.Stat(root + "/usr/lib/dsec/reward"); err != nil || st.Mode().Perm() != 0o666 {
		t.Errorf("the reward file: %v, %v; want mode 0666", st, err)
	}
	if st, err := os.Stat(root + "/home/user/project/tests/test_b.py"); err != nil || st.Mode().Perm() != 0o644 {
		t.Errorf("test_b.py replaced: %v, %v; want mode 0644", st, err)
	}
	if b, _ := os.ReadFile(outside + "/victim"); string(b) != "host" {
		t.Errorf("a symlink at a path was written through: the host file holds %q", b)
	}
	// A link to a host path names that path in root, where there is none:
	// an error, and nothing written on the host.
	if err := WriteFiles(root, []File{{Path: "/home/user/project/out/x", Data: []byte("x")}}); err == nil {
		t.Errorf("a file through a link to a path root lacks: no error")
	}
	if _, err := os.Stat(outside + "/x"); err == nil {
		t.Errorf("a file was written out of root")
	}
	if err := WriteFiles(root, []File{{Path: "/home/user/project/tests/dir.py", Data: []byte("x")}}); err == nil {
		t.Errorf("a file over a directory: no error")
	}
	for _, bad := range []string{"relative", "/a/../b", "/"} {
		if err := WriteFiles(root, []File{{Path: bad}}); err == nil {
			t.Errorf("path %q: no error", bad)
		}
	}
}

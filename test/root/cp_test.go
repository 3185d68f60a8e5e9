package root

import (
	"archive/tar"
	"bytes"
	"io"
	"os"
	"path"
	"path/filepath"
	"strings"
	"testing"

	"dsec.dev/dsec/internal/testutil"
)

// testCopy runs `dsec cp` both ways in the sandbox id, with the docker cp
// rules: into an existing directory or one named with a trailing slash,
// otherwise as the destination; "/." for a directory's contents; "-" for a
// tar archive on stdin or stdout.
func testCopy(t *testing.T, d *testutil.Daemon, id string) {
	t.Helper()
	local := t.TempDir()
	os.MkdirAll(filepath.Join(local, "proj", "sub"), 0o755)
	os.WriteFile(filepath.Join(local, "proj", "sub", "f.txt"), []byte("copied"), 0o644)
	os.WriteFile(filepath.Join(local, "one.txt"), []byte("one"), 0o600)
	cp := func(stdin string, args ...string) string {
		t.Helper()
		out, errOut, code := d.CLI(stdin, append([]string{"cp"}, args...)...)
		if code != 0 {
			t.Fatalf("dsec cp %v: exit %d: %s %s", args, code, out, errOut)
		}
		return out
	}
	cpFails := func(want string, args ...string) {
		t.Helper()
		out, errOut, code := d.CLI("", append([]string{"cp"}, args...)...)
		if code == 0 || !strings.Contains(errOut, want) {
			t.Fatalf("dsec cp %v: exit %d, stderr %q; want a failure saying %q (stdout %q)", args, code, errOut, want, out)
		}
	}
	remote := func(file, want string) {
		t.Helper()
		if got := mustSh(t, d, id, "cat "+file); got != want {
			t.Fatalf("%s in the sandbox: %q, want %q", file, got, want)
		}
	}
	localFile := func(file, want string) {
		t.Helper()
		data, err := os.ReadFile(file)
		if err != nil || string(data) != want {
			t.Fatalf("%s: %q %v, want %q", file, data, err, want)
		}
	}

	// In.
	cp("", filepath.Join(local, "proj"), id+":/in/") // trailing slash: made, then into
	remote("/in/proj/sub/f.txt", "copied")
	cp("", filepath.Join(local, "proj"), id+":/in") // existing directory: into again
	remote("/in/proj/sub/f.txt", "copied")
	cp("", filepath.Join(local, "proj"), id+":/in2") // missing: becomes /in2
	remote("/in2/sub/f.txt", "copied")
	cp("", filepath.Join(local, "proj")+"/.", id+":/in3") // contents
	remote("/in3/sub/f.txt", "copied")
	cp("", filepath.Join(local, "one.txt"), id+":/in") // a file into a directory
	remote("/in/one.txt", "one")
	if got := strings.TrimSpace(mustSh(t, d, id, "stat -c %a /in/one.txt")); got != "600" {
		t.Fatalf("mode of /in/one.txt: %s, want 600", got)
	}
	// A relative path starts where the sandbox's commands start.
	wd := strings.TrimSpace(mustSh(t, d, id, "pwd"))
	cp("", filepath.Join(local, "one.txt"), id+":rel.txt")
	remote(path.Join(wd, "rel.txt"), "one")
	cp("", filepath.Join(local, "one.txt"), id+":/in/renamed.txt") // a file as a new name
	remote("/in/renamed.txt", "one")
	os.WriteFile(filepath.Join(local, "one.txt"), []byte("two"), 0o600)
	cp("", filepath.Join(local, "one.txt"), id+":/in/renamed.txt") // replaces the file
	remote("/in/renamed.txt", "two")
	cpFails("not a directory", filepath.Join(local, "proj"), id+":/in/renamed.txt")
	cpFails("not a directory", filepath.Join(local, "one.txt"), id+":/in/renamed.txt/")
	remote("/in/renamed.txt", "two")
	mustSh(t, d, id, "ln -s /in /in/link")
	cpFails("symlink", filepath.Join(local, "one.txt"), id+":/in/link")

	var archive bytes.Buffer
	tw := tar.NewWriter(&archive)
	tw.WriteHeader(&tar.Header{Name: "t.txt", Mode: 0o644, Size: 3, Typeflag: tar.TypeReg})
	tw.Write([]byte("tar"))
	tw.Close()
	cp(archive.String(), "-", id+":/in/fromtar") // a tar archive from stdin
	remote("/in/fromtar/t.txt", "tar")

	// Out.
	back := t.TempDir()
	cp("", id+":/in/proj", back) // existing directory: into
	localFile(filepath.Join(back, "proj", "sub", "f.txt"), "copied")
	cp("", id+":/in/proj", filepath.Join(back, "new")) // missing: becomes new
	localFile(filepath.Join(back, "new", "sub", "f.txt"), "copied")
	cp("", id+":/in/proj/.", filepath.Join(back, "contents")) // contents
	localFile(filepath.Join(back, "contents", "sub", "f.txt"), "copied")
	cp("", id+":rel.txt", filepath.Join(back, "rel.txt")) // relative, from the working directory
	localFile(filepath.Join(back, "rel.txt"), "one")
	cp("", id+":/in/renamed.txt", filepath.Join(back, "r.txt")) // a file as a new name
	localFile(filepath.Join(back, "r.txt"), "two")
	mustSh(t, d, id, "echo -n three > /in/renamed.txt")
	cp("", id+":/in/renamed.txt", filepath.Join(back, "r.txt")) // replaces the file
	localFile(filepath.Join(back, "r.txt"), "three")
	cpFails("not a directory", id+":/in/proj", filepath.Join(back, "r.txt"))
	cpFails("does not exist", id+":/nope", back)

	tr := tar.NewReader(strings.NewReader(cp("", id+":/in/renamed.txt", "-"))) // a tar archive to stdout
	hdr, err := tr.Next()
	if err != nil || hdr.Name != "renamed.txt" {
		t.Fatalf("archive on stdout: %v %v", hdr, err)
	}
	if data, _ := io.ReadAll(tr); string(data) != "three" {
		t.Fatalf("archive on stdout holds %q", data)
	}
}

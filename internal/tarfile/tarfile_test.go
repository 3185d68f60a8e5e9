package tarfile

import (
	"archive/tar"
	"bytes"
	"io"
	"os"
	"path/filepath"
	"testing"

	"github.com/google/go-cmp/cmp"
)

func TestWriteEntry(t *testing.T) {
	dir := t.TempDir()
	must := func(err error) {
		t.Helper()
		if err != nil {
			t.Fatal(err)
		}
	}
	must(os.Mkdir(filepath.Join(dir, "d"), 0o750))
	must(os.WriteFile(filepath.Join(dir, "d", "f"), []byte("content"), 0o640))
	must(os.Symlink("d/f", filepath.Join(dir, "ln")))

	var buf bytes.Buffer
	tw := tar.NewWriter(&buf)
	for _, name := range []string{"d", "d/f", "ln"} {
		p := filepath.Join(dir, name)
		info, err := os.Lstat(p)
		must(err)
		must(WriteEntry(tw, p, name, info, nil))
	}
	// edit may turn a regular file into a hard link: no content follows.
	p := filepath.Join(dir, "d", "f")
	info, err := os.Lstat(p)
	must(err)
	must(WriteEntry(tw, p, "again", info, func(h *tar.Header) {
		h.Typeflag, h.Linkname, h.Size = tar.TypeLink, "d/f", 0
	}))
	must(tw.Close())

	type entry struct {
		Name, Link, Content string
		Type                byte
		Mode                int64
		Uname               string
	}
	var got []entry
	tr := tar.NewReader(&buf)
	for {
		h, err := tr.Next()
		if err == io.EOF {
			break
		}
		must(err)
		b, err := io.ReadAll(tr)
		must(err)
		got = append(got, entry{h.Name, h.Linkname, string(b), h.Typeflag, h.Mode & 0o7777, h.Uname})
	}
	want := []entry{
		{Name: "d/", Type: tar.TypeDir, Mode: 0o750},
		{Name: "d/f", Content: "content", Type: tar.TypeReg, Mode: 0o640},
		{Name: "ln", Link: "d/f", Type: tar.TypeSymlink, Mode: 0o777},
		{Name: "again", Link: "d/f", Type: tar.TypeLink, Mode: 0o640},
	}
	if diff := cmp.Diff(want, got); diff != "" {
		t.Errorf("archive (-want +got):\n%s", diff)
	}
}

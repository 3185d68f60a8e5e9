package snapshot

import (
	"context"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/google/go-cmp/cmp"
	"golang.org/x/sys/unix"
)

// TestLayMatchesPack lays a grade's capture into a running file system and
// checks it shows what the same capture packed into a layer and stacked
// over the same layers shows: deletions, an opaque directory, a symlink
// and a FIFO, owners and modes, the trusted and excluded paths left out,
// a path the capture reaches through a symlink left out, and a symlink the
// room held where the capture has a directory replaced, never followed.
func TestLayMatchesPack(t *testing.T) {
	needRoot(t)
	ctx := context.Background()
	mtime := time.Unix(1_700_000_000, 0)
	write := func(dir, rel, content string, uid int) {
		t.Helper()
		p := filepath.Join(dir, rel)
		if err := os.MkdirAll(filepath.Dir(p), 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(p, []byte(content), 0o644); err != nil {
			t.Fatal(err)
		}
		if err := os.Lchown(p, uid, uid); err != nil {
			t.Fatal(err)
		}
		if err := os.Chtimes(p, mtime, mtime); err != nil {
			t.Fatal(err)
		}
	}
	// lower is the environment: what the room shows before the lay.
	lower := func() string {
		d := t.TempDir()
		write(d, "work/src/old.py", "old", 0)
		write(d, "work/src/keep.py", "keep", 0)
		write(d, "work/src/pkg/a.py", "a", 0)
		write(d, "work/tests/test_x.py", "pristine", 0)
		write(d, "work/data/x", "x", 0)
		write(d, "usr/bin/python3", "real", 0)
		if err := os.Symlink("/usr", filepath.Join(d, "work/alt")); err != nil {
			t.Fatal(err)
		}
		return d
	}
	// capture is the sandbox's writable layer, in overlayfs's upper form.
	capture := func() *Tree {
		d := t.TempDir()
		write(d, "work/src/new.py", "new", 1000)
		write(d, "work/src/keep.py", "changed", 0)
		write(d, "work/src/pkg/b.py", "b", 0)
		write(d, "work/src/excl/big", "residue", 0)
		write(d, "work/tests/test_x.py", "forged", 0)
		write(d, "work/alt/f", "through a dir over the environment's symlink", 0)
		write(d, "usr/bin/python3", "fake", 0)
		write(d, "via/f", "reached through a symlink", 0)
		if err := unix.Mknod(filepath.Join(d, "work/src/old.py"), unix.S_IFCHR, 0); err != nil {
			t.Fatal(err)
		}
		if err := unix.Setxattr(filepath.Join(d, "work/src/pkg"), "trusted.overlay.opaque", []byte("y"), 0); err != nil {
			t.Fatal(err)
		}
		if err := os.Symlink("/usr/bin/python3", filepath.Join(d, "work/src/ln")); err != nil {
			t.Fatal(err)
		}
		if err := unix.Mkfifo(filepath.Join(d, "work/src/fifo"), 0o640); err != nil {
			t.Fatal(err)
		}
		if err := os.Symlink("/via", filepath.Join(d, "work/way")); err != nil {
			t.Fatal(err)
		}
		ts := []unix.Timespec{unix.NsecToTimespec(mtime.UnixNano()), unix.NsecToTimespec(mtime.UnixNano())}
		for _, p := range []string{"work/src/pkg", "work/alt", "work/src", "work/src/ln", "work/src/fifo"} {
			if err := unix.UtimesNanoAt(unix.AT_FDCWD, filepath.Join(d, p), ts, unix.AT_SYMLINK_NOFOLLOW); err != nil {
				t.Fatal(err)
			}
		}
		return &Tree{Dir: d, Method: MethodCopy}
	}
	opts := PackOptions{
		Include: []string{"/work/src", "/work/alt", "/work/way/f", "/work/nothing"},
		Trusted: []string{"/work/tests", "/work/src/tests"},
		Exclude: []string{"/work/src/excl"},
	}

	// A layer packed from the capture, over the environment's layer.
	envLayer := layerOf(t, lower())
	out := filepath.Join(t.TempDir(), "snap.erofs")
	packed, err := Pack(ctx, capture(), out, PackOptions{Lower: []string{envLayer}, Include: opts.Include, Trusted: opts.Trusted, Exclude: opts.Exclude})
	if err != nil {
		t.Fatal(err)
	}
	merged, _ := overlay(t, []string{envLayer, mountLayer(t, out)}, "", "")

	// The same capture laid into the environment's tree.
	room := lower()
	laid, err := Lay(ctx, capture(), room, opts)
	if err != nil {
		t.Fatal(err)
	}
	if diff := cmp.Diff(sorted(packed.Included), laid.Included); diff != "" {
		t.Errorf("included (-packed +laid):\n%s", diff)
	}
	want, got := describe(t, merged), describe(t, room)
	for _, m := range []map[string]obj{want, got} {
		for p, o := range m {
			if o.Type == "dir" {
				o.Mtime = 0 // the room's directories changed as entries were laid
				m[p] = o
			}
		}
	}
	if diff := cmp.Diff(want, got); diff != "" {
		t.Errorf("the room after the lay differs from the packed layer over the environment (-packed +laid):\n%s", diff)
	}
	for _, p := range []string{"work/src/old.py", "work/src/pkg/a.py", "work/src/excl", "via"} {
		if _, err := os.Lstat(filepath.Join(room, p)); !os.IsNotExist(err) {
			t.Errorf("%s in the room after the lay: %v", p, err)
		}
	}
	if b, _ := os.ReadFile(filepath.Join(room, "work/tests/test_x.py")); string(b) != "pristine" {
		t.Errorf("the trusted tests after the lay: %q", b)
	}
	if !strings.HasPrefix(laid.Digest, "sha256:") || laid.Entries == 0 {
		t.Errorf("laid %+v", laid)
	}
	again, err := Lay(ctx, capture(), lower(), opts)
	if err != nil || again.Digest != laid.Digest {
		t.Errorf("the same capture laid again: %v, digest %s, want %s", err, again.Digest, laid.Digest)
	}

	// A room holding a symlink out of it where the capture has a
	// directory: the link is replaced, nothing is written through it.
	outside := t.TempDir()
	room2 := lower()
	if err := os.RemoveAll(filepath.Join(room2, "work/src")); err != nil {
		t.Fatal(err)
	}
	if err := os.Symlink(outside, filepath.Join(room2, "work/src")); err != nil {
		t.Fatal(err)
	}
	if _, err := Lay(ctx, capture(), room2, opts); err != nil {
		t.Fatal(err)
	}
	if entries, _ := os.ReadDir(outside); len(entries) > 0 {
		t.Errorf("the lay wrote through the room's symlink: %v", entries)
	}
	if st, err := os.Lstat(filepath.Join(room2, "work/src")); err != nil || !st.IsDir() {
		t.Errorf("work/src in the room is not a directory after the lay: %v", err)
	}
}

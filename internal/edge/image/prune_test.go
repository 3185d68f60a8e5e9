//go:build linux

package image

import (
	"context"
	"errors"
	"os"
	"path/filepath"
	"sort"
	"strconv"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"dsec.dev/dsec/internal/testutil"
)

// tree makes the objects spec names under dir: "NAME" a file, "NAME/" a
// directory, "NAME/+" an opaque directory, "NAME!" a whiteout, "NAME@T" a
// symlink to T.
func tree(t *testing.T, dir string, spec ...string) string {
	t.Helper()
	for _, s := range spec {
		var err error
		switch {
		case strings.HasSuffix(s, "/+"):
			p := filepath.Join(dir, strings.TrimSuffix(s, "/+"))
			if err = os.MkdirAll(p, 0o755); err == nil {
				err = unix.Setxattr(p, opaqueXattr, []byte("y"), 0)
			}
		case strings.HasSuffix(s, "/"):
			err = os.MkdirAll(filepath.Join(dir, s), 0o755)
		case strings.HasSuffix(s, "!"):
			p := filepath.Join(dir, strings.TrimSuffix(s, "!"))
			if err = os.MkdirAll(filepath.Dir(p), 0o755); err == nil {
				err = unix.Mknod(p, unix.S_IFCHR, 0)
			}
		case strings.Contains(s, "@"):
			name, target, _ := strings.Cut(s, "@")
			p := filepath.Join(dir, name)
			if err = os.MkdirAll(filepath.Dir(p), 0o755); err == nil {
				err = os.Symlink(target, p)
			}
		default:
			p := filepath.Join(dir, s)
			if err = os.MkdirAll(filepath.Dir(p), 0o755); err == nil {
				err = os.WriteFile(p, []byte(s), 0o644)
			}
		}
		if err != nil {
			t.Fatalf("make %s: %v", s, err)
		}
	}
	return dir
}

// describe lists the tree at dir in tree's notation, sorted.
func describe(t *testing.T, dir string) []string {
	t.Helper()
	var out []string
	err := filepath.Walk(dir, func(p string, fi os.FileInfo, err error) error {
		if err != nil || p == dir {
			return err
		}
		rel, _ := filepath.Rel(dir, p)
		switch {
		case fi.IsDir():
			if v, err := getxattr(p, opaqueXattr); err == nil && v == "y" {
				rel += "/+"
			} else {
				rel += "/"
			}
		case fi.Mode()&os.ModeCharDevice != 0:
			rel += "!"
		case fi.Mode()&os.ModeSymlink != 0:
			target, _ := os.Readlink(p)
			rel += "@" + target
		}
		out = append(out, rel)
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	sort.Strings(out)
	return out
}

func getxattr(p, name string) (string, error) {
	buf := make([]byte, 256)
	n, err := unix.Lgetxattr(p, name, buf)
	if err != nil {
		return "", err
	}
	return string(buf[:n]), nil
}

func TestPruneWhiteouts(t *testing.T) {
	testutil.RequireRoot(t) // whiteouts are devices; opaque marks trusted.* xattrs
	for _, tc := range []struct {
		name  string
		lower [][]string // bottom first
		tree  []string
		want  []string
	}{
		{"bottom-most layer keeps none",
			nil,
			[]string{"etc/gone!", "etc/keep", "opq/+", "opq/file"},
			[]string{"etc/", "etc/keep", "opq/", "opq/file"}},
		{"whiteout of a lower file stays",
			[][]string{{"etc/passwd", "etc/shadow"}},
			[]string{"etc/passwd!", "etc/new!", "etc/shadow"},
			[]string{"etc/", "etc/passwd!", "etc/shadow"}},
		{"whiteout in a directory only this layer has goes",
			[][]string{{"etc/passwd"}},
			[]string{"opt/app/gone!", "opt/app/kept"},
			[]string{"opt/", "opt/app/", "opt/app/kept"}},
		{"whiteout of a lower directory stays",
			[][]string{{"var/cache/big/file"}},
			[]string{"var/cache/big!"},
			[]string{"var/", "var/cache/", "var/cache/big!"}},
		{"a higher lower layer already hid the name",
			[][]string{{"a/f"}, {"a/f!"}},
			[]string{"a/f!"},
			[]string{"a/"}},
		{"a lower file in the way ends the lookup",
			[][]string{{"a/b/f"}, {"a/b"}},
			[]string{"a/b/f!", "a/b/+"},
			[]string{"a/", "a/b/"}},
		{"a lower opaque directory ends the lookup",
			[][]string{{"d/old", "d/both"}, {"d/+", "d/both"}},
			[]string{"d/old!", "d/both!"},
			[]string{"d/", "d/both!"}},
		{"under an opaque directory nothing is looked up",
			[][]string{{"d/x", "d/sub/y"}},
			[]string{"d/+", "d/x!", "d/sub/y!"},
			[]string{"d/+", "d/sub/"}},
		{"an opaque mark over a lower directory stays",
			[][]string{{"d/x"}, {"e/y"}},
			[]string{"d/+", "d/new", "e/+"},
			[]string{"d/+", "d/new", "e/+"}},
		{"symlinks below are not followed",
			[][]string{{"real/f", "link@real"}},
			[]string{"link/f!", "link/+"},
			[]string{"link/"}},
		{"a whiteout over a lower symlink stays",
			[][]string{{"link@real"}},
			[]string{"link!"},
			[]string{"link!"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			base := t.TempDir()
			var lower []string
			for i, spec := range tc.lower {
				lower = append(lower, tree(t, filepath.Join(base, "lower", string(rune('0'+i))), spec...))
			}
			dir := tree(t, filepath.Join(base, "tree"), tc.tree...)
			if _, err := PruneWhiteouts(context.Background(), dir, lower); err != nil {
				t.Fatal(err)
			}
			if got := describe(t, dir); strings.Join(got, " ") != strings.Join(tc.want, " ") {
				t.Errorf("pruned tree\n got %v\nwant %v", got, tc.want)
			}
		})
	}
}

func TestPruneWhiteoutsKeepsMtimesAndCounts(t *testing.T) {
	testutil.RequireRoot(t)
	base := t.TempDir()
	lower := tree(t, filepath.Join(base, "lower"), "a/x")
	dir := tree(t, filepath.Join(base, "tree"), "a/x!", "a/y!", "b/z!", "c/+")
	old := time.Unix(1500000000, 0)
	for _, d := range []string{"a", "b", "c", "."} {
		if err := os.Chtimes(filepath.Join(dir, d), old, old); err != nil {
			t.Fatal(err)
		}
	}
	n, err := PruneWhiteouts(context.Background(), dir, []string{lower})
	if err != nil {
		t.Fatal(err)
	}
	if n != (Pruned{Whiteouts: 2, OpaqueMarks: 1}) {
		t.Errorf("pruned %+v; want 2 whiteouts and 1 opaque mark", n)
	}
	for _, d := range []string{"a", "b", "c", "."} {
		fi, err := os.Stat(filepath.Join(dir, d))
		if err != nil {
			t.Fatal(err)
		}
		if !fi.ModTime().Equal(old) {
			t.Errorf("%s mtime %v after pruning; want %v", d, fi.ModTime(), old)
		}
	}

	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	many := tree(t, filepath.Join(base, "many"), "d/")
	for i := range 5000 {
		if err := os.WriteFile(filepath.Join(many, "d", strconv.Itoa(i)), nil, 0o644); err != nil {
			t.Fatal(err)
		}
	}
	if _, err := PruneWhiteouts(ctx, many, nil); !errors.Is(err, context.Canceled) {
		t.Errorf("PruneWhiteouts with a cancelled context: %v", err)
	}
	if _, err := PruneWhiteouts(context.Background(), filepath.Join(base, "missing"), nil); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("PruneWhiteouts of a missing tree: %v; want not found", err)
	}
}

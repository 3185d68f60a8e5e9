package snapshot

import (
	"errors"
	"strings"
	"testing"

	"dsec.dev/dsec/internal/errdefs"
)

func TestCleanExcludes(t *testing.T) {
	got, err := cleanExcludes([]string{"/root/.cache", "/tests/answers/", "//tmp//x", "/root/.cache", "/a/./b"})
	if err != nil {
		t.Fatal(err)
	}
	if want := "root/.cache tests/answers tmp/x a/b"; strings.Join(got, " ") != want {
		t.Errorf("cleanExcludes = %q; want %q", got, want)
	}
	for _, p := range []string{"", "x", "./x", "../x", "/..", "/a/../b", "/a/..", "/", "//", "/x\x00y"} {
		if _, err := cleanExcludes([]string{"/ok", p}); !errors.Is(err, errdefs.ErrInvalidArgument) {
			t.Errorf("exclude %q: %v; want invalid argument", p, err)
		}
	}
}

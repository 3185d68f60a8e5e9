package sandboxpage

import (
	"errors"
	"fmt"
	"testing"

	dsecv1 "dsec.dev/dsec/api/gen/dsec/v1"
	"dsec.dev/dsec/internal/errdefs"
)

func sb(id string, at int64) *dsecv1.Sandbox { return &dsecv1.Sandbox{Id: id, CreatedUnixMs: at} }

func ids(sbs []*dsecv1.Sandbox) string {
	s := ""
	for _, x := range sbs {
		s += x.GetId() + " "
	}
	return s
}

// TestCut: pages newest first, IDs breaking ties, walked by their tokens
// to the end; a sandbox made after the first page was read does not shift
// the next, nor does the cursor's own sandbox going away; a forged token
// is InvalidArgument.
func TestCut(t *testing.T) {
	all := []*dsecv1.Sandbox{sb("a", 1), sb("b", 3), sb("c", 2), sb("d", 3), sb("e", 5)}
	Sort(all)
	if got := ids(all); got != "e b d c a " {
		t.Fatalf("sorted: %s", got)
	}
	var walked string
	token, pages := "", 0
	for {
		page, next, err := Cut(all, 2, token)
		if err != nil {
			t.Fatal(err)
		}
		walked += ids(page)
		pages++
		if next == "" {
			break
		}
		token = next
	}
	if walked != "e b d c a " || pages != 3 {
		t.Fatalf("walked %q in %d pages, want every sandbox once in 3", walked, pages)
	}

	first, next, _ := Cut(all, 2, "")
	if ids(first) != "e b " {
		t.Fatalf("first page %s", ids(first))
	}
	// A newer sandbox arrives, and b (the cursor's) goes.
	moved := []*dsecv1.Sandbox{sb("f", 9), sb("e", 5), sb("d", 3), sb("c", 2), sb("a", 1)}
	page, _, err := Cut(moved, 2, next)
	if err != nil || ids(page) != "d c " {
		t.Fatalf("the page after b once b is gone and f is new: %s (%v), want d c", ids(page), err)
	}
	for _, bad := range []string{"!!", "bm8tc2xhc2g", fmt.Sprint("eA")} {
		if _, _, err := Cut(all, 2, bad); !errors.Is(err, errdefs.ErrInvalidArgument) {
			t.Errorf("token %q: %v, want InvalidArgument", bad, err)
		}
	}
	if _, _, err := Cut(all, 0, ""); !errors.Is(err, errdefs.ErrInvalidArgument) {
		t.Errorf("page size 0: %v", err)
	}
	if page, next, _ := Cut(nil, 5, ""); len(page) != 0 || next != "" {
		t.Errorf("no sandboxes: %v %q", page, next)
	}
}

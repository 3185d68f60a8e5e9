package sandboxid

import (
	"errors"
	"strings"
	"testing"

	"dsec.dev/dsec/internal/errdefs"
)

func TestRoundTrip(t *testing.T) {
	for _, tc := range []ID{{"t1", 0, 0}, {"node-3", 3, 1}, {"n", 65535, 4294967295}} {
		id := New(tc.Node, tc.Slot, tc.Generation)
		got, err := Parse(id)
		if err != nil || got != tc {
			t.Errorf("Parse(New(%v)) = %v, %v (id %s)", tc, got, err, id)
		}
		if !strings.HasPrefix(id, "sb-"+tc.Node+"-") {
			t.Errorf("id %s does not name node %s", id, tc.Node)
		}
	}
	if a, b := New("n", 1, 1), New("n", 1, 1); a == b {
		t.Errorf("two IDs alike: %s", a)
	}
	// An ID minted before slots: its node, slot 0.
	if got, err := Parse("sb-t1-ohhugpoch4c5xsvq"); err != nil || got != (ID{Node: "t1"}) {
		t.Errorf("legacy ID: %v, %v", got, err)
	}
}

func TestParseRefuses(t *testing.T) {
	for _, bad := range []string{"", "sb-", "sb-n1", "x-n1-abc", "sb-n1-", "sb-n1-abc", "sb-n1-!!!!!!!!!!!!!!!!", "sb--aaaaaaaaaaaaaaaa"} {
		if _, err := Parse(bad); !errors.Is(err, errdefs.ErrInvalidArgument) {
			t.Errorf("Parse(%q): %v, want invalid argument", bad, err)
		}
	}
}

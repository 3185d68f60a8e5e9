package sandboxid

import (
	"errors"
	"strings"
	"testing"

	"dsec.dev/dsec/internal/errdefs"
)

func TestNode(t *testing.T) {
	for id, want := range map[string]string{"sb-n1-abc": "n1", "sb-my-node-x": "my-node", New("t1"): "t1"} {
		if got, err := Node(id); err != nil || got != want {
			t.Errorf("Node(%q) = %q, %v; want %q", id, got, err, want)
		}
	}
	for _, bad := range []string{"", "sb-", "sb-n1", "x-n1-abc", "sb-n1-"} {
		if _, err := Node(bad); !errors.Is(err, errdefs.ErrInvalidArgument) {
			t.Errorf("Node(%q): %v, want invalid argument", bad, err)
		}
	}
	if a, b := New("n"), New("n"); a == b || !strings.HasPrefix(a, "sb-n-") {
		t.Errorf("New gave %q and %q", a, b)
	}
}

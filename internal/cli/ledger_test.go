package cli

import "testing"

// TestUsageKey: by project the root's sandboxes are "/", as dsec events
// and dsec webhook ls show the root, not "-", which means a group without
// the label.
func TestUsageKey(t *testing.T) {
	for _, tc := range []struct{ by, key, want string }{
		{"project", "", "/"},
		{"", "", "/"},
		{"project", "ml/rl", "ml/rl"},
		{"label:run", "", "-"},
		{"label:run", "r7", "r7"},
		{"node", "n1", "n1"},
	} {
		if got := usageKey(tc.by, tc.key); got != tc.want {
			t.Errorf("usageKey(%q, %q) = %q, want %q", tc.by, tc.key, got, tc.want)
		}
	}
}

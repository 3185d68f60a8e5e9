package agent

import "testing"

// TestStatusUID: a /proc/PID/status's uids and whether it runs; a zombie
// does not. killUser itself runs in sandboxes (edgetest's Inside, an
// exec's after steps): on the host it would kill other sandboxes' nobody.
func TestStatusUID(t *testing.T) {
	for _, c := range []struct {
		status  string
		uids    [4]uint32
		running bool
	}{
		{"Name:\tsleep\nState:\tS (sleeping)\nUid:\t65534\t65534\t65534\t65534\nGid:\t65534\n", [4]uint32{65534, 65534, 65534, 65534}, true},
		{"Name:\tsh\nState:\tZ (zombie)\nUid:\t1000\t0\t1000\t0\n", [4]uint32{1000, 0, 1000, 0}, false},
	} {
		uids, running := statusUID([]byte(c.status))
		if uids != c.uids || running != c.running {
			t.Errorf("statusUID(%q) = %v %v, want %v %v", c.status, uids, running, c.uids, c.running)
		}
	}
}

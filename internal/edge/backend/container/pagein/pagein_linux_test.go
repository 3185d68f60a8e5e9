package pagein

import "testing"

// TestSwapBacked: the mappings prefetched are those whose memory swap
// holds: private anonymous ones and the kernel's own shared memory.
func TestSwapBacked(t *testing.T) {
	tests := []struct {
		shared      bool
		inode, path string
		want        bool
	}{
		{false, "0", "", true},
		{false, "0", "[heap]", true},
		{false, "0", "[stack]", true},
		{false, "0", "[anon:arena]", true},
		{false, "0", "[vdso]", false},
		{false, "1234", "/usr/lib/libc.so.6", false},
		{true, "5", "/SYSV0000002a", true},
		{true, "6", "/memfd:pool", true},
		{true, "7", "/dev/zero", true},
		{true, "8", "[anon_shmem:ring]", true},
		{true, "9", "/dev/shm/psm_1", false}, // WillNeedTmpfs reads it back
		{true, "10", "/data/db", false},
	}
	for _, tt := range tests {
		if got := swapBacked(tt.shared, tt.inode, tt.path); got != tt.want {
			t.Errorf("swapBacked(%v, %q, %q) = %v, want %v", tt.shared, tt.inode, tt.path, got, tt.want)
		}
	}
}

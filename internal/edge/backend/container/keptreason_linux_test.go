package container

import (
	"strings"
	"testing"

	"dsec.dev/dsec/internal/edge/backend/cgroups"
)

// TestKeptReason: what a pause says about the memory it left in RAM names
// each kind that stayed and why, as far as the node can tell.
func TestKeptReason(t *testing.T) {
	const mb = 1 << 20
	tests := []struct {
		name string
		r    cgroups.Reclaimed
		want []string // each must appear; none when empty
	}{
		{"all released", cgroups.Reclaimed{SwapFree: 512 * mb, Kept: cgroups.Kept{Kernel: mb / 2}}, nil},
		{"no swap", cgroups.Reclaimed{Kept: cgroups.Kept{Shmem: 64 * mb, Anon: 2 * mb}},
			[]string{"64.0 MiB of shared memory (tmpfs files such as /dev/shm", "and 2.0 MiB of process memory", "the node has no swap"}},
		{"swap full", cgroups.Reclaimed{SwapFree: 10 * mb, SwapFreeAfter: 0, Kept: cgroups.Kept{Anon: 40 * mb}},
			[]string{"40.0 MiB of process memory stayed: the node's swap has 0.0 MiB free"}},
		{"locked", cgroups.Reclaimed{SwapFree: 512 * mb, SwapFreeAfter: 500 * mb, Kept: cgroups.Kept{Anon: 8 * mb, Locked: 8 * mb}},
			[]string{"8.0 MiB of process memory is locked in RAM"}},
		{"refused", cgroups.Reclaimed{SwapFree: 512 * mb, SwapFreeAfter: 500 * mb, Kept: cgroups.Kept{Shmem: 3 * mb}},
			[]string{"3.0 MiB of shared memory", "the kernel's reclaim did not take it"}},
		{"cache and kernel", cgroups.Reclaimed{SwapFree: 512 * mb, Kept: cgroups.Kept{Cache: 2 * mb, Kernel: 5 * mb}},
			[]string{"2.0 MiB of page cache stayed", "5.0 MiB is kernel memory"}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			got := keptReason(tt.r)
			if len(tt.want) == 0 && got != "" {
				t.Errorf("keptReason = %q, want none", got)
			}
			for _, w := range tt.want {
				if !strings.Contains(got, w) {
					t.Errorf("keptReason = %q, want it to say %q", got, w)
				}
			}
		})
	}
}

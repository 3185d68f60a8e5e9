package daemon

import (
	"runtime"
	"testing"

	"dsec.dev/dsec/internal/edge/sandbox"
)

// Limits left at 0 come from the node; set ones stay.
func TestFillDerivesLimitsFromNode(t *testing.T) {
	total, err := sandbox.MemTotalMB()
	if err != nil {
		t.Skipf("no /proc/meminfo: %v", err)
	}
	for _, tc := range []struct {
		name string
		in   sandbox.Limits
		want sandbox.Limits // the fields checked: MaxSandboxes, MaxCPUs, MaxMemoryMB
	}{
		{"derived", sandbox.Limits{}, sandbox.Limits{MaxSandboxes: defaultMaxSandboxes(total), MaxCPUs: float64(runtime.NumCPU()), MaxMemoryMB: total}},
		{"set", sandbox.Limits{MaxSandboxes: 1, MaxCPUs: 0.5, MaxMemoryMB: 100}, sandbox.Limits{MaxSandboxes: 1, MaxCPUs: 0.5, MaxMemoryMB: 100}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			c := Config{Root: t.TempDir(), Limits: tc.in}
			if err := c.fill(); err != nil {
				t.Fatal(err)
			}
			if got := c.Limits; got.MaxSandboxes != tc.want.MaxSandboxes || got.MaxCPUs != tc.want.MaxCPUs || got.MaxMemoryMB != tc.want.MaxMemoryMB {
				t.Errorf("limits %+v; want MaxSandboxes %d, MaxCPUs %v, MaxMemoryMB %d", got, tc.want.MaxSandboxes, tc.want.MaxCPUs, tc.want.MaxMemoryMB)
			}
		})
	}
}

func TestDefaultMaxSandboxes(t *testing.T) {
	for _, tc := range []struct {
		memTotalMB int64
		want       int
	}{
		{24105, 6026},    // 24 GiB: three times the old fixed 2,000
		{13 << 10, 3328}, // 13 GiB: 3,328 idle ones at the measured 3.4 MiB take 11.3 GiB
		{8 << 10, 2048},
		{1 << 10, 256},
		{256, 64}, // the floor
		{0, 64},
	} {
		if got := defaultMaxSandboxes(tc.memTotalMB); got != tc.want {
			t.Errorf("defaultMaxSandboxes(%d MiB) = %d, want %d", tc.memTotalMB, got, tc.want)
		}
	}
}

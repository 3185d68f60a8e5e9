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
		want sandbox.Limits // the fields checked: MaxCPUs, MaxMemoryMB
	}{
		{"derived", sandbox.Limits{}, sandbox.Limits{MaxCPUs: float64(runtime.NumCPU()), MaxMemoryMB: total}},
		{"set", sandbox.Limits{MaxCPUs: 0.5, MaxMemoryMB: 100}, sandbox.Limits{MaxCPUs: 0.5, MaxMemoryMB: 100}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			c := Config{Root: t.TempDir(), Limits: tc.in}
			if err := c.fill(); err != nil {
				t.Fatal(err)
			}
			if got := c.Limits; got.MaxCPUs != tc.want.MaxCPUs || got.MaxMemoryMB != tc.want.MaxMemoryMB {
				t.Errorf("limits %+v; want MaxCPUs %v, MaxMemoryMB %d", got, tc.want.MaxCPUs, tc.want.MaxMemoryMB)
			}
		})
	}
}

package bench

import (
	"slices"
	"strings"
	"testing"
)

func TestParseVMParts(t *testing.T) {
	for _, tc := range []struct {
		in   string
		want []string
		err  string
	}{
		{"", VMParts, ""},
		{"all", VMParts, ""},
		{"idle, cold", []string{"cold", "idle"}, ""},
		{"restore,pause,gvisor", []string{"pause", "gvisor"}, ""},
		{"cold,boot", nil, `no part "boot"`},
	} {
		got, err := ParseVMParts(tc.in)
		if tc.err != "" {
			if err == nil || !strings.Contains(err.Error(), tc.err) {
				t.Errorf("ParseVMParts(%q): error %v, want one saying %q", tc.in, err, tc.err)
			}
			continue
		}
		if err != nil || !slices.Equal(got, tc.want) {
			t.Errorf("ParseVMParts(%q) = %v, %v; want %v", tc.in, got, err, tc.want)
		}
	}
}

// The target lines follow the figures: the accelerator picks the cold
// target, a figure past its target is a MISS, and the shared-pages line
// without its figure is PENDING, never a verdict.
func TestVMReportChecks(t *testing.T) {
	r := &VMReport{Node: "n1", Accelerator: "tcg", GVisorPlatform: "systrap", Cores: 2, HostMemGiB: 23.5, MemoryMiB: 256,
		Parts:       VMParts,
		MicroVMCold: VMLatency{N: 5, P50: 3400, P90: 3900}, RuncCold: VMLatency{N: 10, P50: 40, P90: 50},
		Warm: VMLatency{N: 5, P50: 30, P90: 45}, WarmHits: 5,
		GVisorCold: VMLatency{N: 5, P50: 150, P90: 160},
		Pause:      &VMPause{ResumeExec: VMLatency{N: 5, P50: 200}, ResidentMiB: 300, ReleasedPct: 99, ReleasedMin: 95, ColdP50: 3400, RestoreFaster: 17},
		Shared:     &VMShared{VMs: 8, FileMiB: 200, MemoryMiB: 512, Blk: VMSharedSide{Node: "n1", Device: "virtio-blk", BeforeMiB: 1600, AfterMiB: 2400}, Pending: "pending"},
		Idle:       &VMIdle{VMs: 32, Started: 32, Answering: 32, MemMeanMiB: 190, MemMaxMiB: 200, CPUMeanPct: 1.5, CPUMaxPct: 3, CPUOver: 2},
	}
	r.Checks = r.checks()
	verdicts := map[string]string{}
	for _, c := range r.Checks {
		verdicts[c.Name] = c.Verdict
	}
	want := map[string]string{
		"microvm create → first exec p50, cold":                                           "MISS",
		"microvm create → first exec p50, warm pool":                                      "PASS",
		"restore from the memory snapshot → first exec vs a cold boot":                    "PASS",
		"pause: QEMU's host memory released (the least of any pause)":                     "PASS",
		"resume → first exec p50":                                                         "PASS",
		"8 microVMs of 512 MiB reading 200 MiB of a base layer: host memory shared / not": "PENDING",
		"32 idle microVMs of 256 MiB answer exec":                                         "PASS",
		"host memory per idle microVM (mean)":                                             "MISS",
		"CPU per idle microVM (mean)":                                                     "PASS",
	}
	for name, v := range want {
		if verdicts[name] != v {
			t.Errorf("%s: %q, want %s (all: %v)", name, verdicts[name], v, verdicts)
		}
	}
	if len(r.Checks) != len(want) {
		t.Errorf("%d target lines, want %d: %v", len(r.Checks), len(want), r.Checks)
	}

	var b strings.Builder
	r.Print(&b)
	out := b.String()
	for _, s := range []string{"microvm accelerator tcg", "gvisor systrap", "2 cores, 23.5 GiB RAM",
		"≤ 3000 ms under tcg", "85.0×", "17.0× (200 vs 3400 ms)", "shared: not measured", "PENDING"} {
		if !strings.Contains(out, s) {
			t.Errorf("the report lacks %q:\n%s", s, out)
		}
	}

	// With a node of shared pages the line has its ratio and verdict.
	r.Shared.Pmem = &VMSharedSide{Node: "n2", Device: "pmem", AfterMiB: 1200}
	r.Shared.HostCopyMiB = 200
	r.Shared.Ratio, r.Shared.Pending = 1400.0/2600, ""
	for _, c := range r.checks() {
		if strings.HasPrefix(c.Name, "8 microVMs") && (c.Verdict != "PASS" || !strings.HasPrefix(c.Value, "0.54× (1400 vs 2600 MiB")) {
			t.Errorf("shared line with pmem: %+v", c)
		}
	}

	// Under KVM the cold target is 300 ms.
	r.Accelerator = "kvm"
	r.MicroVMCold.P50 = 250
	if c := r.checks()[0]; c.Verdict != "PASS" || !strings.Contains(c.Target, "300 ms under kvm") {
		t.Errorf("kvm cold line: %+v", c)
	}

	// Floors: a miss whose floor is past the target is FLOOR, one whose
	// floor is under it MISS; either way the line shows the floor.
	r.Accelerator, r.MicroVMCold.P50 = "tcg", 3400
	r.Floor = VMLatency{N: 5, P50: 3100}
	r.Warm, r.WarmCreateCall, r.WarmSecondExec = VMLatency{N: 5, P50: 120}, VMLatency{N: 5, P50: 2}, VMLatency{N: 5, P50: 10}
	r.Idle.FloorVMs, r.Idle.FloorMemMiB, r.Idle.FloorCPUPct = 2, 150, 1.25
	floors := map[string][2]string{
		"microvm create → first exec p50, cold":      {"FLOOR", "3100 ms: QEMU + the kernel to a trivial init (+300 ms ours)"},
		"microvm create → first exec p50, warm pool": {"MISS", "12 ms: the claim + a warm guest's exec (+108 ms ours)"},
		"host memory per idle microVM (mean)":        {"FLOOR", "150 MiB: QEMU + the kernel idle at a trivial init (+40 MiB ours)"},
		"CPU per idle microVM (mean)":                {"PASS", "1.25 %: QEMU + the kernel idle at a trivial init (+0.25 ours)"},
	}
	for _, c := range r.checks() {
		if w, ok := floors[c.Name]; ok && (c.Verdict != w[0] || c.Floor != w[1]) {
			t.Errorf("%s: %s, floor %q; want %s, %q", c.Name, c.Verdict, c.Floor, w[0], w[1])
		}
	}
	r.Floor.P50 = 2500
	if c := r.checks()[0]; c.Verdict != "MISS" {
		t.Errorf("cold line with a floor under the target: %+v", c)
	}
}

package bench

import (
	"strings"
	"testing"
)

func TestLifecycleReportVerdicts(t *testing.T) {
	r := &LifecycleReport{Env: "busybox:bench", MemoryMiB: 512, PauseReleases: "page cache only",
		Frozen: Latency{N: 10, P50: 12}, ReleaseRate: 300, ReleasedMiB: 500, ResidentMiB: 510, Released90: 10,
		ResumeExecKept: Latency{N: 10, P50: 60}, ResumeExecPaged: Latency{N: 5, P99: 900},
		TouchPrefetched: Latency{N: 5, P50: 100}, TouchFaulted: Latency{N: 5, P50: 400}, PrefetchGain: 4,
		Notes: []string{"the node has no swap"}}
	var b strings.Builder
	r.Print(&b)
	out := b.String()
	for _, want := range []string{
		"pause to frozen p50 12.0 ms   target <= 100 ms   PASS",
		"at 300 MiB/s   target >= 250 MiB/s   PASS",
		"memory kept: p50 60.0 ms   target <= 50 ms   MISS",
		"paged out: p99 900.0 ms   target <= 1000 ms   PASS",
		"4.0x (p50 400.0 vs 100.0 ms)   target >= 5x   MISS",
		"note: the node has no swap",
	} {
		if !strings.Contains(out, want) {
			t.Errorf("report lacks %q:\n%s", want, out)
		}
	}
	// No figures measured is never a pass.
	b.Reset()
	(&LifecycleReport{}).Print(&b)
	if strings.Contains(b.String(), "PASS") {
		t.Errorf("an empty report passes a target:\n%s", b.String())
	}
}

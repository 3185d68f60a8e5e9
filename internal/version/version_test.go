package version

import (
	"runtime/debug"
	"strings"
	"testing"
)

func TestDescribe(t *testing.T) {
	for _, tc := range []struct {
		name string
		bi   debug.BuildInfo
		want string
	}{
		{"a git checkout", debug.BuildInfo{GoVersion: "go1.26.8", Main: debug.Module{Version: "v0.0.0-20261205173022-36c52f9614f7"},
			Settings: []debug.BuildSetting{{Key: "vcs.revision", Value: "36c52f9614f7515b23794d683d3dd356a7718c8c"},
				{Key: "vcs.time", Value: "2026-12-05T17:30:22Z"}, {Key: "vcs.modified", Value: "true"}}},
			"dsec v0.0.0-20261205173022-36c52f9614f7 (commit 36c52f9614f7, 2026-12-05T17:30:22Z, modified, go1.26.8)"},
		{"go install @version", debug.BuildInfo{GoVersion: "go1.26.8", Main: debug.Module{Version: "v1.2.3"}},
			"dsec v1.2.3 (go1.26.8)"},
		{"no VCS stamp", debug.BuildInfo{GoVersion: "go1.26.8", Main: debug.Module{Version: "(devel)"}},
			"dsec (devel) (no VCS stamp: built outside a git checkout or with -buildvcs=false; go1.26.8)"},
	} {
		if got := describe("dsec", &tc.bi); got != tc.want {
			t.Errorf("%s: %q, want %q", tc.name, got, tc.want)
		}
	}
	// This test binary has build information of its own.
	if got := String("dsec"); !strings.HasPrefix(got, "dsec ") || !strings.Contains(got, "go1.") {
		t.Errorf("String = %q", got)
	}
}

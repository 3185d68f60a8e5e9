package bench

import (
	"testing"
	"time"
)

// A mixed call is late past verl's HTTP timeout for it: compile_timeout +
// run_timeout + 10 s, SandboxFusion's default compile_timeout when unset.
func TestMixedCallClientTimeout(t *testing.T) {
	want := map[string]time.Duration{"python": 25 * time.Second, "cpp": 45 * time.Second, "bash": 25 * time.Second}
	seen := map[string]bool{}
	for _, mc := range mixedCalls() {
		lang := mc.req["language"].(string)
		if got := mc.clientTimeout(); got != want[lang] {
			t.Errorf("%s call %q: client timeout %s, want %s", lang, mc.req["code"], got, want[lang])
		}
		seen[lang] = true
	}
	for lang := range want {
		if !seen[lang] {
			t.Errorf("the mixed burst sends no %s call", lang)
		}
	}
}

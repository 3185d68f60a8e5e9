package bench

import (
	"strings"
	"testing"
)

func TestPerSandboxMiB(t *testing.T) {
	if got, method := perSandboxMiB(300, 100); got != 3 || method != idleMemoryMethod {
		t.Errorf("grown by 300 MiB over 100: %v %q", got, method)
	}
	got, method := perSandboxMiB(-10, 200)
	if got != 0 || !strings.Contains(method, "not measured") {
		t.Errorf("shrunk: %v %q, want 0 and a method saying it was not measured", got, method)
	}
	if got, _ := perSandboxMiB(300, 0); got != 0 {
		t.Errorf("no sandboxes: %v", got)
	}
}

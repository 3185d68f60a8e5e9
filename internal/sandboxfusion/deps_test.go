package sandboxfusion

import (
	"bytes"
	"io"
	"os/exec"
	"strings"
	"testing"

	"dsec.dev/dsec/internal/testutil"
)

// TestDependencies: the apiserver serves this package, so it imports no
// edge or agent package.
func TestDependencies(t *testing.T) {
	testutil.RequireCommand(t, "go")
	out, err := exec.Command("go", "list", "-deps", ".").Output()
	if err != nil {
		t.Fatalf("go list -deps: %v", err)
	}
	for _, dep := range strings.Fields(string(out)) {
		if strings.HasPrefix(dep, "dsec.dev/dsec/internal/edge") || strings.HasPrefix(dep, "dsec.dev/dsec/internal/agent") {
			t.Errorf("imports %s", dep)
		}
	}
}

func bytesReader(b []byte) io.Reader { return bytes.NewReader(b) }

func splitLines(s string) []string { return strings.Split(s, "\n") }

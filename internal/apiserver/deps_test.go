package apiserver

import (
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	"dsec.dev/dsec/internal/agent/execwire"
	"dsec.dev/dsec/internal/testutil"
)

// TestDependencies keeps the seams honest: the apiserver reaches edges
// through EdgeService only, so it imports no edge or agent package (a
// cluster's apiserver runs on machines with no sandboxes), and the SDKs
// import no server code.
func TestDependencies(t *testing.T) {
	testutil.RequireCommand(t, "go")
	for _, tc := range []struct {
		dir, pkg  string
		forbidden []string
	}{
		{".", "./internal/apiserver", []string{"dsec.dev/dsec/internal/edge/", "dsec.dev/dsec/internal/agent/"}},
		{".", "./internal/edgeclient", []string{"dsec.dev/dsec/internal/edge/", "dsec.dev/dsec/internal/agent/"}},
		{"sdk/go", "./...", []string{"dsec.dev/dsec/internal/"}},
	} {
		cmd := exec.Command("go", "list", "-deps", tc.pkg)
		cmd.Dir = filepath.Join(testutil.RepoRoot(), tc.dir)
		out, err := cmd.Output()
		if err != nil {
			t.Fatalf("go list -deps %s in %s: %v", tc.pkg, tc.dir, err)
		}
		for _, dep := range strings.Fields(string(out)) {
			for _, f := range tc.forbidden {
				if strings.HasPrefix(dep, f) {
					t.Errorf("%s imports %s", tc.pkg, dep)
				}
			}
		}
	}
}

// TestExecStdinLimit: the apiserver's limit fits the agent channel's frame.
func TestExecStdinLimit(t *testing.T) {
	if maxExecStdin != execwire.MaxStdin {
		t.Errorf("maxExecStdin = %d, execwire.MaxStdin = %d", maxExecStdin, execwire.MaxStdin)
	}
}

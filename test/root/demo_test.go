package root

import (
	"encoding/json"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
	"time"

	"dsec.dev/dsec/internal/testutil"
)

// TestDemoRollouts runs the README's main job (demo/rollout.py through the
// Python SDK) on a real Debian base layer and checks the rewards it earns.
func TestDemoRollouts(t *testing.T) {
	testutil.RequireCommand(t, "debootstrap")
	python := testutil.RequireCommand(t, "python3")
	d := testutil.StartDaemon(t)
	repo := testutil.RepoRoot()

	tree := t.TempDir()
	if out, err := exec.Command(filepath.Join(repo, "scripts", "build-debian-base.sh"), tree).CombinedOutput(); err != nil {
		t.Fatalf("build Debian base: %v\n%s", err, out)
	}
	for _, l := range []struct{ kind, ref, dir string }{
		{"base", "debian:test", tree},
		{"workspace", "textstats:1", filepath.Join(repo, "demo", "workspace")},
		{"toolkit", "harness:1", filepath.Join(repo, "demo", "toolkit")},
	} {
		args := []string{"layer", "import", "--kind", l.kind, l.ref, l.dir}
		if l.kind == "base" {
			args = append(args[:2], append([]string{"--allow-setuid"}, args[2:]...)...)
		}
		if out, errOut, code := d.CLI("", args...); code != 0 {
			t.Fatalf("import %s: %s %s", l.ref, out, errOut)
		}
	}
	os.RemoveAll(tree)

	cmd := exec.Command(python, filepath.Join(repo, "demo", "rollout.py"),
		"--addr", d.Addr, "--env", "debian:test+textstats:1+harness:1", "-n", "12", "--json")
	cmd.Env = append(os.Environ(), "PYTHONPATH="+filepath.Join(repo, "sdk", "python"), "DSEC_TOKEN_FILE="+d.TokenFile())
	out, err := cmd.CombinedOutput()
	if err != nil {
		t.Fatalf("rollout: %v\n%s", err, out)
	}
	lines := strings.Split(strings.TrimSpace(string(out)), "\n")
	var rows []struct {
		Patch  string  `json:"patch"`
		Reward float64 `json:"reward"`
		Error  string  `json:"error"`
		Warm   bool    `json:"warm"`
	}
	if err := json.Unmarshal([]byte(lines[len(lines)-1]), &rows); err != nil {
		t.Fatalf("rollout JSON: %v\n%s", err, out)
	}
	if len(rows) != 12 {
		t.Fatalf("%d rollouts, want 12", len(rows))
	}
	want := map[string]func(float64) bool{
		"01-correct-fix":       func(r float64) bool { return r == 1 },
		"04-syntax-error":      func(r float64) bool { return r == 0 },
		"05-statistics-module": func(r float64) bool { return r == 1 },
		"06-edits-the-test":    func(r float64) bool { return r < 1 }, // the grader restores the tests
	}
	warm := 0
	for _, r := range rows {
		if r.Warm {
			warm++
		}
		if r.Error != "" {
			t.Errorf("%s: %s", r.Patch, r.Error)
		}
		if ok, known := want[r.Patch]; known && !ok(r.Reward) {
			t.Errorf("%s earned %.2f", r.Patch, r.Reward)
		}
	}
	// Midway it is preempted: it pauses the batch and resumes it, and the
	// rollouts caught mid-command carry on (no errors above).
	if !regexp.MustCompile(`preemption: [1-9][0-9]* sandboxes paused in .* resumed in`).Match(out) {
		t.Errorf("the demo did not pause and resume its batch:\n%s", out)
	}
	// The demo fills a warm pool of 8 before its 12 rollouts start.
	if warm == 0 {
		t.Errorf("no rollout took its sandbox from the warm pool\n%s", out)
	}
	// Its pool is removed at the end: the members drain in the background.
	deadline := time.Now().Add(30 * time.Second)
	for {
		out, errOut, code := d.CLI("", "pool", "ls", "--json")
		if code != 0 {
			t.Fatalf("pool ls after the demo: %s", errOut)
		}
		if !strings.Contains(out, "debian:test") {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("the demo left its warm pool: %s", out)
		}
		time.Sleep(100 * time.Millisecond)
	}
}

// TestDemoE2BEpisodes runs the demo's last step: the rollouts as an agent
// framework on E2B's official SDK runs them (demo/e2b/episodes.mjs, npm
// e2b as locked there), on the daemon's E2B API over E2B's base
// environment with the demo's layers, preempted through E2B's pause and
// connect.
func TestDemoE2BEpisodes(t *testing.T) {
	node := requireNode(t)
	testutil.E2BBaseTree(t)
	repo := testutil.RepoRoot()
	dir := filepath.Join(repo, "demo", "e2b")
	npmCI(t, dir)
	d := testutil.StartDaemon(t)
	d.ImportE2BBase()
	for _, l := range []struct{ kind, ref, dir string }{
		{"workspace", "textstats:1", filepath.Join(repo, "demo", "workspace")},
		{"toolkit", "harness:1", filepath.Join(repo, "demo", "toolkit")},
	} {
		if out, errOut, code := d.CLI("", "layer", "import", "--kind", l.kind, l.ref, l.dir); code != 0 {
			t.Fatalf("import %s: %s %s", l.ref, out, errOut)
		}
	}
	cmd := exec.Command(node, filepath.Join(dir, "episodes.mjs"), "--template", testutil.E2BBaseEnv+":latest+textstats:1+harness:1", "-n", "8", "--json")
	cmd.Env = sdkEnv(d)
	out, err := cmd.CombinedOutput()
	if err != nil {
		t.Fatalf("episodes: %v\n%s", err, out)
	}
	lines := strings.Split(strings.TrimSpace(string(out)), "\n")
	var rows []struct {
		Patch  string  `json:"patch"`
		Reward float64 `json:"reward"`
		Error  string  `json:"error"`
	}
	if err := json.Unmarshal([]byte(lines[len(lines)-1]), &rows); err != nil {
		t.Fatalf("episodes JSON: %v\n%s", err, out)
	}
	if len(rows) != 8 {
		t.Fatalf("%d episodes, want 8", len(rows))
	}
	want := map[string]func(float64) bool{
		"01-correct-fix":       func(r float64) bool { return r == 1 },
		"04-syntax-error":      func(r float64) bool { return r == 0 },
		"05-statistics-module": func(r float64) bool { return r == 1 },
		"06-edits-the-test":    func(r float64) bool { return r < 1 }, // the trusted tests are put back
	}
	for _, r := range rows {
		if r.Error != "" {
			t.Errorf("%s: %s", r.Patch, r.Error)
		}
		if ok, known := want[r.Patch]; known && !ok(r.Reward) {
			t.Errorf("%s earned %.2f", r.Patch, r.Reward)
		}
	}
	if !regexp.MustCompile(`preempted: [1-9][0-9]* sandboxes paused in .* resumed by connect in`).Match(out) {
		t.Errorf("the episodes were not paused and resumed through E2B:\n%s", out)
	}
	checkNoSandboxes(t, d)
}

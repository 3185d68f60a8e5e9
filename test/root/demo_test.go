package root

import (
	"encoding/json"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"testing"
	"time"

	"dsec.dev/dsec/internal/grade"
	"dsec.dev/dsec/internal/testutil"
)

// TestDemoRollouts runs the README's main job (demo/rollout.py through the
// Python SDK) on a real Debian base layer and checks the rewards it earns:
// the coding batch in containers and, where the node has QEMU and the guest
// kernel (always under DSEC_TEST_ROOT=1), the systems batch beside it in
// four microVMs, whose tasks a container refuses; the preemption pauses
// both batches, the microVMs to disk, and no rollout fails of it; the
// trainer follows the lifecycle events and sees every rollout's create,
// delete, pause and resume.
func TestDemoRollouts(t *testing.T) {
	testutil.RequireCommand(t, "debootstrap")
	python := testutil.RequireCommand(t, "python3")
	var args []string
	// The microVM batch runs in the all-in-one pass: its boots behind an
	// apiserver would prove nothing more and cost CI's two cores ~30 s.
	systems := (os.Getenv("DSEC_VM_MODULES_DIR") != "" || testutil.Strict()) && !testutil.ClusterMode()
	var modulesDir string
	if systems {
		modulesDir = testutil.VMModulesDir(t)
		args = append(args, "--vm-kernel-dir", testutil.VMKernelDir(t))
	}
	d := testutil.StartDaemon(t, args...)
	repo := testutil.RepoRoot()

	tree := demoBaseTree(t)
	layers := []struct{ kind, ref, dir string }{
		{"base", "debian:test", tree},
		{"workspace", "textstats:1", filepath.Join(repo, "demo", "workspace")},
		{"toolkit", "harness:1", filepath.Join(repo, "demo", "toolkit")},
	}
	if systems {
		layers = append(layers,
			struct{ kind, ref, dir string }{"toolkit", "vm-modules:test", modulesDir},
			struct{ kind, ref, dir string }{"workspace", "systems:1", filepath.Join(repo, "demo", "systems", "layer")})
	}
	for _, l := range layers {
		args := []string{"layer", "import", "--kind", l.kind, l.ref, l.dir}
		if l.kind == "base" {
			args = append(args[:2], append([]string{"--allow-setuid"}, args[2:]...)...)
		}
		if out, errOut, code := d.CLI("", args...); code != 0 {
			t.Fatalf("import %s: %s %s", l.ref, out, errOut)
		}
	}

	demoArgs := []string{filepath.Join(repo, "demo", "rollout.py"),
		"--addr", d.Addr, "--env", "debian:test+textstats:1+harness:1", "-n", "12", "--json",
		// The rollouts at the latency class: beside CI's other packages'
		// tests, best-effort ones (the demo's default) would wait for all
		// of them (docs/qos.md).
		"--qos", "latency"}
	if systems {
		demoArgs = append(demoArgs, "--systems-env", "debian:test+vm-modules:test+systems:1")
	}
	cmd := exec.Command(python, demoArgs...)
	cmd.Env = append(os.Environ(), "PYTHONPATH="+filepath.Join(repo, "sdk", "python"), "DSEC_TOKEN_FILE="+d.TokenFile())
	out, err := cmd.CombinedOutput()
	if err != nil {
		t.Fatalf("rollout: %v\n%s", err, out)
	}
	lines := strings.Split(strings.TrimSpace(string(out)), "\n")
	var report struct {
		Coding []struct {
			Patch  string  `json:"patch"`
			Reward float64 `json:"reward"`
			Error  string  `json:"error"`
			Warm   bool    `json:"warm"`
		} `json:"coding"`
		Systems *systemsReport `json:"systems"`
		Events  map[string]int `json:"events"`
		Cost    map[string]struct {
			Sandboxes  int     `json:"sandboxes"`
			CPUSeconds float64 `json:"cpu_seconds"`
		} `json:"cost"`
	}
	if err := json.Unmarshal([]byte(lines[len(lines)-1]), &report); err != nil {
		t.Fatalf("rollout JSON: %v\n%s", err, out)
	}
	rows := report.Coding
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
	if !regexp.MustCompile(`preemption: [1-9][0-9]* sandboxes paused( \(.*\))? in .* resumed in`).Match(out) {
		t.Errorf("the demo did not pause and resume its batch:\n%s", out)
	}
	// The trainer followed the batch's lifecycle events as they came: every
	// rollout's create and delete, the preemption's pauses and resumes.
	if ev := report.Events; ev["created"] < 12 || ev["deleted"] < 12 || ev["paused"] < 1 || ev["resumed"] < 1 || ev["failed"] > 0 {
		t.Errorf("the events the demo followed: %v, want at least 12 created and deleted, pauses and resumes, no failure\n%s", ev, out)
	}
	// At the end it prints what the batch cost by patch, from the cost
	// ledger: every rollout's sandbox counted, each patch's CPU time above 0.
	costed := 0
	for patch, c := range report.Cost {
		costed += c.Sandboxes
		if c.CPUSeconds <= 0 {
			t.Errorf("the ledger's CPU time of patch %s's rollouts: %v s\n%s", patch, c.CPUSeconds, out)
		}
	}
	if costed < 12 || !strings.Contains(string(out), "cost by patch") {
		t.Errorf("the demo's cost by patch counted %d sandboxes, want the 12 rollouts'\n%s", costed, out)
	}
	// The demo fills a warm pool of 8 before its 12 rollouts start.
	if warm == 0 {
		t.Errorf("no rollout took its sandbox from the warm pool\n%s", out)
	}
	if systems {
		checkSystems(t, report.Systems, out)
		// The preemption pauses the microVMs too (to disk), and their
		// tasks carry on: checkSystems saw no errors.
		m := regexp.MustCompile(`preemption: [0-9]+ sandboxes paused \(([0-9]+) microVMs among them, ([0-9]+) mid-task\)`).FindSubmatch(out)
		if m == nil || string(m[1]) == "0" {
			t.Errorf("the preemption paused no microVM:\n%s", out)
		} else {
			t.Logf("the preemption paused %s microVMs, %s of them mid-task", m[1], m[2])
		}
	}
	// Its pool is removed at the end: the members drain in the background.
	// The grade pools its grades asked for (clean rooms, host name
	// dsec-grade) are the platform's and stay until they idle out.
	deadline := time.Now().Add(30 * time.Second)
	for {
		out, errOut, code := d.CLI("", "pool", "ls", "--json")
		if code != 0 {
			t.Fatalf("pool ls after the demo: %s", errOut)
		}
		var list struct {
			Pools []struct {
				Spec struct{ Environment, Hostname string }
			}
		}
		if err := json.Unmarshal([]byte(out), &list); err != nil {
			t.Fatalf("pool ls --json printed %q: %v", out, err)
		}
		left := false
		for _, p := range list.Pools {
			if strings.Contains(p.Spec.Environment, "debian:test") && p.Spec.Hostname != grade.RoomHostname {
				left = true
			}
		}
		if !left {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("the demo left its warm pool: %s", out)
		}
		time.Sleep(100 * time.Millisecond)
	}
}

// demoBaseTree is the demo's Debian base with the systems batch's tools
// (scripts/build-demo-debian.sh): the tree DSEC_DEMO_BASE_TREE names, built
// once for both of CI's passes, else one built for t (over a minute of
// debootstrap) and removed when it ends.
func demoBaseTree(t *testing.T) string {
	t.Helper()
	if tree := os.Getenv("DSEC_DEMO_BASE_TREE"); tree != "" {
		if _, err := os.Stat(filepath.Join(tree, "etc", "dsec-demo-debian")); err != nil {
			t.Fatalf("DSEC_DEMO_BASE_TREE=%s is no finished demo base (scripts/build-demo-debian.sh %s): %v", tree, tree, err)
		}
		return tree
	}
	tree := filepath.Join(t.TempDir(), "debian")
	if out, err := exec.Command(filepath.Join(testutil.RepoRoot(), "scripts", "build-demo-debian.sh"), tree).CombinedOutput(); err != nil {
		t.Fatalf("build the demo's Debian base: %v\n%s", err, out)
	}
	return tree
}

// systemsReport is the JSON of demo/systems_batch.py's report.
type systemsReport struct {
	Accelerator string `json:"accelerator"`
	Missing     string `json:"missing"`
	Refusal     string `json:"refusal"`
	Rows        []struct {
		Candidate string   `json:"candidate"`
		Reward    float64  `json:"reward"`
		Failed    []string `json:"failed"`
		Error     string   `json:"error"`
		Masked    string   `json:"masked"`
		MaskedBy  string   `json:"masked_by"`
	} `json:"rows"`
}

// checkSystems checks the systems batch: run in microVMs under a named
// accelerator, refused in a container by its first mount, and each
// candidate's reward the one its end state earns (the wrong port fails the
// firewall checks, the forgotten loop module everything after the tmpfs);
// at most one rollout masked by a platform fault, which is logged.
func checkSystems(t *testing.T, r *systemsReport, out []byte) {
	t.Helper()
	if r == nil || r.Accelerator == "" {
		t.Fatalf("no systems batch ran (%+v)\n%s", r, out)
	}
	if !strings.Contains(r.Refusal, "permission denied") {
		t.Errorf("the container's attempt at the task: %q, want mount's permission denied", r.Refusal)
	}
	want := map[string]float64{"01-complete": 1, "02-drops-wrong-port": 0, "03-forgets-loop-module": 0, "04-network-first": 1}
	if len(r.Rows) != len(want) {
		t.Fatalf("%d systems rollouts, want %d\n%s", len(r.Rows), len(want), out)
	}
	masked := 0
	for _, row := range r.Rows {
		if row.Error != "" {
			t.Errorf("%s: %s", row.Candidate, row.Error)
			continue
		}
		if row.Masked != "" {
			// A platform fault (a microVM under TCG on a loaded 2-core
			// node) masks the rollout, as a trainer's loop would: never
			// scored, left out. One of four may be; say which and why.
			masked++
			t.Logf("%s masked: %s (%s)", row.Candidate, row.Masked, row.MaskedBy)
			continue
		}
		if row.Reward != want[row.Candidate] {
			t.Errorf("%s earned %.0f (failed %v), want %.0f", row.Candidate, row.Reward, row.Failed, want[row.Candidate])
		}
		if row.Candidate == "02-drops-wrong-port" && !slices.Contains(row.Failed, "firewall") {
			t.Errorf("%s failed %v, want the firewall check among them", row.Candidate, row.Failed)
		}
		if row.Candidate == "03-forgets-loop-module" && (!slices.Contains(row.Failed, "loop_ext4") || slices.Contains(row.Failed, "tmpfs")) {
			t.Errorf("%s failed %v, want loop_ext4 and not tmpfs", row.Candidate, row.Failed)
		}
	}
	if masked > 1 {
		t.Errorf("%d of %d systems rollouts masked by platform faults, want at most one\n%s", masked, len(r.Rows), out)
	}
	t.Logf("systems batch under %s: %s", r.Accelerator, r.Refusal)
}

// testDemoE2BEpisodes (TestE2BBase/DemoEpisodes) runs the demo's last step: the rollouts as an agent
// framework on E2B's official SDK runs them (demo/e2b/episodes.mjs, npm
// e2b as locked there), on the daemon's E2B API over E2B's base
// environment with the demo's layers, preempted through E2B's pause and
// connect.
func testDemoE2BEpisodes(t *testing.T, d *testutil.Daemon) {
	node := requireNode(t)
	repo := testutil.RepoRoot()
	dir := filepath.Join(repo, "demo", "e2b")
	npmCI(t, dir)
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

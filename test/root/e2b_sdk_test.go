package root

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"connectrpc.com/connect"

	dsecv1 "dsec.dev/dsec/api/gen/dsec/v1"
	"dsec.dev/dsec/internal/bench"
	"dsec.dev/dsec/internal/testutil"
)

// e2bSuiteDir is the Node suite of the official E2B SDKs (package.json pins
// them, package-lock.json locks them).
func e2bSuiteDir() string { return filepath.Join(testutil.RepoRoot(), "test", "e2b") }

// TestE2BBase runs every test on E2B's base environment against one dsecd
// of the pass, which imports it once: the official SDKs, the code
// interpreter, the files API, the syscalls provenance records and the
// demo's E2B episodes. Each imported the environment into a dsecd of its
// own, in both passes. The subtests run one after another, each deleting
// what it made, so that those checking that no sandbox is left (the SDKs',
// the demo's) see only their own.
func TestE2BBase(t *testing.T) {
	testutil.E2BBaseTree(t)
	d := testutil.StartDaemon(t)
	d.ImportE2BBase()
	run := func(name string, f func(*testing.T, *testutil.Daemon)) {
		t.Run(name, func(t *testing.T) { f(t, d.For(t)) })
	}
	run("SDK", testE2BSDK)
	run("Interpreter", testE2BInterpreter)
	run("Files", testE2BFilesOnE2BBase)
	run("ProvenanceSyscalls", testProvenanceSyscalls)
	run("DemoEpisodes", testDemoE2BEpisodes)
}

// testE2BSDK (TestE2BBase/SDK) runs the official E2B SDKs, unchanged,
// against the daemon's E2B API: the pinned versions of
// test/e2b/package-lock.json, then the newest ones of the npm registry.
// Each is configured only as users configure it: E2B_API_URL,
// E2B_SANDBOX_URL and E2B_API_KEY.
func testE2BSDK(t *testing.T, d *testutil.Daemon) {
	node := requireNode(t)
	npmCI(t, e2bSuiteDir())
	env := sdkEnv(d)

	t.Run("Pinned", func(t *testing.T) {
		runE2BSuite(t, node, e2bSuiteDir(), env)
		checkNoSandboxes(t, d)
	})
	t.Run("Newest", func(t *testing.T) {
		if testutil.ClusterMode() {
			t.Skip("the newest SDK runs once, against the all-in-one dsecd (the pinned one covers the cluster's path)")
		}
		dir := installNewestSDK(t)
		runE2BSuite(t, node, dir, env)
		checkNoSandboxes(t, d)
	})
	t.Run("Bench", func(t *testing.T) { smallE2BBench(t, d, node) })
}

// smallE2BBench runs a small `dsec bench e2b` and checks that every figure
// was measured and nothing is left behind; it asserts no timing.
func smallE2BBench(t *testing.T, d *testutil.Daemon, node string) {
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	url := "http://" + d.E2BAddr
	rep, err := bench.RunE2B(ctx, d.Clients, bench.E2BOptions{Node: node, Script: filepath.Join(e2bSuiteDir(), "bench.mjs"),
		APIURL: url, SandboxURL: url, APIKey: d.E2BKey(), DsecAddr: d.Addr, Template: "base", Rounds: 2, Warm: 1, Runs: 30})
	if err != nil {
		t.Fatal(err)
	}
	var out strings.Builder
	rep.Print(&out)
	t.Logf("dsec bench e2b (small):\n%s", out.String())
	for name, l := range map[string]bench.Latency{"cold e2b": rep.Cold.E2B, "cold dsec": rep.Cold.Dsec, "warm e2b": rep.Warm.E2B,
		"warm dsec": rep.Warm.Dsec, "run e2b": rep.Run.E2B, "exec dsec": rep.Run.Dsec, "exec bash": rep.Run.DsecBash, "cold bash": rep.Cold.DsecBash,
		"cold e2b instant": rep.Cold.E2BFloor, "cold dsec instant": rep.Cold.DsecFloor, "warm e2b instant": rep.Warm.E2BFloor,
		"run e2b instant": rep.Run.E2BFloor, "exec dsec instant": rep.Run.DsecFloor} {
		if l.N == 0 || l.P50 <= 0 || l.P99 < l.P50 || l.Max < l.P99 {
			t.Errorf("%s: not a distribution: %+v", name, l)
		}
	}
	if rep.Run.E2B.N != 30 || rep.Run.Dsec.N != 30 || rep.Cold.E2B.N != 2 || rep.Warm.Dsec.N != 2 || rep.Run.E2BFloor.N != 30 || rep.Warm.DsecFloor.N != 2 {
		t.Errorf("counts: %+v", rep)
	}
	for name, p := range map[string]bench.E2BPair{"cold": rep.Cold, "warm": rep.Warm, "run": rep.Run} {
		// Nothing dsec does is free: the best an adapter could do lies
		// above the SDK's instant-server figure.
		if z := p.ZeroCost(); z <= p.E2BFloor.P50 {
			t.Errorf("%s: zero-cost adapter figure %.3f ms is not above the SDK's instant-server p50 %.3f ms", name, z, p.E2BFloor.P50)
		}
	}
	if rep.WarmHitsOwn != 2 {
		t.Errorf("dsec's warm rounds were served by the pool %d times of 2", rep.WarmHitsOwn)
	}
	checkNoSandboxes(t, d)
}

// requireNode returns node's path; without node and npm the test skips,
// or fails under DSEC_TEST_ROOT=1.
func requireNode(t *testing.T) string {
	t.Helper()
	node, err := exec.LookPath("node")
	_, errNpm := exec.LookPath("npm")
	testutil.Require(t, err == nil && errNpm == nil, "node and npm are not installed (apt-get install nodejs npm): the E2B SDK suite needs them")
	out, err := exec.Command(node, "--version").Output()
	if err != nil {
		t.Fatalf("node --version: %v", err)
	}
	// The SDKs' own floor (their package.json engines).
	var major, minor int
	fmt.Sscanf(strings.TrimPrefix(strings.TrimSpace(string(out)), "v"), "%d.%d", &major, &minor)
	testutil.Require(t, major > 20 || (major == 20 && minor >= 18),
		"node "+strings.TrimSpace(string(out))+" is older than 20.18.1, which the E2B SDKs need (.ci/run installs one)")
	return node
}

// sdkEnv is the environment of the SDK's process: this one's without any
// E2B_ setting, plus the three that point the SDK at d.
func sdkEnv(d *testutil.Daemon) []string {
	var env []string
	for _, kv := range os.Environ() {
		if !strings.HasPrefix(kv, "E2B_") {
			env = append(env, kv)
		}
	}
	url := "http://" + d.E2BAddr
	return append(env, "E2B_API_URL="+url, "E2B_SANDBOX_URL="+url, "E2B_API_KEY="+d.E2BKey())
}

// npmInstalls remembers, per directory, the outcome of its npm ci.
var npmInstalls sync.Map // dir → *npmInstall

type npmInstall struct {
	once    sync.Once
	failure string
}

// npmCI installs the packages dir's package-lock.json pins into
// dir/node_modules with npm ci, unless an install of the same lockfile is
// there already.
func npmCI(t *testing.T, dir string) {
	t.Helper()
	v, _ := npmInstalls.LoadOrStore(dir, &npmInstall{})
	in := v.(*npmInstall)
	in.once.Do(func() {
		lock, err := os.Stat(filepath.Join(dir, "package-lock.json"))
		if err != nil {
			in.failure = err.Error()
			return
		}
		// npm keeps a copy of the lockfile it installed in node_modules.
		if installed, err := os.Stat(filepath.Join(dir, "node_modules", ".package-lock.json")); err == nil &&
			!installed.ModTime().Before(lock.ModTime()) && fileExists(filepath.Join(dir, "node_modules", "e2b", "package.json")) {
			return
		}
		cmd := exec.Command("npm", "ci", "--no-audit", "--no-fund")
		cmd.Dir = dir
		if out, err := cmd.CombinedOutput(); err != nil {
			in.failure = fmt.Sprintf("npm ci in %s: %v\n%s", dir, err, out)
		}
	})
	if in.failure != "" {
		t.Fatal(in.failure)
	}
}

// installNewestSDK installs the registry's newest e2b and
// @e2b/code-interpreter into a temporary directory with the suite's files
// beside them, and returns the directory.
func installNewestSDK(t *testing.T) string {
	t.Helper()
	dir := t.TempDir()
	pkg := `{"name": "dsec-e2b-newest", "private": true, "type": "module"}`
	if err := os.WriteFile(filepath.Join(dir, "package.json"), []byte(pkg), 0o644); err != nil {
		t.Fatal(err)
	}
	cmd := exec.Command("npm", "install", "--prefix", dir, "--no-audit", "--no-fund", "--no-save",
		"e2b@latest", "@e2b/code-interpreter@latest")
	out, err := cmd.CombinedOutput()
	testutil.Require(t, err == nil, fmt.Sprintf("npm install of the newest E2B SDKs failed (is the npm registry reachable?): %v\n%s", err, out))
	files, err := filepath.Glob(filepath.Join(e2bSuiteDir(), "*.mjs"))
	if err != nil || len(files) == 0 {
		t.Fatalf("the suite's files: %v", err)
	}
	for _, f := range files {
		b, err := os.ReadFile(f)
		if err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(filepath.Join(dir, filepath.Base(f)), b, 0o644); err != nil {
			t.Fatal(err)
		}
	}
	for _, p := range []string{"e2b", "@e2b/code-interpreter"} {
		b, err := os.ReadFile(filepath.Join(dir, "node_modules", p, "package.json"))
		if err != nil {
			t.Fatalf("the newest %s is not installed: %v", p, err)
		}
		var v struct{ Version string }
		json.Unmarshal(b, &v)
		t.Logf("newest %s: %s", p, v.Version)
	}
	return dir
}

// runE2BSuite runs the suite's test files in dir with node --test and
// fails with node's output when any test fails.
func runE2BSuite(t *testing.T, node, dir string, env []string) {
	t.Helper()
	files, err := filepath.Glob(filepath.Join(dir, "*.test.mjs"))
	if err != nil || len(files) == 0 {
		t.Fatalf("no test files in %s: %v", dir, err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Minute)
	defer cancel()
	// One file at a time: the 50-sandbox file alone is what a 2-core
	// machine should carry.
	args := append([]string{"--test", "--test-reporter=spec", "--test-concurrency=1"}, files...)
	cmd := exec.CommandContext(ctx, node, args...)
	cmd.Dir = dir
	cmd.Env = env
	out, err := cmd.CombinedOutput()
	if err != nil {
		t.Fatalf("node --test in %s: %v\n%s", dir, err, out)
	}
	t.Logf("node --test in %s:\n%s", dir, tailLines(string(out), 40))
}

// checkNoSandboxes fails when a sandbox the suite made is still live a
// few seconds on (a kill's teardown takes a moment).
func checkNoSandboxes(t *testing.T, d *testutil.Daemon) {
	t.Helper()
	deadline := time.Now().Add(15 * time.Second)
	for {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		resp, err := d.Clients.Sandboxes.List(ctx, connect.NewRequest(&dsecv1.ListRequest{}))
		cancel()
		if err != nil {
			t.Fatalf("list sandboxes: %v", err)
		}
		var left []string
		for _, sb := range resp.Msg.GetSandboxes() {
			left = append(left, sb.GetId()+" "+sb.GetState().String()+" "+fmt.Sprint(sb.GetSpec().GetLabels()))
		}
		if len(left) == 0 {
			return
		}
		if time.Now().After(deadline) {
			t.Errorf("%d sandboxes are still live:\n  %s", len(left), strings.Join(left, "\n  "))
			return
		}
		time.Sleep(200 * time.Millisecond)
	}
}

// tailLines is the last n lines of s.
func tailLines(s string, n int) string {
	lines := strings.Split(strings.TrimRight(s, "\n"), "\n")
	if len(lines) > n {
		lines = lines[len(lines)-n:]
	}
	return strings.Join(lines, "\n")
}

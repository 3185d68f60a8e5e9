package agent_test

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"connectrpc.com/connect"

	agentv1 "dsec.dev/dsec/api/gen/dsec/agent/v1"
	dsecv1 "dsec.dev/dsec/api/gen/dsec/v1"
	"dsec.dev/dsec/internal/testutil"
)

// callAgent is an agent started with --fncall on the host, inside test
// cgroups of its own (freezer, memory, cpu, pids with a commands' child),
// with its scratch and wiped directories in a temp dir.
type callAgent struct {
	*agentProc
	scratch, wipe string
}

func startCallAgent(t testing.TB) *callAgent {
	t.Helper()
	testutil.RequireRoot(t)
	for _, c := range []string{"freezer", "memory", "cpu", "pids"} {
		testutil.Require(t, fileExists("/sys/fs/cgroup/"+c+"/tasks"), "no cgroup v1 "+c+" hierarchy")
	}
	testutil.Require(t, fileExists("/usr/bin/python3"), "no /usr/bin/python3")
	b := make([]byte, 4)
	rand.Read(b)
	name := "dsec-test-call-" + hex.EncodeToString(b)
	var dirs []string // removal order: deepest first
	mk := func(p string) {
		if err := os.Mkdir(p, 0o755); err != nil {
			t.Fatal(err)
		}
		dirs = append([]string{p}, dirs...)
	}
	t.Cleanup(func() {
		for _, d := range dirs {
			subs, _ := os.ReadDir(d)
			for _, s := range subs {
				if s.IsDir() {
					killCgroup(filepath.Join(d, s.Name()))
					os.Remove(filepath.Join(d, s.Name()))
				}
			}
			killCgroup(d)
			deadline := time.Now().Add(5 * time.Second)
			for os.Remove(d) != nil && fileExists(d) && time.Now().Before(deadline) {
				time.Sleep(20 * time.Millisecond)
			}
			if fileExists(d) {
				t.Errorf("test cgroup %s left behind", d)
			}
		}
	})
	var fds []*os.File
	var cgs []string
	for _, c := range []string{"freezer", "memory", "cpu", "pids"} {
		d := filepath.Join("/sys/fs/cgroup", c, name)
		mk(d)
		cgs = append(cgs, d)
	}
	mk(filepath.Join(cgs[3], "cmds"))
	os.WriteFile(filepath.Join(cgs[1], "memory.limit_in_bytes"), []byte("1G"), 0o644)
	for _, d := range []string{cgs[0], cgs[1], cgs[2], filepath.Join(cgs[3], "cmds")} {
		f, err := os.Open(d)
		if err != nil {
			t.Fatal(err)
		}
		defer f.Close()
		fds = append(fds, f)
	}
	// Not t.TempDir: its parent is private to root, and calls run as
	// other uids.
	base, err := os.MkdirTemp("", "dsec-call-test-")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(base) })
	os.Chmod(base, 0o755)
	scratch, wipe := filepath.Join(base, "scratch"), filepath.Join(base, "wipe")
	for _, d := range []string{scratch, wipe} {
		os.Mkdir(d, 0o1777)
		os.Chmod(d, 0o1777)
	}
	a := startAgentWith(t, fds, []string{"--fncall", "--cgroup-fd", "4", "--memory-cgroup-fd", "5",
		"--cpu-cgroup-fd", "6", "--pids-cgroup-fd", "7", "--call-scratch", scratch, "--call-wipe", wipe + "," + scratch},
		func(pid int) {
			for _, d := range cgs {
				if err := os.WriteFile(filepath.Join(d, "cgroup.procs"), []byte(strconv.Itoa(pid)), 0o644); err != nil {
					t.Fatal(err)
				}
			}
		})
	return &callAgent{agentProc: a, scratch: scratch, wipe: wipe}
}

func (a *callAgent) call(t testing.TB, req *agentv1.CallRequest) *agentv1.CallResponse {
	t.Helper()
	resp, err := a.client.Call(context.Background(), connect.NewRequest(req))
	if err != nil {
		t.Fatalf("call: %v", err)
	}
	return resp.Msg
}

func py(code string, stdin string, timeout float64) *agentv1.CallRequest {
	return &agentv1.CallRequest{
		Files: map[string][]byte{"main.py": []byte(code)},
		Steps: []*agentv1.CallStep{{Argv: []string{"python3", "main.py"}, ZygoteFile: "main.py", Stdin: []byte(stdin), TimeoutSeconds: timeout}},
	}
}

func TestCallZygote(t *testing.T) {
	a := startCallAgent(t)
	code := `import os, sys
n = int(input())
print(n * 2)
print(os.getuid(), os.getcwd() == os.environ["HOME"], sys.argv[0], __name__, file=sys.stderr)
open("out.txt", "w").write("written")
`
	r := a.call(t, py(code, "21\n", 5))
	if len(r.Steps) != 1 {
		t.Fatalf("steps: %v", r.Steps)
	}
	s := r.Steps[0]
	if !s.Zygote {
		t.Errorf("not served by the zygote")
	}
	want := strconv.Itoa(int(r.Uid)) + " True main.py __main__\n"
	if string(s.Stdout) != "42\n" || string(s.Stderr) != want || s.Exited.Status != dsecv1.ExitStatus_EXIT_STATUS_OK {
		t.Fatalf("stdout %q stderr %q (want %q) exited %v", s.Stdout, s.Stderr, want, s.Exited)
	}
	if r.Dirty {
		t.Errorf("dirty: %s", r.DirtyReason)
	}

	// Fetch files, an exception, sys.exit codes.
	req := py(code, "1\n", 5)
	req.FetchFiles = []string{"out.txt", "missing.txt"}
	r = a.call(t, req)
	if string(r.Files["out.txt"]) != "written" || len(r.Files) != 1 {
		t.Errorf("fetched %v", r.Files)
	}
	r = a.call(t, py("raise ValueError('boom')", "", 5))
	if s := r.Steps[0]; s.Exited.ExitCode != 1 || !strings.Contains(string(s.Stderr), "ValueError: boom") {
		t.Errorf("exception: %v %q", s.Exited, s.Stderr)
	}
	// Tracebacks and syntax errors read as python3's own.
	for _, code := range []string{"def f():\n    raise ValueError('boom')\nf()\n", "def (:\n", "import sys\nsys.exit('bye')\n"} {
		r = a.call(t, py(code, "", 5))
		want := python3Stderr(t, code, r.Scratch)
		if s := r.Steps[0]; string(s.Stderr) != want {
			t.Errorf("%q: stderr\n%s\nwant (python3's)\n%s", code, s.Stderr, want)
		}
	}
	// What python3 starts with: default signal dispositions, no wakeup
	// fd, only the call's environment (a child process sees the same).
	state := `import os, signal, subprocess
print(signal.getsignal(signal.SIGCHLD) == signal.SIG_DFL, signal.set_wakeup_fd(-1), signal.getsignal(signal.SIGINT) is signal.default_int_handler)
seen = subprocess.run(["env", "-0"], capture_output=True).stdout.decode().split("\0")
print(sorted(os.environ) == sorted(v.split("=", 1)[0] for v in seen if v), "DSEC_ZYGOTE_PRELOAD" in os.environ)
`
	r = a.call(t, py(state, "", 5))
	if s := r.Steps[0]; string(s.Stdout) != "True -1 True\nTrue False\n" {
		t.Errorf("a run's starting state: stdout %q stderr %q", s.Stdout, s.Stderr)
	}
	// The environment is the call's exactly, values too, however it
	// differs from the zygote's: a variable overridden, one added.
	envCode := `import os, subprocess
seen = subprocess.run(["env", "-0"], capture_output=True).stdout.decode().split("\0")
mine = sorted("%s=%s" % kv for kv in os.environ.items())
print(" ".join(mine), sorted(v for v in seen if v) == mine)
`
	envReq := py(envCode, "", 5)
	envReq.Env = map[string]string{"LANG": "C", "DSEC_TEST_VAR": "x y"}
	r = a.call(t, envReq)
	wantEnv := "DSEC_TEST_VAR=x y HOME=" + r.Scratch + " LANG=C PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin TMPDIR=/tmp True\n"
	if s := r.Steps[0]; string(s.Stdout) != wantEnv {
		t.Errorf("a run's environment:\n got %q\nwant %q (stderr %q)", s.Stdout, wantEnv, s.Stderr)
	}
	r = a.call(t, py("import sys; sys.exit(3)", "", 5))
	if s := r.Steps[0]; s.Exited.ExitCode != 3 {
		t.Errorf("sys.exit(3): %v", s.Exited)
	}

	// A timeout keeps the output so far.
	r = a.call(t, py("import time\nprint('partial', flush=True)\ntime.sleep(100)", "", 1))
	if s := r.Steps[0]; s.Exited.Status != dsecv1.ExitStatus_EXIT_STATUS_TIMEOUT || string(s.Stdout) != "partial\n" {
		t.Errorf("timeout: %v %q", s.Exited, s.Stdout)
	}

	// The call's memory limit is also the run's RLIMIT_DATA: asking for
	// more private memory than it fails at once with MemoryError, the
	// program's own error, not the OOM killer's kill; within it, the
	// same amount works.
	req = py("x = bytearray(300 << 20)\nprint(len(x))", "", 10)
	req.MemoryBytes = 64 << 20
	r = a.call(t, req)
	if s := r.Steps[0]; s.Exited.ExitCode != 1 || s.OomKilled || !strings.Contains(string(s.Stderr), "MemoryError") {
		t.Errorf("300 MiB under a 64 MiB limit: %v oom %v %q", s.Exited, s.OomKilled, s.Stderr)
	}
	req = py("x = bytearray(32 << 20)\nprint(len(x))", "", 10)
	req.MemoryBytes = 64 << 20
	r = a.call(t, req)
	if s := r.Steps[0]; s.Exited.Status != dsecv1.ExitStatus_EXIT_STATUS_OK || string(s.Stdout) != "33554432\n" {
		t.Errorf("32 MiB under a 64 MiB limit: %v %q %q", s.Exited, s.Stdout, s.Stderr)
	}
	// Memory RLIMIT_DATA does not count (a shared mapping) still meets
	// the cgroup's limit.
	req = py("import mmap\nm = mmap.mmap(-1, 300 << 20)\nc = b'x' * (1 << 20)\nfor _ in range(300): m.write(c)\nprint('all written')", "", 10)
	req.MemoryBytes = 64 << 20
	r = a.call(t, req)
	if s := r.Steps[0]; s.Exited.Status != dsecv1.ExitStatus_EXIT_STATUS_OOM || !s.OomKilled || len(s.Stdout) != 0 {
		t.Errorf("300 MiB of shared memory under a 64 MiB limit: %v oom %v %q %q", s.Exited, s.OomKilled, s.Stdout, s.Stderr)
	}
}

func TestCallLeavesNothing(t *testing.T) {
	a := startCallAgent(t)
	// A call that leaves a daemon, a file in a wiped dir and one in its
	// scratch dir, and remembers where they are.
	first := &agentv1.CallRequest{Steps: []*agentv1.CallStep{{Argv: []string{"bash", "-c",
		"setsid sleep 1000 </dev/null >/dev/null 2>&1 & echo hidden > " + a.wipe + "/left; echo secret > mine; pwd; id -u"}}}}
	r := a.call(t, first)
	s := r.Steps[0]
	if s.Exited.Status != dsecv1.ExitStatus_EXIT_STATUS_OK || r.Dirty {
		t.Fatalf("first call: %v %q dirty=%v %s", s.Exited, s.Stderr, r.Dirty, r.DirtyReason)
	}
	lines := strings.Fields(string(s.Stdout))
	if len(lines) != 2 || lines[0] != r.Scratch || lines[1] != strconv.Itoa(int(r.Uid)) {
		t.Fatalf("first call printed %q; scratch %s uid %d", s.Stdout, r.Scratch, r.Uid)
	}
	firstScratch, firstUID := r.Scratch, r.Uid
	if fileExists(firstScratch) || fileExists(filepath.Join(a.wipe, "left")) {
		t.Errorf("files left: scratch %v wiped dir %v", fileExists(firstScratch), fileExists(filepath.Join(a.wipe, "left")))
	}
	second := &agentv1.CallRequest{Steps: []*agentv1.CallStep{{Argv: []string{"bash", "-c",
		"cat " + firstScratch + "/mine " + a.wipe + "/left 2>&1; ps -eo uid= | grep -cx ' *" + strconv.Itoa(int(firstUID)) + "' ; id -u"}}}}
	r = a.call(t, second)
	s = r.Steps[0]
	out := string(s.Stdout)
	if strings.Contains(out, "secret") || strings.Contains(out, "hidden") {
		t.Errorf("the next call read the previous call's files: %q", out)
	}
	if r.Uid == firstUID {
		t.Errorf("the next call ran as the same uid %d", r.Uid)
	}
	if f := strings.Fields(out); len(f) < 2 || f[len(f)-2] != "0" {
		t.Errorf("processes of the previous call's uid still run: %q", out)
	}

	// A fork bomb is contained by the call's pids limit and killed with
	// it; the container stays clean and serves the next call.
	bomb := &agentv1.CallRequest{Pids: 64, Steps: []*agentv1.CallStep{{Argv: []string{"bash", "-c", "b() { b | b & }; b; sleep 100"}, TimeoutSeconds: 2}}}
	r = a.call(t, bomb)
	if r.Dirty {
		t.Errorf("fork bomb left the container dirty: %s", r.DirtyReason)
	}
	r = a.call(t, &agentv1.CallRequest{Steps: []*agentv1.CallStep{{Argv: []string{"bash", "-c", "echo ok"}}}})
	if string(r.Steps[0].Stdout) != "ok\n" {
		t.Errorf("after the fork bomb: %v %q", r.Steps[0].Exited, r.Steps[0].Stderr)
	}

	// Infinite output is capped and the call still ends at its timeout.
	r = a.call(t, &agentv1.CallRequest{OutputLimitBytes: 1 << 20, Steps: []*agentv1.CallStep{{Argv: []string{"yes"}, TimeoutSeconds: 1}}})
	if s := r.Steps[0]; len(s.Stdout) != 1<<20 || !s.Exited.StdoutTruncated || s.Exited.Status != dsecv1.ExitStatus_EXIT_STATUS_TIMEOUT {
		t.Errorf("yes: %d bytes, %v", len(s.Stdout), s.Exited)
	}

	// Paths that leave the scratch dir are refused.
	for _, p := range []string{"../x", "/etc/passwd", "a/../../x", ""} {
		_, err := a.client.Call(context.Background(), connect.NewRequest(&agentv1.CallRequest{
			Files: map[string][]byte{p: []byte("x")}, Steps: []*agentv1.CallStep{{Argv: []string{"true"}}}}))
		if connect.CodeOf(err) != connect.CodeInvalidArgument {
			t.Errorf("file %q: %v", p, err)
		}
	}
	// A symlink made by the call is not followed out by fetch_files.
	r = a.call(t, &agentv1.CallRequest{FetchFiles: []string{"link"}, Steps: []*agentv1.CallStep{{Argv: []string{"ln", "-s", "/etc/hostname", "link"}}}})
	if len(r.Files) != 0 {
		t.Errorf("fetched through a symlink out of the scratch dir: %v", r.Files)
	}
}

// python3Stderr is what /usr/bin/python3 prints on stderr running code as
// main.py in dir (made for it, then removed).
func python3Stderr(t *testing.T, code, dir string) string {
	t.Helper()
	if err := os.MkdirAll(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	defer os.RemoveAll(dir)
	if err := os.WriteFile(filepath.Join(dir, "main.py"), []byte(code), 0o644); err != nil {
		t.Fatal(err)
	}
	cmd := exec.Command("/usr/bin/python3", "main.py")
	cmd.Dir = dir
	var stderr strings.Builder
	cmd.Stderr = &stderr
	cmd.Run()
	return stderr.String()
}

// BenchmarkCallPython is one print(1) call after another on one agent:
// the agent's and the zygote's share of a call, without dsecd. It reports
// the CPU the agent, the zygote and its children used per call.
func BenchmarkCallPython(b *testing.B) {
	a := startCallAgent(b)
	req := py("print(1)", "", 5)
	a.call(b, req) // starts the zygote
	cpu0 := treeCPU(a.cmd.Process.Pid)
	parts0 := cpuParts(a.cmd.Process.Pid)
	b.ResetTimer()
	for range b.N {
		if r := a.call(b, req); string(r.Steps[0].Stdout) != "1\n" || !r.Steps[0].Zygote {
			b.Fatalf("%v %q", r.Steps[0].Exited, r.Steps[0].Stderr)
		}
	}
	b.StopTimer()
	b.ReportMetric(float64(treeCPU(a.cmd.Process.Pid)-cpu0)/float64(b.N)*1e3/100, "cpu-ms/call")
	parts := cpuParts(a.cmd.Process.Pid)
	for k, v := range parts {
		b.ReportMetric(float64(v-parts0[k])/float64(b.N)*1e3/100, k+"-cpu-ms/call")
	}
}

// cpuParts splits treeCPU: the agent's own, the zygote's own, the
// zygote's reaped children's.
func cpuParts(pid int) map[string]int64 {
	out := map[string]int64{}
	fields := func(p int) []string {
		data, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", p))
		if err != nil {
			return nil
		}
		return strings.Fields(string(data[strings.LastIndexByte(string(data), ')')+2:]))
	}
	n := func(f []string, i int) int64 { v, _ := strconv.ParseInt(f[i], 10, 64); return v }
	if f := fields(pid); f != nil {
		out["agent"] = n(f, 11) + n(f, 12)
	}
	for _, p := range descendants(pid) {
		if f := fields(p); f != nil {
			out["zygote"] += n(f, 11) + n(f, 12)
			out["runs"] += n(f, 13) + n(f, 14)
		}
	}
	return out
}

// treeCPU is the CPU ticks of pid and its descendants, reaped children's
// included.
func treeCPU(pid int) int64 {
	var total int64
	for _, p := range append([]int{pid}, descendants(pid)...) {
		data, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", p))
		if err != nil {
			continue
		}
		f := strings.Fields(string(data[strings.LastIndexByte(string(data), ')')+2:]))
		for _, i := range []int{11, 12, 13, 14} { // utime stime cutime cstime
			n, _ := strconv.ParseInt(f[i], 10, 64)
			total += n
		}
	}
	return total
}

// TestCommandsAreTheOOMKillersFirstChoice: a command's oom_score_adj is
// above the agent's, so a sandbox's OOM killer never takes the agent while
// a command is left.
func TestCommandsAreTheOOMKillersFirstChoice(t *testing.T) {
	testutil.RequireRoot(t)
	a := startAgentWith(t, nil, nil, nil)
	for _, user := range []string{"", "65534"} {
		// The score is set just after the command starts: what it forks in
		// its first moments still has the agent's (see markOOMScore).
		r := a.exec(t, &dsecv1.ExecRequest{Command: "sleep 0.2; cat /proc/self/oom_score_adj; cat /proc/$$/oom_score_adj", User: user})
		if r.stdout != "500\n500\n" {
			t.Errorf("user %q: a command's oom_score_adj is %q, want 500 (%v)", user, r.stdout, r.exited)
		}
	}
	b, _ := os.ReadFile(fmt.Sprintf("/proc/%d/oom_score_adj", a.cmd.Process.Pid))
	if strings.TrimSpace(string(b)) != "0" {
		t.Errorf("the agent's oom_score_adj is %q, want 0", b)
	}
}

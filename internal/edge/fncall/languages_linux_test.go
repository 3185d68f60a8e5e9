//go:build linux

package fncall

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"sort"
	"strconv"
	"strings"
	"testing"
	"time"

	"dsec.dev/dsec/internal/testutil"
)

// treeVar names the fncall environment tree the test runs the builtin
// languages in (scripts/build-fncall-env.sh builds it).
const treeVar = "DSEC_FNCALL_ENV_TREE"

// callUID is the uid (and gid) calls run as: one from the runner's pool,
// with no passwd entry in the tree.
const callUID = 60001

// program is a language's test programs. want is the hello's exact stdout,
// or, where it starts with "~", a substring of it.
type program struct {
	hello, want string
	compileErr  string // "" for languages without a compile step
	runtimeErr  string
}

var programs = map[string]program{
	"python": {
		hello:      "import sys\nprint('hello fncall')\n",
		want:       "hello fncall\n",
		runtimeErr: "raise ValueError('boom')\n",
	},
	"pytest": {
		hello:      "def test_hello():\n    print('hello fncall')\n    assert 1 + 1 == 2\n",
		want:       "~1 passed",
		runtimeErr: "def test_fails():\n    assert 1 + 1 == 3\n",
	},
	"cpp": {
		hello:      "#include <iostream>\n#include <thread>\nint main() {\n  std::thread t([] { std::cout << \"hello fncall\" << std::endl; });\n  t.join();\n}\n",
		want:       "hello fncall\n",
		compileErr: "int main() { return x; }\n",
		runtimeErr: "#include <vector>\nint main() { std::vector<int> v; return v.at(3); }\n",
	},
	"c": {
		hello:      "#include <stdio.h>\n#include <math.h>\n#include <stdlib.h>\nint main(int argc, char **argv) {\n  printf(\"hello fncall\\n\");\n  return (int)sqrt((double)(argc - 1));\n}\n",
		want:       "hello fncall\n",
		compileErr: "int main(void) { return x; }\n",
		runtimeErr: "#include <stdio.h>\nint main(void) { FILE *f = fopen(\"/nonexistent\", \"r\"); return fgetc(f); }\n",
	},
	"go": {
		hello:      "package main\n\nimport \"fmt\"\n\nfunc main() { fmt.Println(\"hello fncall\") }\n",
		want:       "hello fncall\n",
		compileErr: "package main\n\nfunc main() { x := 1 }\n",
		runtimeErr: "package main\n\nimport \"os\"\n\nfunc main() {\n\tvar a []int\n\t_ = a[len(os.Args)]\n}\n",
	},
	"go_test": {
		hello:      "package main\n\nimport \"testing\"\n\nfunc TestHello(t *testing.T) {\n\tif 1+1 != 2 {\n\t\tt.Fatal(\"arithmetic\")\n\t}\n}\n",
		want:       "~ok",
		runtimeErr: "package main\n\nimport \"testing\"\n\nfunc TestFails(t *testing.T) { t.Fatal(\"boom\") }\n",
	},
	"java": {
		// javatuples on the class path, as in SandboxFusion's image.
		hello:      "import org.javatuples.Pair;\n\npublic class Main {\n  public static void main(String[] args) {\n    Pair<String, String> p = Pair.with(\"hello\", \"fncall\");\n    System.out.println(p.getValue0() + \" \" + p.getValue1());\n  }\n}\n",
		want:       "hello fncall\n",
		compileErr: "public class Main {\n  public static void main(String[] args) { int x = \"s\"; }\n}\n",
		// Fails only if assertions are on (-ea).
		runtimeErr: "public class Main {\n  public static void main(String[] args) { assert args.length > 0 : \"assertions are on\"; }\n}\n",
	},
	"nodejs": {
		hello:      "console.log('hello fncall');\n",
		want:       "hello fncall\n",
		runtimeErr: "throw new Error('boom');\n",
	},
	"bash": {
		hello:      "echo hello fncall\n",
		want:       "hello fncall\n",
		runtimeErr: "cat /nonexistent\n",
	},
	"rust": {
		hello:      "fn main() {\n    println!(\"hello fncall\");\n}\n",
		want:       "hello fncall\n",
		compileErr: "fn main() {\n    let x: i32 = \"s\";\n}\n",
		runtimeErr: "fn main() {\n    let v: Vec<i32> = Vec::new();\n    println!(\"{}\", v[std::env::args().count()]);\n}\n",
	},
}

// treeRunner runs argvs in the tree as a call would: chrooted, as callUID,
// in a scratch dir under the tree's /tmp that is also HOME and TMPDIR, in
// new mount, PID and network namespaces (no network; /proc and a minimal
// /dev mounted in the private mount namespace, so they go with it).
type treeRunner struct {
	tree string
}

type treeResult struct {
	stdout, stderr string
	code           int // -1: did not run to an exit status
	wall           time.Duration
}

// inTree is the shell run in the new namespaces: $1 the tree, $2 the
// scratch dir inside it, $3 "sys" to bind the host's /sys (the cgroup file
// system included, as a container sees its own), then env -i's NAME=VALUE
// pairs and the argv. The call is a child of the shell, not PID 1 of the
// namespace, so that signals kill it as they would in a container.
const inTree = `set -e
t=$1 d=$2 sys=$3
shift 3
mount -t proc proc "$t/proc"
mount -t tmpfs -o mode=0755,size=64k tmpfs "$t/dev"
for n in null zero full random urandom; do
	touch "$t/dev/$n"
	mount --bind "/dev/$n" "$t/dev/$n"
done
ln -s /proc/self/fd "$t/dev/fd"
ln -s /proc/self/fd/0 "$t/dev/stdin"
ln -s /proc/self/fd/1 "$t/dev/stdout"
ln -s /proc/self/fd/2 "$t/dev/stderr"
mkdir "$t/dev/shm"
mount -t tmpfs -o mode=1777 tmpfs "$t/dev/shm"
if [ "$sys" = sys ]; then mount --rbind /sys "$t/sys"; fi
set +e
chroot --userspec=` + "60001:60001 --groups=60001" + ` "$t" /usr/bin/env -i -C "$d" "$@"
`

// run runs argv in scratch dir dir (a path inside the tree), in cgroup cg
// when it is not "".
func (r treeRunner) run(t *testing.T, dir string, argv []string, env map[string]string, cg string, sys bool) treeResult {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	inner := "/" + strings.TrimPrefix(strings.TrimPrefix(dir, r.tree), "/")
	sysArg := "-"
	if sys {
		sysArg = "sys"
	}
	args := []string{"-c", `[ -z "$1" ] || echo $$ >"$1/cgroup.procs" || exit 125; shift; exec "$@"`, "sh", cg,
		"unshare", "--mount", "--pid", "--fork", "--net", "--kill-child", "--",
		"/bin/sh", "-c", inTree, "sh", r.tree, inner, sysArg,
		"HOME=" + inner, "TMPDIR=" + inner, "PATH=/usr/local/bin:/usr/bin:/bin", "LANG=C.UTF-8"}
	keys := make([]string, 0, len(env))
	for k := range env {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	for _, k := range keys {
		args = append(args, k+"="+env[k])
	}
	args = append(args, argv...)
	cmd := exec.CommandContext(ctx, "/bin/sh", args...)
	var stdout, stderr bytes.Buffer
	cmd.Stdout, cmd.Stderr = &stdout, &stderr
	start := time.Now()
	err := cmd.Run()
	res := treeResult{stdout: stdout.String(), stderr: stderr.String(), wall: time.Since(start), code: 0}
	var exit *exec.ExitError
	switch {
	case errors.As(err, &exit):
		res.code = exit.ExitCode()
	case err != nil:
		t.Fatalf("run %v: %v", argv, err)
	}
	if ctx.Err() != nil {
		t.Fatalf("run %v: timed out after 2m; stderr: %s", argv, res.stderr)
	}
	return res
}

// scratch makes a fresh scratch dir under the tree's /tmp owned by the
// call's uid, holding code in file; it is removed when the test ends.
func (r treeRunner) scratch(t *testing.T, file, code string) string {
	t.Helper()
	dir, err := os.MkdirTemp(filepath.Join(r.tree, "tmp"), "fncall-test-")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if err := os.RemoveAll(dir); err != nil {
			t.Errorf("remove scratch dir: %v", err)
		}
	})
	p := filepath.Join(dir, file)
	if err := os.WriteFile(p, []byte(code), 0o644); err != nil {
		t.Fatal(err)
	}
	for _, f := range []string{dir, p} {
		if err := os.Chown(f, callUID, callUID); err != nil {
			t.Fatal(err)
		}
	}
	if err := os.Chmod(dir, 0o700); err != nil {
		t.Fatal(err)
	}
	return dir
}

func requireTree(t *testing.T) treeRunner {
	t.Helper()
	tree := os.Getenv(treeVar)
	if tree == "" {
		t.Skipf("skipping: %s is not set (build the tree with scripts/build-fncall-env.sh)", treeVar)
	}
	testutil.RequireRoot(t)
	_, err := os.Stat(filepath.Join(tree, "etc/dsec-fncall-env"))
	testutil.Require(t, err == nil, fmt.Sprintf("%s=%s is not a finished fncall environment tree (%v)", treeVar, tree, err))
	testutil.RequireCommand(t, "unshare")
	testutil.RequireCommand(t, "chroot")
	tree, err = filepath.Abs(tree)
	if err != nil {
		t.Fatal(err)
	}
	// Leak check, run after every other cleanup: nothing stays mounted in
	// the tree and no scratch dir is left in its /tmp.
	t.Cleanup(func() {
		mounts, _ := os.ReadFile("/proc/self/mounts")
		for _, line := range strings.Split(string(mounts), "\n") {
			if f := strings.Fields(line); len(f) > 1 && strings.HasPrefix(f[1], tree+"/") {
				t.Errorf("left mounted: %s", f[1])
			}
		}
		left, _ := filepath.Glob(filepath.Join(tree, "tmp", "fncall-test-*"))
		for _, l := range left {
			t.Errorf("left behind: %s", l)
		}
	})
	return treeRunner{tree: tree}
}

func checkRun(t *testing.T, step string, res treeResult, wantOK bool) {
	t.Helper()
	if ok := res.code == 0; ok != wantOK {
		t.Errorf("%s: exit %d, want success=%v\nstdout: %s\nstderr: %s", step, res.code, wantOK, res.stdout, res.stderr)
	}
}

func TestBuiltinLanguagesInTree(t *testing.T) {
	r := requireTree(t)
	langs := Builtin()
	names := make([]string, 0, len(programs))
	for name := range programs {
		names = append(names, name)
	}
	sort.Strings(names)
	for _, name := range names {
		prog := programs[name]
		l, ok := langs[name]
		if !ok {
			t.Errorf("Builtin has no %s", name)
			continue
		}
		t.Run(name, func(t *testing.T) {
			t.Run("hello", func(t *testing.T) {
				dir := r.scratch(t, l.File, prog.hello)
				var compile time.Duration
				if l.Compile != nil {
					res := r.run(t, dir, l.Compile, l.Env, "", false)
					checkRun(t, "compile", res, true)
					if res.code != 0 {
						return
					}
					compile = res.wall
				}
				res := r.run(t, dir, l.Run, l.Env, "", false)
				checkRun(t, "run", res, true)
				if want, ok := strings.CutPrefix(prog.want, "~"); ok {
					if !strings.Contains(res.stdout, want) {
						t.Errorf("stdout %q does not contain %q", res.stdout, want)
					}
				} else if res.stdout != prog.want {
					t.Errorf("stdout = %q, want %q (stderr %q)", res.stdout, prog.want, res.stderr)
				}
				// A second compile in the same scratch dir shows what a
				// warm per-user cache (Go's) would save.
				var again time.Duration
				if l.Compile != nil {
					again = r.run(t, dir, l.Compile, l.Env, "", false).wall
				}
				t.Logf("%s: compile %v (again in the same dir %v), run %v", name,
					compile.Round(time.Millisecond), again.Round(time.Millisecond), res.wall.Round(time.Millisecond))
			})
			if prog.compileErr != "" {
				t.Run("compile error", func(t *testing.T) {
					dir := r.scratch(t, l.File, prog.compileErr)
					res := r.run(t, dir, l.Compile, l.Env, "", false)
					checkRun(t, "compile", res, false)
				})
			}
			t.Run("runtime error", func(t *testing.T) {
				dir := r.scratch(t, l.File, prog.runtimeErr)
				if l.Compile != nil {
					res := r.run(t, dir, l.Compile, l.Env, "", false)
					checkRun(t, "compile", res, true)
					if res.code != 0 {
						return
					}
				}
				res := r.run(t, dir, l.Run, l.Env, "", false)
				checkRun(t, "run", res, false)
			})
		})
	}
}

// TestPythonPackagesInTree checks the scientific packages import, for the
// uid of a call.
func TestPythonPackagesInTree(t *testing.T) {
	r := requireTree(t)
	l := Builtin()["python"]
	code := "import numpy, pandas, sortedcontainers\nprint(int(numpy.arange(4).sum()), len(pandas.DataFrame({'a': [1, 2]})))\n"
	dir := r.scratch(t, l.File, code)
	res := r.run(t, dir, l.Run, l.Env, "", false)
	checkRun(t, "run", res, true)
	if res.stdout != "6 2\n" {
		t.Errorf("stdout = %q, want %q (stderr %q)", res.stdout, "6 2\n", res.stderr)
	}
	t.Logf("python with numpy and pandas: %v", res.wall.Round(time.Millisecond))
}

// javaMemory allocates until the heap is full and says how far it got: an
// OutOfMemoryError inside the JVM, not the cgroup's OOM killer.
const javaMemory = `import java.util.*;

public class Main {
  public static void main(String[] args) {
    long max = Runtime.getRuntime().maxMemory() >> 20;
    List<long[]> l = new ArrayList<>();
    try {
      while (true) l.add(new long[1 << 17]);
    } catch (OutOfMemoryError e) {
      int n = l.size();
      l = null;
      System.out.println("heap " + max + " MiB, OutOfMemoryError after " + n + " MiB");
    }
  }
}
`

// TestJavaUnderMemoryLimit runs javac and java in a memory cgroup of 1 GiB
// and of 256 MiB, with the cgroup file system visible as in a container:
// both work, and a program that fills its heap gets an OutOfMemoryError
// rather than being killed.
func TestJavaUnderMemoryLimit(t *testing.T) {
	r := requireTree(t)
	l := Builtin()["java"]
	for _, mib := range []int{1024, 256} {
		t.Run(strconv.Itoa(mib)+"MiB", func(t *testing.T) {
			cg := memoryCgroup(t, int64(mib)<<20)
			dir := r.scratch(t, l.File, javaMemory)
			res := r.run(t, dir, l.Compile, l.Env, cg, true)
			checkRun(t, "javac", res, true)
			if res.code != 0 {
				return
			}
			compile := res.wall
			res = r.run(t, dir, l.Run, l.Env, cg, true)
			checkRun(t, "java", res, true)
			if !strings.Contains(res.stdout, "OutOfMemoryError") {
				t.Errorf("stdout = %q, want an OutOfMemoryError caught (stderr %q)", res.stdout, res.stderr)
			}
			t.Logf("%d MiB: javac %v, java %v: %s", mib, compile.Round(time.Millisecond),
				res.wall.Round(time.Millisecond), strings.TrimSpace(res.stdout))
		})
	}
}

// memoryCgroup makes a memory cgroup limited to limit bytes, without swap,
// removed when the test ends (after its processes are gone).
func memoryCgroup(t *testing.T, limit int64) string {
	t.Helper()
	name := fmt.Sprintf("dsec-fncall-test-%d-%d", os.Getpid(), time.Now().UnixNano())
	var dir string
	var files [][2]string
	if _, err := os.Stat("/sys/fs/cgroup/cgroup.controllers"); err == nil {
		dir = filepath.Join("/sys/fs/cgroup", name)
		files = [][2]string{{"memory.max", strconv.FormatInt(limit, 10)}, {"memory.swap.max", "0"}}
	} else if _, err := os.Stat("/sys/fs/cgroup/memory/memory.limit_in_bytes"); err == nil {
		dir = filepath.Join("/sys/fs/cgroup/memory", name)
		files = [][2]string{{"memory.limit_in_bytes", strconv.FormatInt(limit, 10)}, {"memory.swappiness", "0"}}
		if _, err := os.Stat("/sys/fs/cgroup/memory/memory.memsw.limit_in_bytes"); err == nil {
			files = append(files, [2]string{"memory.memsw.limit_in_bytes", strconv.FormatInt(limit, 10)})
		}
	} else {
		testutil.Require(t, false, "no memory cgroup controller")
	}
	if err := os.Mkdir(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		var err error
		for i := 0; i < 50; i++ {
			if err = os.Remove(dir); err == nil {
				return
			}
			time.Sleep(100 * time.Millisecond)
		}
		t.Errorf("remove cgroup %s: %v", dir, err)
	})
	for _, f := range files {
		if err := os.WriteFile(filepath.Join(dir, f[0]), []byte(f[1]), 0o644); err != nil {
			t.Fatalf("cgroup %s: %v", f[0], err)
		}
	}
	return dir
}

package dsec

// FnCall against the live dsecd of live_test.go, with the fncall
// environment imported as fncall:latest from $DSEC_FNCALL_ENV_TREE (default
// /var/cache/dsec/fncall-env; scripts/build-fncall-env.sh builds it).
// Without the tree these tests skip; with DSEC_TEST_ROOT=1 they fail.

import (
	"context"
	"errors"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"testing"
)

const defaultFnCallTree = "/var/cache/dsec/fncall-env"

var (
	fnOnce sync.Once
	fnSkip string
	fnErr  error
)

func requireFnCall(t *testing.T) *Client {
	t.Helper()
	c := requireLive(t)
	fnOnce.Do(func() {
		tree := os.Getenv("DSEC_FNCALL_ENV_TREE")
		if tree == "" {
			tree = defaultFnCallTree
		}
		if !exists(filepath.Join(tree, "usr", "bin", "python3")) {
			fnSkip = "the fncall environment is not built at " + tree + " (scripts/build-fncall-env.sh " + tree + ", or set DSEC_FNCALL_ENV_TREE)"
			return
		}
		cli := filepath.Join(live.bin, "dsec")
		if !exists(cli) {
			fnSkip = "no dsec binary in " + live.bin + " (run make build)"
			return
		}
		out, err := exec.Command(cli, "--addr", live.addr, "layer", "import", "--kind", "base", "--allow-setuid", "fncall:latest", tree).CombinedOutput()
		if err != nil {
			fnErr = errors.New("dsec layer import fncall:latest: " + err.Error() + "\n" + string(out))
		}
	})
	if fnSkip != "" {
		if os.Getenv("DSEC_TEST_ROOT") == "1" {
			t.Fatalf("required under DSEC_TEST_ROOT=1: %s", fnSkip)
		}
		t.Skip(fnSkip)
	}
	if fnErr != nil {
		t.Fatal(fnErr)
	}
	return c
}

func TestLiveRunCode(t *testing.T) {
	c := requireFnCall(t)
	ctx := t.Context()
	r, err := c.RunCode(ctx, RunCodeRequest{Language: "python", Code: "print(1)"})
	if err != nil {
		t.Fatal(err)
	}
	if !r.OK() || r.Stdout() != "1\n" || r.Compile != nil || r.Run.ReturnCode == nil || *r.Run.ReturnCode != 0 || r.Node != "go" {
		t.Fatalf("print(1): %+v %+v", r, r.Run)
	}

	r, err = c.RunCode(ctx, RunCodeRequest{Language: "python", Code: "import sys\nprint('before')\nsys.exit(3)"})
	if err != nil {
		t.Fatal(err)
	}
	if r.Status != RunFailed || r.Run.ReturnCode == nil || *r.Run.ReturnCode != 3 || r.Stdout() != "before\n" {
		t.Fatalf("exit 3: %+v %+v", r, r.Run)
	}

	r, err = c.RunCode(ctx, RunCodeRequest{Language: "cpp", Code: "int main( { return 0; }"})
	if err != nil {
		t.Fatal(err)
	}
	if r.Status != RunFailed || r.Run != nil || r.Compile == nil || r.Compile.ReturnCode == nil || *r.Compile.ReturnCode == 0 ||
		!strings.Contains(string(r.Compile.Stderr), "error") {
		t.Fatalf("compile error: %+v %+v", r, r.Compile)
	}

	r, err = c.RunCode(ctx, RunCodeRequest{Language: "python", Code: "open('out.txt', 'w').write(open('in.txt').read() * 2)",
		Files: map[string][]byte{"in.txt": []byte("ab")}, FetchFiles: []string{"out.txt", "missing.txt"}})
	if err != nil || !r.OK() || string(r.Files["out.txt"]) != "abab" || len(r.Files) != 1 {
		t.Fatalf("files: %v %+v", err, r)
	}

	if _, err := c.RunCode(ctx, RunCodeRequest{Language: "cobol", Code: "x"}); !errors.Is(err, ErrInvalidArgument) {
		t.Fatalf("unknown language: %v", err)
	}
	langs, err := c.Languages(ctx)
	if err != nil {
		t.Fatal(err)
	}
	var names []string
	for _, l := range langs {
		names = append(names, l.Name)
	}
	for _, want := range []string{"python", "cpp", "go", "java"} {
		if !strings.Contains(" "+strings.Join(names, " ")+" ", " "+want+" ") {
			t.Errorf("languages %v lack %s", names, want)
		}
	}
}

func TestLiveRunTests(t *testing.T) {
	c := requireFnCall(t)
	// Each case reports when it ran on stderr; stdout is the answer.
	code := "import sys, time\nt0 = time.time()\ntime.sleep(1)\nprint(sum(map(int, input().split())))\nprint(t0, time.time(), file=sys.stderr)"
	var cases []TestCase
	for i := range 8 {
		want := strconv.Itoa(2*i+1) + "\n"
		cases = append(cases, TestCase{Stdin: strconv.Itoa(i) + " " + strconv.Itoa(i+1) + "\n", Expected: &want})
	}
	rs, err := c.RunTests(t.Context(), RunCodeRequest{Language: "python", Code: code}, cases)
	if err != nil {
		t.Fatal(err)
	}
	type span struct{ start, end float64 }
	var spans []span
	for i, r := range rs {
		if !r.Passed {
			t.Fatalf("case %d did not pass: %+v %q %q", i, r.RunCodeResult, r.Stdout(), r.Stderr())
		}
		f := strings.Fields(r.Stderr())
		s, _ := strconv.ParseFloat(f[0], 64)
		e, _ := strconv.ParseFloat(f[1], 64)
		spans = append(spans, span{s, e})
	}
	most := 0
	for _, at := range spans {
		n := 0
		for _, s := range spans {
			if s.start <= at.start && at.start < s.end {
				n++
			}
		}
		most = max(most, n)
	}
	t.Logf("%d of 8 cases ran at once", most)
	if most < 2 {
		t.Errorf("the cases ran one after another: %v", spans)
	}
}

// TestLiveCLIFnRun: dsec fn run --language python file.py < input prints
// the program's output and exits with its code.
func TestLiveCLIFnRun(t *testing.T) {
	requireFnCall(t)
	prog := filepath.Join(t.TempDir(), "file.py")
	os.WriteFile(prog, []byte("import sys\nx = input()\nprint(x[::-1])\nprint('to stderr', file=sys.stderr)\nsys.exit(int(x) % 7)\n"), 0o644)
	cmd := exec.CommandContext(context.Background(), filepath.Join(live.bin, "dsec"), "--addr", live.addr, "fn", "run", "--language", "python", prog)
	cmd.Stdin = strings.NewReader("1234\n")
	var stdout, stderr strings.Builder
	cmd.Stdout, cmd.Stderr = &stdout, &stderr
	err := cmd.Run()
	var ee *exec.ExitError
	if !errors.As(err, &ee) || ee.ExitCode() != 1234%7 || stdout.String() != "4321\n" || stderr.String() != "to stderr\n" {
		t.Fatalf("dsec fn run: %v, stdout %q, stderr %q", err, stdout.String(), stderr.String())
	}
}

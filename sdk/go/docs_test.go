package dsec

// The Go blocks of docs/go.md are complete programs. They are built here as
// a user builds them: in a module of their own outside this repository,
// whose go.mod has one replace, of the module that holds the SDK, and takes
// every other module (connect, protobuf) from the module proxy. Against the
// live dsecd of live_test.go they then run, each to a zero exit.

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
	"time"
)

// docPrograms returns the Go blocks of docs/go.md.
func docPrograms(t *testing.T) []string {
	t.Helper()
	doc, err := os.ReadFile(filepath.Join(repoRoot(), "docs", "go.md"))
	if err != nil {
		t.Fatal(err)
	}
	var out []string
	for _, m := range regexp.MustCompile("(?s)```go\n(.*?)```").FindAllStringSubmatch(string(doc), -1) {
		out = append(out, m[1])
	}
	if len(out) < 8 {
		t.Fatalf("docs/go.md has %d Go blocks; want its examples (at least 8)", len(out))
	}
	return out
}

// sdkModule returns the path and directory of the module that holds this
// package, as go list reports them.
func sdkModule(t *testing.T) (path, dir string) {
	t.Helper()
	out, err := exec.Command("go", "list", "-m", "-f", "{{.Path}} {{.Dir}}").Output()
	if err != nil {
		t.Fatalf("go list -m: %v", err)
	}
	path, dir, ok := strings.Cut(strings.TrimSpace(string(out)), " ")
	if !ok {
		t.Fatalf("go list -m: %q", out)
	}
	return path, dir
}

// userEnv is the environment of a go command in the user's module: no
// workspace, and go.mod and go.sum completed from the module proxy.
func userEnv() []string {
	var env []string
	for _, kv := range os.Environ() {
		if !strings.HasPrefix(kv, "GOFLAGS=") && !strings.HasPrefix(kv, "GOWORK=") {
			env = append(env, kv)
		}
	}
	return append(env, "GOFLAGS=-mod=mod", "GOWORK=off")
}

// TestDocProgramsOutsideRepo builds every Go block of docs/go.md in a module
// outside the repository with one replace, then runs each against a live
// dsecd (when there is one).
func TestDocProgramsOutsideRepo(t *testing.T) {
	if _, err := exec.LookPath("go"); err != nil {
		t.Skip("go is not on PATH")
	}
	progs := docPrograms(t)
	modPath, modDir := sdkModule(t)
	user := t.TempDir()
	gomod := fmt.Sprintf("module example.com/dsecuser\n\ngo 1.26\n\nrequire %s v0.0.0\n\nreplace %s => %s\n", modPath, modPath, modDir)
	if err := os.WriteFile(filepath.Join(user, "go.mod"), []byte(gomod), 0o644); err != nil {
		t.Fatal(err)
	}
	for i, p := range progs {
		if !strings.HasPrefix(p, "package main\n") {
			t.Fatalf("docs/go.md block %d is not a program (package main):\n%s", i, p)
		}
		dir := filepath.Join(user, fmt.Sprintf("ex%02d", i))
		if err := os.MkdirAll(dir, 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(filepath.Join(dir, "main.go"), []byte(p), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	bin := filepath.Join(user, "bin")
	build := exec.Command("go", "build", "-o", bin+string(filepath.Separator), "./...")
	build.Dir, build.Env = user, userEnv()
	if out, err := build.CombinedOutput(); err != nil {
		t.Fatalf("go build of docs/go.md's programs in a module outside the repository (go.mod: %q): %v\n%s", gomod, err, out)
	}

	for i, p := range progs {
		t.Run(fmt.Sprintf("run/%02d", i), func(t *testing.T) {
			requireLive(t)
			if strings.Contains(p, "RunCode") || strings.Contains(p, "RunTests") {
				requireFnCall(t)
			}
			ctx, cancel := context.WithTimeout(t.Context(), 3*time.Minute)
			defer cancel()
			cmd := exec.CommandContext(ctx, filepath.Join(bin, fmt.Sprintf("ex%02d", i)))
			cmd.Env = append(os.Environ(), "DSEC_ADDR="+live.addr)
			out, err := cmd.CombinedOutput()
			if err != nil {
				t.Fatalf("docs/go.md block %d: %v\n%s\n--- program:\n%s", i, err, out, p)
			}
			t.Logf("docs/go.md block %d printed:\n%s", i, out)
		})
	}
}

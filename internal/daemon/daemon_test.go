package daemon

import (
	"errors"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strings"
	"testing"

	"dsec.dev/dsec/internal/apiserver"
	"dsec.dev/dsec/internal/edge/fncall"
	"dsec.dev/dsec/internal/edge/sandbox"
	"dsec.dev/dsec/internal/errdefs"
	"dsec.dev/dsec/internal/testutil"
)

// The chunk cache's memory tier is a sixteenth of the node's memory,
// between 64 MiB and 4 GiB, unless set.
func TestFillDerivesChunkMemory(t *testing.T) {
	for _, tc := range []struct{ memMB, want int64 }{
		{512, 64 << 20},
		{24 << 10, 1536 << 20},
		{256 << 10, 4 << 30},
	} {
		if got := defaultChunkMemory(tc.memMB); got != tc.want {
			t.Errorf("defaultChunkMemory(%d MiB) = %d, want %d", tc.memMB, got, tc.want)
		}
	}
	total, err := sandbox.MemTotalMB()
	if err != nil {
		t.Skipf("no /proc/meminfo: %v", err)
	}
	c := Config{Root: t.TempDir()}
	if err := c.fill(); err != nil {
		t.Fatal(err)
	}
	if c.Storage.MemoryBytes != defaultChunkMemory(total) {
		t.Errorf("derived MemoryBytes %d, want %d", c.Storage.MemoryBytes, defaultChunkMemory(total))
	}
	c = Config{Root: t.TempDir(), Storage: StorageConfig{MemoryBytes: 1 << 20}}
	if err := c.fill(); err != nil || c.Storage.MemoryBytes != 1<<20 {
		t.Errorf("set MemoryBytes became %d (%v)", c.Storage.MemoryBytes, err)
	}
}

// Limits left at 0 come from the node; set ones stay.
func TestFillDerivesLimitsFromNode(t *testing.T) {
	total, err := sandbox.MemTotalMB()
	if err != nil {
		t.Skipf("no /proc/meminfo: %v", err)
	}
	for _, tc := range []struct {
		name string
		in   sandbox.Limits
		want sandbox.Limits // the fields checked: MaxSandboxes, MaxCPUs, MaxMemoryMB
	}{
		{"derived", sandbox.Limits{}, sandbox.Limits{MaxSandboxes: defaultMaxSandboxes(total), MaxCPUs: float64(runtime.NumCPU()), MaxMemoryMB: total}},
		{"set", sandbox.Limits{MaxSandboxes: 1, MaxCPUs: 0.5, MaxMemoryMB: 100}, sandbox.Limits{MaxSandboxes: 1, MaxCPUs: 0.5, MaxMemoryMB: 100}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			c := Config{Root: t.TempDir(), Limits: tc.in}
			if err := c.fill(); err != nil {
				t.Fatal(err)
			}
			if got := c.Limits; got.MaxSandboxes != tc.want.MaxSandboxes || got.MaxCPUs != tc.want.MaxCPUs || got.MaxMemoryMB != tc.want.MaxMemoryMB {
				t.Errorf("limits %+v; want MaxSandboxes %d, MaxCPUs %v, MaxMemoryMB %d", got, tc.want.MaxSandboxes, tc.want.MaxCPUs, tc.want.MaxMemoryMB)
			}
		})
	}
}

func TestDefaultMaxSandboxes(t *testing.T) {
	for _, tc := range []struct {
		memTotalMB int64
		want       int
	}{
		{24105, 6026},    // 24 GiB: three times the old fixed 2,000
		{13 << 10, 3328}, // 13 GiB: 3,328 idle ones at the measured 3.4 MiB take 11.3 GiB
		{8 << 10, 2048},
		{1 << 10, 256},
		{256, 64}, // the floor
		{0, 64},
	} {
		if got := defaultMaxSandboxes(tc.memTotalMB); got != tc.want {
			t.Errorf("defaultMaxSandboxes(%d MiB) = %d, want %d", tc.memTotalMB, got, tc.want)
		}
	}
}

// buildHello builds a program that does nothing, for goarch, without cgo.
func buildHello(t *testing.T, goarch string) string {
	t.Helper()
	dir := t.TempDir()
	if err := os.WriteFile(filepath.Join(dir, "main.go"), []byte("package main\n\nfunc main() {}\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	bin := filepath.Join(dir, "hello-"+goarch)
	cmd := exec.Command(testutil.RequireCommand(t, "go"), "build", "-o", bin, "main.go")
	cmd.Dir = dir
	cmd.Env = append(os.Environ(), "CGO_ENABLED=0", "GOOS=linux", "GOARCH="+goarch, "GOFLAGS=")
	if out, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("build hello for %s: %v\n%s", goarch, err, out)
	}
	return bin
}

func TestCheckAgent(t *testing.T) {
	otherArch := "arm64"
	if runtime.GOARCH == "arm64" {
		otherArch = "amd64"
	}
	dir := t.TempDir()
	script := filepath.Join(dir, "script")
	if err := os.WriteFile(script, []byte("#!/bin/sh\nexec true\n"), 0o755); err != nil {
		t.Fatal(err)
	}
	empty := filepath.Join(dir, "empty")
	if err := os.WriteFile(empty, nil, 0o755); err != nil {
		t.Fatal(err)
	}
	fix := "build it static with `make build` (bin/dsec-agent), or `CGO_ENABLED=0 go build -o bin/dsec-agent ./cmd/dsec-agent`"
	for _, tc := range []struct {
		name string
		path string
		kind error    // nil: accepted
		msg  []string // what the refusal says
	}{
		{"static", buildHello(t, runtime.GOARCH), nil, nil},
		{"dynamic", testutil.DynamicExecutable(t), errdefs.ErrFailedPrecondition, []string{"it is dynamically linked (interpreter /", fix}},
		{"other architecture", buildHello(t, otherArch), errdefs.ErrFailedPrecondition, []string{"built for EM_", "but this node is " + runtime.GOARCH, fix}},
		{"script", script, errdefs.ErrFailedPrecondition, []string{"not an ELF executable", fix}},
		{"empty", empty, errdefs.ErrFailedPrecondition, []string{"not an ELF executable", fix}},
		{"missing", filepath.Join(dir, "missing"), errdefs.ErrNotFound, []string{"no such file", fix, "--agent"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			err := checkAgent(tc.path)
			if tc.kind == nil {
				if err != nil {
					t.Fatalf("checkAgent: %v", err)
				}
				return
			}
			if !errors.Is(err, tc.kind) {
				t.Fatalf("checkAgent = %v; want %v", err, tc.kind)
			}
			for _, m := range tc.msg {
				if !strings.Contains(err.Error(), m) {
					t.Errorf("checkAgent = %v; want it to say %q", err, m)
				}
			}
		})
	}
}

func TestFnCallPoolLabelsAgree(t *testing.T) {
	if apiserver.FnCallPoolLabel != fncall.PoolLabel {
		t.Errorf("the apiserver hides %q, the pools label %q", apiserver.FnCallPoolLabel, fncall.PoolLabel)
	}
}

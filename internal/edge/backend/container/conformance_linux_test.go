package container_test

import (
	"fmt"
	"io"
	"log/slog"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	"dsec.dev/dsec/internal/edge/backend"
	"dsec.dev/dsec/internal/edge/backend/backendtest"
	"dsec.dev/dsec/internal/edge/backend/container"
	"dsec.dev/dsec/internal/testutil"
)

// TestContainerConformance runs the runtime conformance suite against the
// container backend with runc and the real dsec-agent.
func TestContainerConformance(t *testing.T) {
	lower, cfg := conformanceSetup(t)
	backendtest.Run(t, backendtest.Options{Layers: backendtest.DirLayers(lower), New: func(t *testing.T, root string) backend.Runtime {
		rt, err := container.New(cfg(t, root))
		if err != nil {
			t.Fatal(err)
		}
		return rt
	}})
}

// TestFnCallConformance runs it against the fncall backend. Its agent runs
// with --cpu-cgroup-fd and --fncall, which dsec-agent must know.
func TestFnCallConformance(t *testing.T) {
	lower, cfg := conformanceSetup(t)
	backendtest.Run(t, backendtest.Options{Layers: backendtest.DirLayers(lower), New: func(t *testing.T, root string) backend.Runtime {
		rt, err := container.NewFnCall(cfg(t, root))
		if err != nil {
			t.Fatal(err)
		}
		return rt
	}})
}

// TestGVisorConformance runs it against the container backend under
// runsc (gVisor) at DSEC_RUNSC (scripts/build-runsc.sh builds one), on the
// platform DSEC_RUNSC_PLATFORM (default systrap).
func TestGVisorConformance(t *testing.T) {
	runsc := testutil.Runsc(t)
	lower, cfg := conformanceSetup(t)
	// The deviations docs/gvisor.md states.
	dev := backendtest.Deviations{OOMKillsSandbox: true, StatfsNoLimit: true}
	backendtest.Run(t, backendtest.Options{Layers: backendtest.DirLayers(lower), Deviations: dev, New: func(t *testing.T, root string) backend.Runtime {
		c := cfg(t, root)
		c.Runtime, c.RuntimePath, c.RunscPlatform = "runsc", runsc, os.Getenv("DSEC_RUNSC_PLATFORM")
		rt, err := container.New(c)
		if err != nil {
			t.Fatal(err)
		}
		return rt
	}})
}

// conformanceSetup makes a busybox root file system and an agent dir with
// the real dsec-agent, and returns the lower dir and a Config maker.
func conformanceSetup(t *testing.T) (string, func(t *testing.T, root string) container.Config) {
	testutil.RequireRoot(t)
	testutil.RequireCommand(t, "runc")
	testutil.RequireCommand(t, "mkfs.ext4")
	busybox := testutil.RequireCommand(t, "busybox")
	shell := busybox
	if p, err := exec.LookPath("bash-static"); err == nil {
		shell = p
	}
	base := t.TempDir()
	agentDir := filepath.Join(base, "agent")
	if err := os.MkdirAll(agentDir, 0o755); err != nil {
		t.Fatal(err)
	}
	copyFile(t, filepath.Join(testutil.Binaries(t), "dsec-agent"), filepath.Join(agentDir, "dsec-agent"))
	copyFile(t, shell, filepath.Join(agentDir, "sh"))
	lower := filepath.Join(base, "lower")
	makeRootfs(t, busybox, lower)
	cgroupParent := fmt.Sprintf("dsec-conf-%d", os.Getpid())
	return lower, func(t *testing.T, root string) container.Config {
		return container.Config{
			Root:         filepath.Join(root, "runtime"),
			UpperRoot:    filepath.Join(root, "upper"),
			UpperImage:   filepath.Join(root, "upper.img"),
			UpperFSBytes: 1 << 30,
			CgroupParent: cgroupParent,
			AgentDir:     agentDir,
			SocketDir:    filepath.Join(root, "sock"),
			Log:          slog.New(slog.NewTextHandler(testLog{t}, &slog.HandlerOptions{Level: slog.LevelWarn})),
		}
	}
}

type testLog struct{ t *testing.T }

func (w testLog) Write(p []byte) (int, error) {
	w.t.Log(strings.TrimSpace(string(p)))
	return len(p), nil
}

func makeRootfs(t *testing.T, busybox, dir string) {
	t.Helper()
	for _, d := range []string{"bin", "etc", "tmp", "proc", "sys", "dev", "root"} {
		if err := os.MkdirAll(filepath.Join(dir, d), 0o755); err != nil {
			t.Fatal(err)
		}
	}
	copyFile(t, busybox, filepath.Join(dir, "bin", "busybox"))
	// Every applet, as backendtest's checks run them by name.
	list, err := exec.Command(busybox, "--list").Output()
	if err != nil {
		t.Fatalf("busybox --list: %v", err)
	}
	for _, name := range strings.Fields(string(list)) {
		if name == "busybox" || strings.Contains(name, "/") {
			continue
		}
		if err := os.Symlink("busybox", filepath.Join(dir, "bin", name)); err != nil {
			t.Fatal(err)
		}
	}
	files := map[string]string{
		"etc/passwd": "root:x:0:0:root:/root:/bin/sh\nnobody:x:65534:65534:nobody:/:/bin/false\n",
		"etc/group":  "root:x:0:\nnogroup:x:65534:\n",
	}
	for name, content := range files {
		if err := os.WriteFile(filepath.Join(dir, name), []byte(content), 0o644); err != nil {
			t.Fatal(err)
		}
	}
}

func copyFile(t *testing.T, from, to string) {
	t.Helper()
	in, err := os.Open(from)
	if err != nil {
		t.Fatal(err)
	}
	defer in.Close()
	out, err := os.OpenFile(to, os.O_CREATE|os.O_WRONLY|os.O_TRUNC, 0o755)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := io.Copy(out, in); err != nil {
		t.Fatal(err)
	}
	if err := out.Close(); err != nil {
		t.Fatal(err)
	}
}

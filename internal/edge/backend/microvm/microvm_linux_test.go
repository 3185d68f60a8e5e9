package microvm_test

import (
	"context"
	"debug/elf"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"connectrpc.com/connect"

	agentv1 "dsec.dev/dsec/api/gen/dsec/agent/v1"
	dsecv1 "dsec.dev/dsec/api/gen/dsec/v1"
	"dsec.dev/dsec/internal/agent/agentclient"
	"dsec.dev/dsec/internal/edge/backend"
	"dsec.dev/dsec/internal/edge/backend/backendtest"
	"dsec.dev/dsec/internal/edge/backend/microvm"
	"dsec.dev/dsec/internal/edge/image"
	"dsec.dev/dsec/internal/errdefs"
	"dsec.dev/dsec/internal/testutil"
	"dsec.dev/dsec/internal/vm/fuse2fs"
	"dsec.dev/dsec/internal/vm/qemu"
)

// fixture is what every VM of the package's tests boots from: the guest
// kernel, an agent dir, and one busybox EROFS layer. Made once.
type fixture struct {
	kernelDir string
	agentDir  string
	layers    []backend.Layer
}

var (
	fixOnce sync.Once
	fix     fixture
	fixErr  error
)

// setup returns the shared fixture, or skips (fails under DSEC_TEST_ROOT=1)
// where the node cannot run VMs.
func setup(t *testing.T) fixture {
	t.Helper()
	testutil.RequireRoot(t)
	kernelDir := testutil.VMKernelDir(t)
	for _, cmd := range []string{"mkfs.erofs", "mkfs.ext4"} {
		testutil.RequireCommand(t, cmd)
	}
	busybox := staticBusybox(t)
	agentBin := filepath.Join(testutil.Binaries(t), "dsec-agent")
	fixOnce.Do(func() { fix, fixErr = makeFixture(kernelDir, agentBin, busybox) })
	if fixErr != nil {
		t.Fatal(fixErr)
	}
	return fix
}

func makeFixture(kernelDir, agentBin, busybox string) (fixture, error) {
	base, err := os.MkdirTemp("", "dsec-microvm-test-")
	if err != nil {
		return fixture{}, err
	}
	cleanups = append(cleanups, func() { os.RemoveAll(base) })
	agentDir := filepath.Join(base, "agent")
	tree := filepath.Join(base, "tree")
	for _, d := range []string{agentDir, tree + "/bin", tree + "/etc", tree + "/tmp", tree + "/root"} {
		if err := os.MkdirAll(d, 0o755); err != nil {
			return fixture{}, err
		}
	}
	for name, src := range map[string]string{"dsec-agent": agentBin, "sh": busybox} {
		if err := os.Symlink(src, filepath.Join(agentDir, name)); err != nil {
			return fixture{}, err
		}
	}
	b, err := os.ReadFile(busybox)
	if err != nil {
		return fixture{}, err
	}
	if err := os.WriteFile(filepath.Join(tree, "bin", "busybox"), b, 0o755); err != nil {
		return fixture{}, err
	}
	for _, applet := range []string{"sh", "echo", "cat", "ls", "sleep", "true", "uname", "df", "mount", "dd", "sync", "hostname", "pwd", "seq", "awk"} {
		if err := os.Symlink("busybox", filepath.Join(tree, "bin", applet)); err != nil {
			return fixture{}, err
		}
	}
	files := map[string]string{
		"etc/passwd": "root:x:0:0:root:/root:/bin/sh\nnobody:x:65534:65534:nobody:/:/bin/false\n",
		"etc/group":  "root:x:0:\nnogroup:x:65534:\n",
	}
	for name, content := range files {
		if err := os.WriteFile(filepath.Join(tree, name), []byte(content), 0o644); err != nil {
			return fixture{}, err
		}
	}
	// Built as the layer store builds its files (flat, padded to 2 MiB), so
	// a runtime with PmemLayers attaches it as pmem.
	layer := filepath.Join(base, "layer.erofs")
	digest, size, err := image.BuildLayerFile(context.Background(), tree, layer)
	if err != nil {
		return fixture{}, err
	}
	return fixture{
		kernelDir: kernelDir, agentDir: agentDir,
		layers: []backend.Layer{{Digest: digest, File: layer, FSType: backend.FSTypeEROFS, Size: size}},
	}, nil
}

// cleanups run once every test ended (TestMain).
var cleanups []func()

func TestMain(m *testing.M) {
	if fuse2fs.IsFusermount(os.Args[0]) {
		// fuse2fs's fusermount under a capture (package fuse2fs).
		os.Exit(fuse2fs.Fusermount(os.Args))
	}
	code := m.Run()
	for _, f := range cleanups {
		f()
	}
	testutil.RemoveBinaries()
	os.Exit(code)
}

// staticBusybox is the host's busybox, which must be the static one
// (Debian's busybox-static): the guest has no libraries.
func staticBusybox(t *testing.T) string {
	t.Helper()
	p := testutil.RequireCommand(t, "busybox")
	f, err := elf.Open(p)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	for _, prog := range f.Progs {
		testutil.Require(t, prog.Type != elf.PT_INTERP, p+" is linked dynamically (install busybox-static)")
	}
	return p
}

// cgroupParent keeps the tests' QEMU cgroups apart from a node's.
var cgroupParent = fmt.Sprintf("dsec-microvm-test-%d", os.Getpid())

func config(t *testing.T, f fixture, root string) microvm.Config {
	return microvm.Config{
		StateDir: filepath.Join(root, "microvm"), KernelDir: f.kernelDir, AgentDir: f.agentDir,
		CgroupParent: cgroupParent,
		Log:          slog.New(slog.NewTextHandler(testLog{t}, &slog.HandlerOptions{Level: slog.LevelWarn})),
	}
}

type testLog struct{ t *testing.T }

func (w testLog) Write(p []byte) (int, error) {
	w.t.Log(strings.TrimSpace(string(p)))
	return len(p), nil
}

// TestConformance runs the runtime seam's suite against real guests (TCG
// here, KVM where the host has it). The runtime instances over one root
// share their agent channels, as one daemon's would.
func TestConformance(t *testing.T) {
	f := setup(t)
	var mu sync.Mutex
	channels := map[string]*microvm.Channels{}
	// By design: the guest's resolv.conf names vmnet.DNSAddr, not
	// Spec.ResolvConf (the package doc).
	dev := backendtest.Deviations{OwnResolvConf: true}
	backendtest.Run(t, backendtest.Options{Layers: f.layers, Boot: time.Minute, Deviations: dev, New: func(t *testing.T, root string) backend.Runtime {
		cfg := config(t, f, root)
		mu.Lock()
		if channels[root] == nil {
			channels[root] = microvm.NewChannels(nil)
		}
		cfg.Channels = channels[root]
		mu.Unlock()
		rt, err := microvm.New(cfg)
		if err != nil {
			t.Fatal(err)
		}
		return rt
	}})
}

// TestMissingParts: a node without QEMU or without the guest kernel is
// refused at Init, naming what to install.
func TestMissingParts(t *testing.T) {
	testutil.RequireCommand(t, qemu.DefaultBinary)
	root := t.TempDir()
	kernelDir := filepath.Join(root, "no-kernel")
	for _, tc := range []struct {
		name, qemu, kernel, want string
	}{
		{"qemu", filepath.Join(root, "no-qemu"), kernelDir, "apt-get install qemu-system-x86"},
		{"kernel", "", kernelDir, "scripts/build-vm-kernel.sh"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			rt, err := microvm.New(microvm.Config{StateDir: filepath.Join(root, tc.name), KernelDir: tc.kernel, QEMU: tc.qemu, AgentDir: root})
			if err != nil {
				t.Fatal(err)
			}
			err = rt.Init(context.Background())
			if !errors.Is(err, errdefs.ErrNotSupported) || !strings.Contains(err.Error(), tc.want) {
				t.Errorf("Init = %v, want not supported naming %q", err, tc.want)
			}
			if _, err := os.Stat(filepath.Join(root, tc.name)); !errors.Is(err, os.ErrNotExist) {
				t.Errorf("a refused Init left its state dir: %v", err)
			}
		})
	}
}

// TestBootFailures: a boot the watchdog gives up on, and a guest whose
// init dies (a bad flag: the kernel panics), fail Start with the console's
// last lines and leave nothing.
func TestBootFailures(t *testing.T) {
	f := setup(t)
	for _, tc := range []struct {
		name string
		edit func(*microvm.Config)
		kind error
		want string // in the error
	}{
		{"watchdog", func(c *microvm.Config) { c.BootTimeout = 300 * time.Millisecond }, errdefs.ErrDeadlineExceeded, "console:"},
		{"bad init flag", func(c *microvm.Config) { c.GuestArgs = []string{"--no-such-flag"} }, errdefs.ErrUnavailable, "dsec-agent guest: flag provided but not defined: -no-such-flag"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			root := t.TempDir()
			cfg := config(t, f, root)
			tc.edit(&cfg)
			rt := newRuntime(t, cfg)
			s := spec(root, "sb-"+strings.ReplaceAll(tc.name, " ", "-"), f)
			_, err := rt.Start(context.Background(), s)
			if err == nil {
				t.Fatal("Start succeeded")
			}
			if !errors.Is(err, tc.kind) || !strings.Contains(err.Error(), tc.want) {
				t.Errorf("Start = %v\nwant %v with %q", err, tc.kind, tc.want)
			}
			t.Logf("Start: %v", err)
			assertNothingLeft(t, rt, cfg, s.ID)
		})
	}
}

// TestKilledQEMU: a VM whose QEMU is killed is not running and says why,
// to the instance that started it and to a later one; Delete removes it.
// Inside, the spec's pids limit holds and a command past the guest's
// memory is reported OOM-killed. It logs what a VM costs: Start to the
// agent's answer, QEMU's memory while the guest idles.
func TestKilledQEMU(t *testing.T) {
	f := setup(t)
	root := t.TempDir()
	cfg := config(t, f, root)
	cfg.Channels = microvm.NewChannels(nil)
	rt := newRuntime(t, cfg)
	ctx := context.Background()
	s := spec(root, "sb-killed", f)
	s.Agent = backend.Agent{Workdir: "/root", Env: map[string]string{"GREETING": "hello from the guest"}}
	s.Pids = 24
	start := time.Now()
	dial, err := rt.Start(ctx, s)
	if err != nil {
		t.Fatal(err)
	}
	took := time.Since(start)
	st, err := rt.Status(ctx, s.ID)
	if err != nil || !st.Running || st.Accel == "" {
		t.Fatalf("Status = %+v, %v; want running with its accelerator", st, err)
	}
	client := agentclient.New(dial)
	defer client.Close()
	// The configuration reached the guest's agent through the disk.
	if out := execOut(t, client, "sh", "-c", `echo "$GREETING in $(pwd) on $(hostname)"`); out != "hello from the guest in /root on "+s.Hostname+"\n" {
		t.Errorf("exec: %q", out)
	}
	time.Sleep(2 * time.Second) // the boot's work settles
	u, err := rt.(backend.Meter).Usage(ctx, s.ID)
	if err != nil {
		t.Fatal(err)
	}
	if u.MemoryBytes <= 0 || u.MemoryLimit != s.MemoryBytes || u.DiskLimit != s.DiskBytes || u.DiskBytes <= 0 || u.DiskBytes >= u.DiskLimit {
		t.Errorf("Usage = %+v", u)
	}
	t.Logf("%s VM of %d MiB: Start to the agent's answer %s; idle QEMU's cgroup %.1f MiB (RSS %s), CPU %.2f s, writable disk %.1f MiB allocated of %d MiB",
		st.Accel, s.MemoryBytes>>20, took.Round(time.Millisecond), float64(u.MemoryBytes)/(1<<20), rss(st.Pid),
		float64(u.CPUUsec)/1e6, float64(u.DiskBytes)/(1<<20), u.DiskLimit>>20)

	// The OOM killer ends a command that outgrows the guest's memory (the
	// sandbox's cgroup in the guest), and the agent says so.
	if out, exited := execExit(t, client, "sh", "-c", `awk 'BEGIN { s = "x"; while (1) s = s s }'`); exited.GetStatus() != dsecv1.ExitStatus_EXIT_STATUS_OOM {
		t.Errorf("a command past the guest's memory: %+v, %q; want OOM", exited, out)
	}
	// The commands share the spec's pids limit in the guest.
	if out := execOut(t, client, "sh", "-c", "for i in $(seq 30); do sleep 3 & done 2>&1; wait"); !strings.Contains(out, "fork") {
		t.Errorf("30 sleeps under a limit of %d pids: %q, want a refused fork", s.Pids, out)
	}
	// A later instance (a restarted daemon) re-adopts the VM before it
	// dies.
	later := newRuntime(t, cfg)
	if err := exec.Command("kill", "-9", fmt.Sprint(st.Pid)).Run(); err != nil {
		t.Fatal(err)
	}
	deadline := time.Now().Add(10 * time.Second)
	for {
		st, err = rt.Status(ctx, s.ID)
		if err != nil {
			t.Fatal(err)
		}
		if !st.Running || time.Now().After(deadline) {
			break
		}
		time.Sleep(20 * time.Millisecond)
	}
	if st.Running || !strings.Contains(st.Reason, "killed") || !strings.Contains(st.Reason, "console:") {
		t.Errorf("Status after kill -9 = %+v, want not running, killed, the console's lines", st)
	}
	// The later instance reads what the first recorded.
	if got, err := later.Status(ctx, s.ID); err != nil || got.Running || got.Reason != st.Reason {
		t.Errorf("a later instance's Status = %+v, %v", got, err)
	}
	// Had the first instance died first (the daemon restarted), nothing
	// would be recorded: the later one says as much from the console and
	// QEMU's log.
	if err := os.Remove(filepath.Join(cfg.StateDir, "vms", s.ID, "exit")); err != nil {
		t.Fatal(err)
	}
	if st, err := later.Status(ctx, s.ID); err != nil || st.Running || !strings.Contains(st.Reason, "qemu was killed") || !strings.Contains(st.Reason, "console:") {
		t.Errorf("a re-adopting instance's Status after kill -9 = %+v, %v; want killed, the console's lines", st, err)
	} else {
		t.Logf("a re-adopting instance's reason: %s", firstLine(st.Reason))
	}
	if err := later.Delete(ctx, s.ID); err != nil {
		t.Fatal(err)
	}
	assertNothingLeft(t, later, cfg, s.ID)
}

func newRuntime(t *testing.T, cfg microvm.Config) backend.Runtime {
	t.Helper()
	rt, err := microvm.New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	if err := rt.Init(context.Background()); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		ctx := context.Background()
		ids, _ := rt.List(ctx)
		for _, id := range ids {
			if err := rt.Delete(ctx, id); err != nil {
				t.Errorf("cleanup: Delete %s: %v", id, err)
			}
		}
		if err := rt.Teardown(ctx); err != nil {
			t.Errorf("cleanup: Teardown: %v", err)
		}
	})
	return rt
}

func spec(root, id string, f fixture) backend.Spec {
	return backend.Spec{
		ID: id, Layers: f.layers, DiskBytes: 64 << 20, CPUs: 1, MemoryBytes: 256 << 20, Pids: 256,
		Hostname: id, LogPath: filepath.Join(root, id+".log"),
	}
}

// assertNothingLeft checks that the runtime forgot id and that its run
// dir, its cgroup and its QEMU are gone.
func assertNothingLeft(t *testing.T, rt backend.Runtime, cfg microvm.Config, id string) {
	t.Helper()
	ctx := context.Background()
	if ids, err := rt.List(ctx); err != nil || len(ids) != 0 {
		t.Errorf("List = %v, %v; want none", ids, err)
	}
	if st, err := rt.Status(ctx, id); !errors.Is(err, errdefs.ErrNotFound) {
		t.Errorf("Status = %+v, %v; want not found", st, err)
	}
	if _, err := os.Stat(filepath.Join(cfg.StateDir, "vms", id)); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("run dir: %v, want gone", err)
	}
	for _, ctrl := range []string{"memory", "pids", "unified", ""} {
		if _, err := os.Stat(filepath.Join("/sys/fs/cgroup", ctrl, cfg.CgroupParent, id)); err == nil {
			t.Errorf("cgroup %s/%s/%s left", ctrl, cfg.CgroupParent, id)
		}
	}
	if out, _ := exec.Command("pgrep", "-f", "dsec-"+id).Output(); len(out) > 0 {
		t.Errorf("QEMU of %s still runs: %s", id, out)
	}
}

func execOut(t *testing.T, c agentclient.Client, argv ...string) string {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	if _, err := c.Ping(ctx, connect.NewRequest(&agentv1.PingRequest{})); err != nil {
		t.Fatal(err)
	}
	s, err := c.ExecEvents(ctx, &dsecv1.ExecRequest{Argv: argv})
	if err != nil {
		t.Fatalf("exec %q: %v", argv, err)
	}
	defer s.Close()
	var out strings.Builder
	for s.Receive() {
		out.Write(s.Msg().GetStdout())
		out.Write(s.Msg().GetStderr())
	}
	if err := s.Err(); err != nil {
		t.Fatalf("exec %q: %v", argv, err)
	}
	return out.String()
}

// execExit runs argv and returns its output and how it ended.
func execExit(t *testing.T, c agentclient.Client, argv ...string) (string, *dsecv1.ExecExited) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	s, err := c.ExecEvents(ctx, &dsecv1.ExecRequest{Argv: argv})
	if err != nil {
		t.Fatalf("exec %q: %v", argv, err)
	}
	defer s.Close()
	var out strings.Builder
	var exited *dsecv1.ExecExited
	for s.Receive() {
		out.Write(s.Msg().GetStdout())
		out.Write(s.Msg().GetStderr())
		if e := s.Msg().GetExited(); e != nil {
			exited = e
		}
	}
	if err := s.Err(); err != nil {
		t.Fatalf("exec %q: %v", argv, err)
	}
	return out.String(), exited
}

func firstLine(s string) string {
	line, _, _ := strings.Cut(s, "\n")
	return line
}

// rss is process pid's resident memory, as /proc says it.
func rss(pid int) string {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", pid))
	if err != nil {
		return "?"
	}
	for _, line := range strings.Split(string(b), "\n") {
		if v, ok := strings.CutPrefix(line, "VmRSS:"); ok {
			return strings.TrimSpace(v)
		}
	}
	return "?"
}

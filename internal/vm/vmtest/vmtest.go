// Package vmtest boots real microVMs for tests: the built kernel
// (DSEC_VM_KERNEL_DIR), the built dsec-agent as init (DSEC_BIN_DIR), a
// static busybox as the guest's commands, an EROFS layer holding it and an
// ext4 writable disk. Tests that use it skip without those, and fail under
// DSEC_TEST_ROOT=1 (package testutil). A TCG boot costs seconds of CPU:
// boot few guests and share them between subtests.
package vmtest

import (
	"bytes"
	"context"
	"debug/elf"
	"log/slog"
	"os"
	osexec "os/exec"
	"path/filepath"
	"testing"
	"time"

	"connectrpc.com/connect"

	agentv1 "dsec.dev/dsec/api/gen/dsec/agent/v1"
	dsecv1 "dsec.dev/dsec/api/gen/dsec/v1"
	"dsec.dev/dsec/internal/agent"
	"dsec.dev/dsec/internal/agent/agentclient"
	"dsec.dev/dsec/internal/testutil"
	"dsec.dev/dsec/internal/vm/channel"
	"dsec.dev/dsec/internal/vm/initramfs"
	"dsec.dev/dsec/internal/vm/kernel"
	"dsec.dev/dsec/internal/vm/qemu"
)

// BootTimeout bounds a test guest's boot: about 4 s under TCG on an idle
// 2-core machine, far more on a loaded one.
const BootTimeout = 3 * time.Minute

// Applets are the busybox commands the layer links.
var Applets = []string{"sh", "echo", "cat", "uname", "true", "sync", "sleep", "head", "od", "hostname", "ls", "grep", "tr"}

// Config is a test guest's QEMU config in dir: the built kernel, an
// initramfs with the built agent, the layer and a fresh writable disk;
// the guest's root is the layer under overlayfs over the disk. The caller
// may change it (MemoryFile, MemoryMiB) before Boot.
func Config(t testing.TB, dir string) qemu.Config {
	t.Helper()
	k, err := kernel.Load(testutil.VMKernelDir(t))
	if err != nil {
		t.Fatal(err)
	}
	busybox := StaticBusybox(t)
	initrd, err := initramfs.Cached(filepath.Join(dir, "initramfs"), initramfs.Image{
		Init:     filepath.Join(testutil.Binaries(t), "dsec-agent"),
		Kernel:   k,
		Files:    []initramfs.File{{Name: "/bin/busybox", Source: busybox, Mode: 0o755}},
		Symlinks: map[string]string{agent.DefaultShell: "/bin/busybox"},
	})
	if err != nil {
		t.Fatal(err)
	}
	layer, upper := MakeDisks(t, dir, busybox)
	return qemu.Config{
		Dir: filepath.Join(dir, "vm"), Kernel: k.Vmlinux(), Initrd: initrd,
		Drives: []qemu.Drive{
			{Path: layer, Serial: "dsec-layer0", ReadOnly: true},
			{Path: upper, Serial: "dsec-upper"},
		},
		Cmdline: "-- --layer dsec-layer0 --upper dsec-upper",
	}
}

// Guest is a running test VM and an agent client over its channel.
type Guest struct {
	P      *qemu.Process
	Dialer *channel.Dialer
	Agent  agentclient.Client
}

// Start starts cfg's VM (or takes p, already started, when not nil) and
// connects to its agent; t's cleanup kills it. It does not wait for the
// boot (WaitReady).
func Start(t testing.TB, cfg qemu.Config, log *slog.Logger) *Guest {
	t.Helper()
	p, err := qemu.Start(context.Background(), cfg, log)
	if err != nil {
		t.Fatal(err)
	}
	return Adopt(t, p, log)
}

// Adopt connects to the agent of the running VM p; t's cleanup kills p
// and closes the client.
func Adopt(t testing.TB, p *qemu.Process, log *slog.Logger) *Guest {
	t.Helper()
	t.Cleanup(func() {
		p.Kill()
		<-p.Done()
	})
	d := channel.NewDialer(p.ChannelPath(), log)
	c := agentclient.New(d.Dial)
	t.Cleanup(func() {
		c.Close()
		d.Close()
	})
	return &Guest{P: p, Dialer: d, Agent: c}
}

// Ping asks the agent whether it answers, within 10 s.
func (g *Guest) Ping(ctx context.Context) error {
	ctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	_, err := g.Agent.Ping(ctx, connect.NewRequest(&agentv1.PingRequest{}))
	return err
}

// WaitBoot waits for the agent's first answer (qemu's boot watchdog).
func (g *Guest) WaitBoot(t testing.TB) {
	t.Helper()
	if err := g.P.WaitBoot(context.Background(), BootTimeout, g.Ping); err != nil {
		t.Fatal(err)
	}
}

// Exec runs argv in the guest and returns its output (stdout then
// stderr) and exit code.
func (g *Guest) Exec(t testing.TB, argv ...string) (string, int32) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	s, err := g.Agent.ExecEvents(ctx, &dsecv1.ExecRequest{Argv: argv})
	if err != nil {
		t.Fatalf("exec %q: %v", argv, err)
	}
	defer s.Close()
	var out bytes.Buffer
	code := int32(-1)
	for s.Receive() {
		out.Write(s.Msg().GetStdout())
		out.Write(s.Msg().GetStderr())
		if e := s.Msg().GetExited(); e != nil {
			code = e.GetExitCode()
		}
	}
	if err := s.Err(); err != nil {
		t.Fatalf("exec %q: %v", argv, err)
	}
	return out.String(), code
}

// MustExec is Exec that fails t unless the command exits 0.
func (g *Guest) MustExec(t testing.TB, argv ...string) string {
	t.Helper()
	out, code := g.Exec(t, argv...)
	if code != 0 {
		t.Fatalf("exec %q: exit %d: %s", argv, code, out)
	}
	return out
}

// StaticBusybox is the host's busybox, which the guest gets as its shell
// and commands; it must be the static one (Debian's busybox-static).
func StaticBusybox(t testing.TB) string {
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

// MakeDisks makes a guest's root disks in dir: an EROFS layer holding
// busybox (as /bin/*, the Applets) and /hello.txt, and an empty 64 MiB
// ext4 writable disk.
func MakeDisks(t testing.TB, dir, busybox string) (layer, upper string) {
	t.Helper()
	for _, cmd := range []string{"mkfs.erofs", "mkfs.ext4"} {
		testutil.RequireCommand(t, cmd)
	}
	tree := filepath.Join(dir, "layer")
	if err := os.MkdirAll(filepath.Join(tree, "bin"), 0o755); err != nil {
		t.Fatal(err)
	}
	b, err := os.ReadFile(busybox)
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(tree, "bin", "busybox"), b, 0o755); err != nil {
		t.Fatal(err)
	}
	for _, applet := range Applets {
		if err := os.Symlink("busybox", filepath.Join(tree, "bin", applet)); err != nil {
			t.Fatal(err)
		}
	}
	if err := os.WriteFile(filepath.Join(tree, "hello.txt"), []byte("from the layer\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	layer = filepath.Join(dir, "layer.erofs")
	upper = filepath.Join(dir, "upper.ext4")
	if out, err := osexec.Command("mkfs.erofs", "--quiet", layer, tree).CombinedOutput(); err != nil {
		t.Fatalf("mkfs.erofs: %v\n%s", err, out)
	}
	if err := os.WriteFile(upper, nil, 0o600); err != nil {
		t.Fatal(err)
	}
	if err := os.Truncate(upper, 64<<20); err != nil {
		t.Fatal(err)
	}
	if out, err := osexec.Command("mkfs.ext4", "-q", "-F", upper).CombinedOutput(); err != nil {
		t.Fatalf("mkfs.ext4: %v\n%s", err, out)
	}
	return layer, upper
}

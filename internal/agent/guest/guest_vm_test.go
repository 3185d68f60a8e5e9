package guest_test

import (
	"bytes"
	"context"
	"fmt"
	"log/slog"
	"os"
	osexec "os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"syscall"
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
	"dsec.dev/dsec/internal/vm/qmp"
	"dsec.dev/dsec/internal/vm/vmtest"
)

// bootTimeout bounds the boot of the test's guest: about 4 s under TCG on
// an idle 2-core machine, far more on a loaded one.
const bootTimeout = 3 * time.Minute

// TestGuest boots one real microVM (under TCG here, KVM where the host has
// it) from the built kernel with dsec-agent as its init, and talks to the
// agent over the virtio-serial channel. The subtests share the guest: a
// boot costs seconds of CPU.
func TestGuest(t *testing.T) {
	k, err := kernel.Load(testutil.VMKernelDir(t))
	if err != nil {
		t.Fatal(err)
	}
	busybox := vmtest.StaticBusybox(t)
	agentBin := filepath.Join(testutil.Binaries(t), "dsec-agent")

	dir := t.TempDir()
	initrd, err := initramfs.Cached(filepath.Join(dir, "initramfs"), initramfs.Image{
		Init:   agentBin,
		Kernel: k,
		// The agent's shell, which the guest binds into its root.
		Files:    []initramfs.File{{Name: "/bin/busybox", Source: busybox, Mode: 0o755}},
		Symlinks: map[string]string{agent.DefaultShell: "/bin/busybox"},
	})
	if err != nil {
		t.Fatal(err)
	}

	layer, upper := vmtest.MakeDisks(t, dir, busybox)

	log := slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelWarn}))
	ctx := context.Background()
	start := time.Now()
	p, err := qemu.Start(ctx, qemu.Config{
		Dir: filepath.Join(dir, "vm"), Kernel: k.Vmlinux(), Initrd: initrd,
		Drives: []qemu.Drive{
			{Path: layer, Serial: "dsec-layer0", ReadOnly: true},
			{Path: upper, Serial: "dsec-upper"},
		},
		Cmdline: "-- --layer dsec-layer0 --upper dsec-upper",
	}, log)
	if err != nil {
		t.Fatal(err)
	}
	pid := p.Pid()
	t.Cleanup(func() {
		p.Kill()
		<-p.Done()
	})
	dialer := channel.NewDialer(p.ChannelPath(), log)
	defer dialer.Close()
	client := agentclient.New(dialer.Dial)
	defer client.Close()

	ping := func(ctx context.Context) (*agentv1.PingResponse, error) {
		ctx, cancel := context.WithTimeout(ctx, 10*time.Second)
		defer cancel()
		resp, err := client.Ping(ctx, connect.NewRequest(&agentv1.PingRequest{}))
		if err != nil {
			return nil, err
		}
		return resp.Msg, nil
	}
	err = p.WaitBoot(ctx, bootTimeout, func(ctx context.Context) error {
		_, err := ping(ctx)
		return err
	})
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("%s guest: QEMU start to the agent's first answer %s, QEMU's CPU time %s", p.Config().Accel,
		time.Since(start).Round(time.Millisecond), cpuTime(t, pid))

	t.Run("Ping", func(t *testing.T) {
		resp, err := ping(ctx)
		if err != nil {
			t.Fatal(err)
		}
		if resp.GetVersion() != agent.Version {
			t.Errorf("agent version %q, want %q", resp.GetVersion(), agent.Version)
		}
	})

	exec := func(t *testing.T, argv ...string) (string, int32) {
		t.Helper()
		ctx, cancel := context.WithTimeout(ctx, time.Minute)
		defer cancel()
		s, err := client.ExecEvents(ctx, &dsecv1.ExecRequest{Argv: argv})
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

	t.Run("Exec", func(t *testing.T) {
		if out, code := exec(t, "echo", "hello from the guest"); out != "hello from the guest\n" || code != 0 {
			t.Errorf("echo: %q, exit %d", out, code)
		}
		// The guest's own kernel, not the host's.
		if out, code := exec(t, "uname", "-r"); strings.TrimSpace(out) != k.Version || code != 0 {
			t.Errorf("uname -r: %q, exit %d; want %s", out, code, k.Version)
		}
		if out, code := exec(t, "sh", "-c", "exit 7"); code != 7 {
			t.Errorf("sh -c 'exit 7': %q, exit %d", out, code)
		}
	})

	t.Run("ModulesLoaded", func(t *testing.T) {
		out, code := exec(t, "cat", "/proc/modules")
		if code != 0 {
			t.Fatalf("cat /proc/modules: %q, exit %d", out, code)
		}
		for _, m := range []string{"virtio_console", "erofs", "overlay", "ext4", "virtio_blk"} {
			if !strings.Contains(out, m+" ") {
				t.Errorf("module %s is not loaded in the guest", m)
			}
		}
	})

	// Many connections at once, each a stream of the one port.
	t.Run("ConcurrentCalls", func(t *testing.T) {
		var wg sync.WaitGroup
		for range 8 {
			wg.Go(func() {
				if _, err := ping(ctx); err != nil {
					t.Error(err)
				}
			})
		}
		wg.Wait()
	})

	// The root is the layer under overlayfs, its changes on the writable
	// disk (read back once QEMU is gone).
	t.Run("Root", func(t *testing.T) {
		if out, code := exec(t, "cat", "/hello.txt"); out != "from the layer\n" || code != 0 {
			t.Errorf("cat /hello.txt: %q, exit %d", out, code)
		}
		out, code := exec(t, "cat", "/proc/mounts")
		if code != 0 || !strings.Contains(out, "overlay / overlay ") {
			t.Errorf("the root is not an overlay: %q, exit %d", out, code)
		}
		if out, code := exec(t, "sh", "-c", "echo written in the guest > /written.txt && sync"); code != 0 {
			t.Errorf("write in the root: %q, exit %d", out, code)
		}
	})

	// A session keeps its directory and environment between commands,
	// which the agent learns by running itself (state-dump) in the root.
	t.Run("Session", func(t *testing.T) {
		run := func(command string) string {
			sctx, cancel := context.WithTimeout(ctx, time.Minute)
			defer cancel()
			s, err := client.SessionRun(sctx, connect.NewRequest(&dsecv1.SessionRunRequest{Session: "s1", Command: command}))
			if err != nil {
				t.Fatal(err)
			}
			defer s.Close()
			var out bytes.Buffer
			for s.Receive() {
				out.Write(s.Msg().GetStdout())
				out.Write(s.Msg().GetStderr())
			}
			if err := s.Err(); err != nil {
				t.Fatalf("session run %q: %v", command, err)
			}
			return out.String()
		}
		run("cd /bin && export GREETING=hi")
		if out := run("pwd; echo $GREETING"); out != "/bin\nhi\n" {
			t.Errorf("the session's second command printed %q, want its directory and variable", out)
		}
	})

	// Figures for people, not checked: a round trip of the channel.
	t.Run("Latency", func(t *testing.T) {
		median := func(call func()) time.Duration {
			var ds []time.Duration
			for range 21 {
				t0 := time.Now()
				call()
				ds = append(ds, time.Since(t0))
			}
			slices.Sort(ds)
			return ds[len(ds)/2]
		}
		pingTook := median(func() {
			if _, err := ping(ctx); err != nil {
				t.Fatal(err)
			}
		})
		execTook := median(func() { exec(t, "true") })
		t.Logf("median of 21: ping %s, exec of true %s", pingTook.Round(time.Microsecond), execTook.Round(time.Microsecond))
	})

	// 8 MiB each way through the channel, into the guest's /tmp (on the
	// writable disk) and back; the content is checked, the rate logged.
	t.Run("Files", func(t *testing.T) {
		data := make([]byte, 8<<20)
		for i := range data {
			data[i] = byte(i*7 + i>>13)
		}
		fctx, cancel := context.WithTimeout(ctx, 2*time.Minute)
		defer cancel()
		t0 := time.Now()
		if _, err := client.WriteFile(fctx, connect.NewRequest(&dsecv1.WriteFileRequest{Path: "/tmp/big", Data: data, MakeParents: true})); err != nil {
			t.Fatal(err)
		}
		wrote := time.Since(t0)
		t0 = time.Now()
		resp, err := client.ReadFile(fctx, connect.NewRequest(&dsecv1.ReadFileRequest{Path: "/tmp/big"}))
		if err != nil {
			t.Fatal(err)
		}
		read := time.Since(t0)
		if !bytes.Equal(resp.Msg.GetData(), data) {
			t.Fatalf("read back %d bytes that differ from the %d written", len(resp.Msg.GetData()), len(data))
		}
		mibs := func(d time.Duration) float64 { return float64(len(data)) / (1 << 20) / d.Seconds() }
		t.Logf("8 MiB file: write %s (%.1f MiB/s), read %s (%.1f MiB/s)", wrote.Round(time.Millisecond), mibs(wrote),
			read.Round(time.Millisecond), mibs(read))
	})

	// A restarted edge connects again: a new dialer gets a new session.
	t.Run("Reconnect", func(t *testing.T) {
		dialer.Close()
		client.Close()
		d2 := channel.NewDialer(p.ChannelPath(), log)
		defer d2.Close()
		c2 := agentclient.New(d2.Dial)
		defer c2.Close()
		rctx, cancel := context.WithTimeout(ctx, time.Minute)
		defer cancel()
		if _, err := c2.Ping(rctx, connect.NewRequest(&agentv1.PingRequest{})); err != nil {
			t.Fatalf("ping over a new session: %v", err)
		}
	})

	t.Run("Console", func(t *testing.T) {
		if tail := p.ConsoleTail(200); !strings.Contains(tail, "guest ready") {
			t.Errorf("the console has no \"guest ready\" line from the agent:\n%s", tail)
		}
	})

	t.Run("QMP", func(t *testing.T) {
		qctx, cancel := context.WithTimeout(ctx, time.Minute)
		defer cancel()
		c, err := qmp.Dial(qctx, p.QMPPath())
		if err != nil {
			t.Fatal(err)
		}
		defer c.Close()
		for _, step := range []struct {
			do      func(context.Context) error
			running bool
		}{{nil, true}, {c.Stop, false}, {c.Cont, true}} {
			if step.do != nil {
				if err := step.do(qctx); err != nil {
					t.Fatal(err)
				}
			}
			st, err := c.QueryStatus(qctx)
			if err != nil || st.Running != step.running {
				t.Fatalf("query-status = %+v, %v; want running %v", st, err, step.running)
			}
		}
		if err := c.Quit(qctx); err != nil {
			t.Fatal(err)
		}
		if err := p.Wait(qctx); err != nil {
			t.Errorf("QEMU after quit: %v", err)
		}
	})

	// Nothing is left: the process is gone and the run directory holds
	// only its sockets and logs.
	<-p.Done()
	if err := syscall.Kill(pid, 0); err != syscall.ESRCH {
		t.Errorf("QEMU %d still exists after quit: %v", pid, err)
	}
	out, err := osexec.Command("debugfs", "-R", "cat /upper/written.txt", upper).Output()
	if err != nil || string(out) != "written in the guest\n" {
		t.Errorf("the writable disk's /upper/written.txt: %q, %v", out, err)
	}
}

// cpuTime is the CPU time process pid has used (user and system).
func cpuTime(t *testing.T, pid int) time.Duration {
	t.Helper()
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		t.Fatal(err)
	}
	// The fields after the command's name, which is in parentheses.
	fields := strings.Fields(string(b[bytes.LastIndexByte(b, ')')+1:]))
	var ticks int64
	for _, f := range fields[11:13] { // utime, stime
		n, err := strconv.ParseInt(f, 10, 64)
		if err != nil {
			t.Fatal(err)
		}
		ticks += n
	}
	return time.Duration(ticks) * time.Second / 100 // USER_HZ
}

package container

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"reflect"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"dsec.dev/dsec/internal/edge/backend"
	"dsec.dev/dsec/internal/edge/backend/backendtest"
	"dsec.dev/dsec/internal/edge/backend/cgroups"
	"dsec.dev/dsec/internal/edge/backend/container/mountinfo"
	"dsec.dev/dsec/internal/edge/backend/container/quota"
	"dsec.dev/dsec/internal/errdefs"
	"dsec.dev/dsec/internal/testutil"
)

// node is one Runtime on temp dirs, torn down when the test ends.
type node struct {
	rt      *Container
	cfg     Config
	lower   string // busybox rootfs
	sockDir string
}

func newNode(t *testing.T) *node {
	t.Helper()
	testutil.RequireRoot(t)
	testutil.RequireCommand(t, "runc")
	testutil.RequireCommand(t, "mkfs.ext4")
	testutil.RequireCommand(t, "busybox")
	base := t.TempDir()
	agentDir := filepath.Join(base, "agent")
	lower := filepath.Join(base, "lower")
	buildAgent(t, agentDir)
	buildRootfs(t, lower)
	cfg := Config{
		Root:         filepath.Join(base, "runtime"),
		UpperRoot:    filepath.Join(base, "upper"),
		UpperImage:   filepath.Join(base, "upper.img"),
		UpperFSBytes: 1 << 30,
		CgroupParent: fmt.Sprintf("dsec-test-%d", os.Getpid()),
		AgentDir:     agentDir,
		SocketDir:    filepath.Join(base, "sock"),
		Log:          slog.New(slog.NewTextHandler(testWriter{t}, nil)),
	}
	rt, err := New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	t.Cleanup(func() {
		ids, _ := rt.List(ctx)
		for _, id := range ids {
			if err := rt.Delete(ctx, id); err != nil {
				t.Errorf("delete %s: %v", id, err)
			}
		}
		if err := rt.Teardown(ctx); err != nil {
			t.Errorf("teardown: %v", err)
		}
	})
	if err := rt.Init(ctx); err != nil {
		t.Fatal(err)
	}
	// Init again: it must be idempotent.
	if err := rt.Init(ctx); err != nil {
		t.Fatalf("second Init: %v", err)
	}
	return &node{rt: rt, cfg: rt.cfg, lower: lower, sockDir: base}
}

type testWriter struct{ t *testing.T }

func (w testWriter) Write(p []byte) (int, error) {
	w.t.Log(strings.TrimSpace(string(p)))
	return len(p), nil
}

func buildAgent(t *testing.T, dir string) {
	t.Helper()
	if err := os.MkdirAll(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	cmd := exec.Command("go", "build", "-o", filepath.Join(dir, "dsec-agent"), "./testdata/agent")
	cmd.Env = append(os.Environ(), "CGO_ENABLED=0")
	if out, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("build test agent: %v\n%s", err, out)
	}
	copyFile(t, "/bin/busybox", filepath.Join(dir, "sh"))
}

func buildRootfs(t *testing.T, dir string) {
	t.Helper()
	for _, d := range []string{"bin", "etc", "tmp", "proc", "sys", "dev", "root"} {
		if err := os.MkdirAll(filepath.Join(dir, d), 0o755); err != nil {
			t.Fatal(err)
		}
	}
	if err := os.Chmod(filepath.Join(dir, "tmp"), 0o1777); err != nil {
		t.Fatal(err)
	}
	copyFile(t, "/bin/busybox", filepath.Join(dir, "bin", "busybox"))
	out, err := exec.Command("/bin/busybox", "--list").Output()
	if err != nil {
		t.Fatal(err)
	}
	for _, name := range strings.Fields(string(out)) {
		if name == "busybox" {
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
	b, err := os.ReadFile(from)
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(to, b, 0o755); err != nil {
		t.Fatal(err)
	}
}

// sandbox is a started sandbox and a connection to its test agent.
type sandbox struct {
	id   string
	sock string
	conn net.Conn
	rd   *bufio.Reader
}

func (n *node) spec(t *testing.T, id string) backend.Spec {
	t.Helper()
	return backend.Spec{
		ID:          id,
		Layers:      backendtest.DirLayers(n.lower),
		DiskBytes:   32 << 20,
		CPUs:        0.5,
		MemoryBytes: 128 << 20,
		Pids:        128,
		Hostname:    "box-" + id,
		LogPath:     filepath.Join(n.sockDir, id+".log"),
	}
}

func (n *node) start(t *testing.T, s backend.Spec) *sandbox {
	t.Helper()
	ctx := context.Background()
	t0 := time.Now()
	dial, err := n.rt.Start(ctx, s)
	if err != nil {
		t.Fatalf("start %s: %v", s.ID, err)
	}
	t.Logf("Start(%s) took %v", s.ID, time.Since(t0))
	t.Cleanup(func() {
		if err := n.rt.Delete(ctx, s.ID); err != nil {
			t.Errorf("delete %s: %v", s.ID, err)
		}
	})
	c, err := dial(ctx)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	return &sandbox{id: s.ID, sock: n.rt.socketPath(s.ID), conn: c, rd: bufio.NewReader(c)}
}

// run runs line in the sandbox and returns its output and exit code.
func (sb *sandbox) run(t *testing.T, line string) (string, int) {
	t.Helper()
	sb.conn.SetDeadline(time.Now().Add(60 * time.Second))
	if _, err := fmt.Fprintln(sb.conn, line); err != nil {
		t.Fatalf("send %q: %v", line, err)
	}
	var out strings.Builder
	for {
		l, err := sb.rd.ReadString('\n')
		if err != nil {
			t.Fatalf("read reply to %q: %v (so far %q)", line, err, out.String())
		}
		if code, ok := strings.CutPrefix(l, "@@EXIT "); ok {
			n, _ := strconv.Atoi(strings.TrimSpace(code))
			return strings.TrimSuffix(out.String(), "\n"), n
		}
		out.WriteString(l)
	}
}

func (sb *sandbox) must(t *testing.T, line string) string {
	t.Helper()
	out, code := sb.run(t, line)
	if code != 0 {
		t.Fatalf("%q exited %d: %s", line, code, out)
	}
	return strings.TrimSpace(out)
}

func readHost(t *testing.T, path string) string {
	t.Helper()
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	return strings.TrimSpace(string(b))
}

func TestSandbox(t *testing.T) {
	n := newNode(t)
	s := n.spec(t, "sb-main")
	sb := n.start(t, s)
	rel := filepath.Join(n.cfg.CgroupParent, s.ID)
	lay := n.rt.layout

	t.Run("namespaces", func(t *testing.T) {
		if got := sb.must(t, "hostname"); got != s.Hostname {
			t.Errorf("hostname = %q, want %q", got, s.Hostname)
		}
		dev := sb.must(t, "tail -n +3 /proc/net/dev | cut -d: -f1 | tr -d ' '")
		if dev != "lo" {
			t.Errorf("interfaces = %q, want only lo", dev)
		}
		if got := sb.must(t, "tr '\\0' ' ' < /proc/1/cmdline"); !strings.HasPrefix(got, agentPath+" ") {
			t.Errorf("pid 1 is %q, want the agent", got)
		}
		marker := filepath.Join(n.sockDir, "host-only")
		if err := os.WriteFile(marker, nil, 0o600); err != nil {
			t.Fatal(err)
		}
		if _, code := sb.run(t, "test -e "+marker); code == 0 {
			t.Errorf("host file %s is visible in the sandbox", marker)
		}
		if _, code := sb.run(t, "ls "+n.cfg.AgentDir); code == 0 {
			t.Errorf("host dir %s is visible in the sandbox", n.cfg.AgentDir)
		}
	})

	t.Run("limits", func(t *testing.T) {
		if got := readHost(t, lay.Dir("cpu", filepath.Join(rel, "cpu.cfs_quota_us"))); got != "50000" {
			t.Errorf("cfs quota = %s, want 50000", got)
		}
		if got := readHost(t, lay.Dir("memory", filepath.Join(rel, "memory.limit_in_bytes"))); got != strconv.Itoa(128<<20) {
			t.Errorf("memory limit = %s", got)
		}
		if got := readHost(t, lay.Dir("pids", filepath.Join(rel, "pids.max"))); got != strconv.Itoa(128+agentPids) {
			t.Errorf("sandbox pids.max = %s, want 128 + %d for the agent", got, agentPids)
		}
		if got := readHost(t, lay.Dir("pids", filepath.Join(rel, "cmds", "pids.max"))); got != "128" {
			t.Errorf("commands' pids.max = %s, want 128", got)
		}
		if got := sb.must(t, "cat /proc/self/cgroup | grep freezer"); !strings.HasSuffix(got, ":/") {
			t.Errorf("cgroup namespace not private: %q", got)
		}
	})

	t.Run("capabilities", func(t *testing.T) {
		var want uint64
		for _, c := range []int{0, 1, 3, 4, 5, 6, 7, 8, 10, 18, 27, 29, 31} {
			want |= 1 << c
		}
		// Under a btrfs qgroup the agent also gets CAP_SYS_PTRACE, for its
		// statfs supervisor; the real agent keeps it from its commands (its
		// own tests check that), this stand-in does not.
		q, err := n.rt.quotaManager()
		if err != nil {
			t.Fatal(err)
		}
		if q.Kind() == quota.KindBtrfs {
			want |= 1 << unix.CAP_SYS_PTRACE
		}
		status := sb.must(t, "cat /proc/self/status")
		for _, field := range []string{"CapEff", "CapPrm", "CapBnd"} {
			got := statusField(status, field)
			if got != fmt.Sprintf("%016x", want) {
				t.Errorf("%s = %s, want %016x", field, got, want)
			}
		}
		if got := statusField(status, "NoNewPrivs"); got != "1" {
			t.Errorf("NoNewPrivs = %s", got)
		}
		if got := statusField(status, "Seccomp"); got != "2" {
			t.Errorf("Seccomp = %s", got)
		}
	})

	t.Run("seccomp", func(t *testing.T) {
		tests := []struct {
			probe, want string
		}{
			{"fork", "ok"},
			{"mount", "errno=1"},
			{"unshare-user", "errno=1"},
			{"clone-newuser", "errno=1"},
			{"clone-newns", "errno=1"},
			{"ptrace", "errno=1"},
			{"clone3", "errno=38"},
			{"io_uring", "errno=1"},
			{"personality 0xffffffff", "ok"},
			{"personality 0x8", "ok"},
			{"personality 0", "ok"},
			{"personality 0x0040000", "errno=1"},
			{"personality 0x80000008", "errno=1"},
			{"personality 0x100000000", "errno=1"},
			{"ioctl /tmp/x 0xC0C0586D", "errno=1"},
			{"ioctl /tmp/x 0xC028660F", "errno=1"},
			{"ioctl /tmp/x 0x40049409", "errno=1"},
			{"ioctl /tmp/x 0x401C5820", "errno=1"},
			{"ioctl /tmp/x 0x5401", "errno=25"}, // TCGETS: ENOTTY, not filtered
		}
		for _, tt := range tests {
			t.Run(tt.probe, func(t *testing.T) {
				got := sb.must(t, agentPath+" probe "+tt.probe)
				if got != tt.want {
					t.Errorf("probe %s = %s, want %s", tt.probe, got, tt.want)
				}
			})
		}
	})

	t.Run("paths", func(t *testing.T) {
		for _, p := range []string{"/proc/kcore", "/proc/kpagecgroup", "/proc/keys", "/proc/timer_list"} {
			if got := sb.must(t, "head -c 16 "+p+" 2>/dev/null | wc -c"); got != "0" {
				t.Errorf("%s readable: %s bytes", p, got)
			}
		}
		if got := sb.must(t, "ls -A /sys/firmware | wc -l"); got != "0" {
			t.Errorf("/sys/firmware lists %s entries", got)
		}
		if out, code := sb.run(t, "echo 3 > /proc/sys/vm/drop_caches"); code == 0 {
			t.Errorf("/proc/sys writable: %s", out)
		}
		if out, code := sb.run(t, "echo x > /.dsec/bin/sh"); code == 0 {
			t.Errorf("agent dir writable: %s", out)
		}
		if out, code := sb.run(t, "touch /sys/fs/cgroup/x"); code == 0 {
			t.Errorf("/sys/fs/cgroup writable: %s", out)
		}
		sb.must(t, "echo hi > /etc/new && rm /bin/ls && ! test -e /bin/ls")
		if _, err := os.Lstat(filepath.Join(n.lower, "bin", "ls")); err != nil {
			t.Errorf("lower layer changed: %v", err)
		}
	})

	t.Run("disk quota", func(t *testing.T) {
		// Under a btrfs qgroup the agent is told where the qgroup's sysfs
		// files are, and they are readable inside.
		q, err := n.rt.quotaManager()
		if err != nil {
			t.Fatal(err)
		}
		args := sb.must(t, "tr '\\0' ' ' < /proc/1/cmdline")
		_, dir, found := strings.Cut(args, " --disk-qgroup ")
		if found != (q.Kind() == quota.KindBtrfs) {
			t.Fatalf("agent args %q on a %s node", args, q.Kind())
		}
		if found {
			dir, _, _ = strings.Cut(dir, " ")
			if got := sb.must(t, "cat "+dir+"/max_referenced"); got != strconv.Itoa(32<<20) {
				t.Errorf("%s/max_referenced inside = %s, want the 32 MiB limit", dir, got)
			}
		}
		out, code := sb.run(t, "dd if=/dev/zero of=/big bs=1M count=64")
		if code == 0 || !(strings.Contains(out, "quota") || strings.Contains(out, "space")) {
			t.Errorf("writing 64 MiB into 32 MiB: exit %d: %s", code, out)
		}
		sb.must(t, "rm /big && echo ok > /small")
	})

	t.Run("restart", func(t *testing.T) {
		rt2, err := New(n.cfg)
		if err != nil {
			t.Fatal(err)
		}
		if err := rt2.Init(context.Background()); err != nil {
			t.Fatal(err)
		}
		st, err := rt2.Status(context.Background(), s.ID)
		if err != nil {
			t.Fatal(err)
		}
		if !st.Running || st.Pid <= 0 || st.MemoryBytes <= 0 {
			t.Errorf("status after restart = %+v", st)
		}
		// A container whose create has not written its state yet (a
		// dsecd killed meanwhile) makes runc's list warn on stderr;
		// List still reads the list.
		half := filepath.Join(rt2.stateDir(), "sb-half-made")
		if err := os.Mkdir(half, 0o700); err != nil {
			t.Fatal(err)
		}
		defer os.Remove(half)
		ids, err := rt2.List(context.Background())
		if err != nil {
			t.Fatal(err)
		}
		if len(ids) != 1 || ids[0] != s.ID {
			t.Errorf("List = %v", ids)
		}
		if _, err := rt2.Status(context.Background(), "sb-unknown"); !errors.Is(err, errdefs.ErrNotFound) {
			t.Errorf("Status of unknown = %v, want ErrNotFound", err)
		}
	})

	t.Run("delete", func(t *testing.T) {
		st, err := n.rt.Status(context.Background(), s.ID)
		if err != nil {
			t.Fatal(err)
		}
		child := sb.must(t, "!cgchild cmd-1")
		if _, err := os.Stat(lay.Dir("freezer", filepath.Join(rel, "cmd-1"))); err != nil {
			t.Fatalf("child cgroup: %v", err)
		}
		// A child cgroup in another hierarchy, as a v1 agent may make.
		if err := os.Mkdir(lay.Dir("memory", filepath.Join(rel, "cmd-1")), 0o755); err != nil {
			t.Fatal(err)
		}
		if err := n.rt.Delete(context.Background(), s.ID); err != nil {
			t.Fatal(err)
		}
		if err := n.rt.Delete(context.Background(), s.ID); err != nil {
			t.Fatalf("second delete: %v", err)
		}
		assertGone(t, n, s.ID, st.Pid)
		_ = child
		if _, err := n.rt.Status(context.Background(), s.ID); !errors.Is(err, errdefs.ErrNotFound) {
			t.Errorf("Status after delete = %v, want ErrNotFound", err)
		}
	})
}

func statusField(status, name string) string {
	for _, l := range strings.Split(status, "\n") {
		if v, ok := strings.CutPrefix(l, name+":"); ok {
			return strings.TrimSpace(v)
		}
	}
	return ""
}

// assertGone checks that nothing of sandbox id is left on the host.
func assertGone(t *testing.T, n *node, id string, pid int) {
	t.Helper()
	if pid > 0 {
		// Once killed, the agent is a zombie until the host's init (its
		// parent since runc exited) reaps it.
		for deadline := time.Now().Add(5 * time.Second); ; {
			b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
			if err != nil {
				break
			}
			if _, after, _ := strings.Cut(string(b), ") "); strings.HasPrefix(after, "Z") {
				break
			}
			if time.Now().After(deadline) {
				t.Errorf("agent pid %d still runs: %s", pid, b)
				break
			}
			time.Sleep(10 * time.Millisecond)
		}
	}
	if n.rt.layout.Exists(filepath.Join(n.cfg.CgroupParent, id)) {
		t.Errorf("cgroup of %s left", id)
	}
	ms, err := mountinfo.Read()
	if err != nil {
		t.Fatal(err)
	}
	for _, m := range ms {
		if strings.Contains(m.Point, id) || strings.Contains(m.SuperOptions, id) {
			t.Errorf("mount left: %+v", m)
		}
	}
	for _, d := range []string{n.rt.bundleDir(id), n.rt.upperDir(id)} {
		if _, err := os.Stat(d); !errors.Is(err, os.ErrNotExist) {
			t.Errorf("%s left: %v", d, err)
		}
	}
}

func TestOOMAndPids(t *testing.T) {
	n := newNode(t)
	ctx := context.Background()

	t.Run("oom", func(t *testing.T) {
		s := n.spec(t, "sb-oom")
		s.MemoryBytes = 64 << 20
		sb := n.start(t, s)
		out, code := sb.run(t, "x=aaaaaaaa; while :; do x=$x$x; done")
		if code == 0 {
			t.Fatalf("memory hog exited 0: %s", out)
		}
		st, err := n.rt.Status(ctx, s.ID)
		if err != nil {
			t.Fatal(err)
		}
		if !st.Running || st.OOMKills == 0 {
			t.Errorf("status after OOM = %+v, want running with OOM kills", st)
		}
		if got := sb.must(t, "echo alive"); got != "alive" {
			t.Errorf("agent after OOM: %q", got)
		}
	})

	t.Run("fork bomb", func(t *testing.T) {
		s := n.spec(t, "sb-bomb")
		s.Pids = 64
		sb := n.start(t, s)
		sb.run(t, "b() { b | b & }; b")
		pidsFile := n.rt.layout.Dir("pids", filepath.Join(n.cfg.CgroupParent, s.ID, "pids.current"))
		// Commands share the limit in the cmds child; the sandbox as a whole
		// (this test agent does not use cmds) gets agentPids more.
		if got := readHost(t, filepath.Join(filepath.Dir(pidsFile), "cmds", "pids.max")); got != "64" {
			t.Fatalf("commands' pids.max = %q, want 64", got)
		}
		deadline := time.Now().Add(20 * time.Second)
		for {
			cur, _ := strconv.Atoi(readHost(t, pidsFile))
			if cur > 64+agentPids {
				t.Fatalf("pids.current = %d past the limit", cur)
			}
			events := readHost(t, filepath.Join(filepath.Dir(pidsFile), "pids.events"))
			if strings.Contains(events, "max ") && !strings.HasSuffix(events, "max 0") {
				break
			}
			if time.Now().After(deadline) {
				t.Fatalf("fork bomb never reached the pids limit: %s", events)
			}
			time.Sleep(50 * time.Millisecond)
		}
		st, err := n.rt.Status(ctx, s.ID)
		if err != nil || !st.Running {
			t.Fatalf("status during fork bomb = %+v, %v", st, err)
		}
		if err := n.rt.Delete(ctx, s.ID); err != nil {
			t.Fatal(err)
		}
		assertGone(t, n, s.ID, st.Pid)
	})
}

func TestStartFailureCleansUp(t *testing.T) {
	n := newNode(t)
	ctx := context.Background()
	s := n.spec(t, "sb-bad")
	s.Layers = backendtest.DirLayers(filepath.Join(n.sockDir, "no-such-layer"))
	if _, err := n.rt.Start(ctx, s); err == nil {
		t.Fatal("Start with a missing layer succeeded")
	}
	assertGone(t, n, s.ID, 0)

	// Fails in the OCI runtime itself: the agent cannot be executed.
	s = n.spec(t, "sb-bad2")
	rt2cfg := n.cfg
	rt2cfg.AgentDir = filepath.Join(n.sockDir, "empty-agent")
	if err := os.Mkdir(rt2cfg.AgentDir, 0o755); err != nil {
		t.Fatal(err)
	}
	rt2, err := New(rt2cfg)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := rt2.Start(ctx, s); err == nil {
		t.Fatal("Start without an agent succeeded")
	} else {
		t.Logf("expected error: %v", err)
	}
	assertGone(t, n, s.ID, 0)
	if ids, _ := n.rt.List(ctx); len(ids) != 0 {
		t.Errorf("List after failed starts = %v", ids)
	}

	if _, err := n.rt.Start(ctx, backend.Spec{ID: "../x"}); !errors.Is(err, errdefs.ErrInvalidArgument) {
		t.Errorf("Start with a bad id = %v", err)
	}
}

func TestCgroupLayout(t *testing.T) {
	testutil.RequireRoot(t)
	l, err := cgroups.Detect()
	if err != nil {
		t.Fatal(err)
	}
	var st unix.Statfs_t
	if err := unix.Statfs(cgroups.Root, &st); err != nil {
		t.Fatal(err)
	}
	if l.V2() != (st.Type == unix.CGROUP2_SUPER_MAGIC) {
		t.Errorf("V2() = %v on fs type %x", l.V2(), st.Type)
	}
}

// TestBareSpec checks that the benchmarks' bare container is made like a
// sandbox in everything but its process, root and the agent's mount.
func TestBareSpec(t *testing.T) {
	s := backend.Spec{CPUs: 0.5, MemoryBytes: 64 << 20}
	bare, err := BareSpec(s, "/bench/rootfs", []string{"sleep", "3600"})
	if err != nil {
		t.Fatal(err)
	}
	want := buildSpec(specInput{Spec: s, AgentDir: "/agent", Nofile: nofile(),
		MemorySwap: bare.Linux.Resources.Memory.Swap != nil})
	if !reflect.DeepEqual(bare.Linux, want.Linux) {
		t.Errorf("linux section differs from a sandbox's:\n%+v\nwant\n%+v", bare.Linux, want.Linux)
	}
	if !reflect.DeepEqual(bare.Process.Capabilities, want.Process.Capabilities) || !bare.Process.NoNewPrivileges ||
		!reflect.DeepEqual(bare.Process.Rlimits, want.Process.Rlimits) {
		t.Errorf("process privileges differ from a sandbox's: %+v", bare.Process)
	}
	if !slices.Equal(bare.Process.Args, []string{"sleep", "3600"}) {
		t.Errorf("args = %v", bare.Process.Args)
	}
	if bare.Root == nil || bare.Root.Path != "/bench/rootfs" || !bare.Root.Readonly {
		t.Errorf("root = %+v", bare.Root)
	}
	if len(bare.Mounts) != len(want.Mounts)-1 {
		t.Errorf("%d mounts, want the sandbox's %d but the agent's", len(bare.Mounts), len(want.Mounts))
	}
	for _, m := range bare.Mounts {
		if m.Destination == agentMount {
			t.Errorf("bare container mounts the agent dir: %+v", m)
		}
	}
	if q := bare.Linux.Resources.CPU.Quota; q == nil || *q != 50000 {
		t.Errorf("cpu quota = %v", q)
	}
}

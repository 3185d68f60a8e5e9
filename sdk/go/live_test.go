package dsec

// Tests against a real dsecd. The daemon comes from $DSEC_BIN_DIR (default
// <repo>/bin); it is started once for the package on a fresh root and
// loopback port, and torn down (`dsecd teardown`) when the tests end.
// Without the binary or root these tests skip; with DSEC_TEST_ROOT=1 they fail.

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	dsecv1 "dsec.dev/dsec/api/gen/dsec/v1"
)

const liveEnv = "busybox:test"

type liveDaemon struct {
	bin, root, addr string
	cmd             *exec.Cmd
}

var (
	liveOnce sync.Once
	live     *liveDaemon
	liveErr  error
	liveSkip string
)

func TestMain(m *testing.M) {
	code := m.Run()
	if live != nil {
		live.stop()
	}
	os.Exit(code)
}

func repoRoot() string {
	wd, _ := os.Getwd()
	return filepath.Clean(filepath.Join(wd, "..", ".."))
}

func requireLive(t *testing.T) *Client {
	t.Helper()
	liveOnce.Do(startLive)
	if liveSkip != "" {
		if os.Getenv("DSEC_TEST_ROOT") == "1" {
			t.Fatalf("required under DSEC_TEST_ROOT=1: %s", liveSkip)
		}
		t.Skip(liveSkip)
	}
	if liveErr != nil {
		t.Fatal(liveErr)
	}
	c, err := NewClient(live.addr)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	return c
}

func startLive() {
	bin := os.Getenv("DSEC_BIN_DIR")
	if bin == "" {
		bin = filepath.Join(repoRoot(), "bin")
	}
	d := &liveDaemon{bin: bin}
	switch {
	case !exists(filepath.Join(bin, "dsecd")):
		liveSkip = "no dsecd binary in " + bin + " (run make build)"
		return
	case os.Geteuid() != 0:
		liveSkip = "the live tests need root"
		return
	case !exists("/bin/busybox"):
		liveSkip = "busybox-static is not installed"
		return
	}
	if _, err := exec.LookPath("runc"); err != nil {
		liveSkip = "runc is not installed"
		return
	}
	root, err := os.MkdirTemp("", "dsec-gosdk-root-")
	if err != nil {
		liveErr = err
		return
	}
	d.root = root
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		liveErr = err
		return
	}
	d.addr = ln.Addr().String()
	ln.Close()
	live = d
	if liveErr = d.start(); liveErr != nil {
		return
	}
	liveErr = d.importBase()
}

func (d *liveDaemon) start() error {
	logf, err := os.OpenFile(filepath.Join(d.root, "dsecd.log"), os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o644)
	if err != nil {
		return err
	}
	defer logf.Close()
	cmd := exec.Command(filepath.Join(d.bin, "dsecd"), "--root", d.root, "--listen", d.addr, "--node", "go", "--sandboxfusion-listen", "none")
	cmd.Stdout, cmd.Stderr = logf, logf
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	if err := cmd.Start(); err != nil {
		return fmt.Errorf("start dsecd: %w", err)
	}
	d.cmd = cmd
	deadline := time.Now().Add(30 * time.Second)
	// The TCP port needs the token dsecd writes at start; this test's
	// clients and CLI runs read it from there.
	tokenFile := filepath.Join(d.root, "admin.token")
	for {
		if _, err := os.Stat(tokenFile); err == nil {
			break
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("dsecd wrote no token in %s", tokenFile)
		}
		time.Sleep(20 * time.Millisecond)
	}
	os.Setenv("DSEC_TOKEN_FILE", tokenFile)
	c, err := NewClient(d.addr)
	if err != nil {
		return err
	}
	defer c.Close()
	for {
		ctx, cancel := context.WithTimeout(context.Background(), time.Second)
		_, err := c.ListLayers(ctx)
		cancel()
		if err == nil {
			return nil
		}
		if time.Now().After(deadline) {
			log, _ := os.ReadFile(filepath.Join(d.root, "dsecd.log"))
			return fmt.Errorf("dsecd did not become ready: %v\n%s", err, log)
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// importBase imports a busybox base layer as liveEnv.
func (d *liveDaemon) importBase() error {
	tree, err := os.MkdirTemp("", "dsec-gosdk-base-")
	if err != nil {
		return err
	}
	defer os.RemoveAll(tree)
	if script := filepath.Join(repoRoot(), "scripts", "build-busybox-base.sh"); exists(script) {
		if out, err := exec.Command(script, tree).CombinedOutput(); err != nil {
			return fmt.Errorf("build busybox base: %v\n%s", err, out)
		}
	} else if err := busyboxTree(tree); err != nil {
		return err
	}
	if cli := filepath.Join(d.bin, "dsec"); exists(cli) {
		out, err := exec.Command(cli, "--addr", d.addr, "layer", "import", "--kind", "base", liveEnv, tree).CombinedOutput()
		if err != nil {
			return fmt.Errorf("dsec layer import: %v\n%s", err, out)
		}
		return nil
	}
	c, err := NewClient(d.addr)
	if err != nil {
		return err
	}
	defer c.Close()
	_, err = c.ImportLayer(context.Background(), liveEnv, dsecv1.LayerKind_LAYER_KIND_BASE, tree, nil)
	return err
}

func busyboxTree(dir string) error {
	for _, d := range []string{"bin", "etc", "tmp", "root", "proc", "sys", "dev"} {
		if err := os.MkdirAll(filepath.Join(dir, d), 0o755); err != nil {
			return err
		}
	}
	os.Chmod(filepath.Join(dir, "tmp"), 0o1777)
	data, err := os.ReadFile("/bin/busybox")
	if err != nil {
		return err
	}
	if err := os.WriteFile(filepath.Join(dir, "bin", "busybox"), data, 0o755); err != nil {
		return err
	}
	out, err := exec.Command("/bin/busybox", "--list").Output()
	if err != nil {
		return fmt.Errorf("list busybox applets: %w", err)
	}
	for _, a := range strings.Fields(string(out)) {
		if a != "busybox" {
			os.Symlink("busybox", filepath.Join(dir, "bin", a))
		}
	}
	return os.WriteFile(filepath.Join(dir, "etc", "passwd"), []byte("root:x:0:0:root:/root:/bin/sh\nnobody:x:65534:65534:nobody:/:/bin/sh\n"), 0o644)
}

func (d *liveDaemon) kill() {
	if d.cmd != nil && d.cmd.Process != nil {
		d.cmd.Process.Kill()
		d.cmd.Wait()
		d.cmd = nil
	}
}

func (d *liveDaemon) stop() {
	d.kill()
	if out, err := exec.Command(filepath.Join(d.bin, "dsecd"), "teardown", "--root", d.root).CombinedOutput(); err != nil {
		fmt.Fprintf(os.Stderr, "dsecd teardown: %v\n%s", err, out)
	}
	os.RemoveAll(d.root)
}

func exists(p string) bool { _, err := os.Stat(p); return err == nil }

func newSandbox(t *testing.T, c *Client, o *CreateOptions) *Sandbox {
	t.Helper()
	if o == nil {
		o = &CreateOptions{}
	}
	if o.Labels == nil {
		o.Labels = map[string]string{"test": t.Name()}
	}
	sb, err := c.Create(t.Context(), liveEnv, o)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { sb.Delete(context.Background()) })
	return sb
}

func TestLiveLifecycle(t *testing.T) {
	c := requireLive(t)
	ctx := t.Context()
	sb := newSandbox(t, c, &CreateOptions{MemoryMB: 128, CPUs: 0.5, TTL: 10 * time.Minute, IdleTimeout: 5 * time.Minute,
		Env: map[string]string{"FOO": "bar"}, Labels: map[string]string{"test": "lifecycle"}})
	if sb.State() != "running" || !strings.HasPrefix(sb.ID, "sb-go-") {
		t.Fatalf("sandbox %s is %s", sb.ID, sb.State())
	}
	got, err := c.Get(ctx, sb.ID)
	if err != nil || got.Info().GetSpec().GetEnvironment() != liveEnv {
		t.Fatalf("Get: %v", err)
	}
	list, err := c.List(ctx, map[string]string{"test": "lifecycle"}, dsecv1.State_STATE_RUNNING)
	if err != nil || len(list) != 1 || list[0].ID != sb.ID {
		t.Fatalf("List = %v, %v", list, err)
	}
	page, err := c.ListPage(ctx, &dsecv1.ListRequest{Labels: map[string]string{"test": "lifecycle"}}, 1, "")
	if err != nil || len(page.Sandboxes) != 1 || page.Sandboxes[0].ID != sb.ID || page.Next != "" || page.Total != 1 {
		t.Fatalf("ListPage = %+v, %v; want the one sandbox, no next page", page, err)
	}
	res, err := sb.Exec(ctx, Sh("echo $FOO"), nil)
	if err != nil || string(res.Stdout) != "bar\n" {
		t.Fatalf("Exec: %v %v", res, err)
	}
	if err := sb.Delete(ctx); err != nil {
		t.Fatal(err)
	}
	if err := sb.Delete(ctx); err != nil {
		t.Fatalf("second Delete: %v", err)
	}
	_, err = sb.Exec(ctx, Sh("true"), nil)
	var e *Error
	if !errors.Is(err, ErrSandboxGone) || !errors.As(err, &e) || e.Reason != "deleted" {
		t.Fatalf("Exec after Delete: %v", err)
	}
	if _, err := c.Get(ctx, "sb-go-"+strings.Repeat("a", 23)); !errors.Is(err, ErrNotFound) {
		t.Fatalf("Get of a missing sandbox: %v", err)
	}
	// List shows live sandboxes; a deleted one only in ListAll.
	if list, err := c.List(ctx, map[string]string{"test": "lifecycle"}); err != nil || len(list) != 0 {
		t.Errorf("List after Delete = %v, %v; want none", list, err)
	}
	if list, err := c.ListAll(ctx, map[string]string{"test": "lifecycle"}); err != nil || len(list) != 1 || list[0].State() != "stopped" {
		t.Errorf("ListAll after Delete = %v, %v; want the stopped sandbox", list, err)
	}
}

func TestLivePauseResume(t *testing.T) {
	c := requireLive(t)
	ctx := t.Context()
	sb := newSandbox(t, c, &CreateOptions{Labels: map[string]string{"test": "pause"}})
	if _, err := sb.Exec(ctx, Sh("echo kept > /tmp/f"), nil); err != nil {
		t.Fatal(err)
	}
	res, err := sb.Pause(ctx, false)
	if err != nil || res.AlreadyPaused || sb.State() != "paused" || res.Resident == 0 {
		t.Fatalf("Pause = %+v, %v (state %s)", res, err, sb.State())
	}
	if again, err := sb.Pause(ctx, false); err != nil || !again.AlreadyPaused {
		t.Fatalf("second Pause = %+v, %v; want already paused", again, err)
	}
	// A call resumes it.
	out, err := sb.Exec(ctx, Sh("cat /tmp/f"), nil)
	if err != nil || string(out.Stdout) != "kept\n" {
		t.Fatalf("Exec on a paused sandbox: %v %v", out, err)
	}
	if already, err := sb.Resume(ctx); err != nil || !already {
		t.Fatalf("Resume of a running sandbox = %v, %v; want already running", already, err)
	}
	// With NoAutoResume a call is refused while paused.
	strict := newSandbox(t, c, &CreateOptions{NoAutoResume: true, Labels: map[string]string{"test": "pause"}})
	if _, err := strict.Pause(ctx, true); err != nil {
		t.Fatal(err)
	}
	if _, err := strict.Exec(ctx, Sh("true"), nil); !errors.Is(err, ErrFailedPrecondition) {
		t.Fatalf("Exec on a paused NoAutoResume sandbox: %v, want ErrFailedPrecondition", err)
	}
	if already, err := strict.Resume(ctx); err != nil || already {
		t.Fatalf("Resume = %v, %v", already, err)
	}
}

func TestLiveCreateManyAndReap(t *testing.T) {
	c := requireLive(t)
	labels := map[string]string{"batch": "go-many"}
	sbs, err := c.CreateMany(t.Context(), 3, liveEnv, &CreateOptions{Labels: labels})
	if err != nil || len(sbs) != 3 {
		t.Fatalf("CreateMany: %d, %v", len(sbs), err)
	}
	n, err := c.Reap(t.Context(), labels)
	if err != nil || n != 3 {
		t.Fatalf("Reap = %d, %v", n, err)
	}
	key := newKey()
	a, err := c.Create(t.Context(), liveEnv, &CreateOptions{IdempotencyKey: key, Labels: labels})
	if err != nil {
		t.Fatal(err)
	}
	b, err := c.Create(t.Context(), liveEnv, &CreateOptions{IdempotencyKey: key, Labels: labels})
	if err != nil || a.ID != b.ID {
		t.Fatalf("same key made %s and %s (%v)", a.ID, b.ID, err)
	}
	c.Reap(t.Context(), labels)
}

func TestLiveExec(t *testing.T) {
	c := requireLive(t)
	ctx := t.Context()
	sb := newSandbox(t, c, nil)
	tests := []struct {
		name           string
		cmd            Command
		opts           *ExecOptions
		status         Status
		stdout, stderr string
	}{
		{"nonzero", Sh("echo out; echo err >&2; exit 3"), nil, StatusNonzero, "out\n", "err\n"},
		{"argv cwd env stdin", Argv("/bin/sh", "-c", "pwd; echo $X; cat"), &ExecOptions{Cwd: "/tmp", Env: map[string]string{"X": "y"}, Stdin: []byte("in")}, StatusOK, "/tmp\ny\nin", ""},
		{"user", Sh("id -u"), &ExecOptions{User: "nobody"}, StatusOK, "65534\n", ""},
		{"timeout", Sh("sleep 30"), &ExecOptions{Timeout: time.Second}, StatusTimeout, "", ""},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			res, err := sb.Exec(ctx, tt.cmd, tt.opts)
			if err != nil {
				t.Fatal(err)
			}
			if res.Status != tt.status || string(res.Stdout) != tt.stdout || string(res.Stderr) != tt.stderr {
				t.Fatalf("result = %+v (stdout %q stderr %q)", res, res.Stdout, res.Stderr)
			}
		})
	}
	x, err := sb.ExecStream(ctx, Sh("echo x; echo y >&2"), nil)
	if err != nil {
		t.Fatal(err)
	}
	var out bytes.Buffer
	var last EventType
	for x.Next() {
		if x.Event().Type == EventStdout {
			out.Write(x.Event().Data)
		}
		last = x.Event().Type
	}
	if x.Err() != nil || out.String() != "x\n" || last != EventExited {
		t.Fatalf("stream: %q, last %s, %v", out.String(), last, x.Err())
	}
}

// TestLiveLargeStdin: stdin over the 63 MiB an exec request may carry is
// streamed after the command starts, for Exec, ExecStream and Spawn.
func TestLiveLargeStdin(t *testing.T) {
	c := requireLive(t)
	ctx := t.Context()
	sb := newSandbox(t, c, nil)
	big := bytes.Repeat([]byte("0123456789abcdef"), (70<<20)/16)
	want := strconv.Itoa(len(big))
	res, err := sb.Exec(ctx, Argv("wc", "-c"), &ExecOptions{Stdin: big})
	if err != nil || strings.TrimSpace(string(res.Stdout)) != want {
		t.Fatalf("Exec with %d bytes of stdin: %+v %v", len(big), res, err)
	}
	// A command that reads a little and exits leaves the rest unwritten;
	// its result is what it did, not an error about stdin.
	res, err = sb.Exec(ctx, Sh("head -c 5; exit 3"), &ExecOptions{Stdin: big})
	if err != nil || res.ExitCode != 3 || string(res.Stdout) != "01234" {
		t.Fatalf("Exec reading one line of %d bytes: %+v (stdout %q) %v", len(big), res, res.Stdout, err)
	}
	x, err := sb.ExecStream(ctx, Argv("wc", "-c"), &ExecOptions{Stdin: big})
	if err != nil {
		t.Fatal(err)
	}
	var out bytes.Buffer
	for x.Next() {
		if x.Event().Type == EventStdout {
			out.Write(x.Event().Data)
		}
	}
	if x.Err() != nil || strings.TrimSpace(out.String()) != want {
		t.Fatalf("ExecStream with %d bytes of stdin: %q %v", len(big), out.String(), x.Err())
	}
	job, err := sb.Spawn(ctx, Argv("wc", "-c"), &SpawnOptions{ExecOptions: ExecOptions{Stdin: big}})
	if err != nil {
		t.Fatal(err)
	}
	if err := job.WriteStdin(ctx, []byte("tail"), true); err != nil {
		t.Fatal(err)
	}
	res, err = job.Wait(ctx)
	if err != nil || strings.TrimSpace(string(res.Stdout)) != strconv.Itoa(len(big)+4) {
		t.Fatalf("Spawn with %d bytes of stdin: %+v %v", len(big), res, err)
	}
}

func TestLiveOOM(t *testing.T) {
	c := requireLive(t)
	sb := newSandbox(t, c, &CreateOptions{MemoryMB: 32})
	res, err := sb.Exec(t.Context(), Sh("dd if=/dev/zero of=/dev/null bs=128M count=1"), &ExecOptions{Timeout: time.Minute})
	if err != nil {
		t.Fatal(err)
	}
	if res.Status != StatusOOM {
		t.Fatalf("status = %s (%s), want oom", res.Status, res.Message)
	}
}

func TestLiveSpawnAndSession(t *testing.T) {
	c := requireLive(t)
	ctx := t.Context()
	sb := newSandbox(t, c, nil)
	job, err := sb.Spawn(ctx, Sh("echo started; sleep 1; echo finished"), &SpawnOptions{Tag: "bg"})
	if err != nil {
		t.Fatal(err)
	}
	if running, err := job.Running(ctx); err != nil || !running {
		t.Fatalf("Running = %v, %v", running, err)
	}
	wctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	res, err := job.Wait(wctx)
	if err != nil || string(res.Stdout) != "started\nfinished\n" {
		t.Fatalf("Wait: %+v %v", res, err)
	}
	if out, err := sb.Job("", "bg").Output(ctx); err != nil || string(out.Stdout) != "started\nfinished\n" {
		t.Fatalf("Output by tag: %+v %v", out, err)
	}
	// A job that prints without pause: Output returns what it has at once.
	ticker, err := sb.Spawn(ctx, Sh("echo first; while :; do echo tick; sleep 0.05; done"), nil)
	if err != nil {
		t.Fatal(err)
	}
	for deadline := time.Now().Add(10 * time.Second); ; time.Sleep(100 * time.Millisecond) {
		out, err := ticker.Output(ctx)
		if err != nil {
			t.Fatal(err)
		}
		if strings.Count(string(out.Stdout), "tick") >= 3 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("the ticker printed %q in 10 s", out.Stdout)
		}
	}
	start := time.Now()
	out, err := ticker.Output(ctx)
	if err != nil || out.Status != StatusRunning || out.ExitCode != -1 || !strings.HasPrefix(string(out.Stdout), "first\ntick\n") ||
		time.Since(start) > 5*time.Second {
		t.Fatalf("Output of a running job: %+v %v after %s", out, err, time.Since(start))
	}
	if err := ticker.Kill(ctx, 0); err != nil {
		t.Fatal(err)
	}
	long, err := sb.Spawn(ctx, Sh("sleep 300"), nil)
	if err != nil {
		t.Fatal(err)
	}
	if err := long.Kill(ctx, 0); err != nil {
		t.Fatal(err)
	}
	if res, err := long.Wait(wctx); err != nil || res.Status == StatusOK {
		t.Fatalf("killed job: %+v %v", res, err)
	}
	cat, err := sb.Spawn(ctx, Argv("cat"), nil)
	if err != nil {
		t.Fatal(err)
	}
	if err := cat.WriteStdin(ctx, []byte("hello"), true); err != nil {
		t.Fatal(err)
	}
	if res, err := cat.Wait(wctx); err != nil || string(res.Stdout) != "hello" {
		t.Fatalf("cat: %+v %v", res, err)
	}
	ps, err := sb.Processes(ctx)
	if err != nil || len(ps) < 3 {
		t.Fatalf("Processes = %d, %v", len(ps), err)
	}

	s := sb.Session("main")
	if _, err := s.Run(ctx, "cd /tmp && export A=1", 0); err != nil {
		t.Fatal(err)
	}
	if res, err := s.Run(ctx, "pwd; echo $A", 0); err != nil || string(res.Stdout) != "/tmp\n1\n" {
		t.Fatalf("session state: %+v %v", res, err)
	}
	done := make(chan *ExecResult, 1)
	go func() {
		res, _ := s.Run(ctx, "sleep 60", 2*time.Minute)
		done <- res
	}()
	time.Sleep(time.Second)
	if err := s.Interrupt(ctx); err != nil {
		t.Fatal(err)
	}
	select {
	case res := <-done:
		if res == nil || res.Status == StatusOK {
			t.Fatalf("interrupted run: %+v", res)
		}
	case <-time.After(30 * time.Second):
		t.Fatal("interrupt did not end the command")
	}
	if err := s.Close(ctx); err != nil {
		t.Fatal(err)
	}
}

func TestLiveFiles(t *testing.T) {
	c := requireLive(t)
	ctx := t.Context()
	sb := newSandbox(t, c, nil)
	if err := sb.WriteFile(ctx, "/work/a.txt", []byte("hello"), 0); err != nil {
		t.Fatal(err)
	}
	if err := sb.AppendFile(ctx, "/work/a.txt", []byte(" world")); err != nil {
		t.Fatal(err)
	}
	if b, err := sb.ReadFile(ctx, "/work/a.txt"); err != nil || string(b) != "hello world" {
		t.Fatalf("ReadFile = %q, %v", b, err)
	}
	if err := sb.WriteFile(ctx, "/work/run.sh", []byte("#!/bin/sh\necho ran\n"), 0o755); err != nil {
		t.Fatal(err)
	}
	if st, err := sb.Stat(ctx, "/work/run.sh"); err != nil || st.GetMode()&0o777 != 0o755 || st.GetType() != "file" {
		t.Fatalf("Stat = %v, %v", st, err)
	}
	if err := sb.MkdirAll(ctx, "/work/d/e", 0o755); err != nil {
		t.Fatal(err)
	}
	ents, err := sb.ListDir(ctx, "/work")
	if err != nil {
		t.Fatal(err)
	}
	var names []string
	for _, e := range ents {
		names = append(names, e.GetName())
	}
	slices.Sort(names)
	if strings.Join(names, ",") != "a.txt,d,run.sh" {
		t.Fatalf("ListDir = %v", names)
	}
	if err := sb.Remove(ctx, "/work/d", true); err != nil {
		t.Fatal(err)
	}
	if _, err := sb.Stat(ctx, "/work/d"); !errors.Is(err, ErrNotFound) {
		t.Fatalf("Stat after Remove: %v", err)
	}
	if _, err := sb.ReadFile(ctx, "/work/missing"); !errors.Is(err, ErrNotFound) {
		t.Fatalf("ReadFile of a missing file: %v", err)
	}

	src := t.TempDir()
	os.MkdirAll(filepath.Join(src, "pkg"), 0o755)
	os.WriteFile(filepath.Join(src, "pkg", "m.py"), []byte("x = 1\n"), 0o644)
	if _, err := sb.Upload(ctx, src, "/work/proj"); err != nil {
		t.Fatal(err)
	}
	if b, err := sb.ReadFile(ctx, "/work/proj/pkg/m.py"); err != nil || string(b) != "x = 1\n" {
		t.Fatalf("uploaded file = %q, %v", b, err)
	}
	dest := t.TempDir()
	if _, err := sb.Download(ctx, "/work/proj", dest); err != nil {
		t.Fatal(err)
	}
	found := false
	filepath.WalkDir(dest, func(p string, d os.DirEntry, err error) error {
		if err == nil && strings.HasSuffix(p, filepath.Join("pkg", "m.py")) {
			found = true
		}
		return nil
	})
	if !found {
		t.Fatal("downloaded tree has no pkg/m.py")
	}
}

func TestLiveLayers(t *testing.T) {
	c := requireLive(t)
	layers, err := c.ListLayers(t.Context())
	if err != nil {
		t.Fatal(err)
	}
	var refs []string
	for _, l := range layers {
		refs = append(refs, l.GetRefs()...)
	}
	if !slices.Contains(refs, liveEnv) {
		t.Fatalf("layers %v lack %s", refs, liveEnv)
	}
	newSandbox(t, c, nil)
	envs, err := c.ListEnvironments(t.Context())
	if err != nil || len(envs) == 0 {
		t.Fatalf("ListEnvironments = %v, %v", envs, err)
	}
	uc, err := NewClient("unix://" + filepath.Join(live.root, "dsecd.sock"))
	if err != nil {
		t.Fatal(err)
	}
	defer uc.Close()
	if _, err := uc.ListLayers(t.Context()); err != nil {
		t.Fatalf("over the Unix socket: %v", err)
	}
}

func TestLiveNetwork(t *testing.T) {
	c := requireLive(t)
	plain := newSandbox(t, c, nil)
	if plain.Address() != "" {
		t.Errorf("sandbox without rules has address %q", plain.Address())
	}
	if _, err := plain.SetNetworkRules(t.Context(), map[string]bool{"pypi": true}, false); !errors.Is(err, ErrFailedPrecondition) {
		t.Errorf("rules on a loopback-only sandbox: %v, want ErrFailedPrecondition", err)
	}
	sb := newSandbox(t, c, &CreateOptions{NetworkRules: map[string]bool{"192.0.2.0/24:80/tcp": true}})
	if sb.Address() == "" {
		t.Fatal("networked sandbox has no address")
	}
	res, err := sb.Exec(t.Context(), Sh("cat /etc/resolv.conf; nslookup denied.invalid >/dev/null 2>&1; true"), nil)
	if err != nil || !strings.Contains(string(res.Stdout), "127.0.0.53") {
		t.Fatalf("resolv.conf: %v %v", res, err)
	}
	if _, err := sb.SetNetworkRules(t.Context(), map[string]bool{"no-such-service": true}, false); !errors.Is(err, ErrInvalidArgument) {
		t.Errorf("unknown service: %v, want ErrInvalidArgument", err)
	}
	if _, err := sb.SetNetworkRules(t.Context(), map[string]bool{"example.invalid": true}, true); err != nil {
		t.Fatal(err)
	}
	events, err := sb.NetworkLog(t.Context(), time.Time{}, 0)
	if err != nil {
		t.Fatal(err)
	}
	var denied bool
	for _, e := range events {
		if e.Kind == "dns" && e.Verdict == "deny" && strings.HasPrefix(e.Name, "denied.invalid") {
			denied = true
		}
	}
	if !denied {
		t.Errorf("audit log lacks the denied query: %+v", events)
	}
	st, err := c.LayerStats(t.Context())
	if err != nil || st.GetMode() == "" || len(st.GetLayers()) == 0 {
		t.Errorf("LayerStats = %v, %v", st, err)
	}
}

func TestLiveWarmPool(t *testing.T) {
	c := requireLive(t)
	shape := func() *CreateOptions { return &CreateOptions{Env: map[string]string{"POOL": "warm"}} }
	p, err := c.SetWarmPool(t.Context(), liveEnv, 1, shape())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.SetWarmPool(context.Background(), liveEnv, 0, shape()) })
	if p.Size != 1 || p.Key == "" || p.Environment != liveEnv {
		t.Fatalf("SetWarmPool = %+v", p)
	}
	deadline := time.Now().Add(30 * time.Second)
	for ready := false; !ready; {
		pools, err := c.WarmPools(t.Context())
		if err != nil {
			t.Fatal(err)
		}
		for _, q := range pools {
			if q.Key == p.Key {
				ready = q.Ready == 1
				if !ready && time.Now().After(deadline) {
					t.Fatalf("pool not ready after 30s: %+v", q)
				}
			}
		}
		if !ready {
			if time.Now().After(deadline) {
				t.Fatalf("pool %s is not listed: %+v", p.Key, pools)
			}
			time.Sleep(100 * time.Millisecond)
		}
	}
	// Labels and TTL are not part of the shape.
	o := shape()
	o.TTL = 10 * time.Minute
	sb := newSandbox(t, c, o)
	if !sb.FromWarmPool() {
		t.Fatalf("sandbox %s was not taken from the pool", sb.ID)
	}
	res, err := sb.Exec(t.Context(), Sh("echo $POOL"), nil)
	if err != nil || string(res.Stdout) != "warm\n" {
		t.Fatalf("Exec in a pooled sandbox: %v %v", res, err)
	}
	if other := newSandbox(t, c, nil); other.FromWarmPool() {
		t.Errorf("sandbox %s of another shape came from the pool", other.ID)
	}
	if _, err := c.SetWarmPool(t.Context(), liveEnv, 0, shape()); err != nil {
		t.Fatal(err)
	}
	pools, err := c.WarmPools(t.Context())
	if err != nil {
		t.Fatal(err)
	}
	for _, q := range pools {
		if q.Key == p.Key && q.Size != 0 {
			t.Errorf("pool still listed after size 0: %+v", q)
		}
	}
	if _, err := c.SetWarmPool(t.Context(), liveEnv, 1, &CreateOptions{NetworkRules: map[string]bool{"pypi": true}}); !errors.Is(err, ErrInvalidArgument) {
		t.Errorf("pool with network rules: %v, want ErrInvalidArgument", err)
	}
}

func TestLiveDaemonKilledMidExec(t *testing.T) {
	c := requireLive(t)
	sb := newSandbox(t, c, nil)
	errc := make(chan error, 1)
	go func() {
		_, err := sb.Exec(t.Context(), Sh("sleep 60"), &ExecOptions{Timeout: 30 * time.Second})
		errc <- err
	}()
	time.Sleep(time.Second)
	live.kill()
	defer func() {
		if err := live.start(); err != nil {
			t.Fatal(err)
		}
	}()
	select {
	case err := <-errc:
		if !errors.Is(err, ErrUnavailable) {
			t.Fatalf("err = %v, want ErrUnavailable", err)
		}
	case <-time.After(30 * time.Second):
		t.Fatal("Exec hung after the daemon died")
	}
}

package agent_test

import (
	"bytes"
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"connectrpc.com/connect"

	agentv1 "dsec.dev/dsec/api/gen/dsec/agent/v1"
	dsecv1 "dsec.dev/dsec/api/gen/dsec/v1"
	"dsec.dev/dsec/internal/agent/agentclient"
	"dsec.dev/dsec/internal/testutil"
)

var (
	agentBin string // built in TestMain
	shellDir string // holds sh -> /bin/busybox
)

func TestMain(m *testing.M) {
	dir, err := os.MkdirTemp("", "dsec-agent-test-")
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	os.Chmod(dir, 0o755) // commands run as nobody exec the agent (state-dump)
	agentBin = filepath.Join(dir, "dsec-agent")
	cmd := exec.Command("go", "build", "-o", agentBin, "dsec.dev/dsec/cmd/dsec-agent")
	cmd.Env = append(os.Environ(), "CGO_ENABLED=0")
	if out, err := cmd.CombinedOutput(); err != nil {
		fmt.Fprintf(os.Stderr, "build dsec-agent: %v\n%s", err, out)
		os.RemoveAll(dir)
		os.Exit(1)
	}
	shellDir = dir
	if _, err := os.Stat("/bin/busybox"); err == nil {
		os.Symlink("/bin/busybox", filepath.Join(dir, "sh"))
	}
	code := m.Run()
	os.RemoveAll(dir)
	os.Exit(code)
}

type agentProc struct {
	client agentclient.Client
	cmd    *exec.Cmd
	stderr *bytes.Buffer
}

type agentOpts struct {
	cgroupDir string
	args      []string
}

func startAgent(t *testing.T, o agentOpts) *agentProc {
	t.Helper()
	var extra []*os.File
	args := o.args
	if o.cgroupDir != "" {
		cf, err := os.Open(o.cgroupDir)
		if err != nil {
			t.Fatal(err)
		}
		defer cf.Close()
		extra = append(extra, cf)
		args = append(args, "--cgroup-fd", "4")
	}
	return startAgentWith(t, extra, args, nil)
}

// startAgentWith starts the agent with extra as fds 4, 5, ...; placed is
// called with its pid before the test talks to it.
func startAgentWith(t testing.TB, extra []*os.File, extraArgs []string, placed func(pid int)) *agentProc {
	t.Helper()
	testutil.Require(t, fileExists("/bin/busybox"), "busybox-static is not installed (/bin/busybox)")
	sockDir := t.TempDir()
	sock := filepath.Join(sockDir, "agent.sock")
	ln, err := net.ListenUnix("unix", &net.UnixAddr{Name: sock, Net: "unix"})
	if err != nil {
		t.Fatal(err)
	}
	lf, err := ln.File()
	if err != nil {
		t.Fatal(err)
	}
	defer lf.Close()
	defer ln.Close()
	ln.SetUnlinkOnClose(false)
	args := []string{"serve", "--listen-fd", "3", "--shell", filepath.Join(shellDir, "sh"), "--log-level", "debug"}
	args = append(args, extraArgs...)
	cmd := exec.Command(agentBin, args...)
	cmd.ExtraFiles = append([]*os.File{lf}, extra...)
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	a := &agentProc{client: agentclient.Dial(sock), cmd: cmd, stderr: &stderr}
	t.Cleanup(func() {
		// Kill what the agent started (it is their subreaper), then the agent.
		for _, pid := range descendants(cmd.Process.Pid) {
			syscall.Kill(pid, syscall.SIGKILL)
		}
		cmd.Process.Kill()
		cmd.Wait()
		if t.Failed() {
			t.Logf("agent log:\n%s", stderr.String())
		}
	})
	if placed != nil {
		placed(cmd.Process.Pid)
	}
	deadline := time.Now().Add(20 * time.Second)
	for {
		ctx, cancel := context.WithTimeout(context.Background(), time.Second)
		_, err := a.client.Ping(ctx, connect.NewRequest(&agentv1.PingRequest{}))
		cancel()
		if err == nil {
			return a
		}
		if time.Now().After(deadline) {
			t.Fatalf("agent did not answer Ping: %v\n%s", err, stderr.String())
		}
		time.Sleep(20 * time.Millisecond)
	}
}

func fileExists(p string) bool { _, err := os.Stat(p); return err == nil }

func descendants(pid int) []int {
	ents, _ := os.ReadDir("/proc")
	children := map[int][]int{}
	for _, e := range ents {
		n, err := strconv.Atoi(e.Name())
		if err != nil {
			continue
		}
		b, err := os.ReadFile("/proc/" + e.Name() + "/stat")
		if err != nil {
			continue
		}
		s := string(b)
		f := strings.Fields(s[strings.LastIndexByte(s, ')')+1:])
		pp, _ := strconv.Atoi(f[1])
		children[pp] = append(children[pp], n)
	}
	var out []int
	q := []int{pid}
	for len(q) > 0 {
		c := q[0]
		q = q[1:]
		out = append(out, children[c]...)
		q = append(q, children[c]...)
	}
	return out
}

// alive reports whether pid exists and is not a zombie.
func alive(pid int) bool {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return false
	}
	s := string(b)
	f := strings.Fields(s[strings.LastIndexByte(s, ')')+1:])
	return f[0] != "Z" && f[0] != "X"
}

func waitGone(t *testing.T, pid int) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for alive(pid) {
		if time.Now().After(deadline) {
			t.Fatalf("process %d is still alive", pid)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

type result struct {
	started *dsecv1.ExecStarted
	stdout  string
	stderr  string
	exited  *dsecv1.ExecExited
}

func collect(t *testing.T, s agentclient.ExecStream) result {
	t.Helper()
	var r result
	var out, errb strings.Builder
	for s.Receive() {
		switch ev := s.Msg().Event.(type) {
		case *dsecv1.ExecEvent_Started:
			r.started = ev.Started
		case *dsecv1.ExecEvent_Stdout:
			out.Write(ev.Stdout)
		case *dsecv1.ExecEvent_Stderr:
			errb.Write(ev.Stderr)
		case *dsecv1.ExecEvent_Exited:
			r.exited = ev.Exited
		}
	}
	if err := s.Err(); err != nil {
		t.Fatalf("stream: %v", err)
	}
	if r.exited == nil {
		t.Fatal("stream ended without an exited event")
	}
	r.stdout, r.stderr = out.String(), errb.String()
	return r
}

// exec runs a command the way the edge does: over the framed path.
func (a *agentProc) exec(t *testing.T, req *dsecv1.ExecRequest) result {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	s, err := a.client.ExecEvents(ctx, req)
	if err != nil {
		t.Fatal(err)
	}
	return collect(t, s)
}

// execConnect runs a command through the Connect service's Exec.
func (a *agentProc) execConnect(t *testing.T, req *dsecv1.ExecRequest) result {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	s, err := a.client.Exec(ctx, connect.NewRequest(req))
	if err != nil {
		t.Fatal(err)
	}
	return collect(t, s)
}

func TestExec(t *testing.T) {
	a := startAgent(t, agentOpts{args: []string{"--env", "AGENTVAR=fromflag"}})
	dir := t.TempDir()
	tests := []struct {
		name       string
		req        *dsecv1.ExecRequest
		stdout     string
		stderr     string
		code       int32
		status     dsecv1.ExitStatus
		msgContain string
	}{
		{name: "argv", req: &dsecv1.ExecRequest{Argv: []string{"/bin/busybox", "echo", "hello"}}, stdout: "hello\n", status: dsecv1.ExitStatus_EXIT_STATUS_OK},
		{name: "argv on PATH", req: &dsecv1.ExecRequest{Argv: []string{"busybox", "printf", "x%s", "y"}}, stdout: "xy", status: dsecv1.ExitStatus_EXIT_STATUS_OK},
		{name: "shell command, separate streams, exit code", req: &dsecv1.ExecRequest{Command: "echo out; echo err >&2; exit 3"},
			stdout: "out\n", stderr: "err\n", code: 3, status: dsecv1.ExitStatus_EXIT_STATUS_NONZERO},
		{name: "env and cwd", req: &dsecv1.ExecRequest{Command: `echo "$FOO $AGENTVAR $HOME"; pwd`, Env: map[string]string{"FOO": "bar"}, Cwd: dir},
			stdout: "bar fromflag " + os.Getenv("HOME") + "\n" + dir + "\n", status: dsecv1.ExitStatus_EXIT_STATUS_OK},
		{name: "stdin", req: &dsecv1.ExecRequest{Argv: []string{"/bin/busybox", "cat"}, Stdin: []byte("from stdin")}, stdout: "from stdin", status: dsecv1.ExitStatus_EXIT_STATUS_OK},
		{name: "no stdin is EOF", req: &dsecv1.ExecRequest{Argv: []string{"/bin/busybox", "cat"}}, status: dsecv1.ExitStatus_EXIT_STATUS_OK},
		{name: "killed by signal", req: &dsecv1.ExecRequest{Command: "kill -TERM $$"}, code: -1, status: dsecv1.ExitStatus_EXIT_STATUS_KILLED, msgContain: "SIGTERM"},
		{name: "start error", req: &dsecv1.ExecRequest{Argv: []string{"/does/not/exist"}}, code: 127, status: dsecv1.ExitStatus_EXIT_STATUS_START_ERROR, msgContain: "/does/not/exist"},
		{name: "bad cwd", req: &dsecv1.ExecRequest{Argv: []string{"/bin/busybox", "true"}, Cwd: "/does/not/exist"}, code: 127, status: dsecv1.ExitStatus_EXIT_STATUS_START_ERROR, msgContain: "change directory"},
	}
	if os.Getenv("HOME") == "" {
		t.Skip("HOME is not set")
	}
	paths := map[string]func(*testing.T, *dsecv1.ExecRequest) result{"framed": a.exec, "connect": a.execConnect}
	for _, tt := range tests {
		for path, exec := range paths {
			t.Run(path+"/"+tt.name, func(t *testing.T) {
				r := exec(t, tt.req)
				if r.stdout != tt.stdout || r.stderr != tt.stderr {
					t.Errorf("stdout %q stderr %q, want %q %q", r.stdout, r.stderr, tt.stdout, tt.stderr)
				}
				if r.exited.ExitCode != tt.code || r.exited.Status != tt.status {
					t.Errorf("exit %d %v, want %d %v (%s)", r.exited.ExitCode, r.exited.Status, tt.code, tt.status, r.exited.Message)
				}
				if !strings.Contains(r.exited.Message, tt.msgContain) {
					t.Errorf("message %q does not contain %q", r.exited.Message, tt.msgContain)
				}
				if tt.status != dsecv1.ExitStatus_EXIT_STATUS_START_ERROR && (r.started == nil || r.started.Pid <= 0) {
					t.Errorf("no started event: %v", r.started)
				}
			})
		}
	}

	t.Run("invalid request", func(t *testing.T) {
		s, err := a.client.Exec(context.Background(), connect.NewRequest(&dsecv1.ExecRequest{}))
		if err == nil {
			for s.Receive() {
			}
			err = s.Err()
		}
		if connect.CodeOf(err) != connect.CodeInvalidArgument {
			t.Fatalf("connect: got %v, want InvalidArgument", err)
		}
		fs, err := a.client.ExecEvents(context.Background(), &dsecv1.ExecRequest{})
		if err == nil {
			for fs.Receive() {
			}
			err = fs.Err()
		}
		if connect.CodeOf(err) != connect.CodeInvalidArgument {
			t.Fatalf("framed: got %v, want InvalidArgument", err)
		}
	})

	t.Run("user nobody", func(t *testing.T) {
		testutil.RequireRoot(t)
		r := a.exec(t, &dsecv1.ExecRequest{Command: "id -u; id -g; echo $HOME", User: "nobody"})
		want := "65534\n65534\n/nonexistent\n"
		if r.stdout != want {
			t.Errorf("stdout %q, want %q (%s)", r.stdout, want, r.stderr)
		}
		r = a.exec(t, &dsecv1.ExecRequest{Command: "id -u; id -g", User: "1234:5678"})
		if r.stdout != "1234\n5678\n" {
			t.Errorf("uid:gid stdout %q", r.stdout)
		}
	})

	t.Run("foreground cancel kills", func(t *testing.T) {
		ctx, cancel := context.WithCancel(context.Background())
		defer cancel()
		s, err := a.client.ExecEvents(ctx, &dsecv1.ExecRequest{Argv: []string{"/bin/busybox", "sleep", "1000"}})
		if err != nil {
			t.Fatal(err)
		}
		if !s.Receive() || s.Msg().GetStarted() == nil {
			t.Fatalf("no started event: %v", s.Err())
		}
		pid := int(s.Msg().GetStarted().Pid)
		cancel()
		waitGone(t, pid)
	})

	t.Run("output past the retained limit", func(t *testing.T) {
		// The stream gets all of it, while the agent keeps 1 MiB.
		const total = 40 << 20
		r := a.exec(t, &dsecv1.ExecRequest{Command: fmt.Sprintf("yes | head -c %d", total), OutputLimitBytes: 1 << 20})
		if r.exited.StdoutTruncated || r.exited.StdoutBytes != total || len(r.stdout) != total {
			t.Errorf("truncated %v, bytes %d, streamed %d; want all %d", r.exited.StdoutTruncated, r.exited.StdoutBytes, len(r.stdout), total)
		}
		if hwm := statusKiB(t, a.cmd.Process.Pid, "VmHWM"); hwm > 96<<10 {
			t.Errorf("agent peak RSS %d KiB", hwm)
		}
	})

	t.Run("slow reader", func(t *testing.T) {
		// A reader slower than the command gets every byte, in order: the
		// command waits for it rather than the agent hold or drop output.
		data := make([]byte, 24<<20)
		rand.Read(data)
		file := filepath.Join(t.TempDir(), "data")
		if err := os.WriteFile(file, data, 0o644); err != nil {
			t.Fatal(err)
		}
		ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
		defer cancel()
		s, err := a.client.ExecEvents(ctx, &dsecv1.ExecRequest{Argv: []string{"/bin/busybox", "cat", file}, OutputLimitBytes: 64 << 10})
		if err != nil {
			t.Fatal(err)
		}
		var got []byte
		var exited *dsecv1.ExecExited
		for s.Receive() {
			got = append(got, s.Msg().GetStdout()...)
			if x := s.Msg().GetExited(); x != nil {
				exited = x
			}
			if len(got) < 4<<20 {
				time.Sleep(time.Millisecond)
			}
		}
		if err := s.Err(); err != nil || exited == nil {
			t.Fatalf("stream: %v, exit %v", err, exited)
		}
		if !bytes.Equal(got, data) || exited.StdoutTruncated || exited.Status != dsecv1.ExitStatus_EXIT_STATUS_OK {
			t.Errorf("got %d bytes (equal %v) of %d, exit %v", len(got), bytes.Equal(got, data), len(data), exited)
		}
	})

	t.Run("output nobody read", func(t *testing.T) {
		// A background command's stream goes away; past the retained 1 MiB
		// its output is dropped, and Attach, replaying it, says so where
		// it is missing and in the exit.
		const total = 3 << 20
		ctx, cancel := context.WithCancel(context.Background())
		s, err := a.client.Exec(ctx, connect.NewRequest(&dsecv1.ExecRequest{
			Command: fmt.Sprintf("head -c %d /dev/zero; echo done >&2", total), Background: true, OutputLimitBytes: 1 << 20}))
		if err != nil {
			t.Fatal(err)
		}
		if !s.Receive() || s.Msg().GetStarted() == nil {
			t.Fatalf("no started event: %v", s.Err())
		}
		id := s.Msg().GetStarted().ProcessId
		cancel()
		s.Close()
		testutil.WaitFor(t, 10*time.Second, "the command to exit", func() bool {
			ps, err := a.client.ListProcesses(context.Background(), connect.NewRequest(&dsecv1.ListProcessesRequest{}))
			if err != nil {
				t.Fatal(err)
			}
			for _, p := range ps.Msg.Processes {
				if p.ProcessId == id {
					return !p.Running
				}
			}
			return false
		})
		for _, noFollow := range []bool{false, true} {
			att, err := a.client.Attach(context.Background(), connect.NewRequest(&dsecv1.AttachRequest{ProcessId: id, NoFollow: noFollow}))
			if err != nil {
				t.Fatal(err)
			}
			var stdout, stderr int
			var dropped []*dsecv1.ExecDropped
			var exited *dsecv1.ExecExited
			for att.Receive() {
				m := att.Msg()
				stdout += len(m.GetStdout())
				stderr += len(m.GetStderr())
				if d := m.GetDropped(); d != nil {
					dropped = append(dropped, d)
				}
				if x := m.GetExited(); x != nil {
					exited = x
				}
			}
			if err := att.Err(); err != nil || exited == nil {
				t.Fatalf("attach (no_follow %v): %v, exit %v", noFollow, err, exited)
			}
			if stdout != 1<<20 || stderr != 5 || len(dropped) != 1 || dropped[0].Stderr || dropped[0].Bytes != total-1<<20 ||
				!exited.StdoutTruncated || exited.StderrTruncated || exited.StdoutBytes != total {
				t.Errorf("attach (no_follow %v): %d bytes of stdout, %d of stderr, dropped %v, exit %v", noFollow, stdout, stderr, dropped, exited)
			}
		}
	})

	t.Run("ping", func(t *testing.T) {
		resp, err := a.client.Ping(context.Background(), connect.NewRequest(&agentv1.PingRequest{}))
		if err != nil {
			t.Fatal(err)
		}
		if resp.Msg.Version == "" || resp.Msg.LastActiveUnixMs == 0 || resp.Msg.RunningProcesses != 0 {
			t.Errorf("ping: %v", resp.Msg)
		}
		t.Logf("agent RSS %d KiB", statusKiB(t, a.cmd.Process.Pid, "VmRSS"))
	})
}

func statusKiB(t *testing.T, pid int, field string) int {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", pid))
	if err != nil {
		t.Fatal(err)
	}
	for _, line := range strings.Split(string(b), "\n") {
		if v, ok := strings.CutPrefix(line, field+":"); ok {
			n, _ := strconv.Atoi(strings.Fields(v)[0])
			return n
		}
	}
	return 0
}

func TestTimeoutKillsTreeInCgroup(t *testing.T) {
	testutil.RequireRoot(t)
	testutil.Require(t, fileExists("/sys/fs/cgroup/freezer"), "no cgroup v1 freezer hierarchy")
	b := make([]byte, 4)
	rand.Read(b)
	cg := "/sys/fs/cgroup/freezer/dsec-test-" + hex.EncodeToString(b)
	if err := os.Mkdir(cg, 0o755); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		// Anything the agent left behind: kill it, then remove the cgroups.
		subs, _ := os.ReadDir(cg)
		for _, s := range subs {
			if s.IsDir() {
				killCgroup(filepath.Join(cg, s.Name()))
				os.Remove(filepath.Join(cg, s.Name()))
			}
		}
		killCgroup(cg)
		if err := os.Remove(cg); err != nil {
			t.Errorf("remove test cgroup: %v", err)
		}
	})
	a := startAgent(t, agentOpts{cgroupDir: cg})
	dir := t.TempDir()
	pidFile := filepath.Join(dir, "pid")
	r := a.exec(t, &dsecv1.ExecRequest{
		Command:        fmt.Sprintf("setsid sh -c 'echo $$ > %s; exec sleep 1000' & sleep 1000", pidFile),
		TimeoutSeconds: 1,
	})
	if r.exited.Status != dsecv1.ExitStatus_EXIT_STATUS_TIMEOUT || r.exited.ExitCode != -1 || r.exited.Signal != 9 {
		t.Fatalf("exited %v", r.exited)
	}
	b, err := os.ReadFile(pidFile)
	if err != nil {
		t.Fatal(err)
	}
	pid, _ := strconv.Atoi(strings.TrimSpace(string(b)))
	waitGone(t, pid)

	// Background, attach, list, signal with a cgroup per command.
	ctx, cancel := context.WithCancel(context.Background())
	s, err := a.client.Exec(ctx, connect.NewRequest(&dsecv1.ExecRequest{Command: "echo start; setsid sleep 1000 & sleep 1000", Background: true, Tag: "bg"}))
	if err != nil {
		t.Fatal(err)
	}
	if !s.Receive() {
		t.Fatal(s.Err())
	}
	cancel()
	procs, err := a.client.ListProcesses(context.Background(), connect.NewRequest(&dsecv1.ListProcessesRequest{}))
	if err != nil {
		t.Fatal(err)
	}
	var running *dsecv1.ProcessInfo
	for _, p := range procs.Msg.Processes {
		if p.Tag == "bg" && p.Running {
			running = p
		}
	}
	if running == nil {
		t.Fatalf("background process not listed as running: %v", procs.Msg.Processes)
	}
	att, err := a.client.Attach(context.Background(), connect.NewRequest(&dsecv1.AttachRequest{Tag: "bg"}))
	if err != nil {
		t.Fatal(err)
	}
	go func() {
		time.Sleep(200 * time.Millisecond)
		a.client.Signal(context.Background(), connect.NewRequest(&dsecv1.SignalRequest{ProcessId: running.ProcessId}))
	}()
	ar := collect(t, att)
	if ar.stdout != "start\n" || ar.exited.Signal != 9 {
		t.Errorf("attach: stdout %q exited %v", ar.stdout, ar.exited)
	}
	subs, _ := os.ReadDir(cg)
	deadline := time.Now().Add(5 * time.Second)
	for hasDirs(subs) && time.Now().Before(deadline) {
		time.Sleep(50 * time.Millisecond)
		subs, _ = os.ReadDir(cg)
	}
	if hasDirs(subs) {
		t.Errorf("child cgroups left behind: %v", subs)
	}
}

func hasDirs(ents []os.DirEntry) bool {
	for _, e := range ents {
		if e.IsDir() {
			return true
		}
	}
	return false
}

func killCgroup(dir string) {
	for i := 0; i < 50; i++ {
		b, _ := os.ReadFile(filepath.Join(dir, "cgroup.procs"))
		pids := strings.Fields(string(b))
		if len(pids) == 0 {
			return
		}
		for _, p := range pids {
			n, _ := strconv.Atoi(p)
			syscall.Kill(n, syscall.SIGKILL)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

func TestBackground(t *testing.T) {
	a := startAgent(t, agentOpts{})
	ctx, cancel := context.WithCancel(context.Background())
	s, err := a.client.Exec(ctx, connect.NewRequest(&dsecv1.ExecRequest{
		Argv: []string{"/bin/busybox", "cat"}, KeepStdinOpen: true, Background: true, Tag: "cat"}))
	if err != nil {
		t.Fatal(err)
	}
	if !s.Receive() || s.Msg().GetStarted() == nil {
		t.Fatal("no started event")
	}
	id := s.Msg().GetStarted().ProcessId
	cancel()
	if _, err := a.client.WriteStdin(context.Background(), connect.NewRequest(&dsecv1.WriteStdinRequest{ProcessId: id, Data: []byte("hi there"), Close: true})); err != nil {
		t.Fatal(err)
	}
	att, err := a.client.Attach(context.Background(), connect.NewRequest(&dsecv1.AttachRequest{ProcessId: id}))
	if err != nil {
		t.Fatal(err)
	}
	r := collect(t, att)
	if r.stdout != "hi there" || r.exited.Status != dsecv1.ExitStatus_EXIT_STATUS_OK {
		t.Errorf("attach: %q %v", r.stdout, r.exited)
	}
	// Attach after exit replays too.
	att, err = a.client.Attach(context.Background(), connect.NewRequest(&dsecv1.AttachRequest{Tag: "cat"}))
	if err != nil {
		t.Fatal(err)
	}
	if r := collect(t, att); r.stdout != "hi there" {
		t.Errorf("replay: %q", r.stdout)
	}

	// Signal a running background shell, without cgroups.
	s, err = a.client.Exec(context.Background(), connect.NewRequest(&dsecv1.ExecRequest{Command: "sleep 1000", Background: true}))
	if err != nil {
		t.Fatal(err)
	}
	s.Receive()
	id = s.Msg().GetStarted().ProcessId
	s.Close()
	if _, err := a.client.Signal(context.Background(), connect.NewRequest(&dsecv1.SignalRequest{ProcessId: id, Signal: 15})); err != nil {
		t.Fatal(err)
	}
	att, _ = a.client.Attach(context.Background(), connect.NewRequest(&dsecv1.AttachRequest{ProcessId: id}))
	if r := collect(t, att); r.exited.Status != dsecv1.ExitStatus_EXIT_STATUS_KILLED || r.exited.Signal != 15 {
		t.Errorf("after SIGTERM: %v", r.exited)
	}
	_, err = a.client.Attach(context.Background(), connect.NewRequest(&dsecv1.AttachRequest{ProcessId: "p-nope"}))
	if err == nil {
		var st *connect.ServerStreamForClient[dsecv1.ExecEvent]
		st, err = a.client.Attach(context.Background(), connect.NewRequest(&dsecv1.AttachRequest{ProcessId: "p-nope"}))
		for st.Receive() {
		}
		err = st.Err()
	}
	if connect.CodeOf(err) != connect.CodeNotFound {
		t.Errorf("attach unknown: %v", err)
	}
}

func (a *agentProc) session(t *testing.T, req *dsecv1.SessionRunRequest) result {
	t.Helper()
	s, err := a.client.SessionRun(context.Background(), connect.NewRequest(req))
	if err != nil {
		t.Fatal(err)
	}
	return collect(t, s)
}

func TestSessions(t *testing.T) {
	a := startAgent(t, agentOpts{})
	dir := t.TempDir()
	r := a.session(t, &dsecv1.SessionRunRequest{Session: "s1", Command: "cd " + dir + " && export X=1 Y='two words'"})
	if r.exited.Status != dsecv1.ExitStatus_EXIT_STATUS_OK {
		t.Fatalf("first run: %v %s", r.exited, r.stderr)
	}
	r = a.session(t, &dsecv1.SessionRunRequest{Session: "s1", Command: `pwd; echo "$X $Y"; export Z=3; exit 4`})
	if r.stdout != dir+"\n1 two words\n" || r.exited.ExitCode != 4 {
		t.Errorf("second run: %q %v", r.stdout, r.exited)
	}
	r = a.session(t, &dsecv1.SessionRunRequest{Session: "s1", Command: `echo "$Z"`})
	if r.stdout != "3\n" {
		t.Errorf("state after exit: %q", r.stdout)
	}
	r = a.session(t, &dsecv1.SessionRunRequest{Session: "s2", Command: `echo "[$X]"; pwd`})
	if r.stdout != "[]\n"+mustHomeOrRoot()+"\n" {
		t.Errorf("other session: %q", r.stdout)
	}

	// Interrupt, and one command at a time.
	s, err := a.client.SessionRun(context.Background(), connect.NewRequest(&dsecv1.SessionRunRequest{Session: "s1", Command: "sleep 1000"}))
	if err != nil {
		t.Fatal(err)
	}
	if !s.Receive() {
		t.Fatal(s.Err())
	}
	s2, err := a.client.SessionRun(context.Background(), connect.NewRequest(&dsecv1.SessionRunRequest{Session: "s1", Command: "true"}))
	if err == nil {
		for s2.Receive() {
		}
		err = s2.Err()
	}
	if connect.CodeOf(err) != connect.CodeFailedPrecondition {
		t.Errorf("concurrent run: %v", err)
	}
	ping, _ := a.client.Ping(context.Background(), connect.NewRequest(&agentv1.PingRequest{}))
	if ping.Msg.RunningProcesses != 1 {
		t.Errorf("running processes %d", ping.Msg.RunningProcesses)
	}
	if _, err := a.client.SessionInterrupt(context.Background(), connect.NewRequest(&dsecv1.SessionInterruptRequest{Session: "s1"})); err != nil {
		t.Fatal(err)
	}
	ir := collect(t, s)
	if ir.exited.Status == dsecv1.ExitStatus_EXIT_STATUS_OK {
		t.Errorf("interrupted run: %v", ir.exited)
	}
	r = a.session(t, &dsecv1.SessionRunRequest{Session: "s1", Command: `pwd`})
	if r.stdout != dir+"\n" {
		t.Errorf("after interrupt: %q", r.stdout)
	}

	// Close kills and forgets.
	s, err = a.client.SessionRun(context.Background(), connect.NewRequest(&dsecv1.SessionRunRequest{Session: "s1", Command: "sleep 1000"}))
	if err != nil {
		t.Fatal(err)
	}
	s.Receive()
	pid := int(s.Msg().GetStarted().Pid)
	if _, err := a.client.SessionClose(context.Background(), connect.NewRequest(&dsecv1.SessionCloseRequest{Session: "s1"})); err != nil {
		t.Fatal(err)
	}
	collect(t, s)
	waitGone(t, pid)
	r = a.session(t, &dsecv1.SessionRunRequest{Session: "s1", Command: `echo "[$X]"`})
	if r.stdout != "[]\n" {
		t.Errorf("after close: %q", r.stdout)
	}

	t.Run("as nobody", func(t *testing.T) {
		testutil.RequireRoot(t)
		r := a.session(t, &dsecv1.SessionRunRequest{Session: "n", User: "nobody", Command: "cd /tmp; export A=b"})
		r = a.session(t, &dsecv1.SessionRunRequest{Session: "n", Command: `id -u; pwd; echo $A`})
		if r.stdout != "65534\n/tmp\nb\n" {
			t.Errorf("nobody session: %q %s", r.stdout, r.stderr)
		}
	})
}

func mustHomeOrRoot() string {
	if h := os.Getenv("HOME"); h != "" {
		if st, err := os.Stat(h); err == nil && st.IsDir() {
			return h
		}
	}
	return "/"
}

func TestShell(t *testing.T) {
	a := startAgent(t, agentOpts{})
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	st := a.client.Shell(ctx)
	if err := st.Send(&dsecv1.ShellInput{Input: &dsecv1.ShellInput_Start{Start: &dsecv1.ShellStart{Size: &dsecv1.TerminalSize{Rows: 24, Cols: 80}}}}); err != nil {
		t.Fatal(err)
	}
	if err := st.Send(&dsecv1.ShellInput{Input: &dsecv1.ShellInput_Data{Data: []byte("echo hi-$((40+2)); stty size; exit 7\n")}}); err != nil {
		t.Fatal(err)
	}
	var out strings.Builder
	var exited *dsecv1.ExecExited
	for {
		msg, err := st.Receive()
		if err != nil {
			if !errors.Is(err, io.EOF) {
				t.Fatal(err)
			}
			break
		}
		out.Write(msg.GetData())
		if e := msg.GetExited(); e != nil {
			exited = e
		}
	}
	if !strings.Contains(out.String(), "hi-42") || !strings.Contains(out.String(), "24 80") {
		t.Errorf("shell output %q", out.String())
	}
	if exited == nil || exited.ExitCode != 7 {
		t.Errorf("exited %v", exited)
	}
}

func TestOOMReported(t *testing.T) {
	testutil.RequireRoot(t)
	testutil.Require(t, fileExists("/sys/fs/cgroup/memory/memory.oom_control"), "no cgroup v1 memory hierarchy")
	b := make([]byte, 4)
	rand.Read(b)
	cg := "/sys/fs/cgroup/memory/dsec-test-" + hex.EncodeToString(b)
	if err := os.Mkdir(cg, 0o755); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		killCgroup(cg)
		deadline := time.Now().Add(5 * time.Second)
		for os.Remove(cg) != nil && time.Now().Before(deadline) {
			time.Sleep(50 * time.Millisecond)
		}
		if fileExists(cg) {
			t.Errorf("test memory cgroup %s left behind", cg)
		}
	})
	if err := os.WriteFile(filepath.Join(cg, "memory.limit_in_bytes"), []byte("64M"), 0o644); err != nil {
		t.Fatal(err)
	}
	mf, err := os.Open(cg)
	if err != nil {
		t.Fatal(err)
	}
	defer mf.Close()
	// The agent (and so every command) runs in the memory cgroup.
	a := startAgentIn(t, cg, mf)
	r := a.exec(t, &dsecv1.ExecRequest{Command: "head -c 200000000 /dev/zero | tail > /dev/null"})
	if r.exited.Status != dsecv1.ExitStatus_EXIT_STATUS_OOM && !strings.Contains(r.exited.Message, "OOM") {
		// The pipeline's shell reports tail's death as exit 137; run tail directly.
		r = a.exec(t, &dsecv1.ExecRequest{Argv: []string{"/bin/busybox", "tail", "/dev/zero"}})
	}
	if r.exited.Status != dsecv1.ExitStatus_EXIT_STATUS_OOM || !strings.Contains(r.exited.Message, "64 MiB") {
		t.Errorf("exited %v", r.exited)
	}
	ping, err := a.client.Ping(context.Background(), connect.NewRequest(&agentv1.PingRequest{}))
	if err != nil || ping.Msg.OomKills == 0 {
		t.Errorf("ping: %v %v", ping, err)
	}
}

// startAgentIn starts an agent placed in the memory cgroup dir cg, with its
// fd passed as --memory-cgroup-fd 4.
func startAgentIn(t *testing.T, cg string, mf *os.File) *agentProc {
	t.Helper()
	a := startAgentWith(t, []*os.File{mf}, []string{"--memory-cgroup-fd", "4"}, func(pid int) {
		if err := os.WriteFile(filepath.Join(cg, "cgroup.procs"), []byte(strconv.Itoa(pid)), 0o644); err != nil {
			t.Fatal(err)
		}
	})
	return a
}

// TestBackgroundBurstKeepsOutput runs many short background commands at
// once, as E2B's commands.run does: each Exec stream gets its command's
// output although more of them exit before their streams read it than
// exited background processes keep output for Attach.
func TestBackgroundBurstKeepsOutput(t *testing.T) {
	t.Setenv("GOMAXPROCS", "1") // as in a sandbox, where the race showed
	a := startAgent(t, agentOpts{})
	const n = 64
	for round := range 3 {
		var wg sync.WaitGroup
		errs := make(chan string, n)
		for i := range n {
			wg.Add(1)
			go func() {
				defer wg.Done()
				r := a.execConnect(t, &dsecv1.ExecRequest{Argv: []string{"/bin/busybox", "echo", strconv.Itoa(i)}, Background: true})
				if r.stdout != strconv.Itoa(i)+"\n" || r.exited.GetStatus() != dsecv1.ExitStatus_EXIT_STATUS_OK {
					errs <- fmt.Sprintf("round %d, command %d: stdout %q, %v", round, i, r.stdout, r.exited)
				}
			}()
		}
		wg.Wait()
		close(errs)
		for e := range errs {
			t.Error(e)
		}
	}
}

// A container's agent refuses Reidentify: only a microVM's init may set
// the kernel's host name and reseed its random state (TestPauseResumeFork
// in internal/vm/vmstate covers a guest's).
func TestReidentifyOutsideGuest(t *testing.T) {
	a := startAgent(t, agentOpts{})
	_, err := a.client.Reidentify(context.Background(), connect.NewRequest(&agentv1.ReidentifyRequest{
		Hostname: "child", Entropy: make([]byte, 32)}))
	if connect.CodeOf(err) != connect.CodeFailedPrecondition {
		t.Errorf("Reidentify of a container's agent: %v, want FailedPrecondition", err)
	}
}

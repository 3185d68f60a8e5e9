package root

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"connectrpc.com/connect"

	dsecv1 "dsec.dev/dsec/api/gen/dsec/v1"
	"dsec.dev/dsec/internal/edge/sandbox"
	"dsec.dev/dsec/internal/testutil"
)

func TestLifecycleAndExec(t *testing.T) {
	d := startDaemon(t)
	sb := create(t, d, &dsecv1.SandboxSpec{Labels: map[string]string{"job": "life"}, Env: map[string]string{"GREETING": "hi"}})
	if !strings.HasPrefix(sb.GetId(), "sb-t1-") {
		t.Fatalf("id %q does not name node t1", sb.GetId())
	}
	if sb.GetState() != dsecv1.State_STATE_RUNNING || len(sb.GetLayerDigests()) != 1 {
		t.Fatalf("new sandbox: %v", sb)
	}

	checkExec(t, d, sb.GetId())

	list, err := d.Clients.Sandboxes.List(context.Background(), connect.NewRequest(&dsecv1.ListRequest{Labels: map[string]string{"job": "life"}}))
	if err != nil || len(list.Msg.GetSandboxes()) != 1 {
		t.Fatalf("list by label: %v %v", list, err)
	}
	if _, err := d.Clients.Sandboxes.Delete(context.Background(), connect.NewRequest(&dsecv1.DeleteRequest{Id: sb.GetId()})); err != nil {
		t.Fatal(err)
	}
	got, err := d.Clients.Sandboxes.Get(context.Background(), connect.NewRequest(&dsecv1.GetRequest{Id: sb.GetId()}))
	if err != nil || got.Msg.GetState() != dsecv1.State_STATE_STOPPED || got.Msg.GetReason() != dsecv1.Reason_REASON_DELETED {
		t.Fatalf("after delete: %v %v", got, err)
	}
	_, err = d.Clients.Sandboxes.Exec(context.Background(), connect.NewRequest(&dsecv1.ExecRequest{SandboxId: sb.GetId(), Command: "true"}))
	if err == nil {
		// Server streams report errors on the first Receive.
		stream, _ := d.Clients.Sandboxes.Exec(context.Background(), connect.NewRequest(&dsecv1.ExecRequest{SandboxId: sb.GetId(), Command: "true"}))
		for stream.Receive() {
		}
		err = stream.Err()
	}
	if connect.CodeOf(err) != connect.CodeFailedPrecondition {
		t.Fatalf("exec in a deleted sandbox: %v, want failed_precondition", err)
	}
	// No directory of the sandbox remains.
	if _, err := os.Stat(filepath.Join(d.Root, "sandboxes", sb.GetId())); !os.IsNotExist(err) {
		t.Fatalf("sandbox dir still there: %v", err)
	}
	if _, err := os.Stat(filepath.Join(d.Root, "upper", sb.GetId())); !os.IsNotExist(err) {
		t.Fatalf("upper dir still there: %v", err)
	}
}

// checkExec: sandbox id, created with the environment GREETING=hi, keeps
// a command's stdout and stderr apart, reports its exit code, takes stdin,
// and runs in the asked directory, as the asked user, with the asked
// environment. TestOtherIsolations runs it under gVisor and in a microVM.
func checkExec(t *testing.T, d *testutil.Daemon, id string) {
	t.Helper()
	r := sh(t, d, id, `echo out-$GREETING; echo err >&2; exit 3`)
	if r.stdout != "out-hi\n" || r.stderr != "err\n" || r.exit.GetExitCode() != 3 ||
		r.exit.GetStatus() != dsecv1.ExitStatus_EXIT_STATUS_NONZERO {
		t.Fatalf("separate streams and exit code: %s", r)
	}
	r = execReq(t, d, &dsecv1.ExecRequest{SandboxId: id, Argv: []string{"cat"}, Stdin: []byte("from stdin")})
	if r.stdout != "from stdin" {
		t.Fatalf("stdin: %s", r)
	}
	r = execReq(t, d, &dsecv1.ExecRequest{SandboxId: id, Command: "pwd; id -u; echo $X", Cwd: "/tmp", User: "nobody", Env: map[string]string{"X": "y"}})
	if r.stdout != "/tmp\n65534\ny\n" {
		t.Fatalf("cwd, user and env: %s", r)
	}
}

func TestBatchCreateIsIdempotent(t *testing.T) {
	d := startDaemon(t)
	req := &dsecv1.CreateRequest{Spec: &dsecv1.SandboxSpec{Environment: env, Labels: map[string]string{"batch": "1"}}, Count: 4, IdempotencyKey: "key-1"}
	first, err := d.Clients.Sandboxes.Create(context.Background(), connect.NewRequest(req))
	if err != nil {
		t.Fatal(err)
	}
	for _, sb := range first.Msg.GetSandboxes() {
		id := sb.GetId()
		t.Cleanup(func() {
			d.Clients.Sandboxes.Delete(context.Background(), connect.NewRequest(&dsecv1.DeleteRequest{Id: id}))
		})
	}
	again, err := d.Clients.Sandboxes.Create(context.Background(), connect.NewRequest(req))
	if err != nil {
		t.Fatal(err)
	}
	if len(first.Msg.GetSandboxes()) != 4 || len(again.Msg.GetSandboxes()) != 4 {
		t.Fatalf("batch sizes %d and %d, want 4", len(first.Msg.GetSandboxes()), len(again.Msg.GetSandboxes()))
	}
	for i := range 4 {
		if first.Msg.GetSandboxes()[i].GetId() != again.Msg.GetSandboxes()[i].GetId() {
			t.Fatalf("retried create made new sandboxes: %v vs %v", first.Msg, again.Msg)
		}
	}
	list, _ := d.Clients.Sandboxes.List(context.Background(), connect.NewRequest(&dsecv1.ListRequest{Labels: map[string]string{"batch": "1"}}))
	if n := len(list.Msg.GetSandboxes()); n != 4 {
		t.Fatalf("%d sandboxes exist, want 4", n)
	}
	req.Spec.Cpus = 0.5
	if _, err := d.Clients.Sandboxes.Create(context.Background(), connect.NewRequest(req)); connect.CodeOf(err) != connect.CodeInvalidArgument {
		t.Fatalf("same key, other request: %v, want invalid_argument", err)
	}
}

// TestCreateRefusesBadInput: a create the node can never make is refused
// with the kind that says so, never ResourceExhausted, which callers (the
// SDKs' Overloaded) retry as overload for ever.
func TestCreateRefusesBadInput(t *testing.T) {
	d := startDaemon(t)
	for name, tc := range map[string]struct {
		spec *dsecv1.SandboxSpec
		code connect.Code
		says string
	}{
		"unknown environment": {&dsecv1.SandboxSpec{Environment: "nope:1"}, connect.CodeNotFound, "nope:1"},
		"negative memory":     {&dsecv1.SandboxSpec{Environment: env, MemoryMb: -1}, connect.CodeInvalidArgument, "negative"},
		"too many cpus":       {&dsecv1.SandboxSpec{Environment: env, Cpus: 1000}, connect.CodeInvalidArgument, "--max-cpus"},
		"bad CIDR rule":       {&dsecv1.SandboxSpec{Environment: env, NetworkRules: map[string]bool{"10.0.0.0/33": true}}, connect.CodeInvalidArgument, "10.0.0.0/33"},
		"unknown service":     {&dsecv1.SandboxSpec{Environment: env, NetworkRules: map[string]bool{"no-such-service": true}}, connect.CodeInvalidArgument, "no-such-service"},
		"IPv6 rule":           {&dsecv1.SandboxSpec{Environment: env, NetworkRules: map[string]bool{"2001:db8::/32": true}}, connect.CodeInvalidArgument, `rule "2001:db8::/32"`},
		"IPv6 default route":  {&dsecv1.SandboxSpec{Environment: env, NetworkRules: map[string]bool{"::/0": true}}, connect.CodeInvalidArgument, `rule "::/0"`},
	} {
		_, err := d.Clients.Sandboxes.Create(context.Background(), connect.NewRequest(&dsecv1.CreateRequest{Spec: tc.spec}))
		if connect.CodeOf(err) != tc.code || !strings.Contains(err.Error(), tc.says) {
			t.Errorf("%s: %v: want %v naming %q", name, err, tc.code, tc.says)
		}
	}
	list, _ := d.Clients.Sandboxes.List(context.Background(), connect.NewRequest(&dsecv1.ListRequest{}))
	if n := len(list.Msg.GetSandboxes()); n != 0 {
		t.Fatalf("refused creates left %d sandboxes", n)
	}
}

// A create over a limit of the node is refused with the limit and the flag
// that raises it, for memory as for CPUs: by default the node's physical
// memory bounds what one sandbox may ask for.
func TestCreateOverNodeLimits(t *testing.T) {
	d := startDaemon(t, "--no-network")
	total, err := sandbox.MemTotalMB()
	if err != nil {
		t.Fatal(err)
	}
	_, err = d.Clients.Sandboxes.Create(context.Background(), connect.NewRequest(&dsecv1.CreateRequest{
		Spec: &dsecv1.SandboxSpec{Environment: env, MemoryMb: 1_000_000_000}}))
	want := fmt.Sprintf("memory_mb 1000000000 is over the node's limit of %d (dsecd --max-memory-mb)", total)
	if connect.CodeOf(err) != connect.CodeInvalidArgument || !strings.Contains(err.Error(), want) {
		t.Fatalf("create with memory_mb 10^9: %v; want invalid_argument containing %q", err, want)
	}
	_, errOut, code := d.CLI("", "create", "--cpus", "1000", env)
	if code == 0 || !strings.Contains(errOut, "is over the node's limit of") || !strings.Contains(errOut, "dsecd --max-cpus") {
		t.Fatalf("dsec create --cpus 1000: code %d, stderr %q; want the limit and its flag", code, errOut)
	}
	// The limit itself is accepted.
	create(t, d, &dsecv1.SandboxSpec{MemoryMb: total})
}

// A full node refuses a create with ResourceExhausted and names the flag
// that raises its maximum.
func TestCreateOnFullNode(t *testing.T) {
	d := startDaemon(t, "--no-network", "--max-sandboxes", "1")
	id, errOut, code := d.CLI("", "create", env)
	if code != 0 {
		t.Fatalf("first create: code %d, stderr %q", code, errOut)
	}
	t.Cleanup(func() { d.CLI("", "rm", strings.TrimSpace(id)) })
	_, errOut, code = d.CLI("", "create", env)
	want := []string{"node t1 holds its maximum of 1 sandboxes (dsecd --max-sandboxes raises it)"}
	if testutil.ClusterMode() {
		// The apiserver's placement knows the edge is full, in the edge's
		// words once its next report has come, else in its own.
		want = []string{"full (1 node, 1 of 1 sandboxes)", "dsecd --max-sandboxes raises"}
	}
	for _, w := range append(want, "resource_exhausted") {
		if code == 0 || !strings.Contains(errOut, w) {
			t.Fatalf("second create: code %d, stderr %q; want resource_exhausted containing %q", code, errOut, want)
		}
	}
}

// dsecd refuses at once to start with an agent that cannot run in a
// sandbox, saying how to build one that can, instead of serving creates
// that each time out waiting for it.
func TestDynamicAgentRefused(t *testing.T) {
	onePassOnly(t)
	bin := testutil.Binaries(t)
	agent := testutil.DynamicExecutable(t)
	root, err := os.MkdirTemp("", "dsec-test-root-")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		// A dsecd that got past the check mounted and started things.
		if ents, _ := os.ReadDir(root); len(ents) > 0 {
			if out, err := exec.Command(filepath.Join(bin, "dsecd"), "teardown", "--root", root, "--no-network").CombinedOutput(); err != nil {
				t.Errorf("dsecd teardown: %v\n%s", err, out)
			}
		}
		os.RemoveAll(root)
	})
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	cmd := exec.CommandContext(ctx, filepath.Join(bin, "dsecd"), "--root", root, "--listen", "none", "--no-network", "--agent", agent)
	out, err := cmd.CombinedOutput()
	if ctx.Err() != nil {
		t.Fatalf("dsecd with a dynamically linked agent was still running after 30 s:\n%s", out)
	}
	if err == nil {
		t.Fatalf("dsecd with a dynamically linked agent exited 0:\n%s", out)
	}
	for _, want := range []string{"dsecd: check agent " + agent + ": it is dynamically linked", "make build", "CGO_ENABLED=0"} {
		if !strings.Contains(string(out), want) {
			t.Errorf("dsecd said %q; want it to say %q", out, want)
		}
	}
	if ents, _ := os.ReadDir(root); len(ents) != 0 {
		t.Errorf("dsecd made %d entries in its root before refusing", len(ents))
	}
}

// A node without networking refuses network rules rather than run a
// sandbox with a different network than asked.
func TestNetworkRulesRefusedWithoutNetwork(t *testing.T) {
	d := startDaemon(t, "--no-network")
	_, err := d.Clients.Sandboxes.Create(context.Background(), connect.NewRequest(&dsecv1.CreateRequest{
		Spec: &dsecv1.SandboxSpec{Environment: env, NetworkRules: map[string]bool{"pypi": true}}}))
	if connect.CodeOf(err) != connect.CodeFailedPrecondition {
		t.Fatalf("create with rules on a node without networking: %v, want failed_precondition", err)
	}
	list, _ := d.Clients.Sandboxes.List(context.Background(), connect.NewRequest(&dsecv1.ListRequest{}))
	if n := len(list.Msg.GetSandboxes()); n != 0 {
		t.Fatalf("the refused create left %d sandboxes", n)
	}
}

func TestIsolation(t *testing.T) {
	d := startDaemon(t)
	a := create(t, d, &dsecv1.SandboxSpec{Hostname: "box-a"})
	b := create(t, d, nil)
	mustSh(t, d, a.GetId(), "echo secret > /tmp/a-only")

	// Host and other sandboxes' files are invisible, and writes stay in a's upper.
	out := mustSh(t, d, b.GetId(), "ls /tmp; test -e "+d.Root+" && echo host-root-visible; echo done")
	if strings.Contains(out, "a-only") || strings.Contains(out, "host-root-visible") {
		t.Fatalf("sandbox b sees a's or the host's files: %q", out)
	}
	upperFile := filepath.Join(d.Root, "upper", a.GetId(), "upper", "tmp", "a-only")
	if data, err := os.ReadFile(upperFile); err != nil || string(data) != "secret\n" {
		t.Fatalf("write did not land in a's upper: %v %q", err, data)
	}
	// Processes: only the command's own; neither the host's nor the agent
	// (pid 1, hidden from the sandbox) is listed.
	out = mustSh(t, d, a.GetId(), "ps -o pid,args")
	if strings.Contains(out, "dsecd") || strings.Contains(out, "dsec-agent") || strings.Count(strings.TrimSpace(out), "\n") > 3 {
		t.Fatalf("processes visible from inside:\n%s", out)
	}
	// Network: loopback only.
	out = mustSh(t, d, a.GetId(), "cat /proc/net/dev")
	if strings.Count(out, ":") != 1 || !strings.Contains(out, "lo:") {
		t.Fatalf("interfaces other than lo: %q", out)
	}
	if got := strings.TrimSpace(mustSh(t, d, a.GetId(), "hostname")); got != "box-a" {
		t.Fatalf("hostname %q, want box-a", got)
	}
	// The host's dsec API is not reachable from inside.
	r := sh(t, d, a.GetId(), "wget -q -T 2 -O- http://"+d.Addr+"/healthz")
	if r.exit.GetStatus() == dsecv1.ExitStatus_EXIT_STATUS_OK {
		t.Fatalf("sandbox reached the dsec API: %s", r)
	}
}

func TestLimits(t *testing.T) {
	d := startDaemon(t)
	sb := create(t, d, &dsecv1.SandboxSpec{MemoryMb: 64, Pids: 64, DiskMb: 32, Cpus: 0.5})
	id := sb.GetId()

	t.Run("fork bomb stops at the pids limit", func(t *testing.T) {
		r := execReq(t, d, &dsecv1.ExecRequest{SandboxId: id, Command: `f(){ f | f & }; f; sleep 10`, TimeoutSeconds: 4})
		if r.exit.GetStatus() != dsecv1.ExitStatus_EXIT_STATUS_TIMEOUT {
			t.Fatalf("fork bomb: %s, want timeout", r)
		}
		events, err := os.ReadFile(filepath.Join("/sys/fs/cgroup/pids", d.HostNames().CgroupParent, id, "cmds", "pids.events"))
		if err != nil {
			t.Fatal(err)
		}
		if f := strings.Fields(string(events)); len(f) != 2 || f[1] == "0" {
			t.Fatalf("the pids limit was never hit: %q", events)
		}
		mustSh(t, d, id, "true") // the sandbox, its agent and the node live on
	})
	t.Run("memory hog is OOM-killed and reported", func(t *testing.T) {
		r := execReq(t, d, &dsecv1.ExecRequest{SandboxId: id, Command: `head -c 300m /dev/zero | tail`, TimeoutSeconds: 30})
		if r.exit.GetStatus() != dsecv1.ExitStatus_EXIT_STATUS_OOM {
			t.Fatalf("memory hog: %s, want OOM", r)
		}
		mustSh(t, d, id, "true")
	})
	t.Run("disk fills only to the writable-layer limit", func(t *testing.T) {
		r := sh(t, d, id, `dd if=/dev/zero of=/big bs=1M count=100`)
		if r.exit.GetStatus() == dsecv1.ExitStatus_EXIT_STATUS_OK {
			t.Fatalf("wrote 100 MiB into a 32 MiB writable layer: %s", r)
		}
		out := mustSh(t, d, id, "ls -l /big | awk '{print $5}'; rm /big; echo ok > /after")
		size := strings.Fields(out)[0]
		if len(size) > 8 { // under 100 MB
			t.Fatalf("file grew to %s bytes", size)
		}
	})
	t.Run("yes nobody follows costs no memory and its gap is flagged", func(t *testing.T) {
		// A stream that follows a command gets every byte of it (the
		// 30,000,000-byte cat of TestCLIFirstHour); the output limit bounds
		// what the agent keeps of a command nobody follows, a background
		// yes, and an attach afterwards is told what it missed.
		ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
		defer cancel()
		sc := d.Clients.Sandboxes
		bg, err := sc.Exec(ctx, connect.NewRequest(&dsecv1.ExecRequest{SandboxId: id, Argv: []string{"yes"}, Background: true,
			Tag: "yes", TimeoutSeconds: 2, OutputLimitBytes: 1 << 20}))
		if err != nil {
			t.Fatal(err)
		}
		if !bg.Receive() || bg.Msg().GetStarted() == nil {
			t.Fatalf("background yes did not start: %v", bg.Err())
		}
		bg.Close()
		// Attach once it has exited: an attach while yes runs would follow
		// its live output (always ready) and carry more than the kept part.
		for {
			ps, err := sc.ListProcesses(ctx, connect.NewRequest(&dsecv1.ListProcessesRequest{SandboxId: id}))
			if err != nil {
				t.Fatal(err)
			}
			i := slices.IndexFunc(ps.Msg.GetProcesses(), func(p *dsecv1.ProcessInfo) bool { return p.GetTag() == "yes" })
			if i < 0 {
				t.Fatal("the background yes is not listed")
			}
			if !ps.Msg.GetProcesses()[i].GetRunning() {
				break
			}
			if ctx.Err() != nil {
				t.Fatal("the background yes never exited")
			}
			time.Sleep(200 * time.Millisecond)
		}
		at, err := sc.Attach(ctx, connect.NewRequest(&dsecv1.AttachRequest{SandboxId: id, Tag: "yes", NoFollow: true}))
		if err != nil {
			t.Fatal(err)
		}
		var exit *dsecv1.ExecExited
		var kept, dropped int64
		for at.Receive() {
			switch e := at.Msg().Event.(type) {
			case *dsecv1.ExecEvent_Stdout:
				kept += int64(len(e.Stdout))
			case *dsecv1.ExecEvent_Dropped:
				if !e.Dropped.GetStderr() {
					dropped += e.Dropped.GetBytes()
				}
			case *dsecv1.ExecEvent_Exited:
				exit = e.Exited
			}
		}
		if err := at.Err(); err != nil {
			t.Fatalf("attach: %v", err)
		}
		at.Close()
		if exit == nil {
			t.Fatal("the background yes never exited")
		}
		if exit.GetStatus() != dsecv1.ExitStatus_EXIT_STATUS_TIMEOUT {
			t.Errorf("yes: status %s, want timeout", exit.GetStatus())
		}
		produced := exit.GetStdoutBytes()
		if kept != 1<<20 || !exit.GetStdoutTruncated() || produced <= 1<<20 || dropped != produced-kept {
			t.Fatalf("yes: kept %d, dropped %d, produced %d, truncated=%v; want 1 MiB kept and the rest dropped and flagged",
				kept, dropped, produced, exit.GetStdoutTruncated())
		}
		mustSh(t, d, id, "true")
	})
}

func TestTimeoutKillsTree(t *testing.T) {
	d := startDaemon(t)
	sb := create(t, d, nil)
	checkTimeoutKillsTree(t, d, sb.GetId())
}

// checkTimeoutKillsTree: a command's timeout ends it and every process it
// started, those that left its session included.
func checkTimeoutKillsTree(t *testing.T, d *testutil.Daemon, id string) {
	t.Helper()
	r := execReq(t, d, &dsecv1.ExecRequest{SandboxId: id,
		Command: `setsid sh -c 'sleep 1000' & (sleep 999 &) ; sleep 998`, TimeoutSeconds: 1})
	if r.exit.GetStatus() != dsecv1.ExitStatus_EXIT_STATUS_TIMEOUT {
		t.Fatalf("status %s, want timeout", r)
	}
	deadline := time.Now().Add(5 * time.Second)
	for {
		var left []string
		for _, line := range strings.Split(mustSh(t, d, id, "ps -o args"), "\n") {
			if strings.HasPrefix(strings.TrimSpace(line), "sleep ") {
				left = append(left, line)
			}
		}
		if len(left) == 0 {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("processes survived the timeout: %q", left)
		}
		time.Sleep(100 * time.Millisecond)
	}
}

func TestAgentChannelUnreachable(t *testing.T) {
	d := startDaemon(t)
	sb := create(t, d, nil)
	checkAgentProtected(t, d, sb.GetId())
}

// checkAgentProtected: root in sandbox id cannot reach its agent (pid 1's
// descriptors, environment, memory; killing it), sees no socket of the
// platform, and cannot hijack the platform's shell.
func checkAgentProtected(t *testing.T, d *testutil.Daemon, id string) {
	t.Helper()
	for _, c := range []struct{ name, cmd string }{
		{"list /proc/1/fd", "ls /proc/1/fd"},
		{"read /proc/1/environ", "cat /proc/1/environ"},
		{"kill pid 1", "kill -9 1 && sleep 1 && kill -0 1 && cat /proc/1/status | grep -q zombie"},
		{"ptrace pid 1", "cat /proc/1/mem"},
	} {
		r := sh(t, d, id, c.cmd)
		if r.exit.GetStatus() == dsecv1.ExitStatus_EXIT_STATUS_OK {
			t.Errorf("%s succeeded: %s", c.name, r)
		}
	}
	// No socket file of the platform is visible inside.
	out := mustSh(t, d, id, "find / -xdev -type s 2>/dev/null; echo end")
	if strings.TrimSpace(out) != "end" {
		t.Errorf("socket files visible inside: %q", out)
	}
	// SIGTERM and friends are ignored by the agent as namespace init.
	for _, sig := range []string{"TERM", "INT", "HUP", "QUIT", "USR1"} {
		sh(t, d, id, "kill -"+sig+" 1")
	}
	mustSh(t, d, id, "true")
	// Overwriting /bin/sh does not hijack the platform's shell commands.
	mustSh(t, d, id, `rm /bin/sh; printf '#!/bin/busybox sh\necho HIJACKED\n' > /bin/sh; chmod +x /bin/sh`)
	if out := mustSh(t, d, id, "echo clean"); out != "clean\n" {
		t.Fatalf("shell command after /bin/sh was replaced: %q", out)
	}
	if out := mustSh(t, d, id, "ls -l /.dsec/bin/sh >/dev/null && echo x > /.dsec/bin/sh 2>/dev/null || echo refused"); !strings.Contains(out, "refused") {
		t.Fatalf("the platform shell is writable: %q", out)
	}
}

func TestDaemonKillAndReadopt(t *testing.T) {
	d := startDaemon(t)
	a := create(t, d, nil)
	b := create(t, d, nil)
	// A background process keeps running across the daemon's death.
	mustSh(t, d, a.GetId(), "sh -c 'while true; do date +%s >> /tmp/ticks; sleep 0.2; done' >/dev/null 2>&1 &")
	d.Kill()
	// While the daemon is down, b's container dies.
	out, err := exec.Command("runc", "--root", filepath.Join(d.Root, "runtime", "runc"), "kill", b.GetId(), "KILL").CombinedOutput()
	if err != nil {
		t.Fatalf("kill b behind the daemon's back: %v %s", err, out)
	}
	time.Sleep(500 * time.Millisecond)
	d.Start()

	got, err := d.Clients.Sandboxes.Get(context.Background(), connect.NewRequest(&dsecv1.GetRequest{Id: a.GetId()}))
	if err != nil || got.Msg.GetState() != dsecv1.State_STATE_RUNNING {
		t.Fatalf("a after restart: %v %v", got, err)
	}
	n1 := mustSh(t, d, a.GetId(), "wc -l < /tmp/ticks")
	time.Sleep(time.Second)
	n2 := mustSh(t, d, a.GetId(), "wc -l < /tmp/ticks")
	if n1 == n2 {
		t.Fatalf("a's background process stopped: %s then %s ticks", n1, n2)
	}
	gb, err := d.Clients.Sandboxes.Get(context.Background(), connect.NewRequest(&dsecv1.GetRequest{Id: b.GetId()}))
	if err != nil || gb.Msg.GetState() != dsecv1.State_STATE_FAILED {
		t.Fatalf("b after restart: %v %v, want failed", gb, err)
	}
	if _, err := os.Stat(filepath.Join(d.Root, "upper", b.GetId())); !os.IsNotExist(err) {
		t.Fatalf("b's upper was not reaped: %v", err)
	}
}

// TestTTLAndIdle: TTLs and idle timeouts end sandboxes; a command still
// running keeps one from being idle; and an agent killed -9 fails its
// sandbox (agent_lost), found from its channel's end with no ping asking.
func TestTTLAndIdle(t *testing.T) {
	d := startDaemon(t)
	ttl := create(t, d, &dsecv1.SandboxSpec{TtlSeconds: 2, IdleTimeoutSeconds: -1})
	idle := create(t, d, &dsecv1.SandboxSpec{IdleTimeoutSeconds: 2})
	busy := create(t, d, &dsecv1.SandboxSpec{IdleTimeoutSeconds: 2})
	lost := create(t, d, &dsecv1.SandboxSpec{IdleTimeoutSeconds: -1})
	// A command still running counts as activity.
	execReq(t, d, &dsecv1.ExecRequest{SandboxId: busy.GetId(), Command: "sleep 8", Background: true})
	killAgent(t, d, lost.GetId())

	wait := func(id string, state dsecv1.State, want dsecv1.Reason) {
		deadline := time.Now().Add(15 * time.Second)
		for time.Now().Before(deadline) {
			got, err := d.Clients.Sandboxes.Get(context.Background(), connect.NewRequest(&dsecv1.GetRequest{Id: id}))
			if err == nil && got.Msg.GetState() == state {
				if got.Msg.GetReason() != want {
					t.Fatalf("%s %s for %s, want %s", id, state, got.Msg.GetReason(), want)
				}
				return
			}
			time.Sleep(200 * time.Millisecond)
		}
		t.Fatalf("%s did not reach %s for %s", id, state, want)
	}
	wait(lost.GetId(), dsecv1.State_STATE_FAILED, dsecv1.Reason_REASON_AGENT_LOST)
	wait(ttl.GetId(), dsecv1.State_STATE_STOPPED, dsecv1.Reason_REASON_TTL)
	wait(idle.GetId(), dsecv1.State_STATE_STOPPED, dsecv1.Reason_REASON_IDLE)
	got, _ := d.Clients.Sandboxes.Get(context.Background(), connect.NewRequest(&dsecv1.GetRequest{Id: busy.GetId()}))
	if got.Msg.GetState() != dsecv1.State_STATE_RUNNING {
		t.Fatalf("a sandbox with a running command was reaped as idle: %v", got.Msg)
	}
}

// killAgent sends SIGKILL to sandbox id's agent, behind the daemon's back.
func killAgent(t *testing.T, d *testutil.Daemon, id string) {
	t.Helper()
	out, err := exec.Command("runc", "--root", filepath.Join(d.Root, "runtime", "runc"), "state", id).Output()
	if err != nil {
		t.Fatalf("runc state %s: %v", id, err)
	}
	var st struct{ Pid int }
	if err := json.Unmarshal(out, &st); err != nil || st.Pid <= 0 {
		t.Fatalf("runc state %s: %q: %v", id, out, err)
	}
	if err := syscall.Kill(st.Pid, syscall.SIGKILL); err != nil {
		t.Fatalf("kill -9 the agent of %s (pid %d): %v", id, st.Pid, err)
	}
}

func TestCLIRunExitCodes(t *testing.T) {
	d := startDaemon(t)
	out, _, code := d.CLI("", "run", env, "--", "sh", "-c", "echo hello; exit 7")
	if out != "hello\n" || code != 7 {
		t.Fatalf("run: %q code %d", out, code)
	}
	_, errOut, code := d.CLI("", "run", "--timeout", "1s", env, "--", "sleep", "30")
	if code != 124 || !strings.Contains(errOut, "timed out") {
		t.Fatalf("timeout: code %d, stderr %q", code, errOut)
	}
	_, errOut, code = d.CLI("", "run", "--memory-mb", "32", env, "--", "sh", "-c", "head -c 200m /dev/zero | tail")
	if code != 137 || !strings.Contains(errOut, "OOM") {
		t.Fatalf("oom: code %d, stderr %q", code, errOut)
	}
	// -i streams stdin in chunks: more than one exec request may carry.
	big := strings.Repeat("0123456789abcdef", (70<<20)/16)
	out, errOut, code = d.CLI(big, "run", "-i", env, "--", "wc", "-c")
	if strings.TrimSpace(out) != strconv.Itoa(len(big)) || code != 0 {
		t.Fatalf("run -i with %d bytes: %q code %d, stderr %q", len(big), out, code, errOut)
	}
	out, _, code = d.CLI("line one\nline two\n", "run", "-i", env, "--", "sh", "-c", "read first; echo got $first; exit 3")
	if out != "got line one\n" || code != 3 {
		t.Fatalf("run -i, command reads part of stdin: %q code %d", out, code)
	}
	// exec -d -i streams too, and all of stdin is in before the process ID
	// is printed.
	id, errOut, code := d.CLI("", "create", env)
	id = strings.TrimSpace(id)
	if code != 0 {
		t.Fatalf("create: %s", errOut)
	}
	pid, errOut, code := d.CLI(big, "exec", "-d", "-i", id, "--", "sh", "-c", "wc -c > /tmp/n.part; mv /tmp/n.part /tmp/n")
	if code != 0 || strings.TrimSpace(pid) == "" {
		t.Fatalf("exec -d -i: %q code %d, stderr %q", pid, code, errOut)
	}
	counted := ""
	for deadline := time.Now().Add(20 * time.Second); time.Now().Before(deadline); time.Sleep(50 * time.Millisecond) {
		if out, _, code := d.CLI("", "exec", id, "--", "cat", "/tmp/n"); code == 0 {
			counted = strings.TrimSpace(out)
			break
		}
	}
	if counted != strconv.Itoa(len(big)) {
		t.Fatalf("exec -d -i with %d bytes: the command counted %q", len(big), counted)
	}
	if _, errOut, code := d.CLI("", "rm", id); code != 0 {
		t.Fatalf("rm: %s", errOut)
	}
	_, errOut, code = d.CLI("", "run", "nope:1", "--", "true")
	if code == 0 || errOut == "" {
		t.Fatalf("unknown env: code %d, stderr %q", code, errOut)
	}
	list, _, _ := d.CLI("", "ls", "--state", "running")
	if strings.Count(list, "sb-") != 0 {
		t.Fatalf("dsec run left sandboxes: %s", list)
	}
}

// TestAgentThreadsStayOut checks the v1 path of starting commands: the
// agent's forking thread joins a command's cgroups only for the fork, so
// after many commands every agent thread is back in the sandbox's own
// cgroups, where freezing or limiting a command never reaches it.
func TestAgentThreadsStayOut(t *testing.T) {
	d := startDaemon(t)
	sb := create(t, d, nil)
	for i := 0; i < 30; i++ {
		mustSh(t, d, sb.GetId(), "true")
	}
	out, err := exec.Command("runc", "--root", filepath.Join(d.Root, "runtime", "runc"), "state", sb.GetId()).Output()
	if err != nil {
		t.Fatalf("runc state: %v", err)
	}
	var st struct{ Pid int }
	if err := json.Unmarshal(out, &st); err != nil || st.Pid <= 0 {
		t.Fatalf("runc state %s: %v", out, err)
	}
	tasks, err := os.ReadDir(fmt.Sprintf("/proc/%d/task", st.Pid))
	if err != nil {
		t.Fatal(err)
	}
	for _, task := range tasks {
		cg, err := os.ReadFile(fmt.Sprintf("/proc/%d/task/%s/cgroup", st.Pid, task.Name()))
		if err != nil {
			continue // the thread ended
		}
		for _, line := range strings.Split(string(cg), "\n") {
			if strings.Contains(line, "/dsec-") || strings.HasSuffix(line, "/cmds") {
				t.Errorf("agent thread %s is in a command's cgroup: %s", task.Name(), line)
			}
		}
	}
}

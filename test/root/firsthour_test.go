package root

import (
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"connectrpc.com/connect"

	dsecv1 "dsec.dev/dsec/api/gen/dsec/v1"
	"dsec.dev/dsec/internal/testutil"
)

// copyIn writes a host file into a sandbox with the given mode.
func copyIn(t *testing.T, d *testutil.Daemon, id, hostPath, path string, mode uint32) {
	t.Helper()
	data, err := os.ReadFile(hostPath)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	if _, err := d.Clients.Sandboxes.WriteFile(ctx, connect.NewRequest(&dsecv1.WriteFileRequest{
		SandboxId: id, Path: path, Data: data, Mode: mode, MakeParents: true})); err != nil {
		t.Fatalf("write %s into %s: %v", path, id, err)
	}
}

// TestHostFiles: a sandbox whose image has no /etc/hosts (the busybox base
// has none) still resolves localhost and its own host name, as a Docker
// container does, so test suites that serve on localhost and dial it pass.
func TestHostFiles(t *testing.T) {
	d := startDaemon(t)
	probe := netprobeBinary(t)

	for _, tc := range []struct {
		name, hostname string
	}{
		{"default host name", ""},
		{"host name asked for", "box-1"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			sb := create(t, d, &dsecv1.SandboxSpec{Hostname: tc.hostname})
			copyIn(t, d, sb.GetId(), probe, "/usr/local/bin/netprobe", 0o755)
			want := tc.hostname
			if want == "" {
				want = sb.GetId()
			}
			if got := strings.TrimSpace(mustSh(t, d, sb.GetId(), "hostname")); got != want {
				t.Fatalf("hostname = %q, want %q", got, want)
			}
			if got := mustSh(t, d, sb.GetId(), "cat /etc/hostname"); got != want+"\n" {
				t.Errorf("/etc/hostname = %q, want %q", got, want+"\n")
			}
			hosts := mustSh(t, d, sb.GetId(), "cat /etc/hosts")
			for _, line := range []string{"127.0.0.1\tlocalhost\n", "::1\tlocalhost ip6-localhost ip6-loopback\n", "127.0.1.1\t" + want + "\n"} {
				if !strings.Contains(hosts, line) {
					t.Errorf("/etc/hosts lacks %q:\n%s", line, hosts)
				}
			}
			if r := sh(t, d, sb.GetId(), "netprobe self localhost"); r.exit.GetStatus() != dsecv1.ExitStatus_EXIT_STATUS_OK ||
				!strings.HasPrefix(r.stdout, "connected to ") {
				t.Errorf("dial localhost:PORT from a program listening on loopback: %s", r)
			}
			if got := strings.TrimSpace(mustSh(t, d, sb.GetId(), "netprobe resolve "+want)); got != "127.0.1.1" {
				t.Errorf("the sandbox's own host name resolves to %q, want 127.0.1.1", got)
			}
			// The sandbox owns the files: a test may add names of its own.
			mustSh(t, d, sb.GetId(), "echo '127.0.0.1 db.internal' >> /etc/hosts")
			if r := sh(t, d, sb.GetId(), "netprobe self db.internal"); r.exit.GetStatus() != dsecv1.ExitStatus_EXIT_STATUS_OK {
				t.Errorf("dial a name added to /etc/hosts: %s", r)
			}
		})
	}
}

// TestCLIFirstHour walks the CLI as a new user does, through a real node:
// a typo'd environment, a command that cannot start, background commands
// and the commands that find, follow and kill them, and ls after rm.
func TestCLIFirstHour(t *testing.T) {
	d := startDaemon(t)

	// A typo: said once, with the nearest names.
	_, errOut, code := d.CLI("", "run", "busybox:tset", "--", "true")
	if code == 0 || !strings.Contains(errOut, "no layer or image is named busybox:tset; did you mean busybox:test?") ||
		strings.Count(errOut, "busybox:tset") != 1 {
		t.Errorf("run on a typo'd environment: exit %d, stderr %q", code, errOut)
	}
	// A command that cannot start: "could not start" once.
	_, errOut, code = d.CLI("", "run", env, "--", "/no/such/program")
	if code != 127 || strings.Count(errOut, "could not start") != 1 {
		t.Errorf("run of a missing program: exit %d, stderr %q", code, errOut)
	}

	// A rule no node enforces: the request's fault, named, not a full
	// fleet (which scripts and the SDKs retry as overload).
	_, errOut, code = d.CLI("", "create", "--network-rules", `{"::/0": true}`, env)
	if code == 0 || !strings.Contains(errOut, `rule "::/0"`) || !strings.HasSuffix(errOut, "(invalid_argument)\n") {
		t.Errorf("create with an IPv6 rule: exit %d, stderr %q", code, errOut)
	}

	out, errOut, code := d.CLI("", "create", env)
	if code != 0 {
		t.Fatalf("create: %s", errOut)
	}
	id := strings.TrimSpace(out)
	t.Cleanup(func() { d.CLI("", "rm", id) })

	// The binary says which build it is.
	if out, errOut, code := d.CLI("", "--version"); code != 0 || !strings.HasPrefix(out, "dsec ") {
		t.Errorf("dsec --version: %q %q %d", out, errOut, code)
	}
	// What follows the ID is the command, its flags included (docker
	// exec's rule).
	if out, errOut, code := d.CLI("", "exec", id, "ls", "-d", "/tmp"); code != 0 || out != "/tmp\n" {
		t.Errorf("exec ID ls -d /tmp: %q %q %d", out, errOut, code)
	}
	// A mistyped ID names no sandbox, and the kind is said once.
	if _, errOut, code := d.CLI("", "inspect", id[:len(id)-1]); code == 0 || errOut != "dsec: no sandbox "+id[:len(id)-1]+" (not_found)\n" {
		t.Errorf("inspect of a mistyped ID: %q %d", errOut, code)
	}

	// exec takes --env, as run and create do.
	if out, errOut, code := d.CLI("", "exec", "--env", "GREETING=hi", id, "--", "sh", "-c", "echo $GREETING"); code != 0 || out != "hi\n" {
		t.Errorf("exec --env: %q %q %d", out, errOut, code)
	}

	// A background command: ps lists it, attach --no-follow returns what it
	// printed so far at once, kill ends it, attach then gives its end.
	out, errOut, code = d.CLI("", "exec", "-d", "--tag", "ticker", id, "--", "sh", "-c", "echo first; while :; do echo tick; sleep 0.1; done")
	if code != 0 {
		t.Fatalf("exec -d: %s", errOut)
	}
	pid := strings.TrimSpace(out)
	if !strings.HasPrefix(pid, "p-") {
		t.Fatalf("exec -d printed %q, want a process ID", out)
	}
	testutil.WaitFor(t, 10*time.Second, "the ticker to print", func() bool {
		out, _, _ := d.CLI("", "attach", "--no-follow", id, pid)
		return strings.Count(out, "tick") >= 2
	})
	out, errOut, code = d.CLI("", "ps", id)
	if code != 0 || !strings.Contains(out, pid) || !strings.Contains(out, "ticker") || !strings.Contains(out, "running") {
		t.Errorf("ps: %q %q %d", out, errOut, code)
	}
	start := time.Now()
	out, errOut, code = d.CLI("", "attach", "--no-follow", id, "ticker")
	if code != 0 || !strings.HasPrefix(out, "first\ntick\n") || time.Since(start) > 5*time.Second {
		t.Errorf("attach --no-follow by tag of a running process: %q %q %d after %s", out, errOut, code, time.Since(start))
	}
	if _, errOut, code := d.CLI("", "kill", id, "ticker"); code != 0 {
		t.Fatalf("kill: %s", errOut)
	}
	out, errOut, code = d.CLI("", "attach", id, pid)
	if code != 137 || !strings.HasPrefix(out, "first\ntick\n") || !strings.Contains(errOut, "killed by signal 9") {
		t.Errorf("attach after kill: exit %d, stdout %q, stderr %q", code, out, errOut)
	}
	if out, _, _ := d.CLI("", "ps", id); !strings.Contains(out, "killed (signal 9)") {
		t.Errorf("ps after kill: %q", out)
	}
	// A finished command: attach exits with its code.
	out, _, _ = d.CLI("", "exec", "-d", id, "--", "sh", "-c", "echo bye; exit 3")
	testutil.WaitFor(t, 10*time.Second, "the command to exit", func() bool {
		o, _, _ := d.CLI("", "ps", id)
		return strings.Contains(o, "exited 3")
	})
	if got, _, code := d.CLI("", "attach", id, strings.TrimSpace(out)); code != 3 || got != "bye\n" {
		t.Errorf("attach to a finished command: exit %d, stdout %q", code, got)
	}
	// A background command that cannot start says why, as in the
	// foreground, with the same exit code.
	if _, errOut, code := d.CLI("", "exec", "-d", id, "--", "/no/such/program"); code != 127 ||
		strings.Count(errOut, "could not start") != 1 || !strings.Contains(errOut, "/no/such/program") {
		t.Errorf("exec -d of a missing program: exit %d, stderr %q", code, errOut)
	}

	// Piped into shell, commands run and the end of input ends the shell,
	// whose exit code is the CLI's.
	if out, errOut, code := cliWithin(t, d, time.Minute, "echo hi\nexit 3\n", "shell", id); code != 3 || out != "hi\n" {
		t.Errorf("echo ... | dsec shell: exit %d, stdout %q, stderr %q", code, out, errOut)
	}
	if out, errOut, code := cliWithin(t, d, time.Minute, "cd /tmp; pwd\n", "shell", id); code != 0 || out != "/tmp\n" {
		t.Errorf("echo pwd | dsec shell: exit %d, stdout %q, stderr %q", code, out, errOut)
	}

	testExecOutput(t, d, id)

	// A sandbox made with a working directory: cp's relative paths start there.
	out, errOut, code = d.CLI("", "create", "--workdir", "/tmp", env)
	if code != 0 {
		t.Fatalf("create --workdir: %s", errOut)
	}
	wid := strings.TrimSpace(out)
	t.Cleanup(func() { d.CLI("", "rm", wid) })
	local := filepath.Join(t.TempDir(), "f.txt")
	os.WriteFile(local, []byte("in the workdir"), 0o644)
	if _, errOut, code := d.CLI("", "cp", local, wid+":rel.txt"); code != 0 {
		t.Fatalf("cp into a sandbox with --workdir: %s", errOut)
	}
	if out, errOut, code := d.CLI("", "exec", wid, "--", "cat", "/tmp/rel.txt"); code != 0 || out != "in the workdir" {
		t.Errorf("cp f %s:rel.txt with --workdir /tmp: /tmp/rel.txt is %q (exit %d, %s)", wid, out, code, errOut)
	}

	// ls shows live sandboxes; a removed one only with --all.
	if _, errOut, code := d.CLI("", "rm", id); code != 0 {
		t.Fatalf("rm: %s", errOut)
	}
	if out, _, _ := d.CLI("", "ls"); strings.Contains(out, id) {
		t.Errorf("ls lists a removed sandbox:\n%s", out)
	}
	if out, _, _ := d.CLI("", "ls", "--all"); !strings.Contains(out, id) || !strings.Contains(out, "stopped") {
		t.Errorf("ls --all does not list the removed sandbox:\n%s", out)
	}
}

// TestRetention: a stopped sandbox stays listed with ls --all for the
// node's retention period, then is forgotten.
func TestRetention(t *testing.T) {
	d := startDaemon(t, "--retention", "1s")
	out, errOut, code := d.CLI("", "create", env)
	if code != 0 {
		t.Fatalf("create: %s", errOut)
	}
	id := strings.TrimSpace(out)
	if _, errOut, code := d.CLI("", "rm", id); code != 0 {
		t.Fatalf("rm: %s", errOut)
	}
	if out, _, _ := d.CLI("", "ls", "--all"); !strings.Contains(out, id) {
		t.Fatalf("ls --all right after rm does not list %s:\n%s", id, out)
	}
	testutil.WaitFor(t, 15*time.Second, "the stopped sandbox to be forgotten", func() bool {
		out, _, _ := d.CLI("", "ls", "--all")
		return !strings.Contains(out, id)
	})
	if _, errOut, code := d.CLI("", "inspect", id); code == 0 || !strings.Contains(errOut, "not_found") {
		t.Errorf("inspect of a forgotten sandbox: exit %d, %q", code, errOut)
	}
}

// cliWithin runs the CLI as Daemon.CLI does, failing the test when it has
// not exited within limit (it is killed then) rather than hanging it.
func cliWithin(t *testing.T, d *testutil.Daemon, limit time.Duration, stdin string, args ...string) (string, string, int) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), limit)
	defer cancel()
	cmd := exec.CommandContext(ctx, filepath.Join(d.Bin, "dsec"), append([]string{"--addr", d.Addr}, args...)...)
	cmd.Env = append(os.Environ(), "DSEC_TOKEN_FILE="+d.TokenFile())
	cmd.Stdin = strings.NewReader(stdin)
	var out, errb strings.Builder
	cmd.Stdout, cmd.Stderr = &out, &errb
	err := cmd.Run()
	if ctx.Err() != nil {
		t.Fatalf("dsec %v did not exit within %s (stdout %q, stderr %q)", args, limit, out.String(), errb.String())
	}
	code := 0
	if ee, ok := err.(*exec.ExitError); ok {
		code = ee.ExitCode()
	} else if err != nil {
		t.Fatalf("run dsec %v: %v", args, err)
	}
	return out.String(), errb.String(), code
}

// testExecOutput: a client reading a command's output gets all of it, past
// the 16 MiB a node keeps per stream for replay; output that was dropped
// (written while nothing read it, past what is kept) fails the command that
// shows it rather than passing for the whole.
func testExecOutput(t *testing.T, d *testutil.Daemon, id string) {
	t.Helper()
	const size = 30_000_000
	if _, errOut, code := d.CLI("", "exec", id, "--", "sh", "-c", fmt.Sprintf("head -c %d /dev/urandom > /tmp/big", size)); code != 0 {
		t.Fatalf("make /tmp/big: %s", errOut)
	}
	sumOut, errOut, code := d.CLI("", "exec", id, "--", "sha256sum", "/tmp/big")
	if code != 0 {
		t.Fatalf("sha256sum /tmp/big: %s", errOut)
	}
	out, errOut, code := d.CLI("", "exec", id, "--", "cat", "/tmp/big")
	sum := sha256.Sum256([]byte(out))
	if code != 0 || len(out) != size || !strings.HasPrefix(sumOut, hex.EncodeToString(sum[:])+" ") || errOut != "" {
		t.Errorf("exec cat of %d bytes: exit %d, %d bytes, sha256 %x (in the sandbox: %q), stderr %q",
			size, code, len(out), sum, sumOut, errOut)
	}

	// Nothing reads a background command's output: the node keeps the
	// first 16 MiB; attach then shows it and fails, saying what is missing.
	out, errOut, code = d.CLI("", "exec", "-d", "--tag", "flood", id, "--", "sh", "-c", "head -c 20000000 /dev/zero; echo end >&2")
	if code != 0 {
		t.Fatalf("exec -d flood: %s", errOut)
	}
	testutil.WaitFor(t, 30*time.Second, "the flood to exit", func() bool {
		o, _, _ := d.CLI("", "ps", id)
		for _, line := range strings.Split(o, "\n") {
			if strings.Contains(line, "flood") {
				return strings.Contains(line, "exited 0")
			}
		}
		return false
	})
	for _, args := range [][]string{{"attach", id, "flood"}, {"attach", "--no-follow", id, "flood"}} {
		out, errOut, code = d.CLI("", args...)
		if code == 0 || len(out) != 16<<20 || out != string(bytes.Repeat([]byte{0}, 16<<20)) ||
			!strings.Contains(errOut, fmt.Sprintf("%d bytes of stdout", 20000000-16<<20)) || !strings.Contains(errOut, "dropped") {
			t.Errorf("dsec %v of a command whose output overflowed: exit %d, %d bytes of stdout, stderr %q", args, code, len(out), errOut)
		}
	}
}

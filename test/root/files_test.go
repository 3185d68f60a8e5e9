package root

import (
	"context"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"connectrpc.com/connect"
	"golang.org/x/sys/unix"

	dsecv1 "dsec.dev/dsec/api/gen/dsec/v1"
	"dsec.dev/dsec/internal/testutil"
)

func TestLayeredEnvironment(t *testing.T) {
	d := startDaemon(t)
	ws := t.TempDir()
	os.MkdirAll(filepath.Join(ws, "work"), 0o755)
	os.WriteFile(filepath.Join(ws, "work", "task.txt"), []byte("workspace v1\n"), 0o644)
	os.WriteFile(filepath.Join(ws, "work", "shared.txt"), []byte("from workspace\n"), 0o644)
	tk := t.TempDir()
	os.MkdirAll(filepath.Join(tk, "work"), 0o755)
	os.MkdirAll(filepath.Join(tk, "opt", "tool"), 0o755)
	os.WriteFile(filepath.Join(tk, "work", "shared.txt"), []byte("from toolkit\n"), 0o644)
	os.WriteFile(filepath.Join(tk, "opt", "tool", "run"), []byte("#!/bin/sh\necho tool ran\n"), 0o755)
	for _, l := range []struct{ kind, ref, dir string }{{"workspace", "task:1", ws}, {"toolkit", "tool:1", tk}} {
		if out, errOut, code := d.CLI("", "layer", "import", "--kind", l.kind, l.ref, l.dir); code != 0 {
			t.Fatalf("import %s: %s %s", l.ref, out, errOut)
		}
	}
	// The toolkit is named first but stacks on top of the workspace.
	sb := create(t, d, &dsecv1.SandboxSpec{Environment: env + "+tool:1+task:1"})
	if len(sb.GetLayerDigests()) != 3 {
		t.Fatalf("layers %v, want 3", sb.GetLayerDigests())
	}
	out := mustSh(t, d, sb.GetId(), "cat /work/task.txt /work/shared.txt; /opt/tool/run")
	if out != "workspace v1\nfrom toolkit\ntool ran\n" {
		t.Fatalf("stacked environment: %q", out)
	}
	envs, _, code := d.CLI("", "env", "ls")
	if code != 0 || !strings.Contains(envs, "tool:1") {
		t.Fatalf("env ls: %q", envs)
	}
	// A layer in use cannot be removed.
	if _, errOut, code := d.CLI("", "layer", "rm", "task:1"); code == 0 {
		t.Fatalf("removed a layer in use: %s", errOut)
	}
}

func TestHostileArchiveRefused(t *testing.T) {
	d := startDaemon(t)
	dir := t.TempDir()
	outside := filepath.Join(dir, "outside")
	os.MkdirAll(outside, 0o755)
	// A tar whose entry climbs out of the layer.
	tarPath := filepath.Join(dir, "evil.tar")
	writeTar(t, tarPath, []tarEntry{{name: "../../outside/pwned", body: "x"}})
	_, errOut, code := d.CLI("", "layer", "import", "--kind", "workspace", "evil:1", tarPath)
	if code == 0 || !strings.Contains(errOut, "pwned") {
		t.Fatalf("import of a path-traversal tar: code %d, %q", code, errOut)
	}
	writeTar(t, tarPath, []tarEntry{{name: "a", link: "/etc", symlink: true}, {name: "a/passwd", body: "root::0:0::/:/bin/sh\n"}})
	_, errOut, code = d.CLI("", "layer", "import", "--kind", "workspace", "evil:2", tarPath)
	if code == 0 {
		t.Fatalf("import of a symlink-escape tar succeeded")
	}
	entries, _ := os.ReadDir(outside)
	if len(entries) != 0 {
		t.Fatalf("something was written outside the store: %v", entries)
	}
	list, _, _ := d.CLI("", "layer", "ls")
	if strings.Contains(list, "evil") {
		t.Fatalf("a refused layer is listed: %s", list)
	}
}

// A root file system with device nodes under /dev, as debootstrap makes
// one, imports with those left out (the sandbox gets its own /dev) and
// runs; a setuid file is refused with the flag that accepts it.
func TestImportTreeWithDevNodes(t *testing.T) {
	d := testutil.StartDaemon(t, "--no-network")
	dir := t.TempDir()
	if out, err := exec.Command(filepath.Join(testutil.RepoRoot(), "scripts", "build-busybox-base.sh"), dir).CombinedOutput(); err != nil {
		t.Fatalf("build busybox base: %v\n%s", err, out)
	}
	for _, n := range []struct {
		name       string
		mode       uint32
		major, min uint32
	}{{"console", unix.S_IFCHR | 0o600, 5, 1}, {"null", unix.S_IFCHR | 0o666, 1, 3}} {
		if err := unix.Mknod(filepath.Join(dir, "dev", n.name), n.mode, int(unix.Mkdev(n.major, n.min))); err != nil {
			t.Fatal(err)
		}
	}
	out, errOut, code := d.CLI("", "layer", "import", "--kind", "base", "devbox:1", dir)
	if code != 0 || !strings.HasPrefix(out, "devbox:1 sha256:") {
		t.Fatalf("layer import of a tree with /dev/console: code %d, %q %q", code, out, errOut)
	}
	log, err := os.ReadFile(filepath.Join(d.Root, "dsecd.log"))
	if err != nil {
		t.Fatal(err)
	}
	const note = "left out 2 device nodes or other special files under /dev (/dev/console, /dev/null)"
	if !strings.Contains(string(log), note) {
		t.Errorf("dsecd's log does not say what the import left out")
	}
	if !strings.HasPrefix(errOut, "dsec: warning: ") || !strings.Contains(errOut, note) {
		t.Errorf("layer import's stderr does not say what it left out: %q", errOut)
	}
	out, errOut, code = d.CLI("", "run", "devbox:1", "--", "ls", "/dev")
	if code != 0 || !strings.Contains(out, "null") || !strings.Contains(out, "pts") {
		t.Fatalf("run ls /dev: code %d, %q %q", code, out, errOut)
	}

	suid := filepath.Join(dir, "usr", "bin", "suid-tool")
	if err := os.WriteFile(suid, []byte("#!/bin/sh\n"), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := unix.Chmod(suid, 0o4755); err != nil {
		t.Fatal(err)
	}
	_, errOut, code = d.CLI("", "layer", "import", "--kind", "base", "devbox:2", dir)
	if code == 0 || !strings.Contains(errOut, `"usr/bin/suid-tool": setuid/setgid file (mode 4755); import with --allow-setuid`) {
		t.Fatalf("layer import of a setuid file: code %d, stderr %q; want the refusal naming --allow-setuid", code, errOut)
	}
	if _, errOut, code = d.CLI("", "layer", "import", "--kind", "base", "--allow-setuid", "devbox:2", dir); code != 0 {
		t.Fatalf("layer import --allow-setuid: code %d, stderr %q", code, errOut)
	}
}

func TestFilesSessionsAndBackground(t *testing.T) {
	d := startDaemon(t)
	sb := create(t, d, nil)
	checkFilesSessionsAndBackground(t, d, sb.GetId())
}

// checkFilesSessionsAndBackground: files written, read and listed through
// the API, dsec cp both ways, a session keeping its directory and
// environment, and a background command reattached after its stream ended.
func checkFilesSessionsAndBackground(t *testing.T, d *testutil.Daemon, id string) {
	t.Helper()
	ctx := context.Background()
	sc := d.Clients.Sandboxes

	if _, err := sc.WriteFile(ctx, connect.NewRequest(&dsecv1.WriteFileRequest{SandboxId: id, Path: "/data/x/hello.txt", Data: []byte("hello"), MakeParents: true})); err != nil {
		t.Fatal(err)
	}
	rf, err := sc.ReadFile(ctx, connect.NewRequest(&dsecv1.ReadFileRequest{SandboxId: id, Path: "/data/x/hello.txt"}))
	if err != nil || string(rf.Msg.GetData()) != "hello" {
		t.Fatalf("read back: %v %v", rf, err)
	}
	ls, err := sc.ListDir(ctx, connect.NewRequest(&dsecv1.ListDirRequest{SandboxId: id, Path: "/data/x"}))
	if err != nil || len(ls.Msg.GetEntries()) != 1 || ls.Msg.GetEntries()[0].GetName() != "hello.txt" {
		t.Fatalf("list: %v %v", ls, err)
	}
	if _, err := sc.ReadFile(ctx, connect.NewRequest(&dsecv1.ReadFileRequest{SandboxId: id, Path: "/nope"})); connect.CodeOf(err) != connect.CodeNotFound {
		t.Fatalf("read missing file: %v, want not_found", err)
	}

	// cp both ways through the CLI.
	testCopy(t, d, id)

	// Sessions keep cd and export.
	run := func(cmd string) result {
		stream, err := sc.SessionRun(ctx, connect.NewRequest(&dsecv1.SessionRunRequest{SandboxId: id, Session: "s1", Command: cmd, TimeoutSeconds: 10}))
		if err != nil {
			t.Fatal(err)
		}
		var r result
		for stream.Receive() {
			if o := stream.Msg().GetStdout(); o != nil {
				r.stdout += string(o)
			}
			if x := stream.Msg().GetExited(); x != nil {
				r.exit = x
			}
		}
		if err := stream.Err(); err != nil {
			t.Fatal(err)
		}
		return r
	}
	run("cd /data && export FOO=bar")
	if r := run("pwd; echo $FOO"); r.stdout != "/data\nbar\n" {
		t.Fatalf("session state: %s", r)
	}

	// A background process outlives its stream and can be reattached.
	bg, err := sc.Exec(ctx, connect.NewRequest(&dsecv1.ExecRequest{SandboxId: id, Command: "for i in 1 2 3; do echo tick $i; sleep 0.3; done", Background: true, Tag: "ticker"}))
	if err != nil {
		t.Fatal(err)
	}
	if !bg.Receive() || bg.Msg().GetStarted() == nil {
		t.Fatalf("background start: %v", bg.Err())
	}
	bg.Close()
	time.Sleep(1500 * time.Millisecond)
	at, err := sc.Attach(ctx, connect.NewRequest(&dsecv1.AttachRequest{SandboxId: id, Tag: "ticker"}))
	if err != nil {
		t.Fatal(err)
	}
	var out string
	for at.Receive() {
		out += string(at.Msg().GetStdout())
	}
	if out != "tick 1\ntick 2\ntick 3\n" {
		t.Fatalf("reattached output %q (err %v)", out, at.Err())
	}
}

func TestCLIShellAndJSON(t *testing.T) {
	d := startDaemon(t)
	out, errOut, code := d.CLI("", "create", "--label", "cli=1", env)
	if code != 0 {
		t.Fatalf("create: %s", errOut)
	}
	id := strings.TrimSpace(out)
	t.Cleanup(func() { d.CLI("", "rm", id) })
	checkPTYShell(t, d, id)
	out, _, code = d.CLI("", "--json", "ls", "--label", "cli=1")
	if code != 0 || !strings.Contains(out, `"id": "`+id+`"`) {
		t.Fatalf("ls --json: %q", out)
	}
	out, _, code = d.CLI("", "exec", "-d", "--tag", "bg", id, "--", "sleep", "30")
	if code != 0 || strings.TrimSpace(out) == "" {
		t.Fatalf("exec -d: code %d %q", code, out)
	}
	_, errOut, code = d.CLI("", "exec", "sb-t1-"+strings.Repeat("a", 23), "--", "true")
	if code == 0 || !strings.Contains(errOut, "not_found") {
		t.Fatalf("exec in an unknown sandbox: code %d, %q", code, errOut)
	}
	// A mistyped ID names no sandbox, said once.
	_, errOut, code = d.CLI("", "exec", "sb-t1-doesnotexist", "--", "true")
	if code == 0 || errOut != "dsec: no sandbox sb-t1-doesnotexist (not_found)\n" {
		t.Fatalf("exec in a malformed sandbox ID: code %d, %q", code, errOut)
	}
	if _, errOut, code := d.CLI("", "rm", "--label", "cli=1"); code != 0 {
		t.Fatalf("rm --label: %s", errOut)
	}
	out, _, _ = d.CLI("", "ls", "--state", "running")
	if strings.Contains(out, id) {
		t.Fatalf("rm --label left %s running", id)
	}
}

// checkPTYShell: a PTY shell (dsec shell -t) driven from a pipe: its output
// comes back through the terminal, and its exit code is the CLI's.
func checkPTYShell(t *testing.T, d *testutil.Daemon, id string) {
	t.Helper()
	out, errOut, code := d.CLI("echo from-pty; tty; exit 3\n", "shell", "-t", id)
	if code != 3 || !strings.Contains(out, "from-pty") || !strings.Contains(out, "/dev/pts/") {
		t.Fatalf("shell: code %d, out %q, err %q", code, out, errOut)
	}
}

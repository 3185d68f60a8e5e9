package agent_test

import (
	"fmt"
	"io"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"unsafe"

	"golang.org/x/sys/unix"

	dsecv1 "dsec.dev/dsec/api/gen/dsec/v1"
	"dsec.dev/dsec/internal/testutil"
)

// statfsProbeEnv makes the test binary, run as a command by the agent,
// print what statfs and fstatfs return for each of its arguments.
const statfsProbeEnv = "DSEC_STATFS_PROBE"

// statfsProbe prints one line per argument: "name blocks bfree bavail" or
// "name errno". A path ending in "@fd" is opened and given to fstatfs; the
// argument "efault" is statfs of / into an unmapped buffer.
func statfsProbe(args []string) int {
	for _, a := range args {
		var st unix.Statfs_t
		var err error
		switch {
		case a == "efault":
			p, _ := unix.BytePtrFromString("/")
			_, _, e := unix.Syscall(unix.SYS_STATFS, uintptr(unsafe.Pointer(p)), 8, 0)
			if e != 0 {
				err = e
			}
		case strings.HasSuffix(a, "@fd"):
			var fd int
			fd, err = unix.Open(strings.TrimSuffix(a, "@fd"), unix.O_RDONLY, 0)
			if err == nil {
				err = unix.Fstatfs(fd, &st)
			}
		default:
			err = unix.Statfs(a, &st)
		}
		if err != nil {
			fmt.Printf("%s %s\n", a, unix.ErrnoName(err.(unix.Errno)))
			continue
		}
		fmt.Printf("%s %d %d %d\n", a, st.Blocks, st.Bfree, st.Bavail)
	}
	return 0
}

func init() {
	if os.Getenv(statfsProbeEnv) == "1" {
		os.Exit(statfsProbe(os.Args[1:]))
	}
}

func writeFile(t *testing.T, path, body string) {
	t.Helper()
	if err := os.WriteFile(path, []byte(body), 0o644); err != nil {
		t.Fatal(err)
	}
}

// TestDiskFree runs the statfs supervisor with a qgroup made of plain files
// and checks what commands see: the root described by the qgroup for every
// way of naming it and every user, other mounts and errors left alone, and
// CAP_SYS_PTRACE kept from every command and every other agent thread.
func TestDiskFree(t *testing.T) {
	testutil.RequireRoot(t)
	q := t.TempDir()
	const limit, referenced, reserved = 256 << 20, 16 << 10, 50 << 20
	for name, v := range map[string]int{"max_referenced": limit, "referenced": referenced, "rsv_data": reserved, "rsv_meta_pertrans": 0, "rsv_meta_prealloc": 0} {
		writeFile(t, filepath.Join(q, name), strconv.Itoa(v)+"\n")
	}
	// A directory on the root mount that only root may enter.
	var host unix.Statfs_t
	if err := unix.Statfs("/", &host); err != nil {
		t.Fatal(err)
	}
	work, err := os.MkdirTemp("", "dsec-diskfree-") // t.TempDir's parent is closed to nobody
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(work) })
	os.Chmod(work, 0o755)
	private := filepath.Join(work, "private")
	if err := os.Mkdir(private, 0o700); err != nil {
		t.Fatal(err)
	}
	writeFile(t, filepath.Join(private, "x"), "")
	var wst, rst unix.Statx_t
	unix.Statx(unix.AT_FDCWD, work, 0, unix.STATX_MNT_ID, &wst)
	unix.Statx(unix.AT_FDCWD, "/", 0, unix.STATX_MNT_ID, &rst)
	onRoot := wst.Mnt_id == rst.Mnt_id

	probe := filepath.Join(shellDir, "statfs-probe")
	self, err := os.Open("/proc/self/exe")
	if err != nil {
		t.Fatal(err)
	}
	out, err := os.OpenFile(probe, os.O_CREATE|os.O_WRONLY|os.O_TRUNC, 0o755)
	if err != nil {
		t.Fatal(err)
	}
	io.Copy(out, self)
	self.Close()
	out.Close()

	a := startAgent(t, agentOpts{args: []string{"--disk-qgroup", q}})
	run := func(t *testing.T, user, cwd string, args ...string) map[string]string {
		t.Helper()
		r := a.exec(t, &dsecv1.ExecRequest{Argv: append([]string{probe}, args...), User: user, Cwd: cwd,
			Env: map[string]string{statfsProbeEnv: "1"}})
		if r.exited.GetExitCode() != 0 {
			t.Fatalf("probe as %q: %+v %s", user, r.exited, r.stderr)
		}
		got := map[string]string{}
		for _, line := range strings.Split(strings.TrimSpace(r.stdout), "\n") {
			k, v, _ := strings.Cut(line, " ")
			got[k] = v
		}
		return got
	}
	bs := host.Frsize
	blocks := limit / bs
	free := blocks - (referenced+reserved+bs-1)/bs
	want := fmt.Sprintf("%d %d %d", blocks, free, free)

	// The agent's root, through its /proc files: no command may follow
	// them (the agent is not dumpable), whatever the supervisor may.
	agentRoot := fmt.Sprintf("/proc/%d/root", a.cmd.Process.Pid)
	for _, user := range []string{"", "nobody"} {
		got := run(t, user, work, "/", "/@fd", ".", "../"+filepath.Base(work), "/proc", "efault", "/no/such/path", "private/x", agentRoot)
		t.Logf("as %q from %s: %v", user, work, got)
		if got[agentRoot] != "EACCES" {
			t.Errorf("as %q: %s: %q, want EACCES", user, agentRoot, got[agentRoot])
		}
		for _, path := range []string{"/", "/@fd"} {
			if got[path] != want {
				t.Errorf("as %q: %s: %q, want the qgroup's %q", user, path, got[path], want)
			}
		}
		if onRoot {
			for _, path := range []string{".", "../" + filepath.Base(work)} {
				if got[path] != want {
					t.Errorf("as %q: %s from %s: %q, want the qgroup's %q", user, path, work, got[path], want)
				}
			}
		}
		if f := strings.Fields(got["/proc"]); len(f) != 3 || f[0] != "0" {
			t.Errorf("as %q: /proc: %q, want proc's own (no blocks)", user, got["/proc"])
		}
		if got["efault"] != "EFAULT" || got["/no/such/path"] != "ENOENT" {
			t.Errorf("as %q: errors: %q", user, got)
		}
		// The supervisor looks paths up with the caller's credentials:
		// nobody may not enter private/.
		wantPrivate := "EACCES"
		if user == "" {
			wantPrivate = want
		}
		if onRoot && got["private/x"] != wantPrivate {
			t.Errorf("as %q: private/x: %q, want %s", user, got["private/x"], wantPrivate)
		}
	}

	// Usage is read anew at every call.
	writeFile(t, filepath.Join(q, "rsv_data"), "0\n")
	free = blocks - (referenced+bs-1)/bs
	if got := run(t, "", "/", "/")["/"]; got != fmt.Sprintf("%d %d %d", blocks, free, free) {
		t.Errorf("after the reservation was committed away: %q", got)
	}

	// CAP_SYS_PTRACE: no command holds it or can get it, and of the agent's
	// threads only the supervisor's uses it.
	status := a.exec(t, &dsecv1.ExecRequest{Argv: []string{"cat", "/proc/self/status"}}).stdout
	for _, field := range []string{"CapBnd", "CapEff", "CapPrm", "CapInh", "CapAmb"} {
		if capBit(t, status, field, unix.CAP_SYS_PTRACE) {
			t.Errorf("a command has CAP_SYS_PTRACE in %s", field)
		}
	}
	tasks, _ := os.ReadDir(fmt.Sprintf("/proc/%d/task", a.cmd.Process.Pid))
	withPtrace := 0
	for _, task := range tasks {
		b, err := os.ReadFile(fmt.Sprintf("/proc/%d/task/%s/status", a.cmd.Process.Pid, task.Name()))
		if err != nil {
			continue
		}
		if capBit(t, string(b), "CapEff", unix.CAP_SYS_PTRACE) {
			withPtrace++
		}
		if capBit(t, string(b), "CapBnd", unix.CAP_SYS_PTRACE) {
			t.Errorf("agent thread %s keeps CAP_SYS_PTRACE in its bounding set", task.Name())
		}
	}
	if withPtrace != 1 {
		t.Errorf("%d of the agent's %d threads have CAP_SYS_PTRACE in effect, want 1 (the supervisor's)", withPtrace, len(tasks))
	}
}

func capBit(t *testing.T, status, field string, bit int) bool {
	t.Helper()
	for _, line := range strings.Split(status, "\n") {
		if v, ok := strings.CutPrefix(line, field+":"); ok {
			n, err := strconv.ParseUint(strings.TrimSpace(v), 16, 64)
			if err != nil {
				t.Fatalf("%s: %q", field, line)
			}
			return n&(1<<bit) != 0
		}
	}
	t.Fatalf("no %s in status", field)
	return false
}

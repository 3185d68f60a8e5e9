package agent

import (
	"errors"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strings"
	"testing"

	"golang.org/x/sys/unix"

	"dsec.dev/dsec/internal/refused"
)

// TestRefusalFilter runs the filter logRefusals installs in a child (a
// filter cannot be removed): what the profile refuses is refused with
// EPERM, the rest passes (clone3, ioctls and clones without the refused
// requests and flags). The audit records it makes are test/root's
// TestE2BBase/ProvenanceSyscalls'.
func TestRefusalFilter(t *testing.T) {
	if refused.Arch == 0 {
		t.Skip("the refused numbers are x86_64's")
	}
	if os.Getenv("DSEC_REFUSAL_CHILD") == "1" {
		refusalChild(t)
		return
	}
	cmd := exec.Command(os.Args[0], "-test.run", "^TestRefusalFilter$", "-test.v")
	cmd.Env = append(os.Environ(), "DSEC_REFUSAL_CHILD=1")
	out, err := cmd.CombinedOutput()
	// A process manager another test of this package made reaps every
	// child of the test binary (it is a subreaper, waiting for any pid), so
	// it may take the child's exit first and the wait finds none: the
	// child's own verdict, read to its end, then tells.
	if errors.Is(err, unix.ECHILD) && strings.Contains(string(out), "\n--- PASS: TestRefusalFilter") {
		err = nil
	}
	if err != nil {
		t.Fatalf("child: %v\n%s", err, out)
	}
}

func refusalChild(t *testing.T) {
	runtime.LockOSThread()
	if err := unix.Prctl(unix.PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0); err != nil {
		t.Fatal(err)
	}
	if err := logRefusals(); err != nil {
		t.Fatal(err)
	}
	errno := func(nr uintptr, args ...uintptr) error {
		var a [6]uintptr
		copy(a[:], args)
		_, _, e := unix.Syscall6(nr, a[0], a[1], a[2], a[3], a[4], a[5])
		if e == 0 {
			return nil
		}
		return e
	}
	for _, name := range []string{"unshare", "mount", "keyctl", "bpf", "setns", "ptrace", "io_uring_setup"} {
		if err := errno(uintptr(refused.Numbers[name])); !errors.Is(err, unix.EPERM) {
			t.Errorf("%s: %v, want EPERM", name, err)
		}
	}
	if err := errno(unix.SYS_CLONE, unix.CLONE_NEWUSER|uintptr(unix.SIGCHLD)); !errors.Is(err, unix.EPERM) {
		t.Errorf("clone(CLONE_NEWUSER): %v, want EPERM", err)
	}
	f, err := os.Create(filepath.Join(t.TempDir(), "f"))
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	if err := errno(unix.SYS_IOCTL, f.Fd(), unix.FICLONE, f.Fd()); !errors.Is(err, unix.EPERM) {
		t.Errorf("ioctl(FICLONE): %v, want EPERM", err)
	}
	if err := errno(unix.SYS_IOCTL, f.Fd(), unix.TCGETS, 0); !errors.Is(err, unix.ENOTTY) {
		t.Errorf("ioctl(TCGETS) of a file: %v, want ENOTTY (passed)", err)
	}
	// clone3 with a zero size is EINVAL once it reaches the kernel.
	if err := errno(unix.SYS_CLONE3, 0, 0); !errors.Is(err, unix.EINVAL) {
		t.Errorf("clone3: %v, want EINVAL (passed)", err)
	}
	if err := errno(unix.SYS_GETPPID); err != nil {
		t.Errorf("getppid: %v", err)
	}
	cmd := exec.Command("/bin/true")
	if err := cmd.Run(); err != nil {
		t.Errorf("start a process: %v", err)
	}
}

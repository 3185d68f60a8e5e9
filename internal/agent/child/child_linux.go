// Package child is the first moment of every command the agent starts: a
// small static program (dsec-exec, or the agent binary in its child mode)
// that waits until the agent has put it into the command's cgroups, then
// takes the command's credentials and directory, resets signals and execs
// the target. It imports next to nothing, so it starts in about a
// millisecond.
package child

import (
	"encoding/json"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"unsafe"

	"golang.org/x/sys/unix"
)

// The re-exec'd child gets, besides its stdio, the spec pipe on fd 3 (closed
// by the parent once the child sits in its cgroup: that is the go signal) and
// an error pipe on fd 4 (close-on-exec, so EOF means the target was executed).
const (
	// SpecFD carries the Spec (JSON); its EOF is the signal to go on.
	SpecFD = 3
	// ErrFD gets the reason when the target cannot be executed.
	ErrFD = 4
	// Arg is the argument that selects the child mode of the agent binary.
	Arg = "child"
)

// Spec is what the child needs to become the target process.
type Spec struct {
	Argv   []string `json:"argv"`
	Env    []string `json:"env"`
	Dir    string   `json:"dir"`
	UID    uint32   `json:"uid"`
	GID    uint32   `json:"gid"`
	Groups []uint32 `json:"groups"`
}

// Main waits for its spec, takes the target's credentials and directory and
// executes it. It returns only on failure, with the exit code to use.
func Main() int {
	unix.CloseOnExec(SpecFD)
	unix.CloseOnExec(ErrFD)
	errw := os.NewFile(ErrFD, "errpipe")
	fail := func(err error) int {
		fmt.Fprint(errw, err.Error())
		return 127
	}
	specf := os.NewFile(SpecFD, "specpipe")
	b, err := io.ReadAll(specf)
	specf.Close()
	if err != nil {
		return fail(fmt.Errorf("read spec: %w", err))
	}
	var s Spec
	if err := json.Unmarshal(b, &s); err != nil || len(s.Argv) == 0 {
		return fail(fmt.Errorf("decode spec: %v", err))
	}
	if os.Geteuid() == 0 {
		groups := make([]int, len(s.Groups))
		for i, g := range s.Groups {
			groups[i] = int(g)
		}
		if err := syscall.Setgroups(groups); err != nil {
			return fail(fmt.Errorf("set groups: %w", err))
		}
		if err := syscall.Setgid(int(s.GID)); err != nil {
			return fail(fmt.Errorf("set gid %d: %w", s.GID, err))
		}
		if err := syscall.Setuid(int(s.UID)); err != nil {
			return fail(fmt.Errorf("set uid %d: %w", s.UID, err))
		}
	} else if uint32(os.Geteuid()) != s.UID {
		return fail(fmt.Errorf("run as uid %d: the agent is not root", s.UID))
	}
	if s.Dir != "" {
		if err := syscall.Chdir(s.Dir); err != nil {
			return fail(fmt.Errorf("change directory to %s: %w", s.Dir, err))
		}
	}
	path, err := lookPath(s.Argv[0], s.Env)
	if err != nil {
		return fail(err)
	}
	resetSignals()
	err = syscall.Exec(path, s.Argv, s.Env)
	return fail(fmt.Errorf("execute %s: %w", path, err))
}

// sigaction is the kernel's struct for rt_sigaction on amd64 and arm64.
type sigaction struct {
	handler  uintptr
	flags    uint64
	restorer uintptr
	mask     uint64
}

// resetSignals gives every signal its default action. The agent ignores
// SIGINT, SIGTERM, SIGHUP and more (as pid 1 it must), and an ignored signal
// stays ignored across execve: without this, commands could not be
// interrupted or terminated.
func resetSignals() {
	var dfl sigaction // handler 0 is SIG_DFL
	for sig := 1; sig <= 64; sig++ {
		if sig == int(unix.SIGKILL) || sig == int(unix.SIGSTOP) {
			continue
		}
		unix.RawSyscall6(unix.SYS_RT_SIGACTION, uintptr(sig), uintptr(unsafe.Pointer(&dfl)), 0, 8, 0, 0)
	}
}

// lookPath finds name on the PATH of env, like a shell would.
func lookPath(name string, env []string) (string, error) {
	if strings.Contains(name, "/") {
		return name, nil
	}
	path := "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
	for _, kv := range env {
		if v, ok := strings.CutPrefix(kv, "PATH="); ok {
			path = v
		}
	}
	for _, dir := range filepath.SplitList(path) {
		if dir == "" {
			dir = "."
		}
		p := filepath.Join(dir, name)
		st, err := os.Stat(p)
		if err != nil || st.IsDir() {
			continue
		}
		if unix.Access(p, unix.X_OK) == nil {
			return p, nil
		}
	}
	return "", fmt.Errorf("find %q: executable file not found in PATH", name)
}

package container

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"runtime"
	"strconv"
	"strings"

	"dsec.dev/dsec/internal/edge/provenance"
	"dsec.dev/dsec/internal/errdefs"
)

// startInSession starts cmd from an OS thread given an audit session of its
// own, which the container's processes inherit (the kernel copies a
// task's login uid and session to its children) and cannot change without
// CAP_AUDIT_CONTROL: the audit records of the sandbox's refused syscalls
// carry it, so the edge attributes each record to its sandbox even after
// the process that made it ended (provenance.SyscallLog). When the session
// cannot be made (the kernel's loginuid_immutable), cmd starts in the
// edge's own session and its refusals are not attributed; the error says
// why, for the caller to log.
func startInSession(cmd *exec.Cmd) (sessionErr, startErr error) {
	type result struct{ session, start error }
	done := make(chan result, 1)
	go func() {
		// Never unlocked: the thread, with the session it now carries,
		// ends with this goroutine and serves no other.
		runtime.LockOSThread()
		serr := newAuditSession()
		done <- result{serr, cmd.Start()}
	}()
	r := <-done
	return r.session, r.start
}

// newAuditSession gives the calling thread a new audit session: writing a
// login uid (the one it has, else the process's uid) to its loginuid makes
// the kernel assign the next session id. The edge, root with
// CAP_AUDIT_CONTROL, may do so even when a login uid is set.
func newAuditSession() error {
	const file = "/proc/thread-self/loginuid"
	b, err := os.ReadFile(file)
	if err != nil {
		return fmt.Errorf("read login uid: %w", err)
	}
	uid := strings.TrimSpace(string(b))
	if uid == "4294967295" {
		uid = strconv.Itoa(os.Getuid())
	}
	if err := os.WriteFile(file, []byte(uid), 0); err != nil {
		return fmt.Errorf("start an audit session: %w", err)
	}
	return nil
}

// AuditSession returns the audit session of sandbox id's processes
// (backend.SyscallAuditor), or ErrNotSupported when its refused syscalls
// are not logged: on a node that does not ask for it, under gVisor, or when
// the sandbox may escalate privileges (no no_new_privs, see
// refusalsLogged), which its processes' status shows. It reads any process
// of the sandbox's cgroup, all of which share the session: no OCI runtime
// runs, as it is asked on the create path.
func (r *Container) AuditSession(ctx context.Context, id string) (uint32, error) {
	if !r.cfg.LogRefusals {
		return 0, fmt.Errorf("refused syscalls of %s: this node does not log them: %w", id, errdefs.ErrNotSupported)
	}
	if r.gvisor() {
		return 0, fmt.Errorf("refused syscalls of %s: gVisor's sentry applies the profile: %w", id, errdefs.ErrNotSupported)
	}
	pids, err := r.layout.Procs(r.cgroupRel(id))
	if err != nil {
		return 0, fmt.Errorf("refused syscalls of %s: %w", id, err)
	}
	for _, pid := range pids {
		status, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/status")
		if err != nil {
			continue // ended meanwhile
		}
		if !strings.Contains(string(status), "\nNoNewPrivs:\t1\n") {
			return 0, fmt.Errorf("refused syscalls of %s: it may escalate privileges, and its profile logs nothing: %w", id, errdefs.ErrNotSupported)
		}
		session, err := provenance.ReadSession(pid)
		if err == nil {
			return session, nil
		}
	}
	return 0, fmt.Errorf("refused syscalls of %s: no process: %w", id, errdefs.ErrFailedPrecondition)
}

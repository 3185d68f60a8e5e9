package fs

import (
	"fmt"
	"runtime"

	"golang.org/x/sys/unix"

	"dsec.dev/dsec/internal/agent/account"
	"dsec.dev/dsec/internal/errdefs"
)

// asUser runs fn on a locked OS thread whose file-system credentials are
// those of a. The thread is restored afterwards; if restoring fails, the
// thread stays locked and dies with the goroutine instead of being reused.
func asUser(a account.Account, fn func() error) error {
	if a.UID == 0 && a.GID == 0 && len(a.Groups) == 0 {
		return fn()
	}
	runtime.LockOSThread()
	groups := make([]int, len(a.Groups))
	for i, g := range a.Groups {
		groups[i] = int(g)
	}
	if len(groups) == 0 {
		groups = []int{int(a.GID)}
	}
	// unix.Setgroups, Setfsgid and Setfsuid are plain (per-thread) syscalls.
	if err := unix.Setgroups(groups); err != nil {
		runtime.UnlockOSThread()
		return fmt.Errorf("switch to user %d: set groups: %v: %w", a.UID, err, errdefs.ErrPermissionDenied)
	}
	unix.Setfsgid(int(a.GID))
	unix.Setfsuid(int(a.UID))
	ok := false
	defer func() {
		if !ok {
			return // leave the thread locked: it exits with the goroutine
		}
		runtime.UnlockOSThread()
	}()
	err := fn()
	unix.Setfsuid(0)
	unix.Setfsgid(0)
	if unix.Setgroups(nil) == nil {
		if u, _ := unix.SetfsuidRetUid(-1); u == 0 {
			if g, _ := unix.SetfsgidRetGid(-1); g == 0 {
				ok = true
			}
		}
	}
	return err
}

package call

import (
	"runtime"
	"testing"

	"golang.org/x/sys/unix"

	"dsec.dev/dsec/internal/testutil"
)

// TestIPCInUse: the *_INFO counts see one object of each kind, in an IPC
// namespace of the test's own, and removeIPC leaves none.
func TestIPCInUse(t *testing.T) {
	testutil.RequireRoot(t)
	done := make(chan struct{})
	go func() {
		defer close(done)
		// The namespace and the dropped capability are this thread's
		// only; the thread ends with the goroutine, still locked.
		runtime.LockOSThread()
		if err := unix.Unshare(unix.CLONE_NEWIPC); err != nil {
			t.Errorf("unshare the IPC namespace: %v", err)
			return
		}
		if ipcInUse() {
			t.Error("a new IPC namespace is in use")
		}
		// As in a container, this thread lacks CAP_SYS_ADMIN, and the
		// objects belong to the uid a call ran as.
		if err := dropCap(unix.CAP_SYS_ADMIN); err != nil {
			t.Errorf("drop CAP_SYS_ADMIN: %v", err)
			return
		}
		keep := ^uintptr(0)
		for _, kind := range []struct {
			name string
			make func() (uintptr, unix.Errno)
		}{
			{"shm", func() (uintptr, unix.Errno) { id, _, e := unix.Syscall(unix.SYS_SHMGET, 0, 4096, 0o1600); return id, e }},
			{"sem", func() (uintptr, unix.Errno) { id, _, e := unix.Syscall(unix.SYS_SEMGET, 0, 1, 0o1600); return id, e }},
			{"msg", func() (uintptr, unix.Errno) { id, _, e := unix.Syscall(unix.SYS_MSGGET, 0, 0o1600, 0); return id, e }},
		} {
			unix.RawSyscall(unix.SYS_SETRESUID, keep, 65534, keep)
			_, e := kind.make()
			unix.RawSyscall(unix.SYS_SETRESUID, keep, 0, keep)
			if e != 0 {
				t.Errorf("make a %s object: %v", kind.name, e)
				return
			}
			if !ipcInUse() {
				t.Errorf("a %s object is not seen", kind.name)
			}
			removeIPC()
			if ipcInUse() {
				t.Errorf("removeIPC left the %s object", kind.name)
			}
		}
	}()
	<-done
}

// dropCap removes capability c from this thread's effective and permitted
// sets (capset acts on the calling thread only).
func dropCap(c uint) error {
	hdr := unix.CapUserHeader{Version: unix.LINUX_CAPABILITY_VERSION_3}
	var data [2]unix.CapUserData
	if err := unix.Capget(&hdr, &data[0]); err != nil {
		return err
	}
	data[c/32].Effective &^= 1 << (c % 32)
	data[c/32].Permitted &^= 1 << (c % 32)
	return unix.Capset(&hdr, &data[0])
}

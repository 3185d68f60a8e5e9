//go:build linux && (amd64 || arm64)

package diskfree

import (
	"bytes"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"runtime"
	"strconv"
	"unsafe"

	"golang.org/x/sys/unix"
)

// Config says which mount the supervisor describes and where its limit and
// usage are read.
type Config struct {
	// Root is a path on the mount whose statfs is rewritten: "/" in a sandbox.
	Root string
	// Qgroup is the sysfs directory of the btrfs qgroup that caps the
	// writable layer: /sys/fs/btrfs/<fsid>/qgroups/0_<subvolume id>.
	Qgroup string
	Log    *slog.Logger
}

// Start installs the filter on every thread of the calling process, so that
// every process it starts from then on inherits it, and serves its
// notifications until the process exits. Call it once, before the first
// command starts; afterwards the process must not use
// syscall.AllThreadsSyscall, which would change the supervisor's thread
// too. On error nothing is installed.
func Start(cfg Config) error {
	if cfg.Log == nil {
		cfg.Log = slog.New(slog.DiscardHandler)
	}
	q, err := openQgroup(cfg.Qgroup)
	if err != nil {
		return err
	}
	root, err := unix.Open(cfg.Root, unix.O_RDONLY|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
	if err != nil {
		q.close()
		return fmt.Errorf("open %s: %w", cfg.Root, err)
	}
	mnt, err := mountID(cfg.Root)
	if err != nil {
		q.close()
		unix.Close(root)
		return err
	}
	s := &supervisor{q: q, root: root, rootMount: mnt, log: cfg.Log}
	// Read the root's statfs once the way the supervisor will: a kernel
	// without the calls it needs fails here, not for a command.
	if _, err := s.rootStatfs(); err != nil {
		s.close()
		return err
	}
	prog := filter()
	fprog := unix.SockFprog{Len: uint16(len(prog)), Filter: &prog[0]}
	// TSYNC and NEW_LISTENER go together only with TSYNC_ESRCH (Linux 5.7).
	flags := unix.SECCOMP_FILTER_FLAG_TSYNC | unix.SECCOMP_FILTER_FLAG_NEW_LISTENER | unix.SECCOMP_FILTER_FLAG_TSYNC_ESRCH
	fd, _, e := unix.Syscall(unix.SYS_SECCOMP, unix.SECCOMP_SET_MODE_FILTER, uintptr(flags), uintptr(unsafe.Pointer(&fprog)))
	runtime.KeepAlive(prog)
	if e != 0 {
		s.close()
		return fmt.Errorf("install statfs filter: %w", e)
	}
	s.listener = int(fd) // close-on-exec, as the kernel makes it
	// A caller sleeps until its answer: let the kernel switch straight to
	// the supervisor and back instead of waking each side through the
	// scheduler (Linux 6.6; older kernels refuse it and wake as usual). It
	// halves the cost of a call here, from about 60 to 30 µs.
	unix.Syscall(unix.SYS_IOCTL, fd, unix.SECCOMP_IOCTL_NOTIF_SET_FLAGS, unix.SECCOMP_USER_NOTIF_FD_SYNC_WAKE_UP)
	go s.serve()
	return nil
}

// supervisor answers the filter's notifications. Its fields are set before
// the first serve and read-only after.
type supervisor struct {
	listener  int
	q         *qgroup
	root      int    // fd of the root mount
	rootMount uint64 // its mount ID
	log       *slog.Logger
}

func (s *supervisor) close() {
	s.q.close()
	unix.Close(s.root)
}

// serve answers notifications on a thread of its own, locked for good: the
// thread alone carries CAP_SYS_PTRACE and takes on callers' credentials.
// Should restoring them fail, the thread is retired (it exits with the
// goroutine) and a fresh one goes on.
func (s *supervisor) serve() {
	runtime.LockOSThread()
	t, err := newThread()
	if err != nil {
		// Callers whose /proc files the agent may not read (other users')
		// keep the node's figures.
		s.log.Warn("statfs supervisor reaches only its own user's processes", "err", err)
	}
	for {
		var n notif
		if err := ioctl(s.listener, unix.SECCOMP_IOCTL_NOTIF_RECV, unsafe.Pointer(&n)); err != nil {
			if errors.Is(err, unix.EINTR) || errors.Is(err, unix.ENOENT) {
				continue // interrupted, or the caller went away meanwhile
			}
			// Closing the listener fails every pending and later call with
			// ENOSYS: better than commands that hang.
			s.log.Error("receive statfs notification; statfs fails from now on", "err", err)
			unix.Close(s.listener)
			return
		}
		r := s.answer(t, &n)
		if err := ioctl(s.listener, unix.SECCOMP_IOCTL_NOTIF_SEND, unsafe.Pointer(&r)); err != nil && !errors.Is(err, unix.ENOENT) {
			s.log.Debug("answer statfs notification", "pid", n.Pid, "err", err)
		}
		if t.broken {
			s.log.Error("restore the statfs supervisor's credentials; retiring its thread")
			go s.serve()
			return
		}
	}
}

// answer decides one call: the root's statfs rewritten into the caller's
// buffer, or the call handed back to the kernel. A panic here would take
// pid 1 and the sandbox with it; it hands the call back instead.
func (s *supervisor) answer(t *thread, n *notif) (r notifResp) {
	r = notifResp{ID: n.ID, Flags: unix.SECCOMP_USER_NOTIF_FLAG_CONTINUE}
	defer func() {
		if p := recover(); p != nil {
			s.log.Error("statfs supervisor panicked", "panic", p)
			r = notifResp{ID: n.ID, Flags: unix.SECCOMP_USER_NOTIF_FLAG_CONTINUE}
		}
	}()
	if n.Data.Arch != nativeArch {
		return r
	}
	dir, err := unix.Open("/proc/"+strconv.FormatUint(uint64(n.Pid), 10), unix.O_PATH|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
	if err != nil {
		return r
	}
	defer unix.Close(dir)
	mem, err := unix.Openat(dir, "mem", unix.O_RDWR|unix.O_CLOEXEC, 0)
	if err != nil {
		return r
	}
	defer unix.Close(mem)
	// The fds name the caller only while its call is pending; after that
	// its pid may be another process's. (They keep naming what they named.)
	id := n.ID
	if ioctl(s.listener, unix.SECCOMP_IOCTL_NOTIF_ID_VALID, unsafe.Pointer(&id)) != nil {
		return r
	}
	var mnt uint64
	switch n.Data.Nr {
	case unix.SYS_STATFS:
		mnt, err = s.pathMount(t, dir, mem, n.Data.Args[0])
	case unix.SYS_FSTATFS:
		// No permission is checked on a file the caller has open.
		mnt, err = mountID(fmt.Sprintf("/proc/self/fd/%d/fd/%d", dir, int32(n.Data.Args[0])))
	default:
		return r
	}
	if err != nil || mnt != s.rootMount {
		return r
	}
	st, err := s.rootStatfs()
	if err != nil {
		s.log.Warn("describe the root for statfs", "err", err)
		return r
	}
	// Writing through /proc/PID/mem may reach a page the caller could not
	// write itself; a buffer statfs could not fill is a bug of the caller's.
	b := unsafe.Slice((*byte)(unsafe.Pointer(&st)), unsafe.Sizeof(st))
	if w, err := unix.Pwrite(mem, b, int64(n.Data.Args[1])); err != nil || w != len(b) {
		return notifResp{ID: n.ID, Error: -int32(unix.EFAULT)}
	}
	return notifResp{ID: n.ID}
}

// pathMount is the mount ID of the path at addr in the caller's memory, as
// the caller would reach it: from its directory (opened here, with the
// supervisor's access to the caller's /proc files), with its credentials
// and nothing more. A caller whose root is not the agent's (a chroot) is
// left to the kernel.
func (s *supervisor) pathMount(t *thread, dir, mem int, addr uint64) (uint64, error) {
	path, err := readString(mem, addr)
	if err != nil {
		return 0, err
	}
	if path == "" {
		return 0, unix.ENOENT
	}
	var root [2]byte
	if n, err := unix.Readlinkat(dir, "root", root[:]); err != nil || n != 1 || root[0] != '/' {
		return 0, errors.New("caller's root is not the agent's")
	}
	from := unix.AT_FDCWD // an absolute path starts at the agent's root, the caller's too
	if path[0] != '/' {
		cwd, err := unix.Openat(dir, "cwd", unix.O_PATH|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
		if err != nil {
			return 0, err
		}
		defer unix.Close(cwd)
		from = cwd
	}
	if !t.known {
		return 0, errors.New("cannot take on the caller's credentials")
	}
	c, err := readCreds(dir)
	if err != nil {
		return 0, err
	}
	var mnt uint64
	err = t.as(c, func() error {
		// Without magic links (/proc/PID/{cwd,root,fd/N}): in the agent,
		// /proc/self names the agent, and the agent's own /proc files are
		// open to it whatever the caller's credentials. Such paths go back
		// to the kernel, which resolves them for the caller.
		how := unix.OpenHow{Flags: unix.O_PATH | unix.O_CLOEXEC, Resolve: unix.RESOLVE_NO_MAGICLINKS}
		fd, err := unix.Openat2(from, path, &how)
		if err != nil {
			return err
		}
		defer unix.Close(fd)
		mnt, err = mountIDAt(fd, "", unix.AT_EMPTY_PATH)
		return err
	})
	return mnt, err
}

// rootStatfs is the root's statfs described by the qgroup.
func (s *supervisor) rootStatfs() (unix.Statfs_t, error) {
	var st unix.Statfs_t
	if _, _, e := unix.Syscall(unix.SYS_FSTATFS, uintptr(s.root), uintptr(unsafe.Pointer(&st)), bypass); e != 0 {
		return st, fmt.Errorf("statfs the root: %w", e)
	}
	limit, used, err := s.q.read()
	if err != nil {
		return st, err
	}
	if limit <= 0 {
		return st, fmt.Errorf("read qgroup: no limit set")
	}
	describe(&st, limit, used)
	return st, nil
}

// describe rewrites a statfs for a limit and a usage in bytes: size is the
// limit (or the file system, if smaller); free and available are what the
// limit leaves (or what the file system has, if less). Used rounds up.
func describe(st *unix.Statfs_t, limit, used int64) {
	unit := st.Frsize
	if unit <= 0 {
		unit = st.Bsize
	}
	blocks := uint64(limit / unit)
	usedBlocks := min(uint64((max(used, 0)+unit-1)/unit), blocks)
	st.Blocks = min(st.Blocks, blocks)
	st.Bfree = min(st.Bfree, blocks-usedBlocks)
	st.Bavail = min(st.Bavail, blocks-usedBlocks)
}

// mountID is the ID of the mount path is on (following symlinks, as statfs does).
func mountID(path string) (uint64, error) { return mountIDAt(unix.AT_FDCWD, path, 0) }

func mountIDAt(dirfd int, path string, flags int) (uint64, error) {
	var stx unix.Statx_t
	if err := unix.Statx(dirfd, path, flags, unix.STATX_MNT_ID, &stx); err != nil {
		return 0, err
	}
	if stx.Mask&unix.STATX_MNT_ID == 0 {
		return 0, fmt.Errorf("statx %s: no mount ID: %w", path, unix.ENOTSUP)
	}
	return stx.Mnt_id, nil
}

// readString reads the NUL-terminated string at addr from mem, a page at a
// time so that the read stops where the caller's mapping does.
func readString(mem int, addr uint64) (string, error) {
	page := uint64(os.Getpagesize())
	var out []byte
	buf := make([]byte, page)
	for len(out) < unix.PathMax {
		chunk := buf[:page-addr%page]
		n, err := unix.Pread(mem, chunk, int64(addr))
		if err != nil {
			return "", err
		}
		if n == 0 {
			return "", unix.EFAULT
		}
		if i := bytes.IndexByte(chunk[:n], 0); i >= 0 {
			return string(append(out, chunk[:i]...)), nil
		}
		out = append(out, chunk[:n]...)
		addr += uint64(n)
	}
	return "", unix.ENAMETOOLONG
}

// Package pagein moves another process's memory between RAM and swap from
// outside it, with process_madvise(2) over the process's mappings:
// MADV_WILLNEED reads swapped pages back (so a resumed sandbox does not
// fault them in one by one), MADV_PAGEOUT pushes them out. Both work on
// frozen tasks; they need CAP_SYS_NICE and ptrace rights over the task
// (root has both). WillNeedTmpfs does the same for the files in a mount
// namespace's tmpfs mounts (/dev/shm), which no mapping need reach.
package pagein

import (
	"bufio"
	"errors"
	"fmt"
	"os"
	"strconv"
	"strings"
	"unsafe"

	"golang.org/x/sys/unix"
)

// maxIov is the most ranges one process_madvise call takes (UIO_MAXIOV).
const maxIov = 1024

// WillNeed asks the kernel to read pid's swapped-out anonymous memory back
// into RAM, and returns the bytes of the ranges it was asked about.
func WillNeed(pid int) (int64, error) { return advise(pid, unix.MADV_WILLNEED) }

// PageOut asks the kernel to reclaim pid's anonymous memory (to swap), and
// returns the bytes of the ranges it was asked about.
func PageOut(pid int) (int64, error) { return advise(pid, unix.MADV_PAGEOUT) }

func advise(pid, advice int) (int64, error) {
	ranges, err := anonRanges(pid)
	if err != nil {
		return 0, err
	}
	if len(ranges) == 0 {
		return 0, nil
	}
	fd, err := unix.PidfdOpen(pid, 0)
	if err != nil {
		return 0, fmt.Errorf("open pidfd of %d: %w", pid, err)
	}
	defer unix.Close(fd)
	var total int64
	for len(ranges) > 0 {
		n := min(len(ranges), maxIov)
		iov := make([]iovec, n)
		for i, r := range ranges[:n] {
			iov[i] = iovec{base: r.start, len: r.end - r.start}
		}
		done, _, errno := unix.Syscall6(unix.SYS_PROCESS_MADVISE, uintptr(fd), uintptr(unsafe.Pointer(&iov[0])), uintptr(n), uintptr(advice), 0, 0)
		switch {
		case errno == unix.ESRCH:
			return total, nil // the process exited meanwhile
		case errno == unix.ENOMEM || errno == unix.EFAULT:
			// A range was unmapped meanwhile: advise the rest one by one.
			for i := range iov {
				if d, _, e := unix.Syscall6(unix.SYS_PROCESS_MADVISE, uintptr(fd), uintptr(unsafe.Pointer(&iov[i])), 1, uintptr(advice), 0, 0); e == 0 {
					total += int64(d)
				}
			}
		case errno != 0:
			return total, fmt.Errorf("process_madvise of %d: %w", pid, errno)
		default:
			total += int64(done)
		}
		ranges = ranges[n:]
	}
	return total, nil
}

type memRange struct{ start, end uintptr }

// iovec is struct iovec with the address as a number: the ranges are
// another process's, never dereferenced here.
type iovec struct {
	base uintptr
	len  uintptr
}

// anonRanges lists pid's mappings of the memory swap holds: private
// anonymous ones (heap, stacks, and mappings without a file) and shared
// memory of the kernel's own (System V segments, memfds, shared anonymous
// mappings). Shared mappings of files in a tmpfs the process can see
// (/dev/shm) are left to WillNeedTmpfs.
func anonRanges(pid int) ([]memRange, error) {
	f, err := os.Open("/proc/" + strconv.Itoa(pid) + "/maps")
	if errors.Is(err, os.ErrNotExist) {
		return nil, nil // exited
	}
	if err != nil {
		return nil, fmt.Errorf("read mappings of %d: %w", pid, err)
	}
	defer f.Close()
	var out []memRange
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		// start-end perms offset dev inode [path]
		fields := strings.Fields(sc.Text())
		if len(fields) < 5 {
			continue
		}
		perms, inode := fields[1], fields[4]
		path := ""
		if len(fields) > 5 {
			path = fields[5]
		}
		if len(perms) < 4 || !swapBacked(perms[3] == 's', inode, path) {
			continue
		}
		lo, hi, ok := strings.Cut(fields[0], "-")
		if !ok {
			continue
		}
		start, err1 := strconv.ParseUint(lo, 16, 64)
		end, err2 := strconv.ParseUint(hi, 16, 64)
		if err1 != nil || err2 != nil || end <= start {
			continue
		}
		out = append(out, memRange{uintptr(start), uintptr(end)})
	}
	if err := sc.Err(); err != nil {
		return nil, fmt.Errorf("read mappings of %d: %w", pid, err)
	}
	return out, nil
}

// swapBacked reports whether a mapping of /proc/PID/maps holds memory that
// swap backs: shared says its perms end in 's', inode and path are its
// fields (path only up to the first space).
func swapBacked(shared bool, inode, path string) bool {
	if shared {
		// The kernel's internal shmem files: "/SYSV0000002a (deleted)",
		// "/memfd:name (deleted)", "/dev/zero (deleted)" for a shared
		// anonymous mapping, "[anon_shmem:name]" for a named one.
		for _, p := range []string{"/SYSV", "/memfd:", "/dev/zero", "[anon_shmem"} {
			if strings.HasPrefix(path, p) {
				return true
			}
		}
		return false
	}
	if inode != "0" {
		return false // a private file mapping
	}
	return path == "" || path == "[heap]" || strings.HasPrefix(path, "[stack") || strings.HasPrefix(path, "[anon:")
}

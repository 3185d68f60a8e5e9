package proc

import (
	"errors"
	"fmt"
	"os"
	"strconv"
	"strings"
	"time"

	"golang.org/x/sys/unix"
)

// cgroup is one command's child cgroup under the sandbox's cgroup (a freezer
// cgroup on v1, a unified one on v2).
type cgroup struct {
	parent int // the sandbox's cgroup dir fd (not owned)
	name   string
	fd     int // O_DIRECTORY fd of the child cgroup
	v2     bool
}

// isV2 reports whether dirfd is a cgroup v2 directory.
func isV2(dirfd int) bool {
	return unix.Faccessat(dirfd, "cgroup.kill", unix.F_OK, 0) == nil ||
		unix.Faccessat(dirfd, "cgroup.subtree_control", unix.F_OK, 0) == nil
}

// newCgroup makes the child cgroup name under parent; v2 says which
// hierarchy parent is on, which the child shares.
func newCgroup(parent int, name string, v2 bool) (*cgroup, error) {
	if err := unix.Mkdirat(parent, name, 0o755); err != nil {
		return nil, fmt.Errorf("make cgroup %s: %w", name, err)
	}
	fd, err := unix.Openat(parent, name, unix.O_DIRECTORY|unix.O_RDONLY|unix.O_CLOEXEC, 0)
	if err != nil {
		unix.Unlinkat(parent, name, unix.AT_REMOVEDIR)
		return nil, fmt.Errorf("open cgroup %s: %w", name, err)
	}
	return &cgroup{parent: parent, name: name, fd: fd, v2: v2}, nil
}

func writeAt(dirfd int, file, data string) error {
	fd, err := unix.Openat(dirfd, file, unix.O_WRONLY|unix.O_CLOEXEC, 0)
	if err != nil {
		return err
	}
	defer unix.Close(fd)
	_, err = unix.Write(fd, []byte(data))
	return err
}

func readAt(dirfd int, file string) (string, error) {
	fd, err := unix.Openat(dirfd, file, unix.O_RDONLY|unix.O_CLOEXEC, 0)
	if err != nil {
		return "", err
	}
	f := os.NewFile(uintptr(fd), file)
	defer f.Close()
	var sb strings.Builder
	buf := make([]byte, 4096)
	for {
		n, err := f.Read(buf)
		sb.Write(buf[:n])
		if err != nil || n == 0 {
			break
		}
	}
	return sb.String(), nil
}

func (c *cgroup) add(pid int) error {
	if err := writeAt(c.fd, "cgroup.procs", strconv.Itoa(pid)); err != nil {
		return fmt.Errorf("move pid %d into cgroup %s: %w", pid, c.name, err)
	}
	return nil
}

func (c *cgroup) pids() []int {
	s, err := readAt(c.fd, "cgroup.procs")
	if err != nil {
		return nil
	}
	var out []int
	for _, f := range strings.Fields(s) {
		if p, err := strconv.Atoi(f); err == nil {
			out = append(out, p)
		}
	}
	return out
}

// signal sends sig to every process in the cgroup.
func (c *cgroup) signal(sig unix.Signal) {
	for _, p := range c.pids() {
		unix.Kill(p, sig)
	}
}

// kill SIGKILLs every process in the cgroup, including ones forking while it
// runs: v2 has cgroup.kill; v1 freezes the group so nobody forks between
// reading cgroup.procs and the kills.
func (c *cgroup) kill() {
	if c.v2 {
		if err := writeAt(c.fd, "cgroup.kill", "1"); err == nil {
			return
		}
		for i := 0; i < 100 && len(c.pids()) > 0; i++ {
			c.signal(unix.SIGKILL)
			time.Sleep(10 * time.Millisecond)
		}
		return
	}
	for i := 0; i < 100; i++ {
		pids := c.pids()
		if len(pids) == 0 {
			return
		}
		frozen := writeAt(c.fd, "freezer.state", "FROZEN") == nil
		if frozen {
			for j := 0; j < 100; j++ {
				s, _ := readAt(c.fd, "freezer.state")
				if strings.TrimSpace(s) == "FROZEN" {
					break
				}
				time.Sleep(time.Millisecond)
			}
		}
		for _, p := range c.pids() {
			unix.Kill(p, unix.SIGKILL)
		}
		if frozen {
			writeAt(c.fd, "freezer.state", "THAWED")
		}
		time.Sleep(time.Millisecond)
	}
}

// remove deletes the cgroup; it fails while processes remain.
func (c *cgroup) remove() error {
	err := unix.Unlinkat(c.parent, c.name, unix.AT_REMOVEDIR)
	if err == nil || errors.Is(err, unix.ENOENT) {
		if c.fd >= 0 {
			unix.Close(c.fd)
			c.fd = -1
		}
		return nil
	}
	return err
}

// memCgroup reads the OOM kill count and the memory limit of the sandbox.
// The file with the count is opened once and re-read from its start for
// every command: opening it each time cost a few syscalls per exec.
type memCgroup struct {
	fd      int // the sandbox's memory cgroup directory, or -1
	events  int // memory.events (v2) or memory.oom_control (v1), or -1
	v2      bool
	failcnt []int // memory.failcnt and memory.memsw.failcnt (v1), those that exist
}

func openMemCgroup(dirfd int) memCgroup {
	m := memCgroup{fd: dirfd, events: -1}
	if dirfd < 0 {
		return m
	}
	for _, file := range []string{"memory.events", "memory.oom_control"} {
		if fd, err := unix.Openat(dirfd, file, unix.O_RDONLY|unix.O_CLOEXEC, 0); err == nil {
			m.events, m.v2 = fd, file == "memory.events"
			break
		}
	}
	if !m.v2 {
		for _, file := range []string{"memory.failcnt", "memory.memsw.failcnt"} {
			if fd, err := unix.Openat(dirfd, file, unix.O_RDONLY|unix.O_CLOEXEC, 0); err == nil {
				m.failcnt = append(m.failcnt, fd)
			}
		}
	}
	return m
}

func (m memCgroup) oomKills() int64 { return OOMKills(m.events) }

// limitHits counts the times the sandbox's memory cgroup, or one under it,
// reached its own limit: memory.events' oom (v2); on v1 the sum of
// memory.failcnt and memory.memsw.failcnt (charges that failed at this
// cgroup's memory or memory+swap limit, reclaimed or not); -1 where none
// can be read. A limit above the sandbox (the node's memory, the parent of
// every sandbox) moves none of them.
func (m memCgroup) limitHits() int64 {
	if m.v2 {
		return eventCount(m.events, "oom ", -1)
	}
	if len(m.failcnt) == 0 {
		return -1
	}
	var sum int64
	for _, fd := range m.failcnt {
		var buf [32]byte
		n, err := unix.Pread(fd, buf[:], 0)
		if err != nil || n <= 0 {
			return -1
		}
		v, err := strconv.ParseInt(strings.TrimSpace(string(buf[:n])), 10, 64)
		if err != nil {
			return -1
		}
		sum += v
	}
	return sum
}

// OOMKills reads the oom_kill count of a memory cgroup's open
// memory.oom_control (v1) or memory.events (v2) file; 0 for fd < 0 or
// an unreadable file.
func OOMKills(fd int) int64 { return eventCount(fd, "oom_kill ", 0) }

// eventCount reads the count on the line starting with key of an open
// memory.events or memory.oom_control file; none when it has no such line
// or cannot be read.
func eventCount(fd int, key string, none int64) int64 {
	if fd < 0 {
		return none
	}
	var buf [1024]byte
	n, err := unix.Pread(fd, buf[:], 0)
	if err != nil || n <= 0 {
		return none
	}
	for line := range strings.SplitSeq(string(buf[:n]), "\n") {
		if v, ok := strings.CutPrefix(line, key); ok {
			k, _ := strconv.ParseInt(strings.TrimSpace(v), 10, 64)
			return k
		}
	}
	return none
}

// peakAtLimit says whether the sandbox's memory use ever came within a
// 32nd of its limit (v1's memory.max_usage_in_bytes, the peak; this
// kernel's v1 may leave failcnt at 0). True when it cannot tell (no limit,
// no file): an OOM kill is then the task's. On v2 limitHits is exact, so
// false.
func (m memCgroup) peakAtLimit() bool {
	if m.v2 {
		return false
	}
	l := m.limit()
	s, err := readAt(m.fd, "memory.max_usage_in_bytes")
	if l <= 0 || err != nil {
		return true
	}
	peak, err := strconv.ParseInt(strings.TrimSpace(s), 10, 64)
	return err != nil || peak >= l-l/32
}

// limit is the memory limit in bytes, or 0 when none.
func (m memCgroup) limit() int64 {
	if m.fd < 0 {
		return 0
	}
	for _, file := range []string{"memory.max", "memory.limit_in_bytes"} {
		s, err := readAt(m.fd, file)
		if err != nil {
			continue
		}
		n, err := strconv.ParseInt(strings.TrimSpace(s), 10, 64)
		if err != nil || n >= 1<<60 {
			return 0
		}
		return n
	}
	return 0
}

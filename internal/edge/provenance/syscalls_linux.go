package provenance

import (
	"encoding/binary"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"slices"
	"strconv"
	"strings"
	"time"

	"golang.org/x/sys/unix"

	"dsec.dev/dsec/internal/errdefs"
)

// Audit netlink constants (linux/audit.h).
const (
	auditNlgrpReadlog = 1    // the read-only multicast group
	auditSeccomp      = 1326 // AUDIT_SECCOMP
)

// DefaultSyscallRate is the records a second a SyscallLog reads at most.
const DefaultSyscallRate = 5000

// syscallRcvBuf is the socket's receive buffer: what waits while the
// reader is behind or resting (a few hundred records); the kernel drops
// what does not fit.
const syscallRcvBuf = 256 << 10

// SyscallLog records the syscalls sandboxes' seccomp profiles refused. A
// container sandbox's agent refuses the same calls as its profile with a
// filter loaded with SECCOMP_FILTER_FLAG_LOG (dsec-agent --log-refusals),
// so the kernel writes an audit record (AUDIT_SECCOMP: pid, command,
// syscall, audit session) for each refusal; this reads them from the audit netlink
// socket's read-only multicast group, which needs no audit daemon and
// changes nothing in the node's audit setup. Records are attributed by
// audit session: the backend starts each container in a session of its own,
// which its processes inherit and cannot change (that needs
// CAP_AUDIT_CONTROL), so a record names its sandbox even after its process
// ended.
//
// A sandbox that refuses calls in a tight loop pays about 13 µs a call in
// its own CPU time for the record; the node pays kauditd's ~2.4 µs and this
// reader's, which reads at most rate records a second: past it the socket
// fills and the kernel drops the rest, counted by the gaps in the records'
// serials (Denials.Lost). Memory is bounded: a count per syscall and
// maxSyscallSamples calls per sandbox.
//
// A SyscallLog must be closed; Track, Denials and Forget may be called
// from any goroutine.
type SyscallLog struct {
	f    *os.File
	log  *slog.Logger
	rate int
	own  uint32 // this process's audit session: never a sandbox's
	book *syscallBook
	done chan struct{}
}

// NewSyscallLog joins the audit multicast group (root: CAP_AUDIT_READ)
// and reads at most rate records a second (DefaultSyscallRate if 0).
func NewSyscallLog(log *slog.Logger, rate int) (*SyscallLog, error) {
	if rate <= 0 {
		rate = DefaultSyscallRate
	}
	if err := errnoLogged(); err != nil {
		return nil, err
	}
	fd, err := unix.Socket(unix.AF_NETLINK, unix.SOCK_RAW|unix.SOCK_CLOEXEC|unix.SOCK_NONBLOCK, unix.NETLINK_AUDIT)
	if err != nil {
		return nil, fmt.Errorf("open audit socket: %w: %w", err, errdefs.ErrNotSupported)
	}
	if err := unix.SetsockoptInt(fd, unix.SOL_SOCKET, unix.SO_RCVBUF, syscallRcvBuf); err != nil {
		unix.Close(fd)
		return nil, fmt.Errorf("size audit socket: %w", err)
	}
	if err := unix.Bind(fd, &unix.SockaddrNetlink{Family: unix.AF_NETLINK, Groups: 1 << (auditNlgrpReadlog - 1)}); err != nil {
		unix.Close(fd)
		return nil, fmt.Errorf("join audit multicast group: %w: %w", err, errdefs.ErrNotSupported)
	}
	own, err := ReadSession(os.Getpid())
	if err != nil {
		unix.Close(fd)
		return nil, err
	}
	l := &SyscallLog{f: os.NewFile(uintptr(fd), "audit"), log: log, rate: rate, own: own, book: newSyscallBook(), done: make(chan struct{})}
	go l.run()
	return l, nil
}

// errnoLogged checks that the kernel logs the errno action of filters
// that ask for it (kernel.seccomp.actions_logged, which an administrator
// may narrow).
func errnoLogged() error {
	b, err := os.ReadFile("/proc/sys/kernel/seccomp/actions_logged")
	if err != nil {
		return fmt.Errorf("read kernel.seccomp.actions_logged: %w: %w", err, errdefs.ErrNotSupported)
	}
	if !slices.Contains(strings.Fields(string(b)), "errno") {
		return fmt.Errorf("kernel.seccomp.actions_logged (%s) leaves out errno: %w", strings.TrimSpace(string(b)), errdefs.ErrNotSupported)
	}
	return nil
}

// ReadSession returns process pid's audit session id.
func ReadSession(pid int) (uint32, error) {
	b, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/sessionid")
	if err != nil {
		return 0, fmt.Errorf("read audit session: %w", err)
	}
	n, err := strconv.ParseUint(strings.TrimSpace(string(b)), 10, 32)
	if err != nil {
		return 0, fmt.Errorf("read audit session of %d: %w", pid, err)
	}
	return uint32(n), nil
}

// Close stops the reader.
func (l *SyscallLog) Close() error {
	err := l.f.Close()
	<-l.done
	return err
}

// Track attributes the records of audit session to sandbox id. A session
// never set, or this process's own (which every process it starts shares
// unless given its own), is refused: it names no one sandbox.
func (l *SyscallLog) Track(id string, session uint32) error {
	if session == noSession || session == l.own {
		return fmt.Errorf("track refused syscalls of %s: audit session %d is not its own: %w", id, session, errdefs.ErrFailedPrecondition)
	}
	l.book.track(id, session)
	return nil
}

// Denials returns what sandbox id's profile refused; ok is false when it
// is not tracked.
func (l *SyscallLog) Denials(id string) (Denials, bool) { return l.book.denials(id) }

// Forget drops sandbox id's record.
func (l *SyscallLog) Forget(id string) { l.book.forget(id) }

func (l *SyscallLog) run() {
	defer close(l.done)
	buf := make([]byte, 64<<10)
	window, n := time.Now(), 0
	for {
		if n >= l.rate {
			// Rest out the second: the kernel drops what the socket
			// cannot hold, and the serials' gap counts it.
			time.Sleep(time.Until(window.Add(time.Second)))
		}
		if now := time.Now(); now.Sub(window) >= time.Second {
			window, n = now, 0
		}
		m, err := l.f.Read(buf)
		if errors.Is(err, unix.ENOBUFS) {
			continue
		}
		if err != nil {
			if !errors.Is(err, os.ErrClosed) {
				l.log.Warn("read audit socket", "err", err)
			}
			return
		}
		n++
		l.handle(buf[:m])
	}
}

// handle reads one datagram: netlink messages, of which seccomp records
// are counted and every record's serial checked for a gap.
func (l *SyscallLog) handle(b []byte) {
	for len(b) >= unix.NLMSG_HDRLEN {
		size := int(binary.NativeEndian.Uint32(b[0:4]))
		typ := binary.NativeEndian.Uint16(b[4:6])
		if size < unix.NLMSG_HDRLEN || size > len(b) {
			return
		}
		data := b[unix.NLMSG_HDRLEN:size]
		if typ == auditSeccomp {
			rec, err := parseSeccomp(data)
			if err != nil {
				l.log.Debug("skip audit record", "err", err)
			} else {
				l.book.seen(rec.serial)
				l.book.add(rec)
			}
		} else if serial, ok := recordSerial(data); ok {
			l.book.seen(serial)
		}
		b = b[min(len(b), (size+unix.NLMSG_ALIGNTO-1)&^(unix.NLMSG_ALIGNTO-1)):]
	}
}

// recordSerial reads the serial of any record's audit(TIME:SERIAL) stamp.
func recordSerial(data []byte) (uint64, bool) {
	s := string(data[:min(len(data), 64)])
	rest, ok := strings.CutPrefix(s, "audit(")
	if !ok {
		return 0, false
	}
	stamp, _, ok := strings.Cut(rest, ")")
	if !ok {
		return 0, false
	}
	_, serial, ok := strings.Cut(stamp, ":")
	if !ok {
		return 0, false
	}
	n, err := strconv.ParseUint(serial, 10, 64)
	return n, err == nil
}

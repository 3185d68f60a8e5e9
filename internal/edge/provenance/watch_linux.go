package provenance

import (
	"encoding/binary"
	"errors"
	"fmt"
	"io/fs"
	"log/slog"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"time"

	"golang.org/x/sys/unix"

	dsecv1 "dsec.dev/dsec/api/gen/dsec/v1"
	"dsec.dev/dsec/internal/errdefs"
)

// maxMarks bounds the marks one sandbox's protected dirs take: a dir is
// marked with each dir below it, as fanotify's marks on a dir see only its
// own entries.
const maxMarks = 4096

// maxReads bounds the distinct reads kept per sandbox.
const maxReads = 1000

// Watcher records which processes open a sandbox's protected paths. It
// holds one fanotify group for the node; each protected path is marked on
// the inode the sandbox's processes see (through /proc/PID/root of its
// agent), so an open by any process of the sandbox is reported with its
// pid and nothing else on the node costs an event. Opens by the agent
// itself (the API's file calls) are not counted.
//
// A Watcher must be closed; Watch, Reads and Forget may be called from
// any goroutine.
type Watcher struct {
	f   *os.File
	log *slog.Logger

	mu    sync.Mutex
	byMnt map[uint64]*watched // the sandbox whose root file system each mount is
	byID  map[string]*watched
	done  chan struct{}
}

type watched struct {
	id  string
	mnt uint64 // its root's mount ID
	// prefix is the root's path as this process sees it: a mount it can
	// reach shows in an opened file's path ("/" for a sandbox's root,
	// which it cannot).
	prefix string
	agent  int // the agent's host pid: its own opens are the API's
	reads  map[readKey]*dsecv1.ProvenanceRead
}

type readKey struct {
	path string
	pid  int32
}

// NewWatcher makes the node's fanotify group (root only).
func NewWatcher(log *slog.Logger) (*Watcher, error) {
	fd, err := unix.FanotifyInit(unix.FAN_CLASS_NOTIF|unix.FAN_CLOEXEC|unix.FAN_NONBLOCK, unix.O_RDONLY|unix.O_LARGEFILE|unix.O_CLOEXEC)
	if err != nil {
		return nil, fmt.Errorf("make fanotify group: %w: %w", err, errdefs.ErrNotSupported)
	}
	w := &Watcher{
		f: os.NewFile(uintptr(fd), "fanotify"), log: log,
		byMnt: map[uint64]*watched{}, byID: map[string]*watched{}, done: make(chan struct{}),
	}
	go w.run()
	return w, nil
}

// Close stops the watcher; its marks go with its group.
func (w *Watcher) Close() error {
	err := w.f.Close()
	<-w.done
	return err
}

// Watch marks sandbox id's protected paths, seen through root (a host path
// showing the sandbox's root file system as its processes see it), whose
// agent runs as host pid agent. It returns the paths it could not mark,
// each with why. Watching a sandbox again adds to its marks.
func (w *Watcher) Watch(id, root string, agent int, paths []string) ([]string, error) {
	mnt, err := mountID(unix.AT_FDCWD, root, 0)
	if err != nil {
		return nil, fmt.Errorf("watch protected paths of %s: %w", id, err)
	}
	prefix, err := filepath.EvalSymlinks(root)
	if err != nil {
		return nil, fmt.Errorf("watch protected paths of %s: %w", id, err)
	}
	w.mu.Lock()
	s := w.byID[id]
	if s == nil {
		s = &watched{id: id, reads: map[readKey]*dsecv1.ProvenanceRead{}}
		w.byID[id] = s
	}
	s.prefix = prefix
	s.agent = agent
	if s.mnt != 0 && w.byMnt[s.mnt] == s {
		delete(w.byMnt, s.mnt)
	}
	s.mnt = mnt
	w.byMnt[mnt] = s
	w.mu.Unlock()

	var unwatched []string
	marks := 0
	for _, p := range paths {
		full := filepath.Join(root, filepath.Clean("/"+p))
		info, err := os.Lstat(full)
		if err != nil {
			unwatched = append(unwatched, fmt.Sprintf("%s: %v", p, errors.Unwrap(err)))
			continue
		}
		if !info.IsDir() {
			if err := w.mark(full, false); err != nil {
				unwatched = append(unwatched, fmt.Sprintf("%s: %v", p, err))
			}
			marks++
			continue
		}
		err = filepath.WalkDir(full, func(q string, d fs.DirEntry, err error) error {
			if err != nil || !d.IsDir() {
				return nil
			}
			if marks++; marks > maxMarks {
				return fmt.Errorf("more than %d dirs below", maxMarks)
			}
			return w.mark(q, true)
		})
		if err != nil {
			unwatched = append(unwatched, fmt.Sprintf("%s: %v", p, err))
		}
	}
	return unwatched, nil
}

// mark adds a mark on path: opens of it, or with dir of its entries.
func (w *Watcher) mark(path string, dir bool) error {
	mask := uint64(unix.FAN_OPEN)
	if dir {
		mask |= unix.FAN_EVENT_ON_CHILD
	}
	if err := unix.FanotifyMark(int(w.f.Fd()), unix.FAN_MARK_ADD, mask, unix.AT_FDCWD, path); err != nil {
		return fmt.Errorf("mark %s: %w", path, err)
	}
	return nil
}

// Reads returns the protected reads of sandbox id so far, by path.
func (w *Watcher) Reads(id string) []*dsecv1.ProvenanceRead {
	w.mu.Lock()
	defer w.mu.Unlock()
	s := w.byID[id]
	if s == nil {
		return nil
	}
	out := make([]*dsecv1.ProvenanceRead, 0, len(s.reads))
	for _, r := range s.reads {
		out = append(out, &dsecv1.ProvenanceRead{Path: r.Path, TimeUnixMs: r.TimeUnixMs, Pid: r.Pid, Command: r.Command, Count: r.Count})
	}
	sortReads(out)
	return out
}

// Forget drops sandbox id (deleted): its marks went with its file system.
func (w *Watcher) Forget(id string) {
	w.mu.Lock()
	defer w.mu.Unlock()
	if s := w.byID[id]; s != nil {
		delete(w.byID, id)
		if w.byMnt[s.mnt] == s {
			delete(w.byMnt, s.mnt)
		}
	}
}

func (w *Watcher) run() {
	defer close(w.done)
	buf := make([]byte, 64<<10)
	for {
		n, err := w.f.Read(buf)
		if err != nil {
			if !errors.Is(err, os.ErrClosed) {
				w.log.Warn("read fanotify events; protected reads are no longer seen", "err", err)
			}
			return
		}
		w.handle(buf[:n])
	}
}

// handle records a batch of events. Each carries an fd of the opened file
// (closed here), whose mount says the sandbox (an overlay's files report
// their layer's device, not the overlay's, so the device cannot) and whose
// path, read from /proc/self/fd, is the sandbox's own: its root file
// system is a mount the host cannot reach by path.
func (w *Watcher) handle(b []byte) {
	const metaLen = 24 // struct fanotify_event_metadata
	for len(b) >= metaLen {
		evLen := int(binary.NativeEndian.Uint32(b[0:4]))
		if evLen < metaLen || evLen > len(b) {
			return
		}
		fd := int32(binary.NativeEndian.Uint32(b[16:20]))
		pid := int32(binary.NativeEndian.Uint32(b[20:24]))
		b = b[evLen:]
		if fd < 0 {
			continue // FAN_NOFD: the queue overflowed
		}
		w.record(int(fd), pid)
		unix.Close(int(fd))
	}
}

func (w *Watcher) record(fd int, pid int32) {
	var st unix.Statx_t
	if err := unix.Statx(fd, "", unix.AT_EMPTY_PATH, unix.STATX_TYPE|unix.STATX_MNT_ID, &st); err != nil ||
		st.Mode&unix.S_IFMT == unix.S_IFDIR || st.Mask&unix.STATX_MNT_ID == 0 {
		return
	}
	path, err := os.Readlink("/proc/self/fd/" + strconv.Itoa(fd))
	if err != nil {
		return
	}
	w.mu.Lock()
	defer w.mu.Unlock()
	s := w.byMnt[st.Mnt_id]
	if s == nil || int(pid) == s.agent {
		return
	}
	if rel, ok := strings.CutPrefix(path, s.prefix); ok && s.prefix != "/" && strings.HasPrefix(rel, "/") {
		path = rel
	}
	k := readKey{path, pid}
	if r := s.reads[k]; r != nil {
		r.Count++
		return
	}
	if len(s.reads) >= maxReads {
		return
	}
	comm, _ := os.ReadFile("/proc/" + strconv.Itoa(int(pid)) + "/comm")
	s.reads[k] = &dsecv1.ProvenanceRead{Path: path, TimeUnixMs: time.Now().UnixMilli(), Pid: pid, Command: strings.TrimSpace(string(comm)), Count: 1}
}

// mountID is the ID of the mount holding path (relative to dirfd).
func mountID(dirfd int, path string, flags int) (uint64, error) {
	var st unix.Statx_t
	if err := unix.Statx(dirfd, path, flags, unix.STATX_MNT_ID, &st); err != nil {
		return 0, fmt.Errorf("statx %s: %w", path, err)
	}
	if st.Mask&unix.STATX_MNT_ID == 0 {
		return 0, fmt.Errorf("statx %s: no mount ID: %w", path, errdefs.ErrNotSupported)
	}
	return st.Mnt_id, nil
}

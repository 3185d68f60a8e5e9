package fs

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"unsafe"

	"golang.org/x/sys/unix"

	dsecv1 "dsec.dev/dsec/api/gen/dsec/v1"
	"dsec.dev/dsec/internal/agent/account"
	"dsec.dev/dsec/internal/errdefs"
)

// MaxWatchDirs bounds the directories one recursive watch holds (one
// inotify watch each), well inside the kernel's default of 8192 per user.
const MaxWatchDirs = 4096

// watchMask is what a watched directory reports: its entries made, moved
// in or out, removed, written or changed in metadata, and itself going.
const watchMask = unix.IN_CREATE | unix.IN_MOVED_TO | unix.IN_MOVED_FROM | unix.IN_DELETE | unix.IN_MODIFY |
	unix.IN_ATTRIB | unix.IN_DELETE_SELF | unix.IN_MOVE_SELF | unix.IN_ONLYDIR | unix.IN_DONT_FOLLOW | unix.IN_EXCL_UNLINK

// Watch sends the changes below the directory p, recursively when asked,
// until ctx ends (nil) or p is removed or moved away (not found). started
// is called once the watches are in place. Watches are added with a's
// credentials, so a directory a cannot read is refused as it would be to a
// process of a. A directory made below p while the watch runs is watched
// from the moment its create is seen: what is made in it before then is
// not reported, as with any inotify watcher.
func (f *FS) Watch(ctx context.Context, a account.Account, p string, recursive bool, started func() error, send func(name string, c dsecv1.FileChange) error) error {
	p, err := f.abs(a, p)
	if err != nil {
		return err
	}
	fd, err := unix.InotifyInit1(unix.IN_CLOEXEC | unix.IN_NONBLOCK)
	if err != nil {
		return wrap("watch", p, err)
	}
	// A non-blocking descriptor goes to Go's poller: Read parks the
	// goroutine, and Close wakes it.
	file := os.NewFile(uintptr(fd), "inotify")
	defer file.Close()
	w := &watcher{fd: fd, a: a, root: p, recursive: recursive, dirs: map[int32]string{}}
	if err := w.add(""); err != nil {
		return err
	}
	if err := started(); err != nil {
		return err
	}
	stop := context.AfterFunc(ctx, func() { file.Close() })
	defer stop()
	buf := make([]byte, 64<<10)
	for {
		n, err := file.Read(buf)
		if err != nil {
			if ctx.Err() != nil {
				return nil
			}
			return fmt.Errorf("watch %s: read events: %v: %w", p, err, errdefs.ErrInternal)
		}
		for off := 0; off+unix.SizeofInotifyEvent <= n; {
			ev := (*unix.InotifyEvent)(unsafe.Pointer(&buf[off]))
			name := ""
			if ev.Len > 0 {
				end := off + unix.SizeofInotifyEvent + int(ev.Len)
				if end > n {
					break
				}
				name = strings.TrimRight(string(buf[off+unix.SizeofInotifyEvent:end]), "\x00")
			}
			off += unix.SizeofInotifyEvent + int(ev.Len)
			if err := w.handle(ev.Wd, ev.Mask, name, send); err != nil {
				return err
			}
		}
	}
}

// watcher is one Watch's inotify descriptor and the directories it holds,
// by watch descriptor, relative to root.
type watcher struct {
	fd        int
	a         account.Account
	root      string
	recursive bool
	dirs      map[int32]string
}

// add watches the directory rel (relative to root), and the directories
// below it when recursive. Only rel itself must succeed: a subdirectory
// that vanished or cannot be read is skipped.
func (w *watcher) add(rel string) error {
	full := filepath.Join(w.root, rel)
	var wd int
	err := asUser(w.a, func() error {
		var err error
		wd, err = unix.InotifyAddWatch(w.fd, full, watchMask)
		return err
	})
	if err != nil {
		if errors.Is(err, unix.ENOSPC) {
			return fmt.Errorf("watch %s: the sandbox's inotify watches are used up: %w", full, errdefs.ErrResourceExhausted)
		}
		if errors.Is(err, unix.ENOTDIR) {
			return fmt.Errorf("watch %s: not a directory: %w", full, errdefs.ErrInvalidArgument)
		}
		return wrap("watch", full, err)
	}
	w.dirs[int32(wd)] = rel
	if !w.recursive {
		return nil
	}
	var subs []string
	asUser(w.a, func() error {
		ents, _ := os.ReadDir(full)
		for _, e := range ents {
			if e.IsDir() {
				subs = append(subs, filepath.Join(rel, e.Name()))
			}
		}
		return nil
	})
	for _, s := range subs {
		if len(w.dirs) >= MaxWatchDirs {
			return fmt.Errorf("watch %s: more than %d directories below it: %w", w.root, MaxWatchDirs, errdefs.ErrResourceExhausted)
		}
		if err := w.add(s); err != nil && !errors.Is(err, errdefs.ErrNotFound) && !errors.Is(err, errdefs.ErrPermissionDenied) && !errors.Is(err, errdefs.ErrInvalidArgument) {
			return err
		}
	}
	return nil
}

// handle turns one inotify event into what send takes.
func (w *watcher) handle(wd int32, mask uint32, name string, send func(string, dsecv1.FileChange) error) error {
	if mask&unix.IN_Q_OVERFLOW != 0 {
		return fmt.Errorf("watch %s: the kernel's event queue overflowed; changes were lost: %w", w.root, errdefs.ErrResourceExhausted)
	}
	dir, ok := w.dirs[wd]
	if !ok {
		return nil
	}
	if mask&unix.IN_IGNORED != 0 {
		delete(w.dirs, wd)
		if dir == "" {
			return fmt.Errorf("watch %s: the directory is gone: %w", w.root, errdefs.ErrNotFound)
		}
		return nil
	}
	if mask&(unix.IN_DELETE_SELF|unix.IN_MOVE_SELF) != 0 {
		if dir == "" {
			return fmt.Errorf("watch %s: the directory was removed or moved: %w", w.root, errdefs.ErrNotFound)
		}
		return nil // its parent reports it
	}
	rel := filepath.Join(dir, name)
	var c dsecv1.FileChange
	switch {
	case mask&(unix.IN_CREATE|unix.IN_MOVED_TO) != 0:
		c = dsecv1.FileChange_FILE_CHANGE_CREATE
		if w.recursive && mask&unix.IN_ISDIR != 0 && len(w.dirs) < MaxWatchDirs {
			w.add(rel) // best effort: it may be gone already
		}
	case mask&unix.IN_MODIFY != 0:
		c = dsecv1.FileChange_FILE_CHANGE_WRITE
	case mask&unix.IN_DELETE != 0:
		c = dsecv1.FileChange_FILE_CHANGE_REMOVE
	case mask&unix.IN_MOVED_FROM != 0:
		c = dsecv1.FileChange_FILE_CHANGE_RENAME
		if mask&unix.IN_ISDIR != 0 {
			w.drop(rel) // watched again under its new name, if that is below root
		}
	case mask&unix.IN_ATTRIB != 0:
		c = dsecv1.FileChange_FILE_CHANGE_CHMOD
	default:
		return nil
	}
	return send(rel, c)
}

// drop stops watching the directory rel and everything below it.
func (w *watcher) drop(rel string) {
	for wd, d := range w.dirs {
		if d == rel || strings.HasPrefix(d, rel+"/") {
			unix.InotifyRmWatch(w.fd, uint32(wd))
			delete(w.dirs, wd)
		}
	}
}

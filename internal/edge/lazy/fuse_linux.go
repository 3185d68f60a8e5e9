package lazy

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"sync"
	"syscall"
	"time"

	"github.com/hanwen/go-fuse/v2/fs"
	"github.com/hanwen/go-fuse/v2/fuse"
	"golang.org/x/sys/unix"

	"dsec.dev/dsec/internal/errdefs"
)

// Layer files never change, so the kernel may keep their attributes, names
// and pages for long; Remove invalidates the name explicitly. Negative
// lookups are not cached because a layer may be added at any time.
const (
	entryTimeout = time.Hour
	attrTimeout  = time.Hour
)

// mountState is the FUSE side of an FS.
type mountState struct {
	server *fuse.Server
	root   *rootNode
	pushes chan pushJob // nil: pages are not pushed (Config.NoPagePush)

	closeOnce sync.Once
	closeErr  error         // set before done is closed
	done      chan struct{} // closed when serving has stopped
}

// rootNode is the mount's root directory; its children are the layer files.
type rootNode struct {
	fs.Inode
}

var _ fs.NodeGetattrer = (*rootNode)(nil)

func (r *rootNode) Getattr(ctx context.Context, fh fs.FileHandle, out *fuse.AttrOut) syscall.Errno {
	out.Mode = syscall.S_IFDIR | 0o555
	return 0
}

// fileNode is one layer file: read-only, immutable.
type fileNode struct {
	fs.Inode
	f *FS
	l *layer
}

var (
	_ fs.NodeGetattrer = (*fileNode)(nil)
	_ fs.NodeOpener    = (*fileNode)(nil)
	_ fs.NodeReader    = (*fileNode)(nil)
)

func (n *fileNode) Getattr(ctx context.Context, fh fs.FileHandle, out *fuse.AttrOut) syscall.Errno {
	out.Mode = syscall.S_IFREG | 0o444
	out.Size = uint64(n.l.ix.Size)
	out.Blocks = (out.Size + 511) / 512
	out.Blksize = 4096
	out.Nlink = 1
	return 0
}

func (n *fileNode) Open(ctx context.Context, flags uint32) (fs.FileHandle, uint32, syscall.Errno) {
	if flags&(syscall.O_WRONLY|syscall.O_RDWR|syscall.O_TRUNC) != 0 {
		return nil, 0, syscall.EROFS
	}
	// The file is immutable: pages cached by an earlier open stay valid.
	return nil, fuse.FOPEN_KEEP_CACHE, 0
}

func (n *fileNode) Read(ctx context.Context, fh fs.FileHandle, dest []byte, off int64) (fuse.ReadResult, syscall.Errno) {
	// The kernel cancels ctx when the reading thread gets a signal. Reads
	// are bounded by the fetch retries anyway, so finish them: a regular
	// file that fails with EINTR breaks programs, and mount(2) reading a
	// layer's superblock.
	data, err := n.f.readAt(context.WithoutCancel(ctx), n.l, dest, off)
	if err != nil {
		n.f.log.Error("read layer", "layer", n.l.hex, "offset", off, "bytes", len(dest), "err", err)
		return nil, syscall.EIO
	}
	return fuse.ReadResultData(data), 0
}

// Mount creates the cache (rebuilding its LRU from what an earlier run left)
// and mounts an empty FUSE file system on cfg.MountPoint. Layers appear in
// it as they are added. Close unmounts it.
func Mount(ctx context.Context, cfg Config) (*FS, error) {
	f, err := newFS(cfg)
	if err != nil {
		return nil, err
	}
	root := &rootNode{}
	et, at, nt := entryTimeout, attrTimeout, time.Duration(0)
	server, err := fs.Mount(f.cfg.MountPoint, root, &fs.Options{
		EntryTimeout:    &et,
		AttrTimeout:     &at,
		NegativeTimeout: &nt,
		MountOptions: fuse.MountOptions{
			FsName:            "dsec-lazy",
			Name:              "dsec-lazy",
			AllowOther:        true,
			DirectMountStrict: true,
			DisableXAttrs:     true,
			// Passthrough makes the kernel count this mount as a stacked
			// file system, and EROFS refuses file-backed mounts on those.
			DisabledCapabilities: fuse.CAP_PASSTHROUGH,
			// Reads are answered from memory, never from a file descriptor:
			// with splicing on, go-fuse would first write each reply's
			// header into a pipe, then find no descriptor and write the
			// reply again.
			DisableSplice: true,
			Logger:        slog.NewLogLogger(f.log.Handler(), slog.LevelWarn),
		},
	})
	if err != nil {
		f.cancel()
		return nil, fmt.Errorf("mount lazy fs on %s: %w", f.cfg.MountPoint, err)
	}
	f.mnt = mountState{server: server, root: root, done: make(chan struct{})}
	if !f.cfg.NoPagePush {
		f.startPushing()
	}
	f.log.Info("lazy fs mounted", "mountpoint", f.cfg.MountPoint, "cache", f.cfg.CacheDir,
		"cache_bytes", f.cfg.CacheBytes, "memory_bytes", f.cfg.MemoryBytes, "cached_bytes", f.cache.stats().DiskBytes)
	return f, nil
}

func (m *mountState) addFile(f *FS, l *layer) error {
	node := &fileNode{f: f, l: l}
	ch := m.root.NewPersistentInode(context.Background(), node, fs.StableAttr{Mode: syscall.S_IFREG})
	if !m.root.AddChild(l.hex, ch, false) {
		return fmt.Errorf("add layer file %s: %w", l.hex, errdefs.ErrAlreadyExists)
	}
	return nil
}

func (m *mountState) removeFile(hex string) {
	m.root.RmChild(hex)
	// Drop the kernel's cached name; ENOENT only means it had none.
	m.root.NotifyEntry(hex)
}

// dropPages makes the kernel forget the layer file's cached pages, so the
// next reads reach the file system (and its trace). Pushes queued before
// it are dropped, and the next read of any chunk pushes its pages again.
func (m *mountState) dropPages(l *layer) error {
	ch := m.root.GetChild(l.hex)
	if ch == nil {
		return fmt.Errorf("drop pages of layer file %s: %w", l.hex, errdefs.ErrNotFound)
	}
	l.pushMu.Lock()
	defer l.pushMu.Unlock()
	l.pushGen.Add(1)
	for i := range l.pushedAt {
		l.pushedAt[i].Store(0)
	}
	if errno := ch.NotifyContent(0, 0); errno != 0 && errno != syscall.ENOENT {
		return fmt.Errorf("drop pages of layer file %s: %w", l.hex, errno)
	}
	return nil
}

// Close unmounts the file system. When the mount is busy (an EROFS mount
// still uses a layer file), it is detached lazily and served until its last
// user goes; Close waits for that until ctx ends, then returns an error while
// serving goes on in the background. Fetching stops when serving does, and
// the hot chunks held only in memory are then written to the disk tier, so
// that the next run finds them. Calling Close again waits again.
func (f *FS) Close(ctx context.Context) error {
	m := &f.mnt
	m.closeOnce.Do(func() {
		if err := m.server.Unmount(); err != nil {
			f.log.Warn("unmount lazy fs busy, detaching", "mountpoint", f.cfg.MountPoint, "err", err)
			// EINVAL: no longer mounted, so serving is ending anyway.
			if err := unix.Unmount(f.cfg.MountPoint, unix.MNT_DETACH); err != nil && !errors.Is(err, unix.EINVAL) {
				m.closeErr = fmt.Errorf("detach lazy fs %s: %w", f.cfg.MountPoint, err)
			}
		}
		go func() {
			if m.closeErr == nil {
				m.server.Wait()
			}
			f.cancel()
			f.cache.flush()
			st := f.cache.stats()
			f.log.Info("lazy fs closed", "mountpoint", f.cfg.MountPoint, "memory_bytes", st.MemoryBytes, "decoded_bytes", st.DecodedBytes,
				"disk_bytes", st.DiskBytes, "disk_bytes_written", st.BytesWritten, "disk_chunks_written", st.ChunksWritten)
			close(m.done)
		}()
	})
	select {
	case <-m.done:
		return m.closeErr
	case <-ctx.Done():
		return fmt.Errorf("close lazy fs %s: still in use: %w", f.cfg.MountPoint, ctx.Err())
	}
}

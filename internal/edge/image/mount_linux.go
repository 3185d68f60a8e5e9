package image

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"sort"
	"strconv"
	"strings"

	"golang.org/x/sys/unix"

	"dsec.dev/dsec/internal/errdefs"
)

// erofsSuperMagic is what statfs reports for an EROFS mount (EROFS_SUPER_MAGIC_V1).
const erofsSuperMagic = 0xE0F5E1E2

// Mount mounts the layer read-only at <root>/mnt/<hex>, straight from its
// image file (file-backed EROFS, no loop device), and returns that directory.
// It is idempotent and safe for concurrent use, also across processes and
// restarts: a layer already mounted there is reused. The mount stays until
// Remove or UnmountAll.
func (s *Store) Mount(ctx context.Context, digest string) (string, error) {
	return s.MountFile(ctx, digest, "")
}

// MountFile is Mount with the image read from file instead of the store's
// own copy: a file served on demand, or one pulled whole from a blob store.
// file "" means the store's copy. A layer already mounted is reused
// whatever file it came from (they hold the same bytes).
func (s *Store) MountFile(ctx context.Context, digest, file string) (string, error) {
	hex, err := parseDigest(digest)
	if err != nil {
		return "", fmt.Errorf("mount layer: %w", err)
	}
	ix, err := s.load()
	if err != nil {
		return "", fmt.Errorf("mount layer %s: %w", digest, err)
	}
	if ix.Layers[hex] == nil {
		return "", fmt.Errorf("mount layer %s: %w", digest, errdefs.ErrNotFound)
	}
	dir := s.mountPath(hex)
	s.mountMu.Lock()
	defer s.mountMu.Unlock()
	unlock, err := lockFile(filepath.Join(s.root, "mnt.lock"))
	if err != nil {
		return "", fmt.Errorf("mount layer %s: lock: %w", digest, err)
	}
	defer unlock()
	mounted, err := isErofsMount(dir)
	if err != nil {
		return "", fmt.Errorf("mount layer %s: %w", digest, err)
	}
	if mounted {
		return dir, nil
	}
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return "", fmt.Errorf("mount layer %s: %w", digest, err)
	}
	if file == "" {
		file = s.blobPath(hex)
	}
	err = unix.Mount(file, dir, "erofs", unix.MS_RDONLY|unix.MS_NODEV, "")
	if errors.Is(err, unix.ENOENT) {
		return "", fmt.Errorf("mount layer %s: image file missing: %w", digest, errdefs.ErrNotFound)
	}
	if err != nil {
		return "", fmt.Errorf("mount layer %s at %s: %w", digest, dir, err)
	}
	s.log.Debug("mounted layer", "digest", digest, "dir", dir)
	return dir, nil
}

// isErofsMount reports whether dir is the root of an EROFS mount.
func isErofsMount(dir string) (bool, error) {
	var sfs unix.Statfs_t
	err := unix.Statfs(dir, &sfs)
	if errors.Is(err, unix.ENOENT) {
		return false, nil
	}
	if err != nil {
		return false, fmt.Errorf("statfs %s: %w", dir, err)
	}
	if uint32(sfs.Type) != erofsSuperMagic {
		return false, nil
	}
	var st, parent unix.Stat_t
	if err := unix.Lstat(dir, &st); err != nil {
		return false, fmt.Errorf("stat %s: %w", dir, err)
	}
	if err := unix.Lstat(filepath.Dir(dir), &parent); err != nil {
		return false, fmt.Errorf("stat %s: %w", filepath.Dir(dir), err)
	}
	return st.Dev != parent.Dev, nil
}

// unmountLayer detaches every mount at the layer's directory (lazily, so
// overlays already stacked on it keep working) and removes the directory.
func (s *Store) unmountLayer(ctx context.Context, hex string) error {
	dir := s.mountPath(hex)
	s.mountMu.Lock()
	defer s.mountMu.Unlock()
	unlock, err := lockFile(filepath.Join(s.root, "mnt.lock"))
	if err != nil {
		return fmt.Errorf("unmount layer sha256:%s: lock: %w", hex, err)
	}
	defer unlock()
	for range 16 {
		mounted, err := isErofsMount(dir)
		if err != nil {
			return fmt.Errorf("unmount layer sha256:%s: %w", hex, err)
		}
		if !mounted {
			break
		}
		if err := unix.Unmount(dir, unix.MNT_DETACH); err != nil {
			return fmt.Errorf("unmount layer sha256:%s: %w", hex, err)
		}
	}
	if err := os.Remove(dir); err != nil && !errors.Is(err, fs.ErrNotExist) {
		return fmt.Errorf("unmount layer sha256:%s: %w", hex, err)
	}
	return nil
}

// UnmountAll unmounts every layer mount of the store, for node teardown.
// Mounts still in use are detached lazily.
func (s *Store) UnmountAll(ctx context.Context) error {
	s.mountMu.Lock()
	defer s.mountMu.Unlock()
	unlock, err := lockFile(filepath.Join(s.root, "mnt.lock"))
	if err != nil {
		return fmt.Errorf("unmount layers: lock: %w", err)
	}
	defer unlock()
	prefix := s.mountPath("") // ends in "/"
	var errs []error
	for range 16 {
		points, err := mountPointsUnder(prefix)
		if err != nil {
			return fmt.Errorf("unmount layers: %w", err)
		}
		if len(points) == 0 {
			break
		}
		for _, p := range points {
			err := unix.Unmount(p, 0)
			if errors.Is(err, unix.EBUSY) {
				err = unix.Unmount(p, unix.MNT_DETACH)
			}
			if err != nil && !errors.Is(err, unix.EINVAL) && !errors.Is(err, unix.ENOENT) {
				errs = append(errs, fmt.Errorf("unmount %s: %w", p, err))
			}
		}
		if len(errs) > 0 {
			break
		}
	}
	ents, _ := os.ReadDir(prefix)
	for _, e := range ents {
		os.Remove(filepath.Join(prefix, e.Name())) // only empty directories go
	}
	if err := errors.Join(errs...); err != nil {
		return fmt.Errorf("unmount layers: %w", err)
	}
	return nil
}

// mountPointsUnder lists this mount namespace's mount points below prefix,
// deepest first.
func mountPointsUnder(prefix string) ([]string, error) {
	f, err := os.Open("/proc/self/mountinfo")
	if err != nil {
		return nil, err
	}
	defer f.Close()
	var out []string
	sc := bufio.NewScanner(f)
	sc.Buffer(make([]byte, 64<<10), 1<<20)
	for sc.Scan() {
		fields := strings.Fields(sc.Text())
		if len(fields) < 5 {
			continue
		}
		if p := unescapeMountPath(fields[4]); strings.HasPrefix(p, prefix) {
			out = append(out, p)
		}
	}
	if err := sc.Err(); err != nil {
		return nil, err
	}
	sort.Slice(out, func(i, j int) bool { return len(out[i]) > len(out[j]) })
	return out, nil
}

// unescapeMountPath undoes mountinfo's octal escapes (\040 for a space...).
func unescapeMountPath(s string) string {
	if !strings.Contains(s, `\`) {
		return s
	}
	var b strings.Builder
	for i := 0; i < len(s); i++ {
		if s[i] == '\\' && i+3 < len(s) {
			if n, err := strconv.ParseUint(s[i+1:i+4], 8, 8); err == nil {
				b.WriteByte(byte(n))
				i += 3
				continue
			}
		}
		b.WriteByte(s[i])
	}
	return b.String()
}

// LayerFile is the path of the store's own copy of a layer's image file.
// The file may be absent on a node that serves its layers from a blob store.
func (s *Store) LayerFile(digest string) (string, error) {
	hex, err := parseDigest(digest)
	if err != nil {
		return "", fmt.Errorf("layer file: %w", err)
	}
	return s.blobPath(hex), nil
}

// MountPoint is where Mount puts a layer.
func (s *Store) MountPoint(digest string) (string, error) {
	hex, err := parseDigest(digest)
	if err != nil {
		return "", fmt.Errorf("layer mount point: %w", err)
	}
	return s.mountPath(hex), nil
}

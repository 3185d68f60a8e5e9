package snapshot

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"unsafe"

	"golang.org/x/sys/unix"
)

// btrfs ioctls and constants (linux/btrfs.h, linux/magic.h).
const (
	btrfsIocSnapCreateV2 = 0x50009417 // _IOW(0x94, 23, struct btrfs_ioctl_vol_args_v2)
	btrfsIocSnapDestroy  = 0x5000940f // _IOW(0x94, 15, struct btrfs_ioctl_vol_args)
	btrfsIocInoLookup    = 0xd0009412 // _IOWR(0x94, 18, struct btrfs_ioctl_ino_lookup_args)
	btrfsSuperMagic      = 0x9123683e
	btrfsFirstFreeObject = 256 // the inode number of every subvolume's root
	btrfsTopLevel        = 5   // the ID of the file system's top-level subvolume
)

// struct btrfs_ioctl_vol_args_v2, 4096 bytes.
type btrfsVolArgsV2 struct {
	Fd      int64
	Transid uint64
	Flags   uint64
	Unused  [4]uint64
	Name    [4040]byte
}

// struct btrfs_ioctl_vol_args, 4096 bytes.
type btrfsVolArgs struct {
	Fd   int64
	Name [4088]byte
}

// struct btrfs_ioctl_ino_lookup_args.
type btrfsInoLookupArgs struct {
	TreeID   uint64
	ObjectID uint64
	Name     [4080]byte
}

func btrfsIoctl(fd int, req uintptr, arg unsafe.Pointer) error {
	if _, _, errno := unix.Syscall(unix.SYS_IOCTL, uintptr(fd), req, uintptr(arg)); errno != 0 {
		return errno
	}
	return nil
}

// subvolumeOf returns the root of the btrfs subvolume holding upper and
// upper's path inside it, when that subvolume is upper itself or its parent
// (as the runtime makes each sandbox's <UpperRoot>/<id>) and not the file
// system's top level; ok is false otherwise, and a snapshot would hold more
// than the sandbox's layer.
func subvolumeOf(upper string) (root, rel string, ok bool, err error) {
	var sfs unix.Statfs_t
	if err := unix.Statfs(upper, &sfs); err != nil {
		return "", "", false, fmt.Errorf("statfs %s: %w", upper, err)
	}
	if sfs.Type != btrfsSuperMagic {
		return "", "", false, nil
	}
	var st unix.Stat_t
	if err := unix.Lstat(upper, &st); err != nil {
		return "", "", false, fmt.Errorf("stat %s: %w", upper, err)
	}
	root, rel = upper, "."
	if st.Ino != btrfsFirstFreeObject {
		parent := filepath.Dir(upper)
		var pst unix.Stat_t
		if err := unix.Lstat(parent, &pst); err != nil {
			return "", "", false, fmt.Errorf("stat %s: %w", parent, err)
		}
		if pst.Ino != btrfsFirstFreeObject || pst.Dev != st.Dev {
			return "", "", false, nil
		}
		root, rel = parent, filepath.Base(upper)
	}
	id, err := subvolumeID(root)
	if err != nil {
		return "", "", false, err
	}
	return root, rel, id != btrfsTopLevel, nil
}

// subvolumeID is the ID of the subvolume holding dir.
func subvolumeID(dir string) (uint64, error) {
	fd, err := unix.Open(dir, unix.O_RDONLY|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
	if err != nil {
		return 0, fmt.Errorf("open %s: %w", dir, err)
	}
	defer unix.Close(fd)
	look := btrfsInoLookupArgs{ObjectID: btrfsFirstFreeObject}
	if err := btrfsIoctl(fd, btrfsIocInoLookup, unsafe.Pointer(&look)); err != nil {
		return 0, fmt.Errorf("look up the subvolume of %s: %w", dir, err)
	}
	return look.TreeID, nil
}

// snapshotSubvolume makes dst a writable snapshot of the subvolume src.
// dst's parent must be on the same btrfs (else EXDEV).
func snapshotSubvolume(src, dst string) error {
	name := filepath.Base(dst)
	if len(name) >= len(btrfsVolArgsV2{}.Name) {
		return fmt.Errorf("snapshot name %q is too long", name)
	}
	sfd, err := unix.Open(src, unix.O_RDONLY|unix.O_DIRECTORY|unix.O_CLOEXEC|unix.O_NOFOLLOW, 0)
	if err != nil {
		return fmt.Errorf("open %s: %w", src, err)
	}
	defer unix.Close(sfd)
	pfd, err := unix.Open(filepath.Dir(dst), unix.O_RDONLY|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
	if err != nil {
		return fmt.Errorf("open %s: %w", filepath.Dir(dst), err)
	}
	defer unix.Close(pfd)
	args := btrfsVolArgsV2{Fd: int64(sfd)}
	copy(args.Name[:], name)
	if err := btrfsIoctl(pfd, btrfsIocSnapCreateV2, unsafe.Pointer(&args)); err != nil {
		return fmt.Errorf("snapshot subvolume %s as %s: %w", src, dst, err)
	}
	return nil
}

// isSubvolume reports whether dir is the root of a btrfs subvolume.
func isSubvolume(dir string) (bool, error) {
	var sfs unix.Statfs_t
	if err := unix.Statfs(dir, &sfs); err != nil {
		return false, err
	}
	if sfs.Type != btrfsSuperMagic {
		return false, nil
	}
	var st unix.Stat_t
	if err := unix.Lstat(dir, &st); err != nil {
		return false, err
	}
	return st.Mode&unix.S_IFMT == unix.S_IFDIR && st.Ino == btrfsFirstFreeObject, nil
}

// destroySubvolume deletes the subvolume dir with everything in it.
func destroySubvolume(dir string) error {
	pfd, err := unix.Open(filepath.Dir(dir), unix.O_RDONLY|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
	if err != nil {
		return fmt.Errorf("open %s: %w", filepath.Dir(dir), err)
	}
	defer unix.Close(pfd)
	var args btrfsVolArgs
	copy(args.Name[:], filepath.Base(dir))
	if err := btrfsIoctl(pfd, btrfsIocSnapDestroy, unsafe.Pointer(&args)); err != nil {
		return fmt.Errorf("destroy subvolume %s: %w", dir, err)
	}
	return nil
}

// RemoveCapture deletes what Capture left at dst: the btrfs snapshot, or
// the copied tree. A missing dst is fine. It is what Tree.Remove does, for
// a caller that finds a capture again by its path (after a restart).
func RemoveCapture(dst string) error {
	sub, err := isSubvolume(dst)
	if errors.Is(err, os.ErrNotExist) {
		return nil
	}
	if err != nil {
		return fmt.Errorf("remove capture %s: %w", dst, err)
	}
	if sub {
		return destroySubvolume(dst)
	}
	if err := os.RemoveAll(dst); err != nil {
		return fmt.Errorf("remove capture %s: %w", dst, err)
	}
	return nil
}

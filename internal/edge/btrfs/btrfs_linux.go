package btrfs

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"unsafe"

	"golang.org/x/sys/unix"

	"dsec.dev/dsec/internal/errdefs"
)

const (
	// SuperMagic is what statfs reports for a btrfs.
	SuperMagic = 0x9123683e
	// TopLevel is the ID of a file system's top-level subvolume.
	TopLevel = 5
	// firstFreeObject is the inode number of every subvolume's root.
	firstFreeObject = 256
)

// ioctls and their arguments (linux/btrfs.h).
const (
	iocSubvolCreate = 0x5000940e // _IOW(0x94, 14, struct btrfs_ioctl_vol_args)
	iocSnapDestroy  = 0x5000940f // _IOW(0x94, 15, struct btrfs_ioctl_vol_args)
	iocInoLookup    = 0xd0009412 // _IOWR(0x94, 18, struct btrfs_ioctl_ino_lookup_args)
	iocSnapCreateV2 = 0x50009417 // _IOW(0x94, 23, struct btrfs_ioctl_vol_args_v2)
	iocFSInfo       = 0x8400941f // _IOR(0x94, 31, struct btrfs_ioctl_fs_info_args)
	iocQuotaCtl     = 0xc0109428 // _IOWR(0x94, 40, struct btrfs_ioctl_quota_ctl_args)
	iocQgroupLimit  = 0x8030942b // _IOR(0x94, 43, struct btrfs_ioctl_qgroup_limit_args)
	quotaCtlEnable  = 1
	limitMaxRfer    = 1
)

// struct btrfs_ioctl_vol_args, 4096 bytes.
type volArgs struct {
	Fd   int64
	Name [4088]byte
}

// struct btrfs_ioctl_vol_args_v2, 4096 bytes.
type volArgsV2 struct {
	Fd      int64
	Transid uint64
	Flags   uint64
	Unused  [4]uint64
	Name    [4040]byte
}

// struct btrfs_ioctl_ino_lookup_args.
type inoLookupArgs struct {
	TreeID   uint64
	ObjectID uint64
	Name     [4080]byte
}

// struct btrfs_ioctl_qgroup_limit_args.
type qgroupLimitArgs struct {
	QgroupID uint64
	Flags    uint64
	MaxRfer  uint64
	MaxExcl  uint64
	RsvRfer  uint64
	RsvExcl  uint64
}

// ioctlAt opens dir and runs the ioctl req with arg on it.
func ioctlAt(dir string, req uintptr, arg unsafe.Pointer) error {
	fd, err := unix.Open(dir, unix.O_RDONLY|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
	if err != nil {
		return fmt.Errorf("open %s: %w", dir, err)
	}
	defer unix.Close(fd)
	if _, _, errno := unix.Syscall(unix.SYS_IOCTL, uintptr(fd), req, uintptr(arg)); errno != 0 {
		return errno
	}
	return nil
}

// volumeName checks a subvolume's name, one path component.
func volumeName(name string, size int) error {
	if name == "" || len(name) >= size || strings.Contains(name, "/") {
		return fmt.Errorf("subvolume name %q: %w", name, errdefs.ErrInvalidArgument)
	}
	return nil
}

// Is reports whether path is on a btrfs.
func Is(path string) (bool, error) {
	var st unix.Statfs_t
	if err := unix.Statfs(path, &st); err != nil {
		return false, fmt.Errorf("statfs %s: %w", path, err)
	}
	return st.Type == SuperMagic, nil
}

// FSID returns the UUID of the btrfs holding path, as sysfs names it.
func FSID(path string) (string, error) {
	var info [1024]byte // struct btrfs_ioctl_fs_info_args; fsid at 16
	if err := ioctlAt(path, iocFSInfo, unsafe.Pointer(&info)); err != nil {
		return "", fmt.Errorf("get btrfs info of %s: %w", path, err)
	}
	u := info[16:32]
	return fmt.Sprintf("%x-%x-%x-%x-%x", u[0:4], u[4:6], u[6:8], u[8:10], u[10:16]), nil
}

// EnableQuota turns on qgroups on the btrfs mounted at root. It is a no-op
// when they are on already.
func EnableQuota(root string) error {
	args := [2]uint64{quotaCtlEnable, 0}
	if err := ioctlAt(root, iocQuotaCtl, unsafe.Pointer(&args)); err != nil {
		return fmt.Errorf("enable btrfs quotas on %s: %w", root, err)
	}
	return nil
}

// CreateSubvolume makes the subvolume parent/name.
func CreateSubvolume(parent, name string) error {
	var a volArgs
	if err := volumeName(name, len(a.Name)); err != nil {
		return fmt.Errorf("make subvolume: %w", err)
	}
	copy(a.Name[:], name)
	if err := ioctlAt(parent, iocSubvolCreate, unsafe.Pointer(&a)); err != nil {
		if errors.Is(err, unix.EEXIST) {
			return fmt.Errorf("make subvolume %s: %w", name, errdefs.ErrAlreadyExists)
		}
		return fmt.Errorf("make subvolume %s: %w", name, err)
	}
	return nil
}

// SubvolumeID is the ID of the subvolume holding dir, which for a
// subvolume's root is also the ID of its level-0 qgroup.
func SubvolumeID(dir string) (uint64, error) {
	look := inoLookupArgs{ObjectID: firstFreeObject}
	if err := ioctlAt(dir, iocInoLookup, unsafe.Pointer(&look)); err != nil {
		return 0, fmt.Errorf("look up subvolume id of %s: %w", dir, err)
	}
	return look.TreeID, nil
}

// IsSubvolume reports whether dir is the root of a btrfs subvolume.
func IsSubvolume(dir string) (bool, error) {
	if ok, err := Is(dir); err != nil || !ok {
		return false, err
	}
	var st unix.Stat_t
	if err := unix.Lstat(dir, &st); err != nil {
		return false, fmt.Errorf("stat %s: %w", dir, err)
	}
	return st.Mode&unix.S_IFMT == unix.S_IFDIR && st.Ino == firstFreeObject, nil
}

// LimitSubvolume caps the bytes the subvolume dir references; bytes <= 0
// leaves it unlimited.
func LimitSubvolume(dir string, bytes int64) error {
	id, err := SubvolumeID(dir)
	if err != nil {
		return err
	}
	if bytes <= 0 {
		return nil
	}
	lim := qgroupLimitArgs{QgroupID: id, Flags: limitMaxRfer, MaxRfer: uint64(bytes)}
	if err := ioctlAt(dir, iocQgroupLimit, unsafe.Pointer(&lim)); err != nil {
		return fmt.Errorf("limit subvolume %s: %w", dir, err)
	}
	return nil
}

// Snapshot makes dst a writable snapshot of the subvolume src. dst's parent
// must be on the same btrfs: else the error wraps EXDEV (another btrfs) or
// ENOTTY (another kind of file system).
func Snapshot(src, dst string) error {
	var a volArgsV2
	if err := volumeName(filepath.Base(dst), len(a.Name)); err != nil {
		return fmt.Errorf("snapshot subvolume %s: %w", src, err)
	}
	sfd, err := unix.Open(src, unix.O_RDONLY|unix.O_DIRECTORY|unix.O_CLOEXEC|unix.O_NOFOLLOW, 0)
	if err != nil {
		return fmt.Errorf("snapshot subvolume %s: %w", src, err)
	}
	defer unix.Close(sfd)
	a.Fd = int64(sfd)
	copy(a.Name[:], filepath.Base(dst))
	if err := ioctlAt(filepath.Dir(dst), iocSnapCreateV2, unsafe.Pointer(&a)); err != nil {
		return fmt.Errorf("snapshot subvolume %s as %s: %w", src, dst, err)
	}
	return nil
}

// DeleteSubvolume deletes the subvolume dir with everything in it, at once
// (the space is freed in the background).
func DeleteSubvolume(dir string) error {
	var a volArgs
	if err := volumeName(filepath.Base(dir), len(a.Name)); err != nil {
		return fmt.Errorf("delete subvolume: %w", err)
	}
	copy(a.Name[:], filepath.Base(dir))
	if err := ioctlAt(filepath.Dir(dir), iocSnapDestroy, unsafe.Pointer(&a)); err != nil {
		if errors.Is(err, os.ErrNotExist) {
			return nil
		}
		return fmt.Errorf("delete subvolume %s: %w", dir, err)
	}
	return nil
}

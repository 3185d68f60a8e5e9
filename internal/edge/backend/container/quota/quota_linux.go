package quota

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"unsafe"

	"golang.org/x/sys/unix"

	"dsec.dev/dsec/internal/edge/backend/container/mountinfo"
	"dsec.dev/dsec/internal/errdefs"
)

// Kernel ABI (linux/quota.h, linux/fs.h); x/sys/unix does not carry these.
const (
	prjQuota   = 2
	qGetInfo   = 0x800005
	qGetQuota  = 0x800007
	qSetQuota  = 0x800008
	qifBLimits = 1
	qifILimits = 4
	qifLimits  = qifBLimits | qifILimits

	fsIocFSGetXattr    = 0x801c581f
	fsIocFSSetXattr    = 0x401c5820
	fsXflagProjInherit = 0x200
	quotaBlockSize     = 1024 // dqb_bhardlimit counts 1 KiB blocks
)

// ifDqblk is struct if_dqblk.
type ifDqblk struct {
	BHardLimit uint64
	BSoftLimit uint64
	CurSpace   uint64
	IHardLimit uint64
	ISoftLimit uint64
	CurInodes  uint64
	BTime      uint64
	ITime      uint64
	Valid      uint32
	_          uint32
}

// ifDqinfo is struct if_dqinfo.
type ifDqinfo struct {
	BGrace uint64
	IGrace uint64
	Flags  uint32
	Valid  uint32
}

// fsxattr is struct fsxattr.
type fsxattr struct {
	XFlags     uint32
	ExtSize    uint32
	NExtents   uint32
	ProjID     uint32
	CowExtSize uint32
	_          [8]byte
}

// projectSupported returns nil when the file system holding path accounts project
// quotas and enforces their limits (mounted with prjquota), and an error
// wrapping errdefs.ErrNotSupported otherwise.
func projectSupported(path string) error {
	m, err := mountOf(path)
	if err != nil {
		return err
	}
	if !m.HasSuperOption("prjquota") && !m.HasSuperOption("pquota") {
		return fmt.Errorf("check project quotas on %s (%s at %s): not mounted with prjquota: %w", path, m.FSType, m.Point, errdefs.ErrNotSupported)
	}
	var info ifDqinfo
	if err := quotactl(path, qGetInfo, 0, unsafe.Pointer(&info)); err != nil {
		return fmt.Errorf("check project quotas on %s: %w: %w", path, err, errdefs.ErrNotSupported)
	}
	return nil
}

// project reads dir's project ID.
func project(dir string) (uint32, error) {
	x, err := getXattr(dir)
	if err != nil {
		return 0, err
	}
	return x.ProjID, nil
}

// setProject tags dir with project id and marks it so that every entry made
// inside it later inherits the id. Entries that exist already keep theirs.
func setProject(dir string, id uint32) error {
	f, err := os.Open(dir)
	if err != nil {
		return fmt.Errorf("set project of %s: %w", dir, err)
	}
	defer f.Close()
	var x fsxattr
	if err := ioctl(f, fsIocFSGetXattr, unsafe.Pointer(&x)); err != nil {
		return fmt.Errorf("get fsxattr of %s: %w", dir, err)
	}
	x.ProjID = id
	x.XFlags |= fsXflagProjInherit
	if err := ioctl(f, fsIocFSSetXattr, unsafe.Pointer(&x)); err != nil {
		return fmt.Errorf("set project of %s: %w", dir, err)
	}
	return nil
}

// setProjectLimit sets project id's hard limits on the file system holding path.
// A zero Limit clears them.
func setProjectLimit(path string, id uint32, l Limit) error {
	d := ifDqblk{Valid: qifLimits}
	if l.Bytes > 0 {
		d.BHardLimit = uint64((l.Bytes + quotaBlockSize - 1) / quotaBlockSize)
		d.BSoftLimit = d.BHardLimit
	}
	if l.Inodes > 0 {
		d.IHardLimit = uint64(l.Inodes)
		d.ISoftLimit = d.IHardLimit
	}
	if err := quotactl(path, qSetQuota, id, unsafe.Pointer(&d)); err != nil {
		return fmt.Errorf("set quota of project %d: %w", id, err)
	}
	return nil
}

// getProject returns project id's limits and usage on the file system holding path.
func getProject(path string, id uint32) (Limit, Usage, error) {
	var d ifDqblk
	if err := quotactl(path, qGetQuota, id, unsafe.Pointer(&d)); err != nil {
		return Limit{}, Usage{}, fmt.Errorf("get quota of project %d: %w", id, err)
	}
	return Limit{Bytes: int64(d.BHardLimit) * quotaBlockSize, Inodes: int64(d.IHardLimit)},
		Usage{Bytes: int64(d.CurSpace), Inodes: int64(d.CurInodes)}, nil
}

func getXattr(dir string) (fsxattr, error) {
	f, err := os.Open(dir)
	if err != nil {
		return fsxattr{}, fmt.Errorf("read project of %s: %w", dir, err)
	}
	defer f.Close()
	var x fsxattr
	if err := ioctl(f, fsIocFSGetXattr, unsafe.Pointer(&x)); err != nil {
		return fsxattr{}, fmt.Errorf("get fsxattr of %s: %w", dir, err)
	}
	return x, nil
}

func ioctl(f *os.File, req uintptr, arg unsafe.Pointer) error {
	_, _, e := unix.Syscall(unix.SYS_IOCTL, f.Fd(), req, uintptr(arg))
	if e != 0 {
		return e
	}
	return nil
}

// quotactl runs a PRJQUOTA command against the file system holding path,
// through quotactl_fd (Linux 5.14) or, on older kernels, the mount's block
// device.
func quotactl(path string, cmd int, id uint32, addr unsafe.Pointer) error {
	qcmd := uintptr(cmd<<8 | prjQuota)
	f, err := os.Open(path)
	if err != nil {
		return err
	}
	defer f.Close()
	_, _, e := unix.Syscall6(unix.SYS_QUOTACTL_FD, f.Fd(), qcmd, uintptr(id), uintptr(addr), 0, 0)
	if e == 0 {
		return nil
	}
	if e != unix.ENOSYS {
		return e
	}
	m, err := mountOf(path)
	if err != nil {
		return err
	}
	dev, err := unix.BytePtrFromString(m.Source)
	if err != nil {
		return err
	}
	_, _, e = unix.Syscall6(unix.SYS_QUOTACTL, qcmd, uintptr(unsafe.Pointer(dev)), uintptr(id), uintptr(addr), 0, 0)
	if e != 0 {
		return e
	}
	return nil
}

func mountOf(path string) (mountinfo.Mount, error) {
	real, err := filepath.EvalSymlinks(path)
	if err != nil {
		return mountinfo.Mount{}, fmt.Errorf("resolve %s: %w", path, err)
	}
	ms, err := mountinfo.Read()
	if err != nil {
		return mountinfo.Mount{}, err
	}
	m, ok := mountinfo.Containing(ms, real)
	if !ok {
		return mountinfo.Mount{}, fmt.Errorf("find mount of %s: %w", path, errors.New("no mount"))
	}
	return m, nil
}

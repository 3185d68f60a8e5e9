//go:build linux && (amd64 || arm64)

package diskfree

import (
	"unsafe"

	"golang.org/x/sys/unix"
)

// bypass in fstatfs's third argument, which the kernel ignores, lets the
// call through the filter: the supervisor's own fstatfs of the root. A
// command that passes it gets the node's figures, as it would without us.
const bypass = 0x64662d6279706173 // "df-bypas"

// Layout of struct seccomp_data (linux/seccomp.h), little-endian.
const (
	offNr   = 0
	offArch = 4
	offArg2 = 16 + 2*8
)

// filter is the BPF program: native statfs, and fstatfs without bypass,
// go to the supervisor; everything else, other ABIs included, is allowed.
func filter() []unix.SockFilter {
	ld := func(off uint32) unix.SockFilter {
		return unix.SockFilter{Code: unix.BPF_LD | unix.BPF_W | unix.BPF_ABS, K: off}
	}
	jeq := func(k uint32, jt, jf uint8) unix.SockFilter {
		return unix.SockFilter{Code: unix.BPF_JMP | unix.BPF_JEQ | unix.BPF_K, Jt: jt, Jf: jf, K: k}
	}
	ret := func(k uint32) unix.SockFilter { return unix.SockFilter{Code: unix.BPF_RET | unix.BPF_K, K: k} }
	// Jumps count the instructions skipped: 9 is allow, 10 is notify.
	return []unix.SockFilter{
		/* 0 */ ld(offArch),
		/* 1 */ jeq(nativeArch, 0, 7),
		/* 2 */ ld(offNr),
		/* 3 */ jeq(unix.SYS_STATFS, 6, 0),
		/* 4 */ jeq(unix.SYS_FSTATFS, 0, 4),
		/* 5 */ ld(offArg2),
		/* 6 */ jeq(uint32(bypass&0xffffffff), 0, 3),
		/* 7 */ ld(offArg2 + 4),
		/* 8 */ jeq(uint32(bypass>>32), 0, 1),
		/* 9 */ ret(unix.SECCOMP_RET_ALLOW),
		/* 10 */ ret(unix.SECCOMP_RET_USER_NOTIF),
	}
}

// Kernel ABI (linux/seccomp.h); x/sys/unix has the constants only.
type seccompData struct {
	Nr   int32
	Arch uint32
	IP   uint64
	Args [6]uint64
}

type notif struct {
	ID    uint64
	Pid   uint32
	Flags uint32
	Data  seccompData
}

type notifResp struct {
	ID    uint64
	Val   int64
	Error int32
	Flags uint32
}

func ioctl(fd int, req uint, arg unsafe.Pointer) error {
	_, _, e := unix.Syscall(unix.SYS_IOCTL, uintptr(fd), uintptr(req), uintptr(arg))
	if e != 0 {
		return e
	}
	return nil
}

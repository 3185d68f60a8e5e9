package container

import (
	specs "github.com/opencontainers/runtime-spec/specs-go"
)

// deniedSyscalls fail with EPERM in every sandbox. It holds at least what
// Docker's default profile refuses to a container without CAP_SYS_ADMIN:
// kernel modules, clocks, keyrings, mounts and namespaces, tracing and
// cross-process memory access, NUMA policy, handles that bypass path checks,
// quotas, reboot, swap and BPF. Our default action is allow (the list names
// what is dangerous instead of what is safe), so a new syscall a kernel adds
// is allowed until it lands here. Names libseccomp does not know on an arch
// are skipped by the OCI runtime.
//
// io_uring_* are refused: io_uring performs reads, writes, opens and socket
// calls from kernel workers that seccomp never sees, so a filtered syscall
// could be reached through it, and it has been the source of a long line of
// kernel privilege escalations.
var deniedSyscalls = []string{
	"acct", "add_key", "bpf", "clock_adjtime", "clock_settime", "create_module",
	"delete_module", "finit_module", "get_kernel_syms", "get_mempolicy",
	"init_module", "ioperm", "iopl", "kcmp", "kexec_file_load", "kexec_load",
	"keyctl", "lookup_dcookie", "mbind", "mount", "mount_setattr", "move_mount",
	"open_tree", "fsopen", "fsconfig", "fsmount", "fspick", "move_pages",
	"name_to_handle_at", "nfsservctl", "open_by_handle_at", "perf_event_open",
	"pivot_root", "process_vm_readv", "process_vm_writev", "ptrace",
	"query_module", "quotactl", "quotactl_fd", "reboot", "request_key",
	"set_mempolicy", "set_mempolicy_home_node", "setns", "settimeofday", "stime",
	"swapon", "swapoff", "sysfs", "_sysctl", "umount", "umount2", "unshare",
	"uselib", "userfaultfd", "ustat", "vm86", "vm86old",
	"io_uring_setup", "io_uring_enter", "io_uring_register",
	"lsm_set_self_attr", "pidfd_getfd",
}

// Namespace flags of clone(2); a sandbox may not make namespaces.
const (
	cloneNewNS     = 0x00020000
	cloneNewCgroup = 0x02000000
	cloneNewUTS    = 0x04000000
	cloneNewIPC    = 0x08000000
	cloneNewUser   = 0x10000000
	cloneNewPID    = 0x20000000
	cloneNewNet    = 0x40000000
)

// deniedIoctls fail with EPERM. The first two swap or move extents between
// files and were used to reach (and corrupt) content the sandbox could not
// otherwise write; the clone and dedupe requests share extents with files
// outside the sandbox's writable layer; FS_IOC_FSSETXATTR would let root in
// the sandbox move its files to another quota project and escape the disk
// limit.
var deniedIoctls = []uint64{
	0xC0C0586D, // XFS_IOC_SWAPEXT
	0xC028660F, // EXT4_IOC_MOVE_EXT
	0x40049409, // FICLONE
	0x4020940D, // FICLONERANGE
	0xC0189436, // FIDEDUPERANGE
	0x401C5820, // FS_IOC_FSSETXATTR
}

// Personality values a sandbox may set: PER_LINUX, PER_LINUX32, UNAME26
// with either, and 0xffffffff, which only queries. Other flags turn off
// address randomisation or map page zero.
const (
	perLinux32 = 0x8
	unameNN    = 0x20000
	perQuery   = 0xffffffff
)

// seccompProfile is every sandbox's profile. clone3 is refused with
// ENOSYS, except under gVisor (gvisor): there its agent needs clone3's
// CLONE_INTO_CGROUP to start each command in its own cgroup of the
// sentry's cgroupfs, where the commands' pids limit is (see
// internal/agent's commandsCgroup), and the sentry, not the host's
// kernel, serves the call: a namespace a clone3 asks for is one of the
// sentry's, whose code the sandbox reaches through any syscall anyway.
func seccompProfile(gvisor bool) *specs.LinuxSeccomp {
	eperm := uint(1)   // EPERM
	enosys := uint(38) // ENOSYS
	deny := func(names []string, args ...specs.LinuxSeccompArg) specs.LinuxSyscall {
		return specs.LinuxSyscall{Names: names, Action: specs.ActErrno, ErrnoRet: &eperm, Args: args}
	}
	sys := []specs.LinuxSyscall{deny(deniedSyscalls)}
	// The OCI runtime ORs rules (and conditions on one argument), so each
	// forbidden flag is a rule of its own: (flags & bit) == bit.
	for _, bit := range []uint64{cloneNewNS, cloneNewCgroup, cloneNewUTS, cloneNewIPC, cloneNewUser, cloneNewPID, cloneNewNet} {
		sys = append(sys, deny([]string{"clone"}, specs.LinuxSeccompArg{Index: 0, Value: bit, ValueTwo: bit, Op: specs.OpMaskedEqual}))
	}
	// clone3 passes its flags in memory, out of seccomp's sight: ENOSYS makes
	// libc fall back to clone, which the rules above check.
	if !gvisor {
		sys = append(sys, specs.LinuxSyscall{Names: []string{"clone3"}, Action: specs.ActErrno, ErrnoRet: &enosys})
	}
	// ioctl's request is an unsigned int: compare the low 32 bits only.
	for _, req := range deniedIoctls {
		sys = append(sys, deny([]string{"ioctl"}, specs.LinuxSeccompArg{Index: 1, Value: 0xffffffff, ValueTwo: req, Op: specs.OpMaskedEqual}))
	}
	sys = append(sys, personalityRules(deny)...)
	return &specs.LinuxSeccomp{
		DefaultAction: specs.ActAllow,
		Architectures: []specs.Arch{specs.ArchX86_64, specs.ArchX86, specs.ArchX32},
		Syscalls:      sys,
	}
}

// personalityRules deny every personality(2) argument but the safe values.
// Conditions can only be ORed here, so the allowed set {0, 8, 0x20000,
// 0x20008, 0xffffffff} is written as the complement of a union of deny rules:
//   - anything above 32 bits;
//   - bit 31 clear and any bit but 3 and 17 set;
//   - bit 31 set and any other bit clear (all ones is the query).
func personalityRules(deny func([]string, ...specs.LinuxSeccompArg) specs.LinuxSyscall) []specs.LinuxSyscall {
	names := []string{"personality"}
	out := []specs.LinuxSyscall{deny(names, specs.LinuxSeccompArg{Index: 0, Value: perQuery, Op: specs.OpGreaterThan})}
	const top = uint64(1) << 31
	for b := 0; b < 31; b++ {
		bit := uint64(1) << b
		if bit != perLinux32 && bit != unameNN {
			out = append(out, deny(names, specs.LinuxSeccompArg{Index: 0, Value: bit | top, ValueTwo: bit, Op: specs.OpMaskedEqual}))
		}
		out = append(out, deny(names, specs.LinuxSeccompArg{Index: 0, Value: bit | top, ValueTwo: top, Op: specs.OpMaskedEqual}))
	}
	return out
}

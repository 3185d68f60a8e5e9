// Package refused holds what every container sandbox's seccomp profile
// refuses with EPERM: whole syscalls, clone's namespace flags and ioctl
// requests. The container backend writes the profile from it; the agent
// builds from it the filter that logs these refusals (their audit records
// go into the sandbox's provenance, see docs/provenance.md).
package refused

// Syscalls fail with EPERM in every sandbox. It holds at least what
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
var Syscalls = []string{
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
	CloneNewNS     = 0x00020000
	CloneNewCgroup = 0x02000000
	CloneNewUTS    = 0x04000000
	CloneNewIPC    = 0x08000000
	CloneNewUser   = 0x10000000
	CloneNewPID    = 0x20000000
	CloneNewNet    = 0x40000000
)

// Ioctls fail with EPERM. The first two swap or move extents between
// files and were used to reach (and corrupt) content the sandbox could not
// otherwise write; the clone and dedupe requests share extents with files
// outside the sandbox's writable layer; FS_IOC_FSSETXATTR would let root in
// the sandbox move its files to another quota project and escape the disk
// limit.
var Ioctls = []uint64{
	0xC0C0586D, // XFS_IOC_SWAPEXT
	0xC028660F, // EXT4_IOC_MOVE_EXT
	0x40049409, // FICLONE
	0x4020940D, // FICLONERANGE
	0xC0189436, // FIDEDUPERANGE
	0x401C5820, // FS_IOC_FSSETXATTR
}

// CloneNamespaces is every namespace flag of clone(2).
const CloneNamespaces = CloneNewNS | CloneNewCgroup | CloneNewUTS | CloneNewIPC | CloneNewUser | CloneNewPID | CloneNewNet

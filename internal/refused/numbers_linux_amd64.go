package refused

import "golang.org/x/sys/unix"

// Arch is the audit architecture (linux/audit.h) Numbers are of.
const Arch = 0xc000003e // AUDIT_ARCH_X86_64

// Numbers are Syscalls' numbers on this arch (those it has).
var Numbers = map[string]int{
	"acct":                    unix.SYS_ACCT,
	"add_key":                 unix.SYS_ADD_KEY,
	"bpf":                     unix.SYS_BPF,
	"clock_adjtime":           unix.SYS_CLOCK_ADJTIME,
	"clock_settime":           unix.SYS_CLOCK_SETTIME,
	"create_module":           unix.SYS_CREATE_MODULE,
	"delete_module":           unix.SYS_DELETE_MODULE,
	"finit_module":            unix.SYS_FINIT_MODULE,
	"get_kernel_syms":         unix.SYS_GET_KERNEL_SYMS,
	"get_mempolicy":           unix.SYS_GET_MEMPOLICY,
	"init_module":             unix.SYS_INIT_MODULE,
	"ioperm":                  unix.SYS_IOPERM,
	"iopl":                    unix.SYS_IOPL,
	"kcmp":                    unix.SYS_KCMP,
	"kexec_file_load":         unix.SYS_KEXEC_FILE_LOAD,
	"kexec_load":              unix.SYS_KEXEC_LOAD,
	"keyctl":                  unix.SYS_KEYCTL,
	"lookup_dcookie":          unix.SYS_LOOKUP_DCOOKIE,
	"mbind":                   unix.SYS_MBIND,
	"mount":                   unix.SYS_MOUNT,
	"mount_setattr":           unix.SYS_MOUNT_SETATTR,
	"move_mount":              unix.SYS_MOVE_MOUNT,
	"open_tree":               unix.SYS_OPEN_TREE,
	"fsopen":                  unix.SYS_FSOPEN,
	"fsconfig":                unix.SYS_FSCONFIG,
	"fsmount":                 unix.SYS_FSMOUNT,
	"fspick":                  unix.SYS_FSPICK,
	"move_pages":              unix.SYS_MOVE_PAGES,
	"name_to_handle_at":       unix.SYS_NAME_TO_HANDLE_AT,
	"nfsservctl":              unix.SYS_NFSSERVCTL,
	"open_by_handle_at":       unix.SYS_OPEN_BY_HANDLE_AT,
	"perf_event_open":         unix.SYS_PERF_EVENT_OPEN,
	"pivot_root":              unix.SYS_PIVOT_ROOT,
	"process_vm_readv":        unix.SYS_PROCESS_VM_READV,
	"process_vm_writev":       unix.SYS_PROCESS_VM_WRITEV,
	"ptrace":                  unix.SYS_PTRACE,
	"query_module":            unix.SYS_QUERY_MODULE,
	"quotactl":                unix.SYS_QUOTACTL,
	"quotactl_fd":             unix.SYS_QUOTACTL_FD,
	"reboot":                  unix.SYS_REBOOT,
	"request_key":             unix.SYS_REQUEST_KEY,
	"set_mempolicy":           unix.SYS_SET_MEMPOLICY,
	"set_mempolicy_home_node": unix.SYS_SET_MEMPOLICY_HOME_NODE,
	"setns":                   unix.SYS_SETNS,
	"settimeofday":            unix.SYS_SETTIMEOFDAY,
	"swapon":                  unix.SYS_SWAPON,
	"swapoff":                 unix.SYS_SWAPOFF,
	"sysfs":                   unix.SYS_SYSFS,
	"_sysctl":                 unix.SYS__SYSCTL,
	"umount2":                 unix.SYS_UMOUNT2,
	"unshare":                 unix.SYS_UNSHARE,
	"uselib":                  unix.SYS_USELIB,
	"userfaultfd":             unix.SYS_USERFAULTFD,
	"ustat":                   unix.SYS_USTAT,
	"io_uring_setup":          unix.SYS_IO_URING_SETUP,
	"io_uring_enter":          unix.SYS_IO_URING_ENTER,
	"io_uring_register":       unix.SYS_IO_URING_REGISTER,
	"lsm_set_self_attr":       unix.SYS_LSM_SET_SELF_ATTR,
	"pidfd_getfd":             unix.SYS_PIDFD_GETFD,
}

// byArgument are the numbers of the syscalls the profile refuses by their
// arguments (or, clone3, with ENOSYS).
var byArgument = map[string]int{
	"clone": unix.SYS_CLONE, "clone3": unix.SYS_CLONE3, "ioctl": unix.SYS_IOCTL, "personality": unix.SYS_PERSONALITY,
}

// Package diskfree makes statfs(2) and fstatfs(2) of the sandbox's root, as
// df, statvfs(3) and Python's shutil.disk_usage call them, describe the
// sandbox's writable layer instead of the node's disk: size is the disk
// limit, used is what the sandbox holds, available is the rest (never more
// than the upper file system really has free).
//
// It is needed where the limit is a btrfs qgroup: btrfs's statfs ignores
// qgroups, and overlayfs reports its upper file system's statfs. (Under ext4
// or XFS project quotas the kernel already answers with the project's limit
// and usage, and the edge does not ask for this package.)
//
// Start, called once by the agent before it runs any command, installs a
// seccomp filter on every thread of the agent (SECCOMP_FILTER_FLAG_TSYNC),
// so every command inherits it, whichever thread forks it. The filter passes
// every syscall but native statfs and fstatfs, which it hands to the
// supervisor, a goroutine on an OS thread of its own (SECCOMP_RET_USER_NOTIF).
// For each, the supervisor finds the mount the call names (a path resolved
// from the caller's directory with the caller's file-system credentials and
// capabilities, or the caller's open file) and, when it is the root mount,
// answers with the
// root's real statfs rewritten from the qgroup's sysfs files (max_referenced;
// referenced plus the reservations not yet committed, which is what the
// kernel checks a write against), written into the caller's buffer through
// /proc/PID/mem. Every other call is handed back to the kernel
// (SECCOMP_USER_NOTIF_FLAG_CONTINUE), which runs it as if nothing had
// stopped it; so does any call the supervisor cannot look into.
//
// The supervisor reads other users' /proc/PID files with CAP_SYS_PTRACE,
// which the sandbox grants the agent for this alone: the agent drops it
// from its bounding set at start, so no command ever holds it, and only the
// supervisor's thread has it in its effective set. The supervisor's own
// fstatfs of the root carries a marker in an argument the kernel ignores,
// which the filter lets through: the supervisor must never wait for itself.
// Nothing else in the agent may call statfs on the supervisor's thread.
//
// Limits: a call costs about 15 µs (fstatfs) to 30 µs (statfs) instead of
// 0.4 µs; usage freed by deleting files shows at the next btrfs commit (at
// most 30 s), as the kernel's own limit check sees it; 32-bit programs,
// chrooted callers and paths through /proc's magic links (/proc/self/fd/N,
// /dev/stdin: in the agent they would name the agent's) get the kernel's
// answer, the node's figures; a command cannot install a seccomp filter
// with a listener of its own (the kernel allows one per process tree).
// Should the supervisor stop, the listener is closed and statfs fails with
// ENOSYS rather than hang.
package diskfree

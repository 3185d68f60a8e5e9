package diskfree

import "golang.org/x/sys/unix"

// nativeArch is seccomp_data.arch of this binary's own ABI.
const nativeArch = unix.AUDIT_ARCH_AARCH64

package container

import (
	"log/slog"

	"dsec.dev/dsec/internal/edge/backend"
)

// Config configures a Container. Zero values get the defaults described.
// The container and fncall backends of one node are made from the same
// Config: they share the upper file system and keep their sandboxes apart.
type Config struct {
	Root         string // runtime state dir, e.g. /var/lib/dsec/runtime (runc --root, bundles)
	UpperRoot    string // where sandboxes' writable layers live, e.g. /var/lib/dsec/upper
	UpperImage   string // backing file for the upper file system when the host fs can't do project quotas, e.g. /var/lib/dsec/upper.img
	UpperFSBytes int64  // size of that file system (sparse); 0 = 80% of free space on the host fs, at least 1 GiB
	Runtime      string // "runc" (default), "crun" or "runsc" (gVisor)
	RuntimePath  string // default: look up Runtime in PATH
	// RunscPlatform is runsc's --platform: "systrap" (default), "ptrace"
	// or "kvm" (where /dev/kvm runs stock guests; dsecd picks it there).
	RunscPlatform string
	CgroupParent  string // default "dsec"
	AgentDir      string // host dir with dsec-agent and sh, bind-mounted read-only (nosuid,nodev) at /.dsec/bin
	// SocketDir holds each sandbox's agent socket, <SocketDir>/<id>/agent.sock
	// (the edge keeps its records beside them); default <Root>/sockets.
	SocketDir string
	Log       *slog.Logger
	// LogRefusals has each sandbox's agent log what its profile refuses
	// (dsec-agent --log-refusals) and starts each container in an audit
	// session of its own, for provenance's record of refused syscalls
	// (provenance.SyscallLog); dsecd sets it unless --no-provenance.
	LogRefusals bool
}

const (
	defaultPids     = 4096
	minInodes       = 16384
	bytesPerInode   = 16 << 10
	minUpperFSBytes = 1 << 30
	defaultTmpBytes = 256 << 20
)

func inodeLimit(s backend.Spec) int64 {
	if s.Inodes > 0 {
		return s.Inodes
	}
	return max(s.DiskBytes/bytesPerInode, minInodes)
}

// tmpBytes is the size of a sandbox's /tmp tmpfs.
func tmpBytes(s backend.Spec) int64 {
	switch {
	case s.TmpBytes > 0:
		return s.TmpBytes
	case s.MemoryBytes > 0:
		return max(s.MemoryBytes/2, 1<<20)
	}
	return defaultTmpBytes
}

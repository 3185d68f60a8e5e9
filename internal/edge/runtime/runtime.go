// Package runtime is the container backend's driver of an OCI runtime (runc
// by default, crun on pure cgroup v2). It owns everything a container
// sandbox is made of on the host: the bundle and its config.json (namespaces,
// capabilities, seccomp, masked paths, limits), the overlay root file system
// over read-only layers with a writable upper dir capped by a disk limit,
// the node-level file system that holds those upper dirs, and the sandbox's
// cgroups.
//
// Disk limits (package quota) use project quotas where UpperRoot's file
// system enforces them. Otherwise Init makes UpperImage, a sparse file, and
// mounts it on UpperRoot through a loop device: ext4 with project quotas
// when the kernel supports them (CONFIG_QUOTA, CONFIG_QFMT_V2), else btrfs
// with qgroups (no inode limit there; metadata counts against the bytes). The edge (internal/edge/sandbox) calls Start, Status, Delete and
// List per sandbox, Init when the daemon starts and Teardown when the node is
// emptied.
//
// Host layout:
//
//	<Root>/runc/                       the OCI runtime's state (--root)
//	<Root>/bundles/<id>/config.json    the bundle; rootfs/ is mounted only while starting
//	<UpperRoot>/<id>/{upper,work}      the writable layer, one quota project
//	<UpperRoot>/<id>/.project          its quota project ID (btrfs: <id> is a subvolume)
//	<cgroup>/<CgroupParent>/<id>       the sandbox's cgroups
//
// Everything a sandbox has is found again from its ID, so a restarted daemon
// can inspect and delete sandboxes that an earlier process started.
package runtime

import (
	"log/slog"
	"os"
	"time"
)

// Config configures a Runtime. Zero values get the defaults described.
type Config struct {
	Root         string // runtime state dir, e.g. /var/lib/dsec/runtime (runc --root, bundles)
	UpperRoot    string // where sandboxes' writable layers live, e.g. /var/lib/dsec/upper
	UpperImage   string // backing file for the upper file system when the host fs can't do project quotas, e.g. /var/lib/dsec/upper.img
	UpperFSBytes int64  // size of that file system (sparse); 0 = 80% of free space on the host fs, at least 1 GiB
	Runtime      string // "runc" (default) or "crun"
	RuntimePath  string // default: look up Runtime in PATH
	CgroupParent string // default "dsec"
	AgentDir     string // host dir with dsec-agent and sh, bind-mounted read-only (nosuid,nodev) at /.dsec/bin
	Log          *slog.Logger
}

// Spec describes one sandbox to start.
type Spec struct {
	ID          string
	Lower       []string // read-only layer dirs, bottom first
	DiskBytes   int64    // hard limit of the writable layer; 0 = none
	Inodes      int64    // inode limit of the writable layer; 0 = DiskBytes/16KiB, at least 16384
	CPUs        float64  // fractional cores; 0 = unlimited
	MemoryBytes int64    // 0 = unlimited; no swap either way
	Pids        int64    // 0 = 4096
	Hostname    string
	Listener    *os.File // listening Unix socket; becomes fd 3 of the agent
	AgentArgs   []string // args after /.dsec/bin/dsec-agent; the fd flags are appended
	LogPath     string   // host file for the agent's stdout and stderr
	// NetnsPath joins a network namespace the edge made (a networked
	// sandbox); "" gives the sandbox a new one with loopback only.
	NetnsPath string
	// ResolvConf is a host file bind-mounted read-only at /etc/resolv.conf.
	ResolvConf string
}

// Status is what Status reports of a sandbox.
type Status struct {
	Running     bool
	Pid         int // host pid of the agent while Running
	OOMKills    int64
	MemoryBytes int64
}

// PauseStats is what Pause did.
type PauseStats struct {
	Frozen  time.Duration // from the call to every process frozen
	Reclaim time.Duration // pushing memory out of RAM, after the freeze
	// Resident and Released are the sandbox's memory in RAM before the
	// pause and what left RAM; Swapped is what of it went to swap (the
	// rest was page cache, dropped).
	Resident, Released, Swapped int64
}

// ResumeStats is what Resume did.
type ResumeStats struct {
	Prefetch time.Duration // reading swapped memory back, while still frozen
	Thaw     time.Duration
	// Advised is the bytes of anonymous mappings the kernel was asked to
	// bring back.
	Advised int64
}

const (
	defaultPids     = 4096
	minInodes       = 16384
	bytesPerInode   = 16 << 10
	minUpperFSBytes = 1 << 30
)

func inodeLimit(s Spec) int64 {
	if s.Inodes > 0 {
		return s.Inodes
	}
	return max(s.DiskBytes/bytesPerInode, minInodes)
}

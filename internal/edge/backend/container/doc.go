// Package container is the container backends of the runtime seam
// (package backend): sandboxes as containers of an OCI runtime, runc by
// default or crun on pure cgroup v2.
//
// Two backends live here, both Containers: the container backend (New) and
// the fncall backend (NewFnCall), the same with what pooled reward-code
// containers need (see NewFnCall). A Container owns everything a container
// sandbox is made of on the host: the bundle and its config.json
// (namespaces, capabilities, seccomp, masked paths, limits), the overlay
// root file system over read-only layers with a writable upper dir capped
// by a disk limit, the node-level file system that holds those upper dirs,
// the sandbox's cgroups (package cgroups), and the agent's listening
// socket. Pause freezes a sandbox's cgroups and pushes its memory out
// (package pagein brings it back on resume); a snapshot captures its upper
// dir while it is frozen.
//
// Disk limits (package quota) use project quotas where UpperRoot's file
// system enforces them. Otherwise Init makes UpperImage, a sparse file, and
// mounts it on UpperRoot through a loop device: ext4 with project quotas
// when the kernel supports them (CONFIG_QUOTA, CONFIG_QFMT_V2), else btrfs
// with qgroups (no inode limit there; metadata counts against the bytes).
//
// Under runsc (Config.Runtime) a Container is the gvisor isolation: the
// same sandboxes with gVisor's user-space kernel between them and the host,
// beside runc's on the same node.
//
// Host layout of the container backend (the fncall backend keeps the same
// under <Root>/fncall, <UpperRoot>/.fncall and cgroup parent
// <CgroupParent>-fncall, and one under runsc under <Root>/gvisor,
// <UpperRoot>/.gvisor and <CgroupParent>-gvisor, so no backend can touch
// another's sandboxes):
//
//	<Root>/runc/                       the OCI runtime's state (--root)
//	<Root>/bundles/<id>/config.json    the bundle; rootfs/ is mounted only while starting
//	<UpperRoot>/<id>/{upper,work}      the writable layer, one quota project
//	<UpperRoot>/<id>/.project          its quota project ID (btrfs: <id> is a subvolume)
//	<UpperRoot>/.captures/             snapshots' captures of writable layers, emptied by Init
//	<cgroup>/<CgroupParent>/<id>       the sandbox's cgroups
//	<SocketDir>/<id>/agent.sock        the agent channel: fd 3 of the agent listens on it
//
// Everything a sandbox has is found again from its ID, so a restarted daemon
// can inspect, reach and delete sandboxes that an earlier process started.
package container

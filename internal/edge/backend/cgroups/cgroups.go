// Package cgroups owns the backends' view of the host's cgroup file
// systems: it tells cgroup v1 (including hybrid hosts) from pure v2, prepares
// the parent cgroup of all sandboxes, pre-creates a sandbox's cgroup so the
// runtime can hand the agent directory fds of it, places a process in a
// sandbox's cgroups (Place: the microvm backend's QEMU), reads a sandbox's
// memory statistics, and kills and removes a sandbox's whole cgroup tree,
// children made by the agent included. The container backend (package
// container) and the microvm backend both use it; for containers the OCI
// runtime (runc) applies the limits.
package cgroups

// Stats is what Layout.Stats reads from a sandbox's memory cgroup.
type Stats struct {
	OOMKills    int64 // processes the kernel OOM-killed in the cgroup tree
	MemoryBytes int64 // current memory use
}

// Usage is what Layout.Usage reads of a sandbox's CPU and memory.
type Usage struct {
	CPUUsec     int64 // CPU time used by the tree since it was made
	MemoryBytes int64 // current memory use, page cache included
	// MemoryLimit is the memory limit; 0 when there is none.
	MemoryLimit int64
	CacheBytes  int64 // of MemoryBytes, page cache
}

// Kept is what of a cgroup's memory a Reclaim left in RAM, by kind, in
// bytes; children included.
type Kept struct {
	Anon int64 // processes' private anonymous memory
	// Shmem is shared memory: files in tmpfs (/dev/shm, a tmpfs /tmp),
	// System V segments, shared anonymous mappings. It leaves RAM only
	// through swap, like Anon.
	Shmem int64
	Cache int64 // page cache of files on disk
	// Kernel is kernel memory charged to the cgroup (page tables, kernel
	// objects), which never leaves RAM.
	Kernel int64
	// Locked is what of Anon, Shmem and Cache the kernel holds unevictable
	// (mlock, SHM_LOCK).
	Locked int64
}

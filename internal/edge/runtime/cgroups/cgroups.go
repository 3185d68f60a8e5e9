// Package cgroups owns the container runtime's view of the host's cgroup file
// systems: it tells cgroup v1 (including hybrid hosts) from pure v2, prepares
// the parent cgroup of all sandboxes, pre-creates a sandbox's cgroup so the
// runtime can hand the agent directory fds of it, reads a sandbox's memory
// statistics, and kills and removes a sandbox's whole cgroup tree, children
// made by the agent included. The OCI runtime (runc) applies the limits.
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

// Package quota owns per-directory disk limits. A Manager makes directories
// under one root, each capped in bytes (and inodes where the file system can)
// by either of two mechanisms, whichever the root's file system offers:
//
//   - project quotas (ext4 with the project feature, or XFS, mounted with
//     prjquota): the directory is tagged with its own project ID, inherited
//     by everything made inside it, and the project gets hard limits;
//   - btrfs qgroups: the directory is a subvolume whose qgroup gets a
//     referenced-bytes limit (btrfs has no inode limit; metadata is charged
//     to the bytes).
//
// The container runtime uses it to cap each sandbox's writable layer.
package quota

// Limit is a directory's hard limits. Zero means no limit.
type Limit struct {
	Bytes  int64
	Inodes int64
}

// Usage is what a project holds now.
type Usage struct {
	Bytes  int64
	Inodes int64
}

// Kinds of Manager.
const (
	KindProject = "project"
	KindBtrfs   = "btrfs"
)

// Package btrfs holds the btrfs ioctls the edge uses on the file system of
// sandboxes' writable layers: subvolumes with qgroup limits (one per
// sandbox, made by internal/edge/backend/container/quota) and snapshots of them
// (internal/edge/snapshot). It is Linux only; elsewhere it is empty.
package btrfs

// Package snapshot turns a sandbox's writable layer into a layer file
// (pack_diff): the edge captures the overlay upper dir while the sandbox is
// frozen, thaws it, then packs the capture into an EROFS layer off the
// critical path. Stacked right above the layers the sandbox ran on, the
// packed layer shows what the sandbox showed, so a new sandbox started on
// BASE+...+snapshot carries on from it (a file-system fork: no processes).
//
// The package owns the two steps and nothing around them: the caller
// freezes and thaws the sandbox, says where captures and layer files go,
// stores and publishes the file (internal/edge/image, internal/edge/layers),
// and removes the capture.
//
//	tree, err := snapshot.Capture(ctx, upperDir, captureDir) // frozen meanwhile
//	thaw()
//	defer tree.Remove()
//	packed, err := snapshot.Pack(ctx, tree, layerFile, snapshot.PackOptions{
//		Lower:   lowerDirs, // the sandbox's mounted lower layers, bottom first
//		Exclude: []string{"/root/.cache", "/tests/answers"},
//	})
//
// Capture takes, in order of preference, a btrfs snapshot of the
// sandbox's subvolume (the runtime's <UpperRoot>/<id> on a btrfs upper file
// system: milliseconds whatever the upper holds), a walk that clones file
// extents (FICLONE on btrfs or XFS), or a walk that copies contents; the
// capture directory should be on the upper's file system for the first
// two. Tree reports the method and the time taken. A walk keeps names
// byte for byte, types, owners, modes (setuid, setgid, sticky), atimes and
// mtimes, every extended attribute, symlinks and hard links; a failed or
// cancelled capture leaves nothing behind.
//
// What a packed layer holds: everything the capture held, with
//
//   - overlayfs's private extended attributes removed (origin, impure,
//     nlink, upper, uuid, protattr and any other trusted.overlay.* but the
//     opaque mark and the trusted.overlay.overlay.* a sandbox set itself,
//     which overlayfs stores escaped); redirect and metacopy are refused,
//     as this edge mounts overlayfs with redirect_dir and metacopy off;
//   - whiteouts (0:0 character devices, hard links to one inode or not)
//     and opaque marks kept only where they hide something in the layers
//     below, since overlayfs lists a whiteout that hides nothing;
//   - sockets and device nodes left out, named in Packed.Warnings (FIFOs
//     stay);
//   - sparse files stored at their full size (the store's mkfs.erofs
//     settings keep no holes), which Pack bounds with PackOptions.MaxBytes
//     and the free space at the output; PackOptions.MaxEntries bounds the
//     objects, as mkfs.erofs holds its whole tree in memory (the package's
//     own walks hold one directory per level and the hard-linked inodes);
//   - names of 255 bytes refused: mkfs.erofs 1.5 stores at most 254;
//   - change and birth times, atimes and inode flags not kept.
//
// Exclude takes paths inside the sandbox, literally (no symlink is
// followed): each is removed from the snapshot with everything under it,
// which leaves out the sandbox's changes there, not the layers below. A
// path the sandbox only created is gone in a sandbox made from the layer;
// where a lower layer holds the path, that sandbox sees the lower layer's
// version (a whiteout the sandbox made there is left out too). To delete a
// file of a lower layer in a snapshot, delete it in the sandbox. A path
// that is relative, has a ".." component or is "/" is refused with
// errdefs.ErrInvalidArgument.
//
// A Tree is a private copy: nothing else writes it, and Pack edits it in
// place (so a capture is packed once; Pack may run again after a failure).
// RemoveCapture finds and removes a capture by its path, for a caller that
// lost its Tree in a restart.
package snapshot

// Package fuse2fs mounts an ext4 image a guest wrote (a microVM's writable
// disk, cloned) on the host without the host kernel's ext4 driver ever
// reading it: e2fsprogs' fuse2fs parses the image in user space and serves
// it over FUSE, so a guest that crafts its file system on purpose reaches a
// user-space parser and not the node's kernel.
//
// fuse2fs runs with as little as it needs: as an unprivileged uid (Nobody)
// with no capabilities and no_new_privs, in its own mount, network, IPC and
// UTS namespaces, under rlimits on its memory, CPU time, open files and the
// size of what it writes. It opens nothing by path: the image and a /dev/fuse
// descriptor are handed to it. The FUSE mount itself is made by the caller
// (root) with that descriptor, nosuid, nodev and noexec, so that root on the
// host may read the tree, extended attributes in trusted.* included (an
// overlay's whiteouts and opaque marks).
//
// fuse2fs is built against libfuse 2, which cannot take a mounted
// descriptor: it always mounts through fusermount, which it runs as
// /bin/fusermount, receiving the descriptor over the socket named by
// _FUSE_COMMFD. In fuse2fs's mount namespace /bin/fusermount is the
// caller's own executable, bind-mounted there, whose main calls Fusermount
// when named fusermount: it hands over the descriptor the caller opened and
// mounts nothing. dsecd's main does so, and so must a test binary that
// mounts (its TestMain).
//
// A hostile image can still make fuse2fs fail, return errors or garbage,
// spin or crash: a failure to mount is an error naming fuse2fs's words; a
// crash or an rlimit's kill ends the FUSE connection, so reads fail with
// ENOTCONN rather than hang; Unmount detaches the mount whatever state
// fuse2fs is in.
package fuse2fs

// Package lazy serves an edge's layer files on demand. Each registered layer
// (an EROFS image stored in the blob store as fixed-size, sha256-addressed
// chunks plus an index) appears as a read-only regular file in a FUSE mount;
// the edge mounts EROFS straight from that file. A read fetches only the
// chunks it covers, decodes each one (raw or zstd, as the index says, the
// output capped at the chunk's length) and verifies its length and digest.
//
// Verified chunks are kept in a cache of two tiers (chunkCache): in memory,
// bounded, as the objects the store served (zstd frames) and, while they
// fit, decoded, so that reads (of prefetched chunks too) only copy; and on
// local disk, bounded and kept across restarts, for the chunks that proved
// hot (needed again after the kernel or the memory tier dropped them, or
// pinned), written compressed when they leave memory. A burst of fetches thus costs the disk
// nothing. The chunks holding a layer's EROFS metadata (Index.Meta, found by
// MetaChunks at import) are pinned while the layer is registered: fetched on
// first touch like any chunk, they then stay local.
//
// The file system records which chunks readers take, in the order first
// read: SaveTrace keeps that trace on the node, PublishTrace merges it into
// the layer's trace in the blob store (blob.PublishTrace), and PrefetchTrace
// brings the chunks of the node's own trace, or else of the published one,
// into memory ahead of the readers.
//
// An FS owns its mount point and its cache directory: two FS values must not
// share a CacheDir. Linux only; elsewhere Mount returns errdefs.ErrNotSupported.
package lazy

// Package lazy serves an edge's layer files on demand. Each registered layer
// (an EROFS image stored in the blob store as fixed-size, sha256-addressed
// chunks plus an index) appears as a read-only regular file in a FUSE mount;
// the edge mounts EROFS straight from that file. A read fetches only the
// chunks it covers, decodes each one (raw or zstd, as the index says, the
// output capped at the chunk's length), verifies its length and digest, and
// keeps the plain bytes in a bounded LRU cache on local disk that survives
// restarts. The chunks holding
// a layer's EROFS metadata (Index.Meta, found by MetaChunks at import) are
// pinned in the cache while the layer is registered: fetched on first touch
// like any chunk, they then stay local.
//
// An FS owns its mount point and its cache directory: two FS values must not
// share a CacheDir. Linux only; elsewhere Mount returns errdefs.ErrNotSupported.
package lazy

package image

// Overlayfs reads a directory that only one layer holds straight from that
// layer, whiteouts included: a whiteout hiding nothing below is listed by
// readdir and then fails to stat. So a layer keeps only the whiteouts that
// hide something in the layers it is stacked on, and a bottom-most layer
// none. PruneWhiteouts makes a tree so before mkfs.erofs builds it: for
// collapsed OCI layers (ImportLayers) and packed sandbox uppers
// (internal/edge/snapshot).

// Pruned counts what PruneWhiteouts removed.
type Pruned struct {
	Whiteouts   int64 // whiteouts that hid nothing below
	OpaqueMarks int64 // opaque marks of directories no layer below holds
}

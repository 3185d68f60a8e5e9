// Package image owns a node's local layer store: read-only EROFS layer images
// built with mkfs.erofs, content-addressed by the sha256 of the image file, each
// of kind base, workspace or toolkit and reachable by name:tag refs.
//
// Layout under the store root (e.g. /var/lib/dsec/layers):
//
//	blobs/<hex>      layer images, immutable, named by their sha256
//	mnt/<hex>        where each layer is mounted read-only, once per node
//	tmp/             staging for imports; empty when no import runs
//	index.json       refs, images, layers, layer builds and environment
//	                 statistics (write-temp-and-rename)
//	lock             flock'd while the index changes, so two daemons can share a root
//
// An environment is named BASE[+LAYER...], each part a name:tag ref or a
// sha256: digest; ResolveEnvironment returns its layers bottom first (base,
// then workspaces, then toolkits, each kind in the caller's order), ready to be
// stacked by overlayfs as lower directories returned by Mount.
//
// A name:tag names either a layer or an image: an ordered list of layers plus
// the config of the processes started from it (SetImage, Image, Images;
// internal/oci imports OCI and Docker images this way). As BASE, an image
// stands for all of its layers. Layers are shared: one used by two images is
// stored once.
//
// ImportLayers applies several tar streams (OCI layers) into one layer,
// turning OCI whiteouts into overlayfs whiteouts (0:0 character devices) and
// opaque directories (trusted.overlay.opaque=y), which mkfs.erofs keeps and
// overlayfs honours when the layer is stacked. Of those it keeps only what
// hides something in the layers the built one is stacked on (PruneWhiteouts;
// ImportOptions.Below). BuildLayerFile is the store's mkfs.erofs step on its
// own, for layers made elsewhere (internal/edge/snapshot packs sandbox
// uppers with it).
//
// Import treats its source as hostile: it stages under tmp/, never follows a
// symlink while extracting, refuses entries that would escape the layer, device
// nodes other than overlay whiteouts, and setuid files unless allowed, and
// publishes a layer only once its image is complete and synced. Device nodes
// and other special files under /dev are left out rather than refused (the
// runtime mounts a fresh /dev), and the returned Layer's Warnings say so.
package image

package image

import (
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/binary"
	"encoding/hex"
	"errors"
	"fmt"
	"hash/crc32"
	"io"
	"io/fs"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"time"

	"golang.org/x/sys/unix"

	"dsec.dev/dsec/internal/errdefs"
)

// Import builds a layer of the given kind from src, a directory or a tar
// archive (plain or gzip), stores it and points ref (name[:tag], tag
// defaulting to latest; empty for none) at it. Importing identical content
// again gives the same digest and reuses the stored image. A refused entry
// returns an error wrapping errdefs.ErrInvalidArgument that names it; on any
// failure nothing becomes visible in the store. Special files under /dev are
// left out, logged and named in the returned Layer's Warnings.
func (s *Store) Import(ctx context.Context, ref string, kind Kind, src string, opts ImportOptions) (Layer, error) {
	return s.importLayer(ctx, ref, kind, src, "", opts, func(x *extractor) error {
		return extractSource(ctx, x, src)
	})
}

// ImportArchive is Import of a tar archive (plain or gzip) read from r, a
// stream the caller does not keep (an upload): it is extracted as it is
// read, through every check of Import, and read to its end. name labels it
// in messages and is the layer's source.
func (s *Store) ImportArchive(ctx context.Context, ref string, kind Kind, r io.Reader, name string, opts ImportOptions) (Layer, error) {
	return s.importLayer(ctx, ref, kind, name, "", opts, func(x *extractor) error {
		return extractArchiveFrom(ctx, x, r, name)
	})
}

// ImportLayers builds one layer of the given kind from srcs, uncompressed
// tar streams applied in order into one tree, as overlayfs would stack them:
// OCI whiteouts (.wh.NAME, .wh..wh..opq) delete what earlier streams made and
// stay in the layer as overlay whiteouts and opaque directories, so they also
// hide what lies below the layer when it is stacked. Device nodes (outside
// /dev; under it they are left out, as by Import) and trusted.overlay.*
// xattrs in the streams are refused: only the importer makes whiteouts. ref
// is as for Import.
//
// A source whose Name is a sha256: digest is verified against it (the
// digest of its uncompressed stream, an OCI diff ID; a mismatch wraps
// errdefs.ErrInvalidArgument). When every source is named so, the store
// remembers which layer the list built, and importing the same list again
// returns that layer without rebuilding it (an interrupted image import
// resumes this way).
func (s *Store) ImportLayers(ctx context.Context, ref string, kind Kind, srcs []LayerSource, opts ImportOptions) (Layer, error) {
	if len(srcs) == 0 {
		return Layer{}, fmt.Errorf("import layers: no sources: %w", errdefs.ErrInvalidArgument)
	}
	names := make([]string, len(srcs))
	for i, src := range srcs {
		if src.Open == nil {
			return Layer{}, fmt.Errorf("import layers: source %d (%s) has no Open: %w", i, src.Name, errdefs.ErrInvalidArgument)
		}
		names[i] = src.Name
	}
	source := "layers " + strings.Join(names, ",")
	key := buildKey(kind, opts.Below, srcs)
	if key != "" && kind.valid() {
		l, ok, err := s.reuseBuild(key, ref)
		if err != nil {
			return Layer{}, fmt.Errorf("import layers: %w", err)
		}
		if ok {
			s.log.Info("reused layer", "digest", l.Digest, "ref", ref, "source", source)
			return l, nil
		}
	}
	return s.importLayer(ctx, ref, kind, source, key, opts, func(x *extractor) error {
		x.whiteouts = true
		for _, src := range srcs {
			if err := ctx.Err(); err != nil {
				return err
			}
			x.nextLayer()
			if err := applyStream(ctx, x, src); err != nil {
				return err
			}
		}
		return s.pruneBelow(ctx, x.stage, kind, opts.Below)
	})
}

// pruneBelow drops from the staged tree the whiteouts and opaque marks that
// hide nothing in the layers below (digests, bottom first), which it mounts
// for the lookup; a base layer with nothing below keeps none. A layer of
// another kind with nothing named below keeps all: what it will be stacked
// on is not known.
func (s *Store) pruneBelow(ctx context.Context, stage string, kind Kind, below []string) error {
	if len(below) == 0 && kind != KindBase {
		return nil
	}
	dirs, unmount, err := s.mountBelow(below)
	if err != nil {
		return err
	}
	defer unmount()
	n, err := PruneWhiteouts(ctx, stage, dirs)
	if err != nil {
		return err
	}
	if n.Whiteouts > 0 || n.OpaqueMarks > 0 {
		s.log.Debug("dropped whiteouts that hide nothing below", "whiteouts", n.Whiteouts, "opaque_marks", n.OpaqueMarks, "below", below)
	}
	return nil
}

// mountBelow mounts the stored layers digests read-only in private
// directories under tmp/ (named for this process, so cleanTmp unmounts
// what a dead importer left) and returns the directories, in order, and a
// function that unmounts them.
func (s *Store) mountBelow(digests []string) ([]string, func(), error) {
	var dirs []string
	unmount := func() {
		for _, d := range dirs {
			if err := unix.Unmount(d, unix.MNT_DETACH); err != nil {
				s.log.Warn("unmount layer below an import", "dir", d, "err", err)
				continue
			}
			os.Remove(d)
		}
	}
	ix, err := s.load()
	if err != nil {
		return nil, nil, fmt.Errorf("mount layers below: %w", err)
	}
	for _, dg := range digests {
		hex, err := parseDigest(dg)
		if err != nil {
			unmount()
			return nil, nil, fmt.Errorf("mount layer below: %w", err)
		}
		if ix.Layers[hex] == nil {
			unmount()
			return nil, nil, fmt.Errorf("mount layer below %s: %w", dg, errdefs.ErrNotFound)
		}
		d, err := os.MkdirTemp(s.tmpDir(), strconv.Itoa(os.Getpid())+"-below-")
		if err != nil {
			unmount()
			return nil, nil, fmt.Errorf("mount layer below %s: %w", dg, err)
		}
		if err := unix.Mount(s.blobPath(hex), d, "erofs", unix.MS_RDONLY|unix.MS_NODEV|unix.MS_NOSUID, ""); err != nil {
			os.Remove(d)
			unmount()
			return nil, nil, fmt.Errorf("mount layer below %s: %w", dg, err)
		}
		dirs = append(dirs, d)
	}
	return dirs, unmount, nil
}

// applyStream extracts one layer stream and, when it is named by a digest,
// reads it to the end and checks it.
func applyStream(ctx context.Context, x *extractor, src LayerSource) error {
	rc, err := src.Open()
	if err != nil {
		return fmt.Errorf("open layer stream %s: %w", src.Name, err)
	}
	defer rc.Close()
	var r io.Reader = rc
	h := sha256.New()
	wantHex, verify := strings.CutPrefix(src.Name, "sha256:")
	verify = verify && hexRE.MatchString(wantHex)
	if verify {
		r = io.TeeReader(rc, h)
	}
	if err := extractTar(ctx, x, r, src.Name, true); err != nil {
		return err
	}
	// The tar end marker may precede padding: read the stream to its end
	// so that it is checked whole.
	if _, err := io.Copy(io.Discard, r); err != nil {
		return fmt.Errorf("read layer stream %s: %w", src.Name, err)
	}
	if verify {
		if got := hex.EncodeToString(h.Sum(nil)); got != wantHex {
			return fmt.Errorf("verify layer stream %s: content has digest sha256:%s: %w", src.Name, got, errdefs.ErrInvalidArgument)
		}
	}
	return nil
}

// buildKey names what ImportLayers builds from srcs over the layers below,
// for reuse: "" unless every source is named by its digest. (Keys without
// the below part name builds that kept whiteouts hiding nothing; they are
// never matched again.)
func buildKey(kind Kind, below []string, srcs []LayerSource) string {
	parts := make([]string, 0, len(srcs)+2)
	parts = append(parts, string(kind), "below:"+strings.Join(below, ","))
	for _, src := range srcs {
		hex, ok := strings.CutPrefix(src.Name, "sha256:")
		if !ok || !hexRE.MatchString(hex) {
			return ""
		}
		parts = append(parts, src.Name)
	}
	return strings.Join(parts, " ")
}

// reuseBuild returns the layer an earlier ImportLayers built under key, if it
// is still stored, pointing ref at it.
func (s *Store) reuseBuild(key, ref string) (Layer, bool, error) {
	ix, err := s.load()
	if err != nil {
		return Layer{}, false, err
	}
	if hex, ok := ix.Builds[key]; !ok || ix.Layers[hex] == nil {
		return Layer{}, false, nil
	}
	if ref != "" {
		var err error
		if ref, err = normalizeRef(ref); err != nil {
			return Layer{}, false, err
		}
	}
	var layer Layer
	found := false
	err = s.update(true, func(ix *index) error {
		hex, ok := ix.Builds[key]
		if !ok || ix.Layers[hex] == nil {
			return nil
		}
		if _, err := os.Stat(s.blobPath(hex)); err != nil {
			return nil // rebuild
		}
		if ref != "" {
			ix.setRef(ref, hex)
		}
		layer, found = ix.layer(hex), true
		return nil
	})
	return layer, found, err
}

// importLayer stages a tree with fill, builds its EROFS image and publishes
// it; key, when set, records the build for ImportLayers to reuse.
func (s *Store) importLayer(ctx context.Context, ref string, kind Kind, src, key string, opts ImportOptions, fill func(x *extractor) error) (Layer, error) {
	if !kind.valid() {
		return Layer{}, fmt.Errorf("import layer: kind %q, want base, workspace or toolkit: %w", kind, errdefs.ErrInvalidArgument)
	}
	if ref != "" {
		var err error
		if ref, err = normalizeRef(ref); err != nil {
			return Layer{}, fmt.Errorf("import layer: %w", err)
		}
	}
	mkfs, err := findMkfs()
	if err != nil {
		return Layer{}, err
	}
	start := time.Now()
	prefix := strconv.Itoa(os.Getpid()) + "-"
	stage, err := os.MkdirTemp(s.tmpDir(), prefix+"stage-")
	if err != nil {
		return Layer{}, fmt.Errorf("import layer: create staging dir: %w", err)
	}
	defer os.RemoveAll(stage)

	x, err := newExtractor(stage, opts)
	if err != nil {
		return Layer{}, fmt.Errorf("import layer: %w", err)
	}
	err = fill(x)
	if err == nil {
		err = x.finish()
	}
	entries, size, warnings := x.entries, x.bytes, x.warnings()
	x.close()
	if err != nil {
		return Layer{}, fmt.Errorf("import layer from %s: %w", src, err)
	}

	img, err := os.CreateTemp(s.tmpDir(), prefix+"layer-*.erofs")
	if err != nil {
		return Layer{}, fmt.Errorf("import layer: %w", err)
	}
	imgPath := img.Name()
	img.Close()
	defer os.Remove(imgPath) // no-op once renamed into blobs/
	if err := buildErofs(ctx, mkfs, imgPath, stage); err != nil {
		return Layer{}, fmt.Errorf("import layer from %s: %w", src, err)
	}
	hexDigest, imgSize, err := sealImage(imgPath)
	if err != nil {
		return Layer{}, fmt.Errorf("import layer from %s: %w", src, err)
	}
	os.RemoveAll(stage) // free the space before publishing

	var layer Layer
	err = s.update(true, func(ix *index) error {
		rec := ix.Layers[hexDigest]
		if rec != nil && rec.Kind != kind {
			return fmt.Errorf("layer sha256:%s is already stored as a %s layer: %w", hexDigest, rec.Kind, errdefs.ErrAlreadyExists)
		}
		if _, err := os.Stat(s.blobPath(hexDigest)); errors.Is(err, fs.ErrNotExist) {
			if err := os.Rename(imgPath, s.blobPath(hexDigest)); err != nil {
				return err
			}
			if err := syncDir(filepath.Dir(s.blobPath(hexDigest))); err != nil {
				return err
			}
		} else if err != nil {
			return err
		}
		if rec == nil {
			ix.Layers[hexDigest] = &layerRecord{Kind: kind, Size: imgSize, Created: time.Now().UTC(), Source: src}
		}
		if key != "" {
			ix.Builds[key] = hexDigest
		}
		if ref != "" {
			if old, ok := ix.Refs[ref]; ok && old != hexDigest {
				s.log.Info("moved layer ref", "ref", ref, "from", "sha256:"+old, "to", "sha256:"+hexDigest)
			}
			ix.setRef(ref, hexDigest)
		}
		layer = ix.layer(hexDigest)
		return nil
	})
	if err != nil {
		return Layer{}, fmt.Errorf("import layer from %s: %w", src, err)
	}
	for _, w := range warnings {
		s.log.Info("import warning", "digest", layer.Digest, "ref", ref, "source", src, "warning", w)
	}
	layer.Warnings = warnings
	s.log.Info("imported layer", "digest", layer.Digest, "ref", ref, "kind", kind, "source", src,
		"entries", entries, "content_bytes", size, "image_bytes", imgSize, "took", time.Since(start).Round(time.Millisecond))
	return layer, nil
}

// BuildLayerFile builds the EROFS layer file out from the tree dir with the
// settings of every layer in the store (see buildErofs) and makes it
// reproducible (see sealImage); it returns the file's digest ("sha256:<hex>")
// and size. The tree is read as it is: whiteouts, opaque marks, owners,
// modes, mtimes and xattrs go into the layer unchanged. out is created or
// truncated; on failure it may hold a partial image, which the caller removes.
func BuildLayerFile(ctx context.Context, dir, out string) (string, int64, error) {
	mkfs, err := findMkfs()
	if err != nil {
		return "", 0, err
	}
	f, err := os.OpenFile(out, os.O_WRONLY|os.O_CREATE|os.O_TRUNC, 0o600) // mkfs.erofs 1.5 creates none
	if err != nil {
		return "", 0, fmt.Errorf("build layer from %s: %w", dir, err)
	}
	f.Close()
	if err := buildErofs(ctx, mkfs, out, dir); err != nil {
		return "", 0, fmt.Errorf("build layer from %s: %w", dir, err)
	}
	hex, size, err := sealImage(out)
	if err != nil {
		return "", 0, fmt.Errorf("build layer from %s: %w", dir, err)
	}
	return "sha256:" + hex, size, nil
}

// findMkfs locates mkfs.erofs, also in the sbin directories a daemon's PATH
// may lack.
func findMkfs() (string, error) {
	if p, err := exec.LookPath("mkfs.erofs"); err == nil {
		return p, nil
	}
	for _, p := range []string{"/usr/sbin/mkfs.erofs", "/sbin/mkfs.erofs", "/usr/bin/mkfs.erofs"} {
		if _, err := os.Stat(p); err == nil {
			return p, nil
		}
	}
	return "", fmt.Errorf("import layer: mkfs.erofs not found (install erofs-utils): %w", errdefs.ErrFailedPrecondition)
}

// buildErofs runs mkfs.erofs over dir into img: uncompressed, keeping owners,
// modes, mtimes and xattrs, with a fixed UUID, and with no file's tail
// inlined beside its inode (-Enoinline_data): EROFS gives DAX only to files
// stored flat, so a microVM that maps the layer as virtio-pmem reads such a
// file from the host's page cache, shared by every VM of the node, where an
// inlined tail would put the whole file in each guest's own page cache.
// It costs 3 % (a Python environment, 22,000 files) to 9 % (a Debian base,
// 10,000 files) more bytes per layer, and no build time.
func buildErofs(ctx context.Context, mkfs, img, dir string) error {
	cmd := exec.CommandContext(ctx, mkfs, "--quiet", "-Enoinline_data", "-U", "00000000-0000-0000-0000-000000000000", img, dir)
	var out bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &out
	if err := cmd.Run(); err != nil {
		if ctx.Err() != nil {
			return ctx.Err()
		}
		return fmt.Errorf("run mkfs.erofs: %v: %s", err, strings.TrimSpace(out.String()))
	}
	return nil
}

// EROFS on-disk superblock (at byte 1024 of the image) fields we touch.
const (
	erofsSuperOffset  = 1024
	erofsMagic        = 0xE0F5E1E2
	erofsCompatChksum = 0x1
	sbChecksum        = 4
	sbFeatureCompat   = 8
	sbBlkSzBits       = 12
	sbBuildTime       = 24
	sbBuildTimeNsec   = 32
	erofsMaxBlkSzBits = 16
	erofsMinBlkSzBits = 9
)

// LayerAlign is what every layer file's size is a multiple of: a microVM
// attaches a layer as virtio-pmem only at a multiple of 2 MiB (Linux maps
// device memory in such sections; qemu.PmemAlign), and QEMU cannot grow
// the store's file, so the store pads each image when it is built. The
// padding is a hole: it costs no disk, and its chunks in a blob store are
// zeros, stored once for every layer.
const LayerAlign = 2 << 20

// sealImage makes the image reproducible, pads it to a multiple of
// LayerAlign, fsyncs it and returns its sha256 and size. mkfs.erofs 1.5
// stamps the build time into the superblock, and its only way to fix it
// (-T) also overwrites every file's mtime; every inode here records its own
// mtime (none equals the build time to the nanosecond), so the build time
// is dead data and is zeroed, with the superblock checksum redone. EROFS
// reads nothing past the blocks its superblock counts, so the padding
// changes no file in the layer.
func sealImage(path string) (string, int64, error) {
	f, err := os.OpenFile(path, os.O_RDWR, 0)
	if err != nil {
		return "", 0, fmt.Errorf("seal image: %w", err)
	}
	defer f.Close()
	head := make([]byte, erofsSuperOffset+64)
	if _, err := io.ReadFull(f, head); err != nil {
		return "", 0, fmt.Errorf("seal image: read superblock: %w", err)
	}
	sb := head[erofsSuperOffset:]
	if binary.LittleEndian.Uint32(sb) != erofsMagic {
		return "", 0, errors.New("seal image: not an EROFS image")
	}
	bits := int(sb[sbBlkSzBits])
	if bits < erofsMinBlkSzBits || bits > erofsMaxBlkSzBits {
		return "", 0, fmt.Errorf("seal image: block size 2^%d unsupported", bits)
	}
	block := make([]byte, (1<<bits)-erofsSuperOffset)
	if _, err := f.ReadAt(block, erofsSuperOffset); err != nil {
		return "", 0, fmt.Errorf("seal image: read superblock: %w", err)
	}
	hasChecksum := binary.LittleEndian.Uint32(block[sbFeatureCompat:])&erofsCompatChksum != 0
	if hasChecksum && superChecksum(block) != binary.LittleEndian.Uint32(block[sbChecksum:]) {
		return "", 0, errors.New("seal image: superblock checksum of mkfs.erofs output does not verify")
	}
	binary.LittleEndian.PutUint64(block[sbBuildTime:], 0)
	binary.LittleEndian.PutUint32(block[sbBuildTimeNsec:], 0)
	if hasChecksum {
		binary.LittleEndian.PutUint32(block[sbChecksum:], superChecksum(block))
	}
	if _, err := f.WriteAt(block, erofsSuperOffset); err != nil {
		return "", 0, fmt.Errorf("seal image: write superblock: %w", err)
	}
	fi, err := f.Stat()
	if err != nil {
		return "", 0, fmt.Errorf("seal image: %w", err)
	}
	if pad := -fi.Size() & (LayerAlign - 1); pad > 0 {
		if err := f.Truncate(fi.Size() + pad); err != nil {
			return "", 0, fmt.Errorf("seal image: pad to %d bytes: %w", LayerAlign, err)
		}
	}
	if err := f.Sync(); err != nil {
		return "", 0, fmt.Errorf("seal image: %w", err)
	}
	if _, err := f.Seek(0, io.SeekStart); err != nil {
		return "", 0, fmt.Errorf("seal image: %w", err)
	}
	h := sha256.New()
	n, err := io.Copy(h, f)
	if err != nil {
		return "", 0, fmt.Errorf("seal image: hash: %w", err)
	}
	return hex.EncodeToString(h.Sum(nil)), n, nil
}

// superChecksum is the checksum the kernel expects in the superblock block:
// crc32c seeded with ~0, without the final inversion, over the block with its
// checksum field zeroed.
func superChecksum(block []byte) uint32 {
	b := bytes.Clone(block)
	binary.LittleEndian.PutUint32(b[sbChecksum:], 0)
	return ^crc32.Checksum(b, crc32.MakeTable(crc32.Castagnoli))
}

// cleanTmp removes what imports of dead processes left in tmp/: every name
// there starts with the pid of the process that made it.
func (s *Store) cleanTmp() {
	ents, err := os.ReadDir(s.tmpDir())
	if err != nil {
		return
	}
	for _, e := range ents {
		pidStr, _, ok := strings.Cut(e.Name(), "-")
		pid, err := strconv.Atoi(pidStr)
		if !ok || err != nil || pid <= 0 || pid == os.Getpid() {
			continue
		}
		if err := unix.Kill(pid, 0); err == nil || errors.Is(err, unix.EPERM) {
			continue // still running
		}
		p := filepath.Join(s.tmpDir(), e.Name())
		unix.Unmount(p, unix.MNT_DETACH) // a layer mounted below an import; EINVAL when not a mount
		if err := os.RemoveAll(p); err != nil {
			s.log.Warn("remove leftover import", "path", p, "err", err)
			continue
		}
		s.log.Info("removed leftover import", "path", p)
	}
}

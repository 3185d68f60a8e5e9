package snapshot

import (
	"fmt"
	"os"
	"path"
	"strings"
	"time"

	"dsec.dev/dsec/internal/edge/image"
	"dsec.dev/dsec/internal/errdefs"
)

// Method names how Capture copied an upper.
type Method string

const (
	// MethodBtrfs is a writable btrfs snapshot of the subvolume holding the
	// upper: constant time, whatever the upper holds.
	MethodBtrfs Method = "btrfs-snapshot"
	// MethodReflink is a walk of the upper that clones every file's extents
	// (FICLONE) instead of copying them.
	MethodReflink Method = "reflink"
	// MethodCopy is a walk of the upper that copies file contents
	// (copy_file_range, holes kept).
	MethodCopy Method = "copy"
	// MethodDiskClone is a VM's writable disk image cloned (a reflink,
	// else a copy of its data ranges) and mounted on the host: its upper
	// dir is the tree. The microvm backend makes it (NewTree).
	MethodDiskClone Method = "disk-clone"
	// MethodFrozen is no copy: the live upper dir read in place while its
	// sandbox is frozen (Lay of a grade's workspace).
	MethodFrozen Method = "frozen-upper"
)

// Tree is a captured upper: a private copy of a sandbox's writable layer,
// owned by the caller of Capture until Remove. Pack reads and edits it.
type Tree struct {
	// Dir holds the copy of the upper dir's contents.
	Dir    string
	Method Method
	// Took is how long Capture ran: the part of a snapshot during which
	// the sandbox must stay frozen.
	Took time.Duration
	// Entries and Bytes count the objects and file content (apparent
	// size, each inode once) a walk copied or cloned; both are 0 for a
	// btrfs snapshot, which walks nothing.
	Entries, Bytes int64
	// Broken, when set, says why the tree can no longer be read, or nil:
	// a runtime's mount of it that was aborted (a VM's disk served by a
	// fuse2fs past its deadline). Pack's error names it.
	Broken func() error

	root   string       // what Remove deletes: Capture's dst
	remove func() error // what Remove runs instead, for a NewTree
}

// NewTree is a capture a runtime made on its own (a VM's disk cloned and
// mounted): dir holds the upper dir's contents, which Pack edits in place,
// and remove deletes it all.
func NewTree(dir string, m Method, took time.Duration, remove func() error) *Tree {
	return &Tree{Dir: dir, Method: m, Took: took, remove: remove}
}

// Remove deletes the captured tree (a btrfs snapshot is destroyed as a
// whole). It is cleanup and not cancellable; the Tree must not be used
// after it.
func (t *Tree) Remove() error {
	if t.remove != nil {
		return t.remove()
	}
	return RemoveCapture(t.root)
}

// PackOptions say how Pack turns a Tree into a layer.
type PackOptions struct {
	// Lower holds the root directories of the mounted layers the packed
	// layer will be stacked on, bottom first: the sandbox's own lower
	// layers. Whiteouts that hide nothing in them are left out.
	Lower []string
	// Exclude lists paths inside the sandbox (absolute, no ".." component)
	// whose changes are left out of the layer, with everything under them.
	Exclude []string
	// Include, when set, lists the only paths inside the sandbox (absolute,
	// no ".." component) whose changes the layer keeps, with everything
	// under them: a workspace captured for a grade. A directory on the way
	// to one keeps only that path and loses any opaque mark, so the layers
	// below show through it; a symlink, file or whiteout on the way is left
	// out (the path is taken literally). Exclude then applies inside.
	Include []string
	// Trusted lists paths a trusted tree will be laid at in a sandbox made
	// from the layer (a grader's tests): each is left out with everything
	// under it, as Exclude does, and so is any ancestor of it that the
	// sandbox made a symlink, a file or a whiteout, so the path resolves
	// through directories of the layers below, never through what the
	// sandbox left.
	Trusted []string
	// MaxBytes caps the file content the layer may hold, counting a sparse
	// file at its full size (the layer stores its holes as zeros); 0 means
	// 64 GiB.
	MaxBytes int64
	// MaxEntries caps the objects the layer may hold; 0 means 2M, as for
	// an import. (mkfs.erofs holds its whole tree in memory: about 5 GiB
	// for a million files.)
	MaxEntries int64
}

const (
	defaultMaxBytes   = 64 << 30
	defaultMaxEntries = 2_000_000
)

// Packed describes the layer file Pack built.
type Packed struct {
	File   string // the EROFS layer file
	Digest string // "sha256:<hex>" of File
	Size   int64  // bytes of File
	// Entries and ContentBytes count what the layer holds: objects, and
	// file content (each inode once, sparse files at their full size).
	Entries, ContentBytes int64
	// Excluded lists the paths of PackOptions.Exclude that the upper
	// held, which were left out.
	Excluded []string
	// Included lists the paths of PackOptions.Include the upper held;
	// Cleared those of PackOptions.Trusted whose way the upper changed.
	Included, Cleared []string
	// Pruned counts the whiteouts and opaque marks left out because they
	// hide nothing below; StrippedXattrs the overlayfs-private extended
	// attributes removed.
	Pruned         image.Pruned
	StrippedXattrs int64
	// Warnings say what was left out besides (sockets, device nodes).
	Warnings []string
	// Took is the whole Pack; Build its mkfs.erofs part.
	Took, Build time.Duration
}

// Laid describes what Lay laid.
type Laid struct {
	// Digest is "sha256:<hex>" over what was laid, in path order: each
	// object's path, kind, owner, mode, and a file's size and content
	// digest or a symlink's target (a whiteout as the path removed).
	Digest string
	// Entries and Bytes count the objects laid and the file content.
	Entries, Bytes int64
	// Included lists the include paths t held; Cleared the trusted paths
	// whose way or contents t changed, left out.
	Included, Cleared []string
	Warnings          []string
	Took              time.Duration
}

// cleanExcludes checks exclude paths and returns them cleaned and relative
// to the tree's root, in order, without duplicates.
func cleanExcludes(paths []string) ([]string, error) {
	var out []string
	seen := map[string]bool{}
	for _, p := range paths {
		rel, err := cleanExclude(p)
		if err != nil {
			return nil, fmt.Errorf("exclude %q: %w: %w", p, err, errdefs.ErrInvalidArgument)
		}
		if !seen[rel] {
			seen[rel] = true
			out = append(out, rel)
		}
	}
	return out, nil
}

func cleanExclude(p string) (string, error) {
	switch {
	case p == "":
		return "", fmt.Errorf("empty path")
	case strings.ContainsRune(p, 0):
		return "", fmt.Errorf("path contains a NUL byte")
	case !strings.HasPrefix(p, "/"):
		return "", fmt.Errorf("not an absolute path inside the sandbox")
	}
	for _, c := range strings.Split(p, "/") {
		if c == ".." {
			return "", fmt.Errorf("path has a .. component")
		}
	}
	rel := strings.TrimPrefix(path.Clean(p), "/")
	if rel == "" {
		return "", fmt.Errorf("excludes the whole file system")
	}
	return rel, nil
}

// CheckExclude refuses exclude paths Pack would refuse (errdefs.
// ErrInvalidArgument), so a caller can say so before it freezes anything.
func CheckExclude(paths []string) error {
	_, err := cleanExcludes(paths)
	return err
}

// Select names what of a sandbox's writable layer a snapshot keeps: see
// PackOptions' fields of the same names.
type Select struct {
	Include, Exclude, Trusted []string
	// Files are written into the room after the capture is laid
	// (WriteFiles); a lay's only.
	Files []File
}

// File is a file WriteFiles writes: a grade's trusted test or its reward
// file, laid into the clean room beside the capture.
type File struct {
	Path string      // absolute and clean, as the room's processes see it
	Data []byte      //
	Mode os.FileMode // permission bits; 0 is 0644
}

// Check refuses paths Pack would refuse (errdefs.ErrInvalidArgument).
func (s Select) Check() error {
	for _, ps := range [][]string{s.Include, s.Exclude, s.Trusted} {
		if err := CheckExclude(ps); err != nil {
			return err
		}
	}
	return nil
}

package snapshot

import (
	"errors"
	"fmt"
	"os"
	"path"
	"strings"

	"golang.org/x/sys/unix"
)

// pathTree holds clean relative paths as a tree of their components: a
// node is marked when a path ends there.
type pathTree struct {
	end  bool
	kids map[string]*pathTree
}

func newPathTree(rels []string) *pathTree {
	t := &pathTree{}
	for _, rel := range rels {
		n := t
		for _, c := range strings.Split(rel, "/") {
			if n.kids == nil {
				n.kids = map[string]*pathTree{}
			}
			k := n.kids[c]
			if k == nil {
				k = &pathTree{}
				n.kids[c] = k
			}
			n = k
		}
		n.end = true
	}
	return t
}

// keepOnly removes from the tree at root everything but the paths of
// includes (clean, relative) with everything under them. A directory on
// the way to an include path stays without the rest of what it holds and
// without an opaque mark (the layers below show through it, as they do
// where the sandbox changed nothing); anything else on the way (a
// symlink, a file, a whiteout) is removed, so the path is taken
// literally, as Exclude takes it. It returns the include paths the tree
// held.
func keepOnly(root *os.File, includes []string) ([]string, error) {
	var found []string
	err := keepUnder(root, "", newPathTree(includes), &found)
	return found, err
}

func keepUnder(d *os.File, rel string, want *pathTree, found *[]string) error {
	dfd := int(d.Fd())
	if err := unix.Fremovexattr(dfd, overlayPrefix+"opaque"); err != nil && !errors.Is(err, unix.ENODATA) && !errors.Is(err, unix.EOPNOTSUPP) {
		return fmt.Errorf("clear opaque mark of /%s: %w", rel, err)
	}
	names, err := d.Readdirnames(-1)
	if err != nil {
		return fmt.Errorf("list /%s: %w", rel, err)
	}
	for _, name := range names {
		full := path.Join(rel, name)
		k := want.kids[name]
		if k != nil && k.end {
			*found = append(*found, "/"+full)
			continue
		}
		var st unix.Stat_t
		if err := unix.Fstatat(dfd, name, &st, unix.AT_SYMLINK_NOFOLLOW); err != nil {
			return fmt.Errorf("stat /%s: %w", full, err)
		}
		if k != nil && st.Mode&unix.S_IFMT == unix.S_IFDIR {
			sub, err := openDir(dfd, name)
			if err != nil {
				return fmt.Errorf("open /%s: %w", full, err)
			}
			err = keepUnder(sub, full, k, found)
			sub.Close()
			if err != nil {
				return err
			}
			continue
		}
		if err := removeAt(dfd, name, &st); err != nil {
			return fmt.Errorf("remove /%s: %w", full, err)
		}
	}
	return nil
}

// removeAt removes name of directory dfd, with everything under it when
// st says it is a directory. No symlink is followed.
func removeAt(dfd int, name string, st *unix.Stat_t) error {
	if st.Mode&unix.S_IFMT == unix.S_IFDIR {
		return os.RemoveAll(fdPath(dfd, name))
	}
	return unix.Unlinkat(dfd, name, 0)
}

// clearWay removes each ancestor of rel (clean, relative) that the tree
// holds as something other than a directory (a symlink, a file, a
// whiteout), so that in a sandbox made from the layer rel resolves
// through directories of the layers below to where they put it, and then
// removes rel itself with everything under it. It reports whether the
// tree held anything it removed.
func clearWay(root *os.File, rel string) (bool, error) {
	comps := strings.Split(rel, "/")
	dfd := int(root.Fd())
	var opened []int
	defer func() {
		for _, fd := range opened {
			unix.Close(fd)
		}
	}()
	for i, c := range comps {
		var st unix.Stat_t
		err := unix.Fstatat(dfd, c, &st, unix.AT_SYMLINK_NOFOLLOW)
		if errors.Is(err, unix.ENOENT) {
			return false, nil
		}
		if err != nil {
			return false, err
		}
		if i == len(comps)-1 || st.Mode&unix.S_IFMT != unix.S_IFDIR {
			return true, removeAt(dfd, c, &st)
		}
		fd, err := unix.Openat(dfd, c, unix.O_RDONLY|unix.O_DIRECTORY|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0)
		if err != nil {
			return false, err
		}
		opened = append(opened, fd)
		dfd = fd
	}
	return false, nil
}

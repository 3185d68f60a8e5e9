package blob

import (
	"context"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path/filepath"
	"sort"
	"strings"
	"syscall"

	"dsec.dev/dsec/internal/errdefs"
)

// tmpDir is the directory under a Dir's root holding objects being written;
// it is on the same file system as the objects, so a rename publishes them.
const tmpDir = ".tmp"

// Dir is a Store keeping each object as a file under a root directory, at
// the path its key names. It is the default store on a single machine.
type Dir struct {
	root string
}

var _ Store = (*Dir)(nil)

// NewDir opens (creating if needed) a directory store rooted at root.
func NewDir(root string) (*Dir, error) {
	if root == "" {
		return nil, fmt.Errorf("open directory store: empty path: %w", errdefs.ErrInvalidArgument)
	}
	abs, err := filepath.Abs(root)
	if err != nil {
		return nil, fmt.Errorf("open directory store %s: %w", root, err)
	}
	if err := os.MkdirAll(filepath.Join(abs, tmpDir), 0o755); err != nil {
		return nil, fmt.Errorf("open directory store %s: %w", root, err)
	}
	return &Dir{root: abs}, nil
}

// Root is the directory the store keeps its objects in.
func (d *Dir) Root() string { return d.root }

func (d *Dir) path(key string) (string, error) {
	if err := CheckKey(key); err != nil {
		return "", err
	}
	if key == tmpDir || strings.HasPrefix(key, tmpDir+"/") {
		return "", fmt.Errorf("check key %q: %s is reserved: %w", key, tmpDir, errdefs.ErrInvalidArgument)
	}
	return filepath.Join(d.root, filepath.FromSlash(key)), nil
}

// Put writes the object to a temporary file, syncs it and renames it into
// place, so readers see either the old object or the whole new one.
func (d *Dir) Put(ctx context.Context, key string, r io.Reader, size int64) (err error) {
	p, err := d.path(key)
	if err != nil {
		return err
	}
	if err := ctx.Err(); err != nil {
		return fmt.Errorf("put %s: %w", key, err)
	}
	f, err := os.CreateTemp(filepath.Join(d.root, tmpDir), "put-*")
	if err != nil {
		return fmt.Errorf("put %s: %w", key, err)
	}
	defer func() {
		if err != nil {
			f.Close()
			os.Remove(f.Name())
		}
	}()
	src := &ctxReader{ctx: ctx, r: r}
	if size >= 0 {
		var n int64
		n, err = io.CopyN(f, src, size)
		if err != nil {
			return fmt.Errorf("put %s: read %d of %d bytes: %w", key, n, size, err)
		}
	} else if _, err = io.Copy(f, src); err != nil {
		return fmt.Errorf("put %s: %w", key, err)
	}
	if err = f.Sync(); err != nil {
		return fmt.Errorf("put %s: %w", key, err)
	}
	if err = f.Close(); err != nil {
		return fmt.Errorf("put %s: %w", key, err)
	}
	if err = os.MkdirAll(filepath.Dir(p), 0o755); err != nil {
		return fmt.Errorf("put %s: %w", key, mapPutErr(err))
	}
	if err = os.Rename(f.Name(), p); err != nil {
		return fmt.Errorf("put %s: %w", key, mapPutErr(err))
	}
	// Sync the directory so the rename survives a crash.
	if dir, derr := os.Open(filepath.Dir(p)); derr == nil {
		dir.Sync()
		dir.Close()
	}
	return nil
}

// Get opens the whole object.
func (d *Dir) Get(ctx context.Context, key string) (io.ReadCloser, error) {
	return d.GetRange(ctx, key, 0, -1)
}

// GetRange opens length bytes from offset; a range running past the end is
// cut at the end, an offset past the end is an invalid argument.
func (d *Dir) GetRange(ctx context.Context, key string, offset, length int64) (io.ReadCloser, error) {
	f, size, err := d.open(ctx, key)
	if err != nil {
		return nil, err
	}
	if offset < 0 || offset > size {
		f.Close()
		return nil, fmt.Errorf("get %s: offset %d outside object of %d bytes: %w", key, offset, size, errdefs.ErrInvalidArgument)
	}
	n := size - offset
	if length >= 0 && length < n {
		n = length
	}
	return &ctxReadCloser{
		ctxReader: ctxReader{ctx: ctx, r: io.NewSectionReader(f, offset, n)},
		c:         f,
	}, nil
}

func (d *Dir) open(ctx context.Context, key string) (*os.File, int64, error) {
	p, err := d.path(key)
	if err != nil {
		return nil, 0, err
	}
	if err := ctx.Err(); err != nil {
		return nil, 0, fmt.Errorf("get %s: %w", key, err)
	}
	f, err := os.Open(p)
	if err != nil {
		return nil, 0, fmt.Errorf("get %s: %w", key, mapDirErr(err))
	}
	fi, err := f.Stat()
	if err != nil {
		f.Close()
		return nil, 0, fmt.Errorf("get %s: %w", key, err)
	}
	if !fi.Mode().IsRegular() {
		f.Close()
		return nil, 0, fmt.Errorf("get %s: %w", key, errdefs.ErrNotFound)
	}
	return f, fi.Size(), nil
}

// Stat returns the object's size.
func (d *Dir) Stat(ctx context.Context, key string) (int64, error) {
	p, err := d.path(key)
	if err != nil {
		return 0, err
	}
	if err := ctx.Err(); err != nil {
		return 0, fmt.Errorf("stat %s: %w", key, err)
	}
	fi, err := os.Stat(p)
	if err != nil {
		return 0, fmt.Errorf("stat %s: %w", key, mapDirErr(err))
	}
	if !fi.Mode().IsRegular() {
		return 0, fmt.Errorf("stat %s: %w", key, errdefs.ErrNotFound)
	}
	return fi.Size(), nil
}

// Delete removes the object. Empty parent directories are left in place:
// removing them would race with a concurrent Put into the same directory.
func (d *Dir) Delete(ctx context.Context, key string) error {
	p, err := d.path(key)
	if err != nil {
		return err
	}
	if err := ctx.Err(); err != nil {
		return fmt.Errorf("delete %s: %w", key, err)
	}
	fi, err := os.Lstat(p)
	if errors.Is(err, fs.ErrNotExist) || errors.Is(err, syscall.ENOTDIR) || (err == nil && fi.IsDir()) {
		return nil
	}
	if err != nil {
		return fmt.Errorf("delete %s: %w", key, err)
	}
	if err := os.Remove(p); err != nil && !errors.Is(err, fs.ErrNotExist) {
		return fmt.Errorf("delete %s: %w", key, err)
	}
	return nil
}

// List calls fn for every key starting with prefix, in lexical order. It
// walks only the directory the prefix names, then sorts: walk order is not
// key order ("a/b" walks before "a.c" but sorts after it).
func (d *Dir) List(ctx context.Context, prefix string, fn func(key string, size int64) error) error {
	start := d.root
	if i := strings.LastIndex(prefix, "/"); i >= 0 {
		start = filepath.Join(d.root, filepath.FromSlash(prefix[:i]))
	}
	if rel, err := filepath.Rel(d.root, start); err != nil || rel == ".." || strings.HasPrefix(rel, "../") ||
		strings.HasPrefix(prefix, "/") || strings.ContainsRune(prefix, 0) {
		return fmt.Errorf("list %q: %w", prefix, errdefs.ErrInvalidArgument)
	}
	type entry struct {
		key  string
		size int64
	}
	var entries []entry
	err := filepath.WalkDir(start, func(p string, de fs.DirEntry, err error) error {
		if err != nil {
			if errors.Is(err, fs.ErrNotExist) || errors.Is(err, syscall.ENOTDIR) {
				return nil
			}
			return err
		}
		if err := ctx.Err(); err != nil {
			return err
		}
		rel, err := filepath.Rel(d.root, p)
		if err != nil {
			return err
		}
		key := filepath.ToSlash(rel)
		if de.IsDir() {
			if key == tmpDir {
				return filepath.SkipDir
			}
			return nil
		}
		if !de.Type().IsRegular() || !strings.HasPrefix(key, prefix) {
			return nil
		}
		fi, err := de.Info()
		if errors.Is(err, fs.ErrNotExist) {
			return nil // deleted while listing
		}
		if err != nil {
			return err
		}
		entries = append(entries, entry{key, fi.Size()})
		return nil
	})
	if err != nil {
		return fmt.Errorf("list %q: %w", prefix, err)
	}
	sort.Slice(entries, func(i, j int) bool { return entries[i].key < entries[j].key })
	for _, e := range entries {
		if err := fn(e.key, e.size); err != nil {
			return err
		}
	}
	return nil
}

// mapDirErr maps a missing file, or a path through a file, to not found.
func mapDirErr(err error) error {
	if errors.Is(err, fs.ErrNotExist) || errors.Is(err, syscall.ENOTDIR) {
		return fmt.Errorf("%w: %w", errdefs.ErrNotFound, err)
	}
	return err
}

// mapPutErr maps the file system's refusal to hold both "a" and "a/b" (S3
// holds both) to a failed precondition.
func mapPutErr(err error) error {
	for _, e := range []error{syscall.ENOTDIR, syscall.EISDIR, syscall.EEXIST, syscall.ENOTEMPTY} {
		if errors.Is(err, e) {
			return fmt.Errorf("%w: a key and a key under it cannot both exist in a directory store: %w",
				errdefs.ErrFailedPrecondition, err)
		}
	}
	return err
}

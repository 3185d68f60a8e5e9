package snapshot

import (
	"os"
	"path/filepath"
	"testing"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"
)

// resident reports how many of path's pages are in the page cache.
func resident(t *testing.T, path string) int {
	t.Helper()
	f, err := os.Open(path)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	st, err := f.Stat()
	if err != nil {
		t.Fatal(err)
	}
	m, err := unix.Mmap(int(f.Fd()), 0, int(st.Size()), unix.PROT_READ, unix.MAP_SHARED)
	if err != nil {
		t.Fatal(err)
	}
	defer unix.Munmap(m)
	vec := make([]byte, (len(m)+os.Getpagesize()-1)/os.Getpagesize())
	if _, _, e := unix.Syscall(unix.SYS_MINCORE, uintptr(unsafe.Pointer(&m[0])), uintptr(len(m)), uintptr(unsafe.Pointer(&vec[0]))); e != 0 {
		t.Fatalf("mincore %s: %v", path, e)
	}
	n := 0
	for _, v := range vec {
		n += int(v & 1)
	}
	return n
}

// evict writes path out and drops its pages from the page cache.
func evict(t *testing.T, path string) {
	t.Helper()
	f, err := os.Open(path)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	if err := f.Sync(); err != nil {
		t.Fatal(err)
	}
	if err := unix.Fadvise(int(f.Fd()), 0, 0, unix.FADV_DONTNEED); err != nil {
		t.Fatal(err)
	}
}

// The prefetcher reads a tree's files into the page cache, and follows no
// symlink out of the tree.
func TestPrefetchReadsFilesAhead(t *testing.T) {
	// /var/tmp is on disk where /tmp may be tmpfs, whose pages cannot be
	// evicted.
	dir, err := os.MkdirTemp("/var/tmp", "dsec-prefetch-test-")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(dir) })
	tree := filepath.Join(dir, "tree")
	data := make([]byte, 64<<10)
	for i := range data {
		data[i] = byte(i)
	}
	if err := os.MkdirAll(filepath.Join(tree, "sub"), 0o755); err != nil {
		t.Fatal(err)
	}
	inside := filepath.Join(tree, "sub", "file")
	outside := filepath.Join(dir, "outside")
	for _, p := range []string{inside, outside} {
		if err := os.WriteFile(p, data, 0o644); err != nil {
			t.Fatal(err)
		}
		evict(t, p)
	}
	if err := os.Symlink(outside, filepath.Join(tree, "link")); err != nil {
		t.Fatal(err)
	}
	if n := resident(t, inside); n != 0 {
		t.Fatalf("%d pages of %s stay cached after FADV_DONTNEED: the test cannot tell a read ahead", n, inside)
	}
	root, err := os.Open(tree)
	if err != nil {
		t.Fatal(err)
	}
	defer root.Close()
	p := startPrefetch(int(root.Fd()))
	p.add("/sub/file", int64(len(data)))
	p.add("/link", int64(len(data)))
	p.add("/missing", 1)
	p.close()
	p.done.Wait()
	p.stop()
	pages := len(data) / os.Getpagesize()
	deadline := time.Now().Add(5 * time.Second)
	for resident(t, inside) < pages {
		if time.Now().After(deadline) {
			t.Fatalf("%d of %d pages of the file were read ahead", resident(t, inside), pages)
		}
		time.Sleep(10 * time.Millisecond)
	}
	if n := resident(t, outside); n != 0 {
		t.Errorf("the prefetcher followed a symlink out of the tree: %d pages of its target were read", n)
	}
}

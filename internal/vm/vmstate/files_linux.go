package vmstate

import (
	"errors"
	"fmt"
	"os"
	"strconv"
	"strings"
	"unsafe"

	"golang.org/x/sys/unix"
)

// processRSS is process pid's resident memory in bytes (VmRSS), 0 when it
// cannot be read.
func processRSS(pid int) int64 {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", pid))
	if err != nil {
		return 0
	}
	for line := range strings.Lines(string(b)) {
		if rest, ok := strings.CutPrefix(line, "VmRSS:"); ok {
			kb, _ := strconv.ParseInt(strings.TrimSuffix(strings.TrimSpace(rest), " kB"), 10, 64)
			return kb << 10
		}
	}
	return 0
}

// residency maps the file at path and returns which of its pages are in
// the page cache (mincore), one byte per page, and the page size.
func residency(path string) ([]byte, int64, error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, 0, fmt.Errorf("read residency: %w", err)
	}
	defer f.Close()
	fi, err := f.Stat()
	if err != nil {
		return nil, 0, fmt.Errorf("read residency: %w", err)
	}
	page := int64(os.Getpagesize())
	if fi.Size() == 0 {
		return nil, page, nil
	}
	m, err := unix.Mmap(int(f.Fd()), 0, int(fi.Size()), unix.PROT_READ, unix.MAP_SHARED)
	if err != nil {
		return nil, 0, fmt.Errorf("read residency of %s: mmap: %w", path, err)
	}
	defer unix.Munmap(m)
	vec := make([]byte, (fi.Size()+page-1)/page)
	if _, _, errno := unix.Syscall(unix.SYS_MINCORE, uintptr(unsafe.Pointer(&m[0])), uintptr(len(m)), uintptr(unsafe.Pointer(&vec[0]))); errno != 0 {
		err := error(errno)
		return nil, 0, fmt.Errorf("read residency of %s: mincore: %w", path, err)
	}
	return vec, page, nil
}

// residentRanges are the ranges of the file at path in the page cache.
func residentRanges(path string) ([]span, error) {
	vec, page, err := residency(path)
	if err != nil {
		return nil, err
	}
	var spans []span
	for i := 0; i < len(vec); {
		if vec[i]&1 == 0 {
			i++
			continue
		}
		j := i
		for j < len(vec) && vec[j]&1 != 0 {
			j++
		}
		spans = append(spans, span{int64(i) * page, int64(j-i) * page})
		i = j
	}
	return spans, nil
}

// cachedBytes is how much of the file at path is in the page cache.
func cachedBytes(path string) (int64, error) {
	vec, page, err := residency(path)
	if err != nil {
		return 0, err
	}
	var n int64
	for _, v := range vec {
		if v&1 != 0 {
			n += page
		}
	}
	return n, nil
}

// prefetch asks the kernel to read spans of the file at path into the
// page cache (POSIX_FADV_WILLNEED starts the reads and returns) and
// returns how many bytes it asked for.
func prefetch(path string, spans []span) (int64, error) {
	f, err := os.Open(path)
	if err != nil {
		return 0, fmt.Errorf("prefetch: %w", err)
	}
	defer f.Close()
	var n int64
	for _, s := range spans {
		if err := unix.Fadvise(int(f.Fd()), s.Off, s.Len, unix.FADV_WILLNEED); err != nil {
			return n, fmt.Errorf("prefetch %s: %w", path, err)
		}
		n += s.Len
	}
	return n, nil
}

// dropCache writes the file at path's dirty pages to disk and drops all
// its pages from the page cache. Pages still mapped by a process stay.
func dropCache(path string) error {
	f, err := os.OpenFile(path, os.O_RDWR, 0)
	if err != nil {
		return fmt.Errorf("drop cache: %w", err)
	}
	defer f.Close()
	if err := unix.Fdatasync(int(f.Fd())); err != nil {
		return fmt.Errorf("drop cache of %s: fdatasync: %w", path, err)
	}
	if err := unix.Fadvise(int(f.Fd()), 0, 0, unix.FADV_DONTNEED); err != nil {
		return fmt.Errorf("drop cache of %s: %w", path, err)
	}
	return nil
}

func fileSize(path string) int64 {
	fi, err := os.Stat(path)
	if err != nil {
		return 0
	}
	return fi.Size()
}

// allocatedBytes is the disk space the file at path takes (its holes
// take none).
func allocatedBytes(path string) int64 {
	var st unix.Stat_t
	if unix.Stat(path, &st) != nil {
		return 0
	}
	return st.Blocks * 512
}

// Clone copies the file src to dst (which must not exist): a reflink
// (FICLONE) where the file system shares extents (btrfs, XFS), else a
// copy of src's data ranges that leaves its holes holes, so a sparse RAM
// file stays sparse.
func Clone(src, dst string) (err error) {
	in, err := os.Open(src)
	if err != nil {
		return fmt.Errorf("clone: %w", err)
	}
	defer in.Close()
	fi, err := in.Stat()
	if err != nil {
		return fmt.Errorf("clone: %w", err)
	}
	out, err := os.OpenFile(dst, os.O_WRONLY|os.O_CREATE|os.O_EXCL, fi.Mode().Perm())
	if err != nil {
		return fmt.Errorf("clone: %w", err)
	}
	defer func() {
		if cerr := out.Close(); err == nil && cerr != nil {
			err = fmt.Errorf("clone %s: %w", dst, cerr)
		}
		if err != nil {
			os.Remove(dst)
		}
	}()
	if unix.IoctlFileClone(int(out.Fd()), int(in.Fd())) == nil {
		return nil
	}
	if err := out.Truncate(fi.Size()); err != nil {
		return fmt.Errorf("clone %s: %w", dst, err)
	}
	if err := copyData(in, out, fi.Size()); err != nil {
		return fmt.Errorf("clone %s to %s: %w", src, dst, err)
	}
	return nil
}

// copyData copies in's data ranges (SEEK_DATA to SEEK_HOLE) to the same
// offsets of out, in the kernel where it can (copy_file_range).
func copyData(in, out *os.File, size int64) error {
	for off := int64(0); off < size; {
		data, err := unix.Seek(int(in.Fd()), off, unix.SEEK_DATA)
		if errors.Is(err, unix.ENXIO) { // no data past off
			return nil
		}
		if err != nil {
			return fmt.Errorf("seek data: %w", err)
		}
		hole, err := unix.Seek(int(in.Fd()), data, unix.SEEK_HOLE)
		if err != nil {
			return fmt.Errorf("seek hole: %w", err)
		}
		for data < hole {
			roff, woff := data, data
			n, err := unix.CopyFileRange(int(in.Fd()), &roff, int(out.Fd()), &woff, int(hole-data), 0)
			if err != nil {
				return fmt.Errorf("copy_file_range: %w", err)
			}
			if n == 0 {
				return fmt.Errorf("copy_file_range: no progress at %d of %d", data, size)
			}
			data += int64(n)
		}
		off = hole
	}
	return nil
}

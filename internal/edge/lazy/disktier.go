package lazy

import (
	"container/list"
	"errors"
	"fmt"
	"io/fs"
	"log/slog"
	"os"
	"path/filepath"
	"regexp"
	"sort"
	"strings"
	"sync"
)

var hexName = regexp.MustCompile(`^[0-9a-f]{64}$`)

// zstdSuffix ends the name of a disk-tier file holding a chunk as one zstd
// frame. A file named by the bare digest holds the chunk's plain bytes: what
// caches wrote before the tiers existed; it is read, never written.
const zstdSuffix = ".zst"

// diskTier keeps chunk objects as files under dir, named by the chunk's
// sha256, evicting the least recently used ones beyond limit bytes. Chunks
// pinned by a registered layer (its metadata) are evicted only when nothing
// unpinned is left. Files are written to a temp name and renamed, so a crash
// never leaves a partial chunk under a digest name; they are not fsynced
// (losing one only costs a refetch), and whoever reads one decodes and
// verifies it (chunkCache.get), which also catches data lost in a power cut.
type diskTier struct {
	dir    string
	limit  int64
	pinned func(hex string) bool
	log    *slog.Logger

	mu      sync.Mutex
	lru     *list.List               // front: most recently used; values are *diskEntry
	entries map[string]*list.Element // by chunk hex
	size    int64                    // bytes of all entries
}

type diskEntry struct {
	hex  string
	size int64
	zstd bool // hex.zst, else the legacy plain file hex
}

func (e *diskEntry) name() string {
	if e.zstd {
		return e.hex + zstdSuffix
	}
	return e.hex
}

// openDiskTier creates dir if needed, drops temp leftovers and files that
// are not chunks, and rebuilds the LRU from the files found (oldest mtime
// least recently used).
func openDiskTier(dir string, limit int64, pinned func(string) bool, log *slog.Logger) (*diskTier, error) {
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return nil, fmt.Errorf("create chunk cache: %w", err)
	}
	d := &diskTier{
		dir:     dir,
		limit:   limit,
		pinned:  pinned,
		log:     log,
		lru:     list.New(),
		entries: map[string]*list.Element{},
	}
	des, err := os.ReadDir(dir)
	if err != nil {
		return nil, fmt.Errorf("read chunk cache: %w", err)
	}
	type found struct {
		diskEntry
		mtime int64
	}
	byHex := map[string]found{}
	for _, de := range des {
		p := filepath.Join(dir, de.Name())
		h, zstd := strings.CutSuffix(de.Name(), zstdSuffix)
		if !hexName.MatchString(h) || !de.Type().IsRegular() {
			// Temp files of an interrupted write, or foreign files.
			if err := os.RemoveAll(p); err != nil {
				return nil, fmt.Errorf("remove cache leftover %s: %w", de.Name(), err)
			}
			continue
		}
		info, err := de.Info()
		if errors.Is(err, fs.ErrNotExist) {
			continue
		}
		if err != nil {
			return nil, fmt.Errorf("stat cached chunk: %w", err)
		}
		f := found{diskEntry{hex: h, size: info.Size(), zstd: zstd}, info.ModTime().UnixNano()}
		if prev, ok := byHex[h]; ok {
			// Both encodings of one chunk: keep the compressed one.
			keep, drop := prev, f
			if f.zstd {
				keep, drop = f, prev
			}
			if err := os.Remove(filepath.Join(dir, drop.name())); err != nil {
				return nil, fmt.Errorf("remove duplicate cached chunk %s: %w", drop.name(), err)
			}
			f = keep
		}
		byHex[h] = f
	}
	all := make([]found, 0, len(byHex))
	for _, f := range byHex {
		all = append(all, f)
	}
	sort.Slice(all, func(i, j int) bool { return all[i].mtime > all[j].mtime })
	for _, f := range all {
		e := f.diskEntry
		d.entries[e.hex] = d.lru.PushBack(&e)
		d.size += e.size
	}
	d.mu.Lock()
	d.evictLocked()
	d.mu.Unlock()
	return d, nil
}

// read returns the file of chunk hex and whether it is a zstd frame, or
// false when the tier does not hold it. The caller verifies the bytes and
// drops the chunk if they are bad.
func (d *diskTier) read(hex string) ([]byte, bool, bool) {
	d.mu.Lock()
	el, ok := d.entries[hex]
	var e diskEntry
	if ok {
		d.lru.MoveToFront(el)
		e = *el.Value.(*diskEntry)
	}
	d.mu.Unlock()
	if !ok {
		return nil, false, false
	}
	data, err := os.ReadFile(filepath.Join(d.dir, e.name()))
	if err != nil {
		// Evicted between the lookup and the read, or lost.
		d.drop(hex)
		return nil, false, false
	}
	return data, e.zstd, true
}

// has reports whether the tier holds the chunk (not whether it is intact).
func (d *diskTier) has(hex string) bool {
	d.mu.Lock()
	defer d.mu.Unlock()
	_, ok := d.entries[hex]
	return ok
}

// write stores a chunk as one zstd frame the caller has verified decodes to
// it, then evicts down to the limit. It returns the bytes written, 0 when
// the tier held the chunk already.
func (d *diskTier) write(hex string, frame []byte) (int64, error) {
	if d.has(hex) {
		return 0, nil
	}
	tmp, err := os.CreateTemp(d.dir, ".tmp-")
	if err != nil {
		return 0, fmt.Errorf("store chunk %s: %w", hex, err)
	}
	_, werr := tmp.Write(frame)
	cerr := tmp.Close()
	if err := errors.Join(werr, cerr); err != nil {
		os.Remove(tmp.Name())
		return 0, fmt.Errorf("store chunk %s: %w", hex, err)
	}
	e := &diskEntry{hex: hex, size: int64(len(frame)), zstd: true}
	if err := os.Rename(tmp.Name(), filepath.Join(d.dir, e.name())); err != nil {
		os.Remove(tmp.Name())
		return 0, fmt.Errorf("store chunk %s: %w", hex, err)
	}
	d.mu.Lock()
	defer d.mu.Unlock()
	if _, ok := d.entries[hex]; !ok {
		d.entries[hex] = d.lru.PushFront(e)
		d.size += e.size
	}
	d.evictLocked()
	return e.size, nil
}

// evictLocked removes least recently used chunks until the tier fits its
// limit: unpinned ones first, pinned ones only when nothing else is left.
// Readers that already opened an evicted file keep reading it.
func (d *diskTier) evictLocked() {
	for _, pinnedToo := range []bool{false, true} {
		for el := d.lru.Back(); el != nil && d.size > d.limit; {
			prev := el.Prev()
			e := el.Value.(*diskEntry)
			if pinnedToo || !d.pinned(e.hex) {
				d.removeLocked(el)
				if pinnedToo {
					d.log.Warn("evict pinned chunk from disk: cache limit too small for metadata", "chunk", e.hex, "limit", d.limit)
				}
			}
			el = prev
		}
	}
}

func (d *diskTier) removeLocked(el *list.Element) {
	e := el.Value.(*diskEntry)
	d.lru.Remove(el)
	delete(d.entries, e.hex)
	d.size -= e.size
	if err := os.Remove(filepath.Join(d.dir, e.name())); err != nil && !errors.Is(err, fs.ErrNotExist) {
		d.log.Warn("remove cached chunk", "chunk", e.hex, "err", err)
	}
}

func (d *diskTier) drop(hex string) {
	d.mu.Lock()
	defer d.mu.Unlock()
	if el, ok := d.entries[hex]; ok {
		d.removeLocked(el)
	}
}

// usage returns the bytes the tier holds.
func (d *diskTier) usage() int64 {
	d.mu.Lock()
	defer d.mu.Unlock()
	return d.size
}

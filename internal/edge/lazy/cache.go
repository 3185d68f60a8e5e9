package lazy

import (
	"container/list"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"log/slog"
	"os"
	"path/filepath"
	"regexp"
	"sort"
	"sync"
)

var hexName = regexp.MustCompile(`^[0-9a-f]{64}$`)

// chunkCache keeps verified chunks as files named by their sha256 under dir,
// evicting the least recently used ones beyond limit bytes. Chunks pinned by
// a registered layer (its metadata) are evicted only when nothing unpinned is
// left. Files are written to a temp name and renamed, so a crash never leaves
// a partial chunk under a digest name; files found at startup are verified
// the first time they are used, which also catches data lost in a power cut
// (chunks are not fsynced: losing one only costs a refetch).
type chunkCache struct {
	dir   string
	limit int64
	log   *slog.Logger

	mu      sync.Mutex
	lru     *list.List               // front: most recently used; values are *cacheEntry
	entries map[string]*list.Element // by chunk hex
	pins    map[string]int           // pin counts by chunk hex, cached or not
	size    int64                    // bytes of all entries
}

type cacheEntry struct {
	hex      string
	size     int64
	verified bool // digest checked in this process
}

// openCache creates dir if needed, drops temp leftovers and files that are not
// chunks, and rebuilds the LRU from the files found (oldest mtime least
// recently used).
func openCache(dir string, limit int64, log *slog.Logger) (*chunkCache, error) {
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return nil, fmt.Errorf("create chunk cache: %w", err)
	}
	c := &chunkCache{
		dir:     dir,
		limit:   limit,
		log:     log,
		lru:     list.New(),
		entries: map[string]*list.Element{},
		pins:    map[string]int{},
	}
	des, err := os.ReadDir(dir)
	if err != nil {
		return nil, fmt.Errorf("read chunk cache: %w", err)
	}
	type found struct {
		hex   string
		size  int64
		mtime int64
	}
	var all []found
	for _, de := range des {
		p := filepath.Join(dir, de.Name())
		if !hexName.MatchString(de.Name()) || !de.Type().IsRegular() {
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
		all = append(all, found{de.Name(), info.Size(), info.ModTime().UnixNano()})
	}
	sort.Slice(all, func(i, j int) bool { return all[i].mtime > all[j].mtime })
	for _, f := range all {
		c.entries[f.hex] = c.lru.PushBack(&cacheEntry{hex: f.hex, size: f.size})
		c.size += f.size
	}
	c.mu.Lock()
	c.evictLocked()
	c.mu.Unlock()
	return c, nil
}

func (c *chunkCache) path(hex string) string { return filepath.Join(c.dir, hex) }

// readAt copies chunk bytes from offset off into dest. It reports false when
// the chunk is not cached (or was evicted, or failed its first verification),
// in which case the caller fetches it.
func (c *chunkCache) readAt(hex string, dest []byte, off int64) bool {
	c.mu.Lock()
	el, ok := c.entries[hex]
	if !ok {
		c.mu.Unlock()
		return false
	}
	c.lru.MoveToFront(el)
	verified := el.Value.(*cacheEntry).verified
	c.mu.Unlock()

	if !verified {
		data, ok := c.readVerified(hex)
		if !ok {
			return false
		}
		if off+int64(len(dest)) > int64(len(data)) {
			return false
		}
		copy(dest, data[off:])
		return true
	}
	f, err := os.Open(c.path(hex))
	if err != nil {
		// Evicted between the lookup and the open.
		return false
	}
	defer f.Close()
	n, err := f.ReadAt(dest, off)
	return n == len(dest) && (err == nil || errors.Is(err, io.EOF))
}

// readAll returns the whole chunk when it is cached and intact.
func (c *chunkCache) readAll(hex string) ([]byte, bool) {
	c.mu.Lock()
	el, ok := c.entries[hex]
	if ok {
		c.lru.MoveToFront(el)
	}
	c.mu.Unlock()
	if !ok {
		return nil, false
	}
	return c.readVerified(hex)
}

// readVerified reads the chunk file and checks its digest, dropping the file
// when it does not match.
func (c *chunkCache) readVerified(hex string) ([]byte, bool) {
	data, err := os.ReadFile(c.path(hex))
	if err != nil {
		c.drop(hex)
		return nil, false
	}
	if digestHex(data) != hex {
		c.log.Warn("drop corrupt cached chunk", "chunk", hex, "bytes", len(data))
		c.drop(hex)
		return nil, false
	}
	c.mu.Lock()
	if el, ok := c.entries[hex]; ok {
		el.Value.(*cacheEntry).verified = true
	}
	c.mu.Unlock()
	return data, true
}

// has reports whether the chunk is cached (not whether it is intact).
func (c *chunkCache) has(hex string) bool {
	c.mu.Lock()
	defer c.mu.Unlock()
	_, ok := c.entries[hex]
	return ok
}

// put stores a chunk whose digest the caller has verified, then evicts down
// to the limit. A failure to store only costs a later refetch.
func (c *chunkCache) put(hex string, data []byte) error {
	if c.has(hex) {
		return nil
	}
	tmp, err := os.CreateTemp(c.dir, ".tmp-")
	if err != nil {
		return fmt.Errorf("store chunk %s: %w", hex, err)
	}
	_, werr := tmp.Write(data)
	cerr := tmp.Close()
	if err := errors.Join(werr, cerr); err != nil {
		os.Remove(tmp.Name())
		return fmt.Errorf("store chunk %s: %w", hex, err)
	}
	if err := os.Rename(tmp.Name(), c.path(hex)); err != nil {
		os.Remove(tmp.Name())
		return fmt.Errorf("store chunk %s: %w", hex, err)
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	if _, ok := c.entries[hex]; !ok {
		c.entries[hex] = c.lru.PushFront(&cacheEntry{hex: hex, size: int64(len(data)), verified: true})
		c.size += int64(len(data))
	}
	c.evictLocked()
	return nil
}

// evictLocked removes least recently used chunks until the cache fits its
// limit: unpinned ones first, pinned ones only when nothing else is left.
// Readers that already opened an evicted file keep reading it.
func (c *chunkCache) evictLocked() {
	for _, pinnedToo := range []bool{false, true} {
		for el := c.lru.Back(); el != nil && c.size > c.limit; {
			prev := el.Prev()
			e := el.Value.(*cacheEntry)
			if pinnedToo || c.pins[e.hex] == 0 {
				c.removeLocked(el)
				if pinnedToo {
					c.log.Warn("evict pinned chunk: cache limit too small for metadata", "chunk", e.hex, "limit", c.limit)
				}
			}
			el = prev
		}
	}
}

func (c *chunkCache) removeLocked(el *list.Element) {
	e := el.Value.(*cacheEntry)
	c.lru.Remove(el)
	delete(c.entries, e.hex)
	c.size -= e.size
	if err := os.Remove(c.path(e.hex)); err != nil && !errors.Is(err, fs.ErrNotExist) {
		c.log.Warn("remove cached chunk", "chunk", e.hex, "err", err)
	}
}

func (c *chunkCache) drop(hex string) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if el, ok := c.entries[hex]; ok {
		c.removeLocked(el)
	}
}

func (c *chunkCache) pin(hex string) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.pins[hex]++
}

func (c *chunkCache) unpin(hex string) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.pins[hex] <= 1 {
		delete(c.pins, hex)
		return
	}
	c.pins[hex]--
}

// usage returns the bytes cached.
func (c *chunkCache) usage() int64 {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.size
}

func digestHex(data []byte) string {
	sum := sha256.Sum256(data)
	return hex.EncodeToString(sum[:])
}

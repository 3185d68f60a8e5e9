package lazy

import (
	"container/list"
	"sync"
	"sync/atomic"
)

// pageSize is the granularity at which the memory tier remembers which
// parts of a chunk it handed to the kernel.
const pageSize = 4096

// maxGhosts bounds how many chunks evicted cold the memory tier remembers,
// so that fetching one of them again marks it hot. At 1 MiB chunks it
// covers 16 GiB of evictions, for about 2 MiB of memory.
const maxGhosts = 16384

// memTier holds verified chunk objects in memory as they were fetched (one
// zstd frame, or the plain bytes of a raw layer), up to limit bytes of
// objects: least recently used ones are evicted first, pinned ones only when
// nothing else is left. It tells hot chunks from cold ones (see chunkCache)
// and returns what it evicts, so that the caller writes the hot ones to the
// disk tier.
type memTier struct {
	limit  int64
	pinned func(hex string) bool

	mu      sync.Mutex
	lru     *list.List               // front: most recently used; values are *memEntry
	entries map[string]*list.Element // by chunk hex
	size    int64                    // bytes of all entries' objects
	ghosts  *list.List               // hexes of chunks evicted cold, most recent at the front
	ghostOf map[string]*list.Element
}

// memEntry is one chunk in memory. hex, obj, zstd, plainLen and written
// never change; served and hot change only under memTier.mu while the entry
// is in the tier. An evicted entry is the caller's.
type memEntry struct {
	hex      string
	obj      []byte // the chunk object, verified; never modified
	zstd     bool   // obj is a zstd frame, else the plain bytes
	plainLen int64
	// served has a bit per page of the plain chunk that the tier's owner
	// handed to the kernel since the chunk came into memory.
	served []uint64
	hot    bool
	// written, when set, counts the bytes the chunk costs the disk tier
	// (the fetching layer's counter).
	written *atomic.Int64
}

func newMemTier(limit int64, pinned func(string) bool) *memTier {
	return &memTier{
		limit:   limit,
		pinned:  pinned,
		lru:     list.New(),
		entries: map[string]*list.Element{},
		ghosts:  list.New(),
		ghostOf: map[string]*list.Element{},
	}
}

// get returns chunk hex's object and whether it is a zstd frame, or false
// when the tier does not hold it.
func (m *memTier) get(hex string) ([]byte, bool, bool) {
	m.mu.Lock()
	defer m.mu.Unlock()
	el, ok := m.entries[hex]
	if !ok {
		return nil, false, false
	}
	m.lru.MoveToFront(el)
	e := el.Value.(*memEntry)
	return e.obj, e.zstd, true
}

func (m *memTier) has(hex string) bool {
	m.mu.Lock()
	defer m.mu.Unlock()
	_, ok := m.entries[hex]
	return ok
}

// add puts e in the tier (a chunk already there stays, hot if either is)
// and evicts down to the limit, returning the evicted entries; those that
// are hot belong on disk. A chunk fetched again soon after it was evicted
// cold comes back hot; so does a pinned one.
func (m *memTier) add(e *memEntry) []*memEntry {
	m.mu.Lock()
	defer m.mu.Unlock()
	if el, ok := m.entries[e.hex]; ok {
		have := el.Value.(*memEntry)
		have.hot = have.hot || e.hot
		m.lru.MoveToFront(el)
		return nil
	}
	if g, ok := m.ghostOf[e.hex]; ok {
		m.ghosts.Remove(g)
		delete(m.ghostOf, e.hex)
		e.hot = true
	}
	e.hot = e.hot || m.pinned(e.hex)
	e.served = make([]uint64, (e.plainLen+pageSize*64-1)/(pageSize*64))
	m.entries[e.hex] = m.lru.PushFront(e)
	m.size += int64(len(e.obj))
	return m.evictLocked()
}

// evictLocked removes least recently used entries until the tier fits its
// limit, unpinned ones first, and returns them. A pinned entry is hot (it
// may have been pinned after it came in); a cold one is remembered as a
// ghost.
func (m *memTier) evictLocked() []*memEntry {
	var out []*memEntry
	for _, pinnedToo := range []bool{false, true} {
		for el := m.lru.Back(); el != nil && m.size > m.limit; {
			prev := el.Prev()
			e := el.Value.(*memEntry)
			if pinned := m.pinned(e.hex); pinnedToo || !pinned {
				m.lru.Remove(el)
				delete(m.entries, e.hex)
				m.size -= int64(len(e.obj))
				e.hot = e.hot || pinned
				if !e.hot {
					m.addGhostLocked(e.hex)
				}
				out = append(out, e)
			}
			el = prev
		}
	}
	return out
}

func (m *memTier) addGhostLocked(hex string) {
	if _, ok := m.ghostOf[hex]; ok {
		return
	}
	m.ghostOf[hex] = m.ghosts.PushFront(hex)
	for m.ghosts.Len() > maxGhosts {
		old := m.ghosts.Back()
		m.ghosts.Remove(old)
		delete(m.ghostOf, old.Value.(string))
	}
}

// serve records that the plain bytes [off, off+n) of chunk hex were handed
// to the kernel. Asking again for a page it was given means the kernel
// dropped that page and needed it again: the chunk is hot.
func (m *memTier) serve(hex string, off, n int64) {
	if n <= 0 {
		return
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	el, ok := m.entries[hex]
	if !ok {
		return
	}
	e := el.Value.(*memEntry)
	for p := off / pageSize; p <= (off+n-1)/pageSize; p++ {
		w, bit := p/64, uint64(1)<<(p%64)
		if w >= int64(len(e.served)) {
			break
		}
		if e.served[w]&bit != 0 {
			e.hot = true
		}
		e.served[w] |= bit
	}
}

// setHot marks chunk hex hot if the tier holds it.
func (m *memTier) setHot(hex string) {
	m.mu.Lock()
	defer m.mu.Unlock()
	if el, ok := m.entries[hex]; ok {
		el.Value.(*memEntry).hot = true
	}
}

// isHot reports whether the tier holds chunk hex and it is hot.
func (m *memTier) isHot(hex string) bool {
	m.mu.Lock()
	defer m.mu.Unlock()
	el, ok := m.entries[hex]
	return ok && el.Value.(*memEntry).hot
}

func (m *memTier) drop(hex string) {
	m.mu.Lock()
	defer m.mu.Unlock()
	if el, ok := m.entries[hex]; ok {
		m.lru.Remove(el)
		delete(m.entries, hex)
		m.size -= int64(len(el.Value.(*memEntry).obj))
	}
}

// hotEntries returns the hot entries (and the pinned ones), least recently
// used first. The caller must not modify them.
func (m *memTier) hotEntries() []*memEntry {
	m.mu.Lock()
	defer m.mu.Unlock()
	var out []*memEntry
	for el := m.lru.Back(); el != nil; el = el.Prev() {
		if e := el.Value.(*memEntry); e.hot || m.pinned(e.hex) {
			out = append(out, e)
		}
	}
	return out
}

// usage returns the bytes of objects the tier holds.
func (m *memTier) usage() int64 {
	m.mu.Lock()
	defer m.mu.Unlock()
	return m.size
}

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
// zstd frame, or the plain bytes of a raw layer) and, beside a frame, its
// decoded bytes while they fit: up to limit bytes of both together.
//
// Decoded copies go first: beyond the limit, the least recently used ones
// are dropped down to a floor of minDecoded bytes of them; only then are
// whole entries evicted, least recently used first, pinned ones only when
// nothing else is left (an evicted entry's decoded copy goes with it). A
// chunk the tier holds thus costs a refetch only once memory cannot hold its
// frame, and a decode only once it cannot hold its decoded copy too. It
// tells hot chunks from cold ones (see chunkCache) and returns what it
// evicts, so that the caller writes the hot ones to the disk tier.
type memTier struct {
	limit      int64
	minDecoded int64
	pinned     func(hex string) bool

	mu      sync.Mutex
	lru     *list.List               // front: most recently used; values are *memEntry
	entries map[string]*list.Element // by chunk hex
	decoded *list.List               // entries holding a decoded copy, most recently used at the front
	size    int64                    // bytes of all entries' objects and decoded copies
	decSize int64                    // bytes of the decoded copies
	ghosts  *list.List               // hexes of chunks evicted cold, most recent at the front
	ghostOf map[string]*list.Element
}

// memEntry is one chunk in memory. hex, obj, zstd, plainLen and written
// never change; plain, served and hot change only under memTier.mu while
// the entry is in the tier. An evicted entry is the caller's.
type memEntry struct {
	hex      string
	obj      []byte // the chunk object, verified; never modified
	zstd     bool   // obj is a zstd frame, else the plain bytes
	plainLen int64
	// plain, for a zstd entry, is the frame decoded (verified; never
	// modified), or nil once the tier dropped it; decodedEl is its element
	// in memTier.decoded.
	plain     []byte
	decodedEl *list.Element
	// served has a bit per page of the plain chunk that the tier's owner
	// handed to the kernel since the chunk came into memory.
	served []uint64
	hot    bool
	// written, when set, counts the bytes the chunk costs the disk tier
	// (the fetching layer's counter).
	written *atomic.Int64
}

// newMemTier returns an empty tier of limit bytes that keeps at least
// minDecoded bytes of decoded copies before it evicts chunks for them.
func newMemTier(limit, minDecoded int64, pinned func(string) bool) *memTier {
	return &memTier{
		limit:      limit,
		minDecoded: min(minDecoded, limit),
		pinned:     pinned,
		lru:        list.New(),
		entries:    map[string]*list.Element{},
		decoded:    list.New(),
		ghosts:     list.New(),
		ghostOf:    map[string]*list.Element{},
	}
}

// get returns chunk hex's plain bytes if the tier has them at hand (a raw
// layer's object, or a frame's decoded copy), else its zstd frame with
// plain nil; ok is false when the tier does not hold the chunk.
func (m *memTier) get(hex string) (plain, frame []byte, ok bool) {
	m.mu.Lock()
	defer m.mu.Unlock()
	el, ok := m.entries[hex]
	if !ok {
		return nil, nil, false
	}
	m.lru.MoveToFront(el)
	e := el.Value.(*memEntry)
	switch {
	case !e.zstd:
		return e.obj, nil, true
	case e.plain != nil:
		m.decoded.MoveToFront(e.decodedEl)
		return e.plain, nil, true
	}
	return nil, e.obj, true
}

// keepDecoded gives the tier's entry of chunk hex, a zstd frame, its decoded
// bytes (which must not be modified afterwards), unless it has them, and
// evicts down to the limit, returning what it evicted as add does.
func (m *memTier) keepDecoded(hex string, plain []byte) []*memEntry {
	m.mu.Lock()
	defer m.mu.Unlock()
	el, ok := m.entries[hex]
	if !ok {
		return nil
	}
	e := el.Value.(*memEntry)
	if !e.zstd || e.plain != nil || int64(len(plain)) != e.plainLen {
		return nil
	}
	m.setPlainLocked(e, plain)
	return m.evictLocked()
}

func (m *memTier) setPlainLocked(e *memEntry, plain []byte) {
	e.plain = plain
	e.decodedEl = m.decoded.PushFront(e)
	m.size += int64(len(plain))
	m.decSize += int64(len(plain))
}

func (m *memTier) dropPlainLocked(e *memEntry) {
	if e.plain == nil {
		return
	}
	m.decoded.Remove(e.decodedEl)
	m.size -= int64(len(e.plain))
	m.decSize -= int64(len(e.plain))
	e.plain, e.decodedEl = nil, nil
}

// removeLocked takes el's entry out of the tier, decoded copy included.
func (m *memTier) removeLocked(el *list.Element) *memEntry {
	e := el.Value.(*memEntry)
	m.dropPlainLocked(e)
	m.lru.Remove(el)
	delete(m.entries, e.hex)
	m.size -= int64(len(e.obj))
	return e
}

func (m *memTier) has(hex string) bool {
	m.mu.Lock()
	defer m.mu.Unlock()
	_, ok := m.entries[hex]
	return ok
}

// add puts e in the tier (a chunk already there stays, hot if either is,
// and takes e's decoded bytes if it had none) and evicts down to the limit,
// returning the evicted entries; those that are hot belong on disk. e.plain,
// if set, is the frame's decoded bytes, kept as a decoded copy. A chunk
// fetched again soon after it was evicted cold comes back hot; so does a
// pinned one.
func (m *memTier) add(e *memEntry) []*memEntry {
	m.mu.Lock()
	defer m.mu.Unlock()
	plain := e.plain
	e.plain = nil
	if !e.zstd || int64(len(plain)) != e.plainLen {
		plain = nil
	}
	if el, ok := m.entries[e.hex]; ok {
		have := el.Value.(*memEntry)
		have.hot = have.hot || e.hot
		m.lru.MoveToFront(el)
		if plain != nil && have.plain == nil {
			m.setPlainLocked(have, plain)
			return m.evictLocked()
		}
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
	if plain != nil {
		m.setPlainLocked(e, plain)
	}
	return m.evictLocked()
}

// evictLocked brings the tier within its limit and returns the entries it
// evicted: first it drops the least recently used decoded copies down to
// minDecoded bytes of them, then it evicts least recently used entries
// (with their decoded copies), unpinned ones first. A pinned entry is
// hot (it may have been pinned after it came in); a cold one is remembered
// as a ghost.
func (m *memTier) evictLocked() []*memEntry {
	for m.size > m.limit && m.decSize > m.minDecoded {
		m.dropPlainLocked(m.decoded.Back().Value.(*memEntry))
	}
	var out []*memEntry
	for _, pinnedToo := range []bool{false, true} {
		for el := m.lru.Back(); el != nil && m.size > m.limit; {
			prev := el.Prev()
			e := el.Value.(*memEntry)
			if pinned := m.pinned(e.hex); pinnedToo || !pinned {
				m.removeLocked(el)
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
		m.removeLocked(el)
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

// usage returns the bytes of objects and decoded copies the tier holds, and
// of the decoded copies alone.
func (m *memTier) usage() (all, decoded int64) {
	m.mu.Lock()
	defer m.mu.Unlock()
	return m.size, m.decSize
}

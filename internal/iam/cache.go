package iam

import (
	"context"
	"crypto/sha256"
	"sync"
	"sync/atomic"
	"time"
)

// Source is where a Cache reads authorities: the metadata store
// (store.Store is one).
type Source interface {
	// Authenticate returns a token's authority now, or an error wrapping
	// errdefs.ErrUnauthenticated.
	Authenticate(ctx context.Context, token string) (Authority, error)
	// Generation grows whenever authority is taken away anywhere (a token
	// revoked, a binding lowered or removed, a project deleted).
	Generation(ctx context.Context) (int64, error)
}

// Cache remembers authenticated tokens (by their SHA-256, never the token)
// so that a token check costs no database round trip. An entry lives at
// most TTL and never past its token's expiry. Revocations reach it across
// apiservers through the source's generation, read at most once per
// GenerationEvery by one caller while the others go on: when it has grown,
// every entry is dropped. So a revoked token, or a lowered binding, stops
// working everywhere within GenerationEvery (plus one read), and a failed
// generation read falls back to TTL. Refusals are not cached.
//
// A Cache is safe for concurrent use.
type Cache struct {
	src Source
	ttl time.Duration
	// every is how often the generation is read.
	every time.Duration
	now   func() time.Time

	mu      sync.RWMutex
	entries map[[32]byte]cacheEntry
	gen     int64

	// genRead is when the generation was last read (Unix nanoseconds);
	// whoever moves it on reads the generation.
	genRead atomic.Int64
}

type cacheEntry struct {
	a     Authority
	until time.Time
}

// Cache defaults.
const (
	DefaultCacheTTL        = 10 * time.Second
	DefaultGenerationEvery = time.Second
	// maxCacheEntries bounds the cache: past it, it is emptied.
	maxCacheEntries = 1 << 20
)

// NewCache returns a Cache over src; zero durations take the defaults.
func NewCache(src Source, ttl, generationEvery time.Duration) *Cache {
	if ttl <= 0 {
		ttl = DefaultCacheTTL
	}
	if generationEvery <= 0 {
		generationEvery = DefaultGenerationEvery
	}
	return &Cache{src: src, ttl: ttl, every: generationEvery, now: time.Now, entries: map[[32]byte]cacheEntry{}}
}

// Authenticate returns token's authority, from the cache when it holds a
// current entry, else from the source.
func (c *Cache) Authenticate(ctx context.Context, token string) (Authority, error) {
	now := c.now()
	c.checkGeneration(ctx, now)
	key := sha256.Sum256([]byte(token))
	c.mu.RLock()
	e, ok := c.entries[key]
	c.mu.RUnlock()
	if ok && now.Before(e.until) {
		return e.a, nil
	}
	c.mu.RLock()
	gen := c.gen
	c.mu.RUnlock()
	a, err := c.src.Authenticate(ctx, token)
	if err != nil {
		return Authority{}, err
	}
	until := now.Add(c.ttl)
	if !a.Expires.IsZero() && a.Expires.Before(until) {
		until = a.Expires
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	// Read before a generation change was seen: it may predate the change,
	// so it is served this once and not kept.
	if c.gen != gen {
		return a, nil
	}
	if len(c.entries) >= maxCacheEntries {
		clear(c.entries)
	}
	c.entries[key] = cacheEntry{a: a, until: until}
	return a, nil
}

// checkGeneration reads the source's generation if it is due, and drops
// every entry when it has grown.
func (c *Cache) checkGeneration(ctx context.Context, now time.Time) {
	last := c.genRead.Load()
	if now.UnixNano()-last < int64(c.every) || !c.genRead.CompareAndSwap(last, now.UnixNano()) {
		return
	}
	g, err := c.src.Generation(ctx)
	if err != nil {
		return // entries still end at their TTL
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	if g != c.gen {
		c.gen = g
		clear(c.entries)
	}
}

// Len is how many tokens the cache holds.
func (c *Cache) Len() int {
	c.mu.RLock()
	defer c.mu.RUnlock()
	return len(c.entries)
}

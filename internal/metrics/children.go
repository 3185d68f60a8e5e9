package metrics

import (
	"maps"
	"sync"
	"sync/atomic"
)

// children caches the series of a metric vector by their label values, so
// that a hot path finds its counter or histogram with one lookup in a map
// keyed by a comparable struct of the values, where the vector's
// WithLabelValues checks each value is valid UTF-8, hashes them and looks
// the series up under a lock at every call. A series is made once, at the
// first call with its labels, by make (which calls WithLabelValues): the
// series and the label sets are the vector's as before, so cardinality is
// what the callers' label values make it. Nothing here deletes a series
// from a vector, which would leave the cache holding one no scrape serves.
//
// The map is copied on write: a read is an atomic load and a lookup, with
// no lock and no shared write, and writes are as rare as new label sets.
type children[K comparable, V any] struct {
	m    atomic.Pointer[map[K]V]
	mu   sync.Mutex // serializes writers
	make func(K) V
}

func newChildren[K comparable, V any](make func(K) V) *children[K, V] {
	c := &children[K, V]{make: make}
	c.m.Store(&map[K]V{})
	return c
}

// get is the series of k, made at its first call.
func (c *children[K, V]) get(k K) V {
	if v, ok := (*c.m.Load())[k]; ok {
		return v
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	old := *c.m.Load()
	if v, ok := old[k]; ok {
		return v
	}
	v := c.make(k)
	next := maps.Clone(old)
	next[k] = v
	c.m.Store(&next)
	return v
}

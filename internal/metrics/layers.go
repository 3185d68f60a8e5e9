package metrics

import "github.com/prometheus/client_golang/prometheus"

// LayerTotals are the node's lazy layer loader's counters (package lazy's
// Totals): since the loader's process started, so they restart from zero
// with it, as any counter of a restarted process does.
type LayerTotals struct {
	BytesRead, BytesFetched, ChunksFetched int64
	MemoryHits, DiskHits, CacheMisses      int64
	FetchErrors                            int64
	// FetchErrors by op: the blob store's Get refused or timed out, the
	// object's bytes broke off while read, the chunk did not verify.
	GetErrors, ReadErrors, VerifyErrors int64
	MemoryBytes, DiskBytes              int64 // the chunk cache's tiers now
}

var (
	layerReadDesc = prometheus.NewDesc("dsec_layer_read_bytes_total",
		"Bytes sandboxes read from lazily loaded layer files on this node.", nil, nil)
	layerFetchedDesc = prometheus.NewDesc("dsec_layer_fetched_bytes_total",
		"Bytes of layer chunks this node's lazy loader fetched from the blob store (compressed, for zstd layers).", nil, nil)
	layerChunksDesc = prometheus.NewDesc("dsec_layer_fetched_chunks_total",
		"Layer chunks this node's lazy loader fetched from the blob store.", nil, nil)
	layerReadsDesc = prometheus.NewDesc("dsec_layer_chunk_reads_total",
		"Chunk reads of lazily loaded layers on this node by where they were served from (memory, disk: the cache; fetch: they waited for the blob store).", []string{"from"}, nil)
	layerErrorsDesc = prometheus.NewDesc("dsec_layer_fetch_errors_total",
		"Failed chunk fetches of this node's lazy loader, each retried, by op: get (the blob store's Get failed or timed out), read (the object's bytes broke off or timed out), verify (the chunk did not match its digest).", []string{"op"}, nil)
	layerCachedDesc = prometheus.NewDesc("dsec_layer_cache_bytes",
		"Bytes of layer chunks this node's lazy loader holds cached now, by tier (memory, disk).", []string{"tier"}, nil)
)

type layerCollector struct {
	read func() (LayerTotals, bool)
}

// Layers has every scrape of r read the lazy loader's totals from read
// (ok false: no loader answers, and the layer metrics are left out). Call
// it once per registry; a nil r does nothing.
func (r *Registry) Layers(read func() (LayerTotals, bool)) {
	if r == nil {
		return
	}
	r.reg.MustRegister(&layerCollector{read: read})
}

func (c *layerCollector) Describe(ch chan<- *prometheus.Desc) {
	for _, d := range []*prometheus.Desc{layerReadDesc, layerFetchedDesc, layerChunksDesc, layerReadsDesc, layerErrorsDesc, layerCachedDesc} {
		ch <- d
	}
}

func (c *layerCollector) Collect(ch chan<- prometheus.Metric) {
	t, ok := c.read()
	if !ok {
		return
	}
	counter := func(d *prometheus.Desc, x int64, labels ...string) {
		ch <- prometheus.MustNewConstMetric(d, prometheus.CounterValue, float64(x), labels...)
	}
	counter(layerReadDesc, t.BytesRead)
	counter(layerFetchedDesc, t.BytesFetched)
	counter(layerChunksDesc, t.ChunksFetched)
	counter(layerReadsDesc, t.MemoryHits, "memory")
	counter(layerReadsDesc, t.DiskHits, "disk")
	counter(layerReadsDesc, t.CacheMisses, "fetch")
	counter(layerErrorsDesc, t.GetErrors, "get")
	counter(layerErrorsDesc, t.ReadErrors, "read")
	counter(layerErrorsDesc, t.VerifyErrors, "verify")
	if rest := t.FetchErrors - t.GetErrors - t.ReadErrors - t.VerifyErrors; rest > 0 {
		// A loader started before it counted by op.
		counter(layerErrorsDesc, rest, "unknown")
	}
	ch <- prometheus.MustNewConstMetric(layerCachedDesc, prometheus.GaugeValue, float64(t.MemoryBytes), "memory")
	ch <- prometheus.MustNewConstMetric(layerCachedDesc, prometheus.GaugeValue, float64(t.DiskBytes), "disk")
}
